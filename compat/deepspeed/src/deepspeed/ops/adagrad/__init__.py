"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` (:mod:`microspeed.ops.cpu_optimizers`)."""

from microspeed.ops.cpu_optimizers import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
