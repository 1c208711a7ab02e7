"""Per-step measurements shared by step logging and monitors: phase times and the mean loss."""

from __future__ import annotations

import time

import torch

PHASES = ("forward", "backward", "step")


class PhaseTimer:
    """Milliseconds spent in forward, backward and step since the last :meth:`take`.

    Does nothing unless ``enabled``: a disabled timer costs one attribute test per call.
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.ms = dict.fromkeys(PHASES, 0.0)
        self._t0 = 0.0

    def start(self) -> None:
        """A phase begins now."""
        if self.enabled:
            self._t0 = time.perf_counter()

    def stop(self, phase: str) -> None:
        """The phase that began at the last :meth:`start` ends now; add its time to ``phase``."""
        if self.enabled:
            self.ms[phase] += (time.perf_counter() - self._t0) * 1e3

    def take(self) -> dict[str, float]:
        """The milliseconds per phase so far, and restart the counts from zero."""
        out, self.ms = self.ms, dict.fromkeys(PHASES, 0.0)
        return out


class LossMeter:
    """Mean of the losses seen since the last :meth:`take`, summed on the device (no host sync)."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, loss: torch.Tensor | None) -> None:
        """Add one micro-step's (unscaled) loss; ``None`` (a backward without a loss of its own) adds nothing."""
        if loss is None:
            return
        loss = loss.detach().float()
        self.total = loss if self.total is None else self.total + loss
        self.count += 1

    def take(self) -> float | None:
        """The mean loss so far (one host sync), or ``None`` if none was added; then start over."""
        mean = None if self.total is None else float(self.total / self.count)
        self.total, self.count = None, 0
        return mean
