"""Global gradient norm, clipping (``gradient_clipping``), the non-finite guard (``max_consecutive_nonfinite_steps``).

The norm is the kernel's one mechanism (``engine.grad_norm``, :mod:`microspeed.gradients`): every
gradient's squares summed once across ranks, as the plugins' ``microspeed_grad_norm_rules`` say
(tied copies skipped, expert squares summed over their expert-parallel group, the rest over the
model-parallel group). Clipping follows DeepSpeed: ``coef = max_norm / (norm + 1e-6)``, applied when < 1.

Bad numbers never train: whoever steps the optimizer asks ``engine.grad_norm.finite(norm)`` and skips a
step whose norm is NaN or inf (fp32 and bf16 as fp16's overflow skip; the step is counted in
``engine.skipped_steps``). A NaN or inf *loss* reaches that check too: this plugin multiplies the loss by
1 when it is finite and by NaN when it is not (``x - x + 1``, no host sync), so its gradients are NaN on this rank, the
reduction carries them to every rank and the one check sees them. Each skipped step is logged with its
number; ``max_consecutive_nonfinite_steps`` skipped in a row end the job with a :class:`NonFiniteError`.
"""

from __future__ import annotations

from typing import Any

import torch

from microspeed.config import Field, non_negative, positive
from microspeed.errors import NonFiniteError
from microspeed.gradients import clip_
from microspeed.hookspecs import StepOutcome, hookimpl
from microspeed.log import get_logger

NONFINITE_KEY = "max_consecutive_nonfinite_steps"


class GradientClippingPlugin:
    """Default answer to ``microspeed_clip_gradients``; the non-finite guard's loss check, log and limit."""

    def __init__(self) -> None:
        self.max_norm = 0.0
        self.limit = 10
        self.in_a_row = 0
        self.log: Any = None

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``gradient_clipping``: max global L2 norm, 0 = off; ``max_consecutive_nonfinite_steps``."""
        return {
            "gradient_clipping": Field((float,), 0.0, "max global gradient L2 norm; 0 = no clipping", non_negative),
            NONFINITE_KEY: Field((int,), 10, "optimizer steps in a row skipped for a NaN/inf loss or gradient norm "
                                 "before the job ends with an error naming the step (each one is skipped and "
                                 "logged)", positive),
        }

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Read ``gradient_clipping`` and ``max_consecutive_nonfinite_steps``."""
        self.max_norm = config["gradient_clipping"]
        self.limit = config[NONFINITE_KEY]

    @hookimpl
    def microspeed_setup(self, engine) -> None:
        """Bind the logger that reports skipped steps (rank 0: every rank skips the same steps)."""
        self.in_a_row = 0
        self.log = get_logger("microspeed.train") if engine.topology.rank == 0 else None

    @hookimpl(trylast=True)
    def microspeed_clip_gradients(self, engine, grads: list[torch.Tensor]) -> torch.Tensor:
        """Measure the global norm; clip when ``gradient_clipping`` > 0."""
        grads = [g for g in grads if g is not None]
        norm = engine.grad_norm(grads)
        if self.max_norm > 0:
            clip_(grads, self.max_norm, norm)
        return norm

    @hookimpl(tryfirst=True)
    def microspeed_scale_loss(self, loss: torch.Tensor) -> torch.Tensor | None:
        """Make a NaN or inf loss's gradients NaN: ``loss * (x - x + 1)`` with ``x`` the loss's value, exactly 1 when
        it is finite (the gradients are unchanged, bit for bit) and NaN when not; two scalar ops, no host sync."""
        if not loss.requires_grad:
            return None
        value = loss.detach()
        return loss * (value - value + 1)

    @hookimpl
    def microspeed_after_step(self, engine, outcome: StepOutcome) -> None:
        """Log a step skipped for a non-finite loss or norm; end the job after the limit in a row."""
        if not outcome.nonfinite:
            if outcome.applied:
                self.in_a_row = 0
            return
        self.in_a_row += 1
        step = engine.global_steps + 1
        norm = outcome.grad_norm
        norm = float(norm) if norm is not None else None
        if self.log is not None:
            self.log.warning("non-finite loss or gradient norm: optimizer step skipped", step=step, grad_norm=norm,
                             skipped_in_a_row=self.in_a_row, skipped_steps=engine.skipped_steps,
                             limit=f"{NONFINITE_KEY}={self.limit}")
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"step {step}: the loss or the gradient norm ({norm}) was NaN or inf in {self.in_a_row} optimizer "
                f"step(s) in a row (steps {step - self.in_a_row + 1}-{step}), each skipped; {NONFINITE_KEY}="
                f"{self.limit} ends the job here. Look for the source: the learning rate, the data (a bad batch), "
                f"an op unstable in this dtype, or raise {NONFINITE_KEY} to tolerate more.")
