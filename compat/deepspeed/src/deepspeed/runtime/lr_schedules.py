"""``deepspeed.runtime.lr_schedules``: microspeed's schedules (:mod:`microspeed.builtin.lr_schedules`)."""

from microspeed.builtin.lr_schedules import (
    SCHEDULER_NAMES,
    WARMUP_TYPES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"

VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
"""The scheduler ``type`` names DeepSpeed implements itself (clients test a config's type against it)."""

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

__all__ = ["LRRangeTest", "OneCycle", "SCHEDULER_NAMES", "VALID_LR_SCHEDULES", "WARMUP_TYPES", "WarmupCosineLR",
           "WarmupDecayLR", "WarmupLR", "build_scheduler"]
