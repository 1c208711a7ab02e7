"""Gradient accumulation: divide each micro-step's loss by the accumulation steps; run backward.

With ``gradient_accumulation_steps = N``, the gradient summed over N micro-steps of
``loss / N`` equals the gradient of the mean loss over the N micro-batches, so N micro-batches
of size b train exactly as one of size N*b.
"""

from __future__ import annotations

import torch

from microspeed.hookspecs import hookimpl


class GradientAccumulationPlugin:
    """Scales the loss for accumulation; the default ``backward`` (``loss.backward()``)."""

    @hookimpl
    def microspeed_scale_loss(self, engine, loss: torch.Tensor) -> torch.Tensor | None:
        """``loss / gradient_accumulation_steps`` unless ``backward(scale_wrt_gas=False)``."""
        gas = engine.gradient_accumulation_steps()
        if gas > 1 and engine.ctx.scale_wrt_gas:
            return loss / gas
        return None

    @hookimpl(trylast=True)
    def microspeed_backward(self, loss: torch.Tensor, retain_graph: bool) -> bool:
        """Plain autograd backward."""
        loss.backward(retain_graph=retain_graph)
        return True
