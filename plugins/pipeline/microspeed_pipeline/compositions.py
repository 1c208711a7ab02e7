"""What the ``pipeline`` and ``activation_checkpointing`` plugins declare to the composition matrix.

The refusals are module-level constants: :meth:`PipelinePlugin.microspeed_conflicts
<microspeed_pipeline.plugin.PipelinePlugin.microspeed_conflicts>` raises with their
:meth:`~microspeed.plugin_api.Refusal.message`, and ``microspeed_refusals`` declares the same objects, so
the text a user reads at ``initialize()`` is the text ``microspeed plugins --matrix`` shows. Lifting a
refusal means deleting its constant here together with the code that raises it.
"""

from __future__ import annotations

from microspeed.plugin_api import Feature

SCHEDULE = "pipeline.schedule"

PIPELINES = ("pipeline-1f1b", "pipeline-interleaved")
"""The pipeline features (a PipelineModule of more than one stage, by schedule)."""

FEATURES = (
    Feature("pipeline-1f1b", "pipeline parallelism, 1F1B schedule",
            "model = PipelineModule(layers=..., num_stages > 1); pipeline.schedule 1f1b (the default)",
            choice=SCHEDULE),
    Feature("pipeline-interleaved", "pipeline parallelism, interleaved schedule",
            "PipelineModule(..., num_stages > 1, num_chunks > 1); pipeline.schedule interleaved (the default then)",
            choice=SCHEDULE),
    Feature("tensor-parallel", "tensor (model) parallelism",
            "tensor-parallel layers with initialize(mpu=ParallelGrid(tensor > 1)), or a PipelineModule whose "
            "topology has a model axis > 1"),
)
"""The ``pipeline`` plugin's features."""

CHECKPOINTING_FEATURES = (
    Feature("activation-checkpointing", "activation checkpointing",
            '"activation_checkpointing" section with deepspeed.checkpointing.checkpoint(...) in the model, or '
            "PipelineModule(activation_checkpoint_interval > 0)"),
)
"""The ``activation_checkpointing`` plugin's feature."""

REFUSALS: tuple = ()
"""Everything the ``pipeline`` plugin refuses: nothing. ZeRO-2/3 with a pipeline, ZeRO with tensor parallelism
and ZeRO with clipped cross-stage tied weights work (ZeRO honours the norm rules on its partitions and sums
the tied copies marked with ``GradientSum``); see test_pipeline_zero.py."""
