"""The exponential LR range test schedule of ``microspeed lr-find`` (a torch scheduler, kept apart from the CLI so
that ``microspeed lr-find --help`` does not import torch; ``microspeed.cli.lr_find.ExponentialRangeTest`` is it)."""

from __future__ import annotations

from typing import Any

from microspeed.builtin.lr_schedules import LRRangeTest
from microspeed.cli.lr_find import _check_range


class ExponentialRangeTest(LRRangeTest):
    """``LRRangeTest`` with a multiplicative increase: ``min_lr * (max_lr / min_lr) ** (b / (num_steps - 1))`` at
    batch ``b = last_batch_iteration + 1``, so ``min_lr`` at the first step and ``max_lr`` at step
    ``num_steps - 1`` (it keeps growing after that)."""

    def __init__(self, optimizer: Any, min_lr: float, max_lr: float, num_steps: int,
                 last_batch_iteration: int = -1) -> None:
        _check_range(min_lr, max_lr, num_steps)
        self.max_lr, self.num_steps = max_lr, num_steps
        self.ratio = max_lr / min_lr
        super().__init__(optimizer, lr_range_test_min_lr=min_lr, lr_range_test_step_size=1,
                         lr_range_test_step_rate=0.0, last_batch_iteration=last_batch_iteration)

    def get_lr(self) -> list[float]:
        """The lr of every param group for batch ``last_batch_iteration``."""
        growth = self.ratio ** ((self.last_batch_iteration + 1) / (self.num_steps - 1))
        return [lo * growth for lo in self.min_lr]
