"""Whole tensors for user code: ``safe_get_full_fp32_param``, ``safe_get_full_grad``, ``safe_get_full_optimizer_state``.

As in DeepSpeed, these are collective: every data-parallel rank calls them for the same
parameter. They work at every stage (at stage 0 they read the parameter, its ``.grad`` or the
optimizer's state directly) and return a new tensor of the parameter's shape.
"""

from __future__ import annotations

from typing import Any

import torch


def _runtime(param: torch.Tensor) -> Any:
    z = getattr(param, "_zero", None)
    return z[0] if z is not None else None


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's fp32 master value (whole), or its value in fp32 when it is not partitioned."""
    rt = _runtime(param)
    if rt is None:
        return param.detach().float().clone()
    return rt.gather_full(param, rt.master_slice(param._zero[1])).float()


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The averaged gradient of ``param`` (between ``backward`` at the boundary and ``step``), whole.

    ``None`` when the parameter has no gradient. With fp16 it is still multiplied by the loss scale,
    as DeepSpeed returns it.
    """
    rt = _runtime(param)
    if rt is None:
        return None if param.grad is None else param.grad.detach().clone()
    local = rt.grad_slice(param._zero[1])
    if local is None:
        return None
    return rt.gather_full(param, local)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"``, ...) of ``param``, whole."""
    rt = _runtime(param)
    if rt is None:
        raise ValueError("safe_get_full_optimizer_state: this parameter is not managed by a ZeRO engine "
                         "(stage >= 1); read optimizer.state[param] directly.")
    local = rt.state_slice(param._zero[1], optim_state_key)
    if local is None:
        local = torch.zeros(rt.segments[param._zero[1]].shard_size)
    return rt.gather_full(param, local)
