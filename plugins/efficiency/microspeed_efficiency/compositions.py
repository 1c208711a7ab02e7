"""What the efficiency plugins (random-LTD, progressive layer drop, curriculum) declare to the composition matrix.

The refusals are module-level constants: the plugin raises with their
:meth:`~microspeed.plugin_api.Refusal.message` and ``microspeed_refusals`` declares the same objects, so
the text a user reads at ``initialize()`` is the text ``microspeed plugins --matrix`` shows.
"""

from __future__ import annotations

from microspeed.plugin_api import Feature, refuse_pairs

RANDOM_LTD_FEATURES = (
    Feature("random-ltd", "random layerwise token dropping",
            '"data_efficiency": {"data_routing": {"random_ltd": {"enabled": true, ...}}}'),
)
"""The ``random_ltd`` plugin's feature."""

PLD_FEATURES = (
    Feature("pld", "progressive layer drop",
            '"progressive_layer_drop": {"enabled": true} with a model whose forward takes progressive_layer_drop '
            "and pld_theta (microspeed.models.GPT does)"),
)
"""The ``progressive_layer_drop`` plugin's feature."""

CURRICULUM_FEATURES = (
    Feature("curriculum", "curriculum learning (sequence length)",
            '"curriculum_learning": {"enabled": true, "curriculum_type": "seqlen", ...}'),
)
"""The ``curriculum`` plugin's feature (DeepSpeed's legacy ``curriculum_learning`` section)."""

PLD_WITH_PIPELINE = refuse_pairs(
    ("pld",), ("pipeline-1f1b", "pipeline-interleaved"),
    reason="progressive layer drop hands its keep probability to the model's forward as the keyword arguments "
           "progressive_layer_drop and pld_theta, while a pipeline stage's forward receives only the activations "
           "of the stage before it",
    instead="use progressive layer drop without a pipeline (with data or tensor parallelism and ZeRO)")
"""Progressive layer drop with a pipeline."""

PLD_REFUSALS = PLD_WITH_PIPELINE
"""Everything the ``progressive_layer_drop`` plugin refuses."""

RANDOM_LTD_WITH_PIPELINE = refuse_pairs(
    ("random-ltd",), ("pipeline-1f1b", "pipeline-interleaved"),
    reason="random-LTD gathers the kept tokens before the first of its layers and scatters them back after the last, "
           "within one nn.ModuleList of the model's total_layer_num layers, while a pipeline spreads those layers "
           "over stages that exchange whole activations",
    instead="use random-LTD without a pipeline (with data or tensor parallelism and ZeRO)")
"""Random-LTD with a pipeline."""

RANDOM_LTD_REFUSALS = RANDOM_LTD_WITH_PIPELINE
"""Everything the ``random_ltd`` plugin refuses."""

CURRICULUM_WITH_PIPELINE = refuse_pairs(
    ("curriculum",), ("pipeline-1f1b", "pipeline-interleaved"),
    reason="sequence-length curriculum cuts each micro-batch where the model's forward receives it, while in a "
           "pipeline only the first stage receives the inputs and the last stage the labels, so the stages would "
           "disagree on the sequence length",
    instead="use curriculum learning without a pipeline (with data or tensor parallelism and ZeRO)")
"""Curriculum learning (sequence length) with a pipeline."""

CURRICULUM_REFUSALS = CURRICULUM_WITH_PIPELINE
"""Everything the ``curriculum`` plugin refuses."""
