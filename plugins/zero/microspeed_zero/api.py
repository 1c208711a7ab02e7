"""Whole tensors for user code: ``safe_get_full_fp32_param``, ``safe_get_full_grad``, ``safe_get_full_optimizer_state``.

As in DeepSpeed, these are collective at stages 1–3: every data-parallel rank calls them for the
same parameter. They return a new tensor of the parameter's shape. For a parameter no ZeRO engine
manages (stage 0), ``safe_get_full_fp32_param`` and ``safe_get_full_grad`` read the parameter and
its ``.grad`` directly (no communication); ``safe_get_full_optimizer_state`` cannot find the
optimizer from the parameter and raises.
"""

from __future__ import annotations

from typing import Any

import torch

from microspeed_zero.init import _comm_device


def _runtime(param: torch.Tensor) -> Any:
    z = getattr(param, "_zero", None)
    return z[0] if z is not None else None


def _gather(rt: Any, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """All-gather this rank's slice ``local`` of ``param``'s segment into the whole ``param`` (collective)."""
    device = _comm_device(rt.group)
    return rt.gather_full(param, local.detach().to(device))


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's fp32 master value (whole), or its value in fp32 when it is not partitioned."""
    rt = _runtime(param)
    if rt is None:
        return param.detach().float().clone()
    index = param._zero[1]
    local = rt.master_slice(index)
    if local is None:  # a segment the optimizer does not step (frozen): its parameters are the truth
        local = rt.local_params(rt.segments[index])
    return _gather(rt, param, local.float())


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The averaged gradient of ``param`` (between ``backward`` at the boundary and ``step``), whole.

    ``None`` when the parameter has no gradient (frozen). With fp16 it is still multiplied by the
    loss scale, as DeepSpeed returns it.
    """
    rt = _runtime(param)
    if rt is None:
        return None if param.grad is None else param.grad.detach().clone()
    if not param.requires_grad:
        return None
    local = rt.grad_slice(param._zero[1])
    if local is None:
        return None
    return _gather(rt, param, local)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"``, ...) of ``param``, whole.

    ``None`` when the optimizer does not step the parameter (frozen or in no param group). Zeros
    before the first step (the state does not exist yet).
    """
    rt = _runtime(param)
    if rt is None:
        raise ValueError("safe_get_full_optimizer_state: this parameter is not managed by a ZeRO engine "
                         "(stage >= 1); read optimizer.state[param] directly.")
    _, index, i = param._zero
    seg = rt.segments[index]
    if seg.groups[i] is None:
        return None
    local = rt.state_slice(index, optim_state_key)
    if local is None:
        local = torch.zeros(seg.shard_size)
    return _gather(rt, param, local)
