"""What the ``zero`` plugin declares to the composition matrix (``microspeed plugins --matrix``).

The features only: ZeRO itself refuses no pair. The plugins that cannot combine with gradient
partitioning declare those pairs (they ask the :class:`~microspeed.plugin_api.GradientPartitioning`
capability at ``initialize()``).
"""

from __future__ import annotations

from microspeed.plugin_api import Feature

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
