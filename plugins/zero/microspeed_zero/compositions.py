"""What the ``zero`` plugin declares to the composition matrix (``microspeed plugins --matrix``).

Its features, and the pairs it refuses itself (its offloaded steps run Adam); the plugins that cannot
combine with gradient partitioning declare their own pairs (they ask the
:class:`~microspeed.plugin_api.GradientPartitioning` capability at ``initialize()``). The refusals are module
constants: ``ZeroPlugin.microspeed_wrap_optimizer`` and :class:`~microspeed_zero.swap.OptimizerSwapper` raise
with their messages.
"""

from __future__ import annotations

from microspeed.plugin_api import Feature, refuse_pairs

STAGE = "zero_optimization.stage"

FEATURES = (
    Feature("zero-1", "ZeRO stage 1 (optimizer state partitioned)", '"zero_optimization": {"stage": 1}', choice=STAGE),
    Feature("zero-2", "ZeRO stage 2 (+ gradients partitioned)", '"zero_optimization": {"stage": 2}', choice=STAGE),
    Feature("zero-3", "ZeRO stage 3 (+ parameters partitioned)", '"zero_optimization": {"stage": 3}', choice=STAGE),
    Feature("offload-cpu", "ZeRO-Offload to CPU memory",
            '"zero_optimization": {"offload_optimizer": {"device": "cpu"}} with stage >= 1 (offload_param with '
            'stage 3)'),
    Feature("offload-nvme", "ZeRO-Infinity offload to NVMe",
            '"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ...}} with stage >= 1 '
            '(offload_param with stage 3)'),
)
"""ZeRO's features: the three stages (alternatives of ``zero_optimization.stage``) and the two offload targets."""

NVME_STEP_IS_ADAM = refuse_pairs(
    ("offload-nvme",), ("onebit-adam", "zero-one-adam", "onebit-lamb"),
    reason="ZeRO's NVMe-offloaded step streams Adam's state (masters, exp_avg, exp_avg_sq) through a few buffers and "
           "applies Adam's update to it, so an optimizer with another update (the 1-bit optimizers' frozen variance "
           "and compressed momentum) has no state there to step",
    instead="use offload_optimizer.device 'cpu' or 'none' for an optimizer other than torch.optim.Adam/AdamW")
"""NVMe optimizer offload with the 1-bit optimizers."""

CPU_STEP_IS_ADAM = refuse_pairs(
    ("offload-cpu",), ("onebit-adam", "zero-one-adam", "onebit-lamb"),
    reason='with "zero_force_ds_cpu_optimizer" true, ZeRO\'s CPU-offloaded step runs a fast CPU Adam in place of the '
           "client's optimizer (as DeepSpeed does), which would replace the 1-bit update by Adam's",
    instead='set "zero_force_ds_cpu_optimizer": false to step the 1-bit optimizer itself on the CPU',
    when='"zero_force_ds_cpu_optimizer" is true (the default)')
"""CPU optimizer offload with the 1-bit optimizers while ZeRO forces its CPU Adam (a condition, not the whole pair)."""

REFUSALS = NVME_STEP_IS_ADAM + CPU_STEP_IS_ADAM
"""Everything the ``zero`` plugin refuses."""
