"""Data helpers the kernel itself needs: :class:`RepeatingLoader` (``engine.train_batch()`` without an iterator)."""

from __future__ import annotations

from typing import Any


class RepeatingLoader:
    """Wraps an iterable and restarts it when exhausted, so ``next()`` never stops."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
