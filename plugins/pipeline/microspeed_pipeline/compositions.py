"""What the ``pipeline`` and ``activation_checkpointing`` plugins declare to the composition matrix.

The refusals are module-level constants: :meth:`PipelinePlugin.microspeed_conflicts
<microspeed_pipeline.plugin.PipelinePlugin.microspeed_conflicts>` raises with their
:meth:`~microspeed.plugin_api.Refusal.message`, and ``microspeed_refusals`` declares the same objects, so
the text a user reads at ``initialize()`` is the text ``microspeed plugins --matrix`` shows. Lifting a
refusal means deleting its constant here together with the code that raises it.
"""

from __future__ import annotations

from microspeed.plugin_api import Feature, refuse_pairs

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

ZERO_2_3_WITH_PIPELINE = refuse_pairs(
    ("zero-2", "zero-3"), PIPELINES,
    reason="ZeRO stages 2 and 3 reduce each gradient from an autograd hook as soon as its backward ends, while a "
           "pipeline schedule runs several micro-batches' backwards interleaved with other stages' sends, so the "
           "partition would be reduced before the last micro-batch has added to it",
    instead="use zero_optimization.stage 1 with a pipeline (it partitions the optimizer state only)")
"""ZeRO-2/3 with a pipeline of several stages."""

ZERO_WITH_TENSOR_PARALLEL = refuse_pairs(
    ("zero-1", "zero-2", "zero-3", "offload-cpu", "offload-nvme"), ("tensor-parallel",),
    reason="ZeRO's flat partitions carry no per-parameter norm rule, so the global gradient norm would count the "
           "parameters every tensor rank replicates (biases, layer norms) once per tensor rank",
    instead="use tensor parallelism with plain data parallelism (zero_optimization.stage 0), or ZeRO without "
            "tensor parallelism")
"""ZeRO (any stage, hence its offload) with tensor parallelism."""

ZERO_WITH_CLIPPED_TIED_WEIGHTS = refuse_pairs(
    ("zero-1", "zero-2", "zero-3"), PIPELINES,
    reason="with gradient partitioning the gradient norm cannot tell the copies of a weight tied across stages "
           "that another stage counts, so clipping would count tied weights once per stage that holds them",
    instead="set gradient_clipping to 0, or zero_optimization.stage to 0",
    when="weights tied across pipeline stages and gradient_clipping > 0")
"""ZeRO with weights tied across stages and gradient clipping (a condition, not a whole pair)."""

REFUSALS = ZERO_2_3_WITH_PIPELINE + ZERO_WITH_TENSOR_PARALLEL + ZERO_WITH_CLIPPED_TIED_WEIGHTS
"""Everything the ``pipeline`` plugin refuses."""
