"""Partitioned tensors for user code: DeepSpeed's ``safe_get_*`` / ``safe_set_*`` functions.

``safe_get_full_*`` (the fp32 master, the gradient, an optimizer state) are collective at stages
1–3: every data-parallel rank calls them for the same parameter. They return a new tensor of the
parameter's shape. For a parameter no ZeRO engine manages (stage 0), ``safe_get_full_fp32_param``
and ``safe_get_full_grad`` read the parameter and its ``.grad`` directly (no communication);
``safe_get_full_optimizer_state`` cannot find the optimizer from the parameter and raises.

``safe_set_full_*`` write a whole value (every rank passes the same tensor of the parameter's
shape; no communication) into this rank's partition of the fp32 master, the gradient or an
optimizer state. As in DeepSpeed, setting the fp32 master of a 16-bit model changes the model's
parameter at the next ``step()`` (which copies the updated masters into the parameters); in fp32
the master is the parameter's own slice, so it changes at once.

``safe_get_local_*`` / ``safe_set_local_*`` read and write only this rank's partition of one
parameter, a 1-D tensor: the elements of the flattened parameter this rank owns (possibly none).
As in DeepSpeed they exist for stage 3 only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from microspeed_zero.init import _comm_device


class ZeroApiError(ValueError, AssertionError):
    """A ``safe_*`` function called for a parameter or value it does not apply to.

    Also an ``AssertionError``, which DeepSpeed raises for the same misuse (code catching either works).
    """


def _runtime(param: torch.Tensor) -> Any:
    z = getattr(param, "_zero", None)
    return z[0] if z is not None else None


def _gather(rt: Any, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """All-gather this rank's slice ``local`` of ``param``'s segment into the whole ``param`` (collective)."""
    device = _comm_device(rt.group)
    return rt.gather_full(param, local.detach().to(device))


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's fp32 master value (whole), or its value in fp32 when it is not partitioned.

    ``None`` for a frozen parameter (``requires_grad`` false: it has no master), as in DeepSpeed.
    """
    if not param.requires_grad:
        return None
    rt = _runtime(param)
    if rt is None:
        return param.detach().float().clone()
    index = param._zero[1]
    local = rt.master_slice(index)
    if local is None:  # a segment the optimizer does not step (in no param group): its parameters are the truth
        local = rt.local_params(rt.segments[index])
    return _gather(rt, param, local.float())


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The averaged gradient of ``param`` (between ``backward`` at the boundary and ``step``), whole.

    ``None`` when the parameter has no gradient (frozen). With fp16 it is still multiplied by the
    loss scale, as DeepSpeed returns it.
    """
    if not param.requires_grad:
        return None
    rt = _runtime(param)
    if rt is None:
        return None if param.grad is None else param.grad.detach().clone()
    local = rt.grad_slice(param._zero[1])
    if local is None:
        return None
    return _gather(rt, param, local)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"``, ...) of ``param``, whole.

    ``None`` when the optimizer does not step the parameter (frozen at any stage, or in no param group). Zeros
    before the first step (the state does not exist yet).
    """
    if not param.requires_grad:
        return None
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


# -- where a parameter's elements are on this rank --------------------------------------------------


def _own_piece(param: torch.Tensor) -> tuple[Any, Any, int, int, int, int]:
    """``(runtime, segment, position, a, b, s)``: this rank owns elements ``[a, b)`` of the flattened ``param``,
    at ``[s, s + b - a)`` of its slice of the segment (``a == b`` when it owns none)."""
    rt, index, i = param._zero
    seg = rt.segments[index]
    rng = seg.param_range(i, seg.rank)
    if rng is None:
        return rt, seg, i, 0, 0, 0
    a, b = rng
    return rt, seg, i, a, b, seg.offsets[i] + a - seg.slice_of(seg.rank)[0]


def _name(rt: Any, param: torch.Tensor) -> str:
    return rt.names.get(id(param), f"parameter of shape {tuple(getattr(param, 'ds_shape', param.shape))}")


