"""``deepspeed.ops.adam``: ``FusedAdam`` (microspeed's multi-tensor Adam) and ``DeepSpeedCPUAdam``."""

from microspeed.ops.cpu_optimizers import DeepSpeedCPUAdam
from microspeed.ops.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
