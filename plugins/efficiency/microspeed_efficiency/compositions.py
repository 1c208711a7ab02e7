"""What the efficiency plugins (random-LTD, progressive layer drop, curriculum) declare to the composition matrix.

Refusals would be module-level constants (the plugin raising with their
:meth:`~microspeed.plugin_api.Refusal.message`, ``microspeed_refusals`` declaring the same objects); today these
plugins refuse no pair: random-LTD, progressive layer drop and curriculum compose with every parallelism,
pipelines (1F1B and interleaved) included.
"""

from __future__ import annotations

from microspeed.plugin_api import Feature

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

PLD_REFUSALS: tuple = ()
"""Everything the ``progressive_layer_drop`` plugin refuses: nothing (in a pipeline, the layers that name
``progressive_layer_drop`` / ``pld_theta`` receive them; see the README)."""

RANDOM_LTD_REFUSALS: tuple = ()
"""Everything the ``random_ltd`` plugin refuses: nothing (in a pipeline, each stage's random-LTD layers gather and
scatter their own tokens, drawn alike on every stage; see the README)."""

CURRICULUM_REFUSALS: tuple = ()
"""Everything the ``curriculum`` plugin refuses: nothing (in a pipeline, every stage cuts the micro-batch it loads;
see the README)."""