def _whole_value(func: str, rt: Any, seg: Any, i: int, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` flattened, checked to have the parameter's element count."""
    if not isinstance(value, torch.Tensor):
        raise ZeroApiError(f"{func}: value must be a torch.Tensor, got {type(value).__name__}")
    if value.numel() != seg.numels[i]:
        raise ZeroApiError(f"{func}({_name(rt, param)}): value has {value.numel()} elements, the parameter "
                           f"{seg.numels[i]} (shape {seg.shapes[i]}); pass the whole (unpartitioned) value.")
    return value.detach().reshape(-1)


def _resident(rt: Any, writeback: bool) -> Any:
    """Masters and optimizer state in memory (an optimizer on NVMe: read, and written back when ``writeback``)."""
    return rt.swapper.resident(writeback=writeback) if rt.swapper is not None else contextlib.nullcontext()


def _write_master(rt: Any, seg: Any, i: int, a: int, b: int, s: int, values: torch.Tensor) -> None:
    """Elements ``[a, b)`` of the parameter (``values``, this rank's part) into the fp32 master, or into the
    parameters' slice where the optimizer does not step the segment (frozen: the parameters are the truth)."""
    with torch.no_grad(), _resident(rt, writeback=True):
        master = rt.masters.get(seg.index)
        if master is None or seg.groups[i] is None:
            rt.store_params(seg.index, s, values.to(seg.dtype))
        else:
            master[s:s + b - a].copy_(values)


def _state_runs(rt: Any, seg: Any, name: str, func: str, param: torch.Tensor,
                missing_ok: bool = False) -> list[tuple[int, int, torch.Tensor]]:
    """``(start, end, state tensor)`` of the optimizer state ``name`` over the runs of ``seg`` on this rank (with
    ``missing_ok``, runs without any state yet -- before the first step -- are left out)."""
    out = []
    for (rseg, _g, start, end, view), st in zip(rt.optimizer.runs, rt.optimizer.run_states(), strict=True):
        if rseg is not seg or (missing_ok and not st):
            continue
        t = st.get(name)
        if not isinstance(t, torch.Tensor) or t.numel() != view.numel():
            keys = sorted(k for k, v in st.items() if isinstance(v, torch.Tensor) and v.numel() == view.numel())
            raise ZeroApiError(f"{func}({_name(rt, param)}): the optimizer has no element-wise state {name!r} "
                               f"for this parameter (it has {keys}; the state is created by the first step()).")
        out.append((start, end, t))
    return out


def _write_state(rt: Any, seg: Any, i: int, a: int, b: int, s: int, values: torch.Tensor, name: str, func: str,
                 param: torch.Tensor) -> None:
    if seg.groups[i] is None or a == b:
        return
    with torch.no_grad(), _resident(rt, writeback=True):
        for start, end, t in _state_runs(rt, seg, name, func, param):
            x, y = max(start, s), min(end, s + b - a)
            if x < y:
                t.view(-1)[x - start:y - start].copy_(values[x - s:y - s])


def _write_grad(rt: Any, seg: Any, i: int, a: int, b: int, s: int, values: torch.Tensor) -> None:
    files = rt.gradients
    with torch.no_grad():
        if files is not None and files.holds(seg.index):
            acc = files.acquire(seg.index)
            acc[s:s + b - a].copy_(values)
            files.release(seg.index, acc)
        elif seg.index in rt.acc:
            rt.local_grads(seg)[s:s + b - a].copy_(values)


def _zero_param(func: str, param: torch.Tensor, stage3: bool = False) -> Any:
    rt = _runtime(param)
    if rt is None or (stage3 and rt.stage3 is None):
        what = "ZeRO stage 3 partitioned parameters" if stage3 else "parameters of a ZeRO engine (stage >= 1)"
        raise ZeroApiError(f"{func}: this API is only defined for {what}; this parameter is "
                           f"{'at stage ' + str(rt.stage) if rt is not None else 'not managed by ZeRO'}.")
    return rt


# -- whole values --------------------------------------------------------------------------------------------


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the fp32 master of ``param`` to the whole ``value`` (this rank keeps its partition of it).

    Every data-parallel rank calls it with the same value. At stage 0 the parameter itself is set.
    """
    rt = _runtime(param)
    if rt is None:
        with torch.no_grad():
            param.copy_(value.reshape(param.shape))
        return
    rt, seg, i, a, b, s = _own_piece(param)
    flat = _whole_value("safe_set_full_fp32_param", rt, seg, i, param, value)
    master = rt.masters.get(seg.index)
    if rt.stage3 is None and master is not None and master.data_ptr() == rt.local_params(seg).data_ptr():
        rt.wait_gathers([seg.index])  # fp32 at stages 1, 2: the master is the parameter's slice -- set it whole
        with torch.no_grad():
            seg.views(rt.flats[seg.index])[i].view(-1).copy_(flat)
    elif a < b:
        _write_master(rt, seg, i, a, b, s, flat[a:b].float())


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the optimizer state ``optim_state_key`` of ``param`` to the whole ``value`` (this rank keeps its part).

    The state must exist (the optimizer creates it at its first ``step()``); a frozen parameter has none and
    the call does nothing, as in DeepSpeed.
    """
    func = "safe_set_full_optimizer_state"
    _zero_param(func, param)
    rt, seg, i, a, b, s = _own_piece(param)
    flat = _whole_value(func, rt, seg, i, param, value)
    _write_state(rt, seg, i, a, b, s, flat[a:b], optim_state_key, func, param)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the averaged gradient of ``param`` (between ``backward`` at the boundary and ``step``) to ``value``."""
    rt = _runtime(param)
    if rt is None:
        if param.grad is None:
            param.grad = value.detach().clone().reshape(param.shape)
        else:
            param.grad.copy_(value.reshape(param.shape))
        return
    rt, seg, i, a, b, s = _own_piece(param)
    flat = _whole_value("safe_set_full_grad", rt, seg, i, param, value)
    if param.requires_grad and a < b:
        _write_grad(rt, seg, i, a, b, s, flat[a:b])


def safe_update_full_grad_vectorized(param_list: list[torch.nn.Parameter], update_func: Callable) -> None:
    """For each parameter, set its whole gradient to ``update_func(current whole gradient, param)``.

    Collective like :func:`safe_get_full_grad`: every rank passes the same parameters in the same order.
    """
    for p in param_list:
        if not p.requires_grad:
            continue
        safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))


# -- this rank's partition (stage 3) ---------------------------------------------------------------------------


def _local_value(func: str, rt: Any, param: torch.Tensor, a: int, b: int, value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ZeroApiError(f"{func}: value must be a torch.Tensor, got {type(value).__name__}")
    if value.numel() != b - a:
        raise ZeroApiError(f"{func}({_name(rt, param)}): value has {value.numel()} elements, this rank's partition "
                           f"of the parameter {b - a}; pass what safe_get_local_* returns for it.")
    return value.detach().reshape(-1)


def _set_local(func: str, param: torch.Tensor, value: torch.Tensor, write: Callable) -> None:
    """Check ``value`` against this rank's partition of ``param`` and ``write`` it (nothing for a frozen one)."""
    _zero_param(func, param, stage3=True)
    if not param.requires_grad:
        return
    rt, seg, i, a, b, s = _own_piece(param)
    flat = _local_value(func, rt, param, a, b, value)
    if a < b:
        write(rt, seg, i, a, b, s, flat)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's partition of ``param``'s fp32 master (1-D; ``None`` when the parameter is frozen). Stage 3."""
    _zero_param("safe_get_local_fp32_param", param, stage3=True)
    if not param.requires_grad:
        return None
    rt, seg, i, a, b, s = _own_piece(param)
    local = rt.master_slice(seg.index)
    if local is None:
        local = rt.local_params(seg)
    return local[s:s + b - a].float().clone()


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's partition of ``param``'s fp32 master (what :func:`safe_get_local_fp32_param` returns)."""
    _set_local("safe_set_local_fp32_param", param, value,
               lambda rt, seg, i, a, b, s, flat: _write_master(rt, seg, i, a, b, s, flat.float()))


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's partition of ``param``'s averaged gradient (1-D; ``None`` when it has none). Stage 3."""
    _zero_param("safe_get_local_grad", param, stage3=True)
    if not param.requires_grad:
        return None
    rt, seg, i, a, b, s = _own_piece(param)
    local = rt.grad_slice(seg.index)
    return None if local is None else local[s:s + b - a].clone()


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's partition of ``param``'s averaged gradient. Stage 3."""
    _set_local("safe_set_local_grad", param, value, _write_grad)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's partition of ``param``'s optimizer state ``optim_state_key`` (1-D; ``None`` when frozen)."""
    func = "safe_get_local_optimizer_state"
    _zero_param(func, param, stage3=True)
    rt, seg, i, a, b, s = _own_piece(param)
    if seg.groups[i] is None:
        return None
    with _resident(rt, writeback=False):
        out = torch.zeros(b - a)  # zeros before the first step, as safe_get_full_optimizer_state
        for start, end, t in _state_runs(rt, seg, optim_state_key, func, param, missing_ok=True):
            x, y = max(start, s), min(end, s + b - a)
            if x < y:
                out = out.to(t.dtype)
                out[x - s:y - s] = t.detach().view(-1)[x - start:y - start].to("cpu")
        return out


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's partition of ``param``'s optimizer state ``optim_state_key``. Stage 3."""
    func = "safe_set_local_optimizer_state"
    _zero_param(func, param, stage3=True)
    rt, seg, i, a, b, s = _own_piece(param)
    flat = _local_value(func, rt, param, a, b, value)
    _write_state(rt, seg, i, a, b, s, flat, optim_state_key, func, param)
