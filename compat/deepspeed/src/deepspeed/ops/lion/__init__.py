"""``deepspeed.ops.lion``: ``DeepSpeedCPULion`` and ``FusedLion`` (:mod:`microspeed.ops.cpu_optimizers`)."""

from microspeed.ops.cpu_optimizers import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
