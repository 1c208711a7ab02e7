"""``deepspeed.runtime.lr_schedules``: microspeed's schedules (:mod:`microspeed.builtin.lr_schedules`).

The schedule classes, ``VALID_LR_SCHEDULES`` and DeepSpeed's key constants (``WARMUP_MIN_LR``, ...) all come
from there; clients test a config's type against ``VALID_LR_SCHEDULES`` and build configs with the constants.
"""

from microspeed.builtin import lr_schedules as _impl
from microspeed.builtin.lr_schedules import (
    SCHEDULER_NAMES,
    VALID_LR_SCHEDULES,
    WARMUP_TYPES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

# DeepSpeed's constant names (scheduler type names, scheduler.params keys), defined once in microspeed.
globals().update({k: v for k, v in vars(_impl).items() if k.isupper() and isinstance(v, (str, list))})

__all__ = ["LRRangeTest", "OneCycle", "SCHEDULER_NAMES", "VALID_LR_SCHEDULES", "WARMUP_TYPES", "WarmupCosineLR",
           "WarmupDecayLR", "WarmupLR", "build_scheduler"]
