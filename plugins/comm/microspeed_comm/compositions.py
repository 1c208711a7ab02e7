"""What the ``comm`` plugin declares to the composition matrix (``microspeed plugins --matrix``).

The refusals are module-level constants: the plugin raises with their
:meth:`~microspeed.plugin_api.Refusal.message` and ``microspeed_refusals`` declares the same objects, so
the text a user reads at ``initialize()`` is the text the matrix shows. Lifting a refusal means deleting
its constant here together with the code that raises it.
"""

from __future__ import annotations

from microspeed.plugin_api import Feature, refuse_pairs

OPTIMIZER_TYPE = "optimizer.type"

ONEBIT = ("onebit-adam", "zero-one-adam", "onebit-lamb")
"""The 1-bit optimizers (alternatives of ``optimizer.type``)."""

FEATURES = (
    Feature("onebit-adam", "1-bit Adam", '"optimizer": {"type": "OneBitAdam"}', choice=OPTIMIZER_TYPE),
    Feature("zero-one-adam", "0/1 Adam", '"optimizer": {"type": "ZeroOneAdam"}', choice=OPTIMIZER_TYPE),
    Feature("onebit-lamb", "1-bit LAMB", '"optimizer": {"type": "OneBitLamb"}', choice=OPTIMIZER_TYPE),
)
"""The ``comm`` plugin's features."""

ZERO_FEATURES = ("zero-1", "zero-2", "zero-3", "offload-cpu", "offload-nvme")
"""The ZeRO features a 1-bit optimizer steps through: ZeRO takes the comm plugin's compressed reduce-scatter
(the GradientCompression capability) and steps the same optimizer on its partitions (1-bit LAMB sums its
whole-parameter norms over the group from the slices' ``partition_pieces``). With MoE as well, the exchange and
LAMB's sums of an expert run over its replica group (no refusal: the triple works)."""

LOCAL_STEPS_WITH_ZERO = refuse_pairs(
    ("zero-one-adam",), ZERO_FEATURES,
    reason="0/1 Adam's local steps update every parameter from the rank's own momentum and frozen variance, while "
           "ZeRO keeps only this rank's slice of them",
    instead="set optimizer.params.local_step_clipper to 1 (one compressed gradient exchange per step after "
            "var_freeze_step), or use zero_optimization.stage 0 for local steps",
    when="optimizer.params.local_step_clipper > 1 (the default is 16)")
"""0/1 Adam's local steps with ZeRO (0/1 Adam with ``local_step_clipper`` 1 runs with ZeRO)."""

REFUSALS = LOCAL_STEPS_WITH_ZERO
"""Everything the ``comm`` plugin refuses."""
