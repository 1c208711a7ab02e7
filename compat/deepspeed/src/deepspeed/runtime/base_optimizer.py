"""``deepspeed.runtime.base_optimizer``: the classes clients test optimizers against.

DeepSpeed's ZeRO optimizers derive from ``DeepSpeedOptimizer``; microspeed's engine hands out
``torch.optim.Optimizer`` objects (wrapped or not), so ``isinstance(x, DeepSpeedOptimizer)`` is true
for any optimizer an engine returned (one that has ``state_dict``/``load_state_dict`` and ``step``
and is a ``torch.optim.Optimizer`` or wraps one as ``.optimizer``).
"""

from __future__ import annotations

from typing import Any

import torch


class _OptimizerMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        if type.__instancecheck__(cls, obj):
            return True
        return isinstance(obj, torch.optim.Optimizer) or isinstance(getattr(obj, "optimizer", None),
                                                                    torch.optim.Optimizer)


class DeepSpeedOptimizer(metaclass=_OptimizerMeta):
    """Base of DeepSpeed's optimizer wrappers; see the module docstring for what counts as an instance."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """Base of DeepSpeed's ZeRO optimizers (same instance rule as :class:`DeepSpeedOptimizer`)."""


__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
