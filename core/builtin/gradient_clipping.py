"""Global gradient norm and clipping (``gradient_clipping``), summed across model-parallel ranks.

Data-parallel ranks hold identical reduced gradients, so the norm is local to a replica; when
the model is split (tensor or pipeline parallel), squares are summed over the model-parallel
group. Clipping follows DeepSpeed: ``coef = max_norm / (norm + 1e-6)``, applied when < 1.
"""

from __future__ import annotations

import torch

from microspeed import comm
from microspeed.config import Field, non_negative
from microspeed.hookspecs import hookimpl


def global_norm(grads: list[torch.Tensor], group=None) -> torch.Tensor:
    """L2 norm over all ``grads`` (fp32), with squares summed over ``group`` when given."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    per_tensor = torch._foreach_norm(grads, 2.0)
    if len({n.dtype for n in per_tensor}) > 1:
        per_tensor = [n.float() for n in per_tensor]
    norms = torch.stack(per_tensor).float()
    if group is None or comm.get_world_size(group) == 1:
        return torch.linalg.vector_norm(norms, 2.0)
    sq = norms.square().sum()
    comm.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``grads`` in place so that their norm is at most ``max_norm`` (no host sync)."""
    if grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))


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
        norm = global_norm(grads, engine.topology.model_parallel_group)
        if self.max_norm > 0:
            clip_(grads, self.max_norm, norm)
        return norm
