"""Wall-clock time per training phase (``wall_clock_breakdown``), shared by logging and monitors."""

from __future__ import annotations

import time

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
