"""What the ``zero`` plugin declares to the composition matrix (``microspeed plugins --matrix``).

Its features, and the pair it refuses itself (its forced CPU Adam in place of a 1-bit optimizer); the plugins
that cannot combine with gradient partitioning declare their own pairs (they ask the
:class:`~microspeed.plugin_api.GradientPartitioning` capability at ``initialize()``). The refusal is a module
constant: ``ZeroPlugin.microspeed_wrap_optimizer`` raises with its message. NVMe offload steps Adam/AdamW and
any optimizer declaring its element-wise state (:class:`~microspeed.plugin_api.ElementwiseState`: the 1-bit
optimizers), so it refuses no declared feature.
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

CPU_STEP_IS_ADAM = refuse_pairs(
    ("offload-cpu",), ("onebit-adam", "zero-one-adam", "onebit-lamb"),
    reason='with "zero_force_ds_cpu_optimizer" true, ZeRO\'s CPU-offloaded step runs a fast CPU Adam in place of the '
           "client's optimizer (as DeepSpeed does), which would replace the 1-bit update by Adam's",
    instead='set "zero_force_ds_cpu_optimizer": false to step the 1-bit optimizer itself on the CPU',
    when='"zero_force_ds_cpu_optimizer" is true (the default)')
"""CPU optimizer offload with the 1-bit optimizers while ZeRO forces its CPU Adam (a condition, not the whole pair)."""

REFUSALS = CPU_STEP_IS_ADAM
"""Everything the ``zero`` plugin refuses."""
