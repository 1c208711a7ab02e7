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

ONEBIT_WITH_ZERO = refuse_pairs(
    ONEBIT, ("zero-1", "zero-2", "zero-3", "offload-cpu", "offload-nvme"),
    reason="the 1-bit optimizers average whole momenta with a compressed all-reduce, while ZeRO keeps only a "
           "partition of the optimizer state on each rank",
    instead="set zero_optimization.stage to 0 to use a 1-bit optimizer, or use Adam with ZeRO")
"""The 1-bit optimizers with ZeRO (any stage, hence its offload)."""

ONEBIT_WITH_MOE = refuse_pairs(
    ONEBIT, ("moe",),
    reason="the 1-bit optimizers compress one momentum per parameter over the whole data-parallel group, while "
           "each expert's copies live only on its expert-data-parallel group (the other ranks hold other experts)",
    instead="use Adam (with ZeRO stage 1 or 2 if you like) for a model with MoE layers")
"""The 1-bit optimizers with MoE layers."""

REFUSALS = ONEBIT_WITH_ZERO + ONEBIT_WITH_MOE
"""Everything the ``comm`` plugin refuses."""
