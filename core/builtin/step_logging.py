"""Every ``steps_per_print`` steps, one structured log line: loss, lr, grad norm, scale, samples/s.

With ``wall_clock_breakdown`` the line also carries the milliseconds spent in forward,
backward and step over the window.
"""

from __future__ import annotations

import math
import time

from microspeed.builtin.step_metrics import LossMeter, PhaseTimer
from microspeed.config import Field
from microspeed.hookspecs import hookimpl
from microspeed.log import get_logger


def _every(value: float) -> str | None:
    """Check: a whole number > 0, or infinity (Accelerate writes ``float("inf")``: never log)."""
    return None if value > 0 and (value == math.inf or float(value).is_integer()) else "a whole number > 0 or inf"


class StepLoggingPlugin:
    """Logs progress on rank 0 through structlog."""

    def __init__(self) -> None:
        self.every = 10
        self.breakdown = False
        self.loss = LossMeter()
        self.window_start = time.perf_counter()
        self.window_samples = 0
        self.timer = PhaseTimer()
        self.log = None

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``steps_per_print`` and ``wall_clock_breakdown``."""
        return {
            "steps_per_print": Field((int, float), 10, "log every N optimizer steps (inf: never)", _every,
                                     infinite=True),
            "wall_clock_breakdown": Field((bool,), False, "log time spent in forward/backward/step"),
        }

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Read the keys."""
        every = config["steps_per_print"]
        self.every = every if every == math.inf else int(every)
        self.breakdown = self.timer.enabled = config["wall_clock_breakdown"]

    @hookimpl
    def microspeed_setup(self, engine) -> None:
        """Bind the logger (rank 0 logs)."""
        if engine.topology.rank == 0:
            self.log = get_logger("microspeed.train")
        self.window_start = time.perf_counter()

    @hookimpl
    def microspeed_before_forward(self) -> None:
        """Start the forward timer."""
        self.timer.start()

    @hookimpl
    def microspeed_after_forward(self) -> None:
        """Stop the forward timer."""
        self.timer.stop("forward")

    @hookimpl
    def microspeed_before_backward(self, ctx) -> None:
        """Accumulate the loss (no host sync) and start the backward timer."""
        self.loss.add(ctx.loss)
        self.timer.start()

    @hookimpl
    def microspeed_after_backward(self) -> None:
        """Stop the backward timer."""
        self.timer.stop("backward")

    @hookimpl
    def microspeed_before_step(self) -> None:
        """Start the step timer."""
        self.timer.start()

    @hookimpl
    def microspeed_after_step(self) -> None:
        """Stop the step timer."""
        self.timer.stop("step")

    @hookimpl
    def microspeed_after_global_step(self, engine) -> None:
        """Emit the line every ``steps_per_print`` steps."""
        self.window_samples += engine.train_batch_size()
        if self.every == math.inf or engine.global_steps % self.every or self.log is None:
            return
        elapsed = time.perf_counter() - self.window_start
        fields = {
            "step": engine.global_steps,
            "loss": None if (mean := self.loss.take()) is None else round(mean, 5),
            "lr": engine.get_lr()[0] if engine.get_lr() else None,
            "grad_norm": None if engine.get_global_grad_norm() is None else round(engine.get_global_grad_norm(), 4),
            "samples_per_s": round(self.window_samples / elapsed, 2) if elapsed > 0 else None,
            "skipped": engine.skipped_steps,
            **engine.metrics,
        }
        if self.breakdown:
            fields.update({f"{k}_ms": round(v, 2) for k, v in self.timer.take().items()})
        self.log.info("train", **fields)
        self.window_start, self.window_samples = time.perf_counter(), 0
