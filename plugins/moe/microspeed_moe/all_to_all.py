"""``all_to_all`` over the expert-parallel group, differentiable both ways."""

from __future__ import annotations

from typing import Any

import torch

from microspeed.plugin_api import comm


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Any, inputs: torch.Tensor) -> torch.Tensor:  # noqa: D102 - autograd protocol
        ctx.group = group
        inputs = inputs.contiguous()
        out = torch.empty_like(inputs)
        comm.all_to_all_single(out, inputs, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # noqa: D102 - autograd protocol
        return None, _AllToAll.apply(ctx.group, grad)


def all_to_all(inputs: torch.Tensor, group: Any) -> torch.Tensor:
    """Rank ``j`` of ``group`` receives chunk ``j`` (along dim 0) of every rank's ``inputs``, in rank order.

    The gradient goes back the same way (an all-to-all is its own transpose). Identity on a group of one.
    """
    if group is None or comm.get_world_size(group) == 1:
        return inputs
    return _AllToAll.apply(group, inputs)
