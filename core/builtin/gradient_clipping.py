"""Global gradient norm and clipping (``gradient_clipping``): the default answer to ``clip_gradients``.

The norm is the kernel's one mechanism (``engine.grad_norm``, :mod:`microspeed.gradients`): every
gradient's squares summed once across ranks, as the plugins' ``microspeed_grad_norm_rules`` say
(tied copies skipped, expert squares summed over their expert-parallel group, the rest over the
model-parallel group). Clipping follows DeepSpeed: ``coef = max_norm / (norm + 1e-6)``, applied when < 1.
"""

from __future__ import annotations

import torch

from microspeed.config import Field, non_negative
from microspeed.gradients import clip_
from microspeed.hookspecs import hookimpl


class GradientClippingPlugin:
    """Default answer to ``microspeed_clip_gradients``."""

    def __init__(self) -> None:
        self.max_norm = 0.0

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``gradient_clipping``: max global L2 norm, 0 = off."""
        return {"gradient_clipping": Field((float,), 0.0, "max global gradient L2 norm; 0 = no clipping",
                                           non_negative)}

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Read ``gradient_clipping``."""
        self.max_norm = config["gradient_clipping"]

    @hookimpl(trylast=True)
    def microspeed_clip_gradients(self, engine, grads: list[torch.Tensor]) -> torch.Tensor:
        """Measure the global norm; clip when ``gradient_clipping`` > 0."""
        grads = [g for g in grads if g is not None]
        norm = engine.grad_norm(grads)
        if self.max_norm > 0:
            clip_(grads, self.max_norm, norm)
        return norm
