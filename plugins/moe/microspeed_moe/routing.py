"""MoE routing: send each token's hidden row to its experts' capacity slots, and bring the experts' rows back.

The gate picks, for each of ``T`` tokens, ``k`` experts (``experts[t, j]``) and a slot in each chosen expert's
buffer of ``C`` rows (``slots[t, j]``, or ``-1`` when that choice was dropped for lack of capacity). Within one
expert the slots are unique, so every row ``(e, s)`` of the ``[E, C, H]`` expert buffer belongs to at most one
``(t, j)``. Two operations move the rows:

* :func:`dispatch` ``(x[T, H]) -> [E, C, H]``: ``out[experts[t, j], slots[t, j]] = x[t]`` for the kept
  choices, zeros in the rows no token took;
* :func:`combine` ``(expert_out[E, C, H], weights[T, k]) -> [T, H]``: ``out[t] = sum_j weights[t, j] *
  expert_out[experts[t, j], slots[t, j]]`` over the kept choices; it is differentiable in ``weights`` too,
  which is how the gate (the router) gets its gradient.

DeepSpeed writes both as einsums against dense ``[T, E, C]`` tensors (:func:`dense_dispatch`,
:func:`dense_combine`, built by :func:`to_dense`): ``T * E * C`` values, quadratic in the tokens at a fixed
capacity factor. Here they are index operations over the flat row ``experts * C + slots``, in
``O(E*C*H + T*H)`` memory, with two implementations of the same three primitives:

* the PyTorch index path of this module (:func:`scatter_rows_torch`, :func:`gather_rows_torch`,
  :func:`combine_backward_torch`), the CPU fast path and the fallback wherever Triton cannot run;
* the Triton kernels of :mod:`microspeed_moe.kernels` (the GPU path; imported only when used).

:func:`kernel_backend` picks one (``MICROSPEED_MOE_KERNELS=torch|triton`` forces it). :func:`dispatch` and
:func:`combine` are custom :class:`torch.autograd.Function` s whose backward calls the same primitives
(dispatch's backward is a gather, combine's a scatter plus one dot product per kept choice).

Why explicit backwards rather than autograd through the index ops: both stay in ``O(E*C*H + T*k*H)``, but
autograd keeps the ``k`` gathered ``[T, H]`` rows alive until backward (for the weights' gradient), and its
backward zero-fills an ``[E*C, H]`` gradient per index op and index-adds into it, allocating about twice the
bytes; the explicit backward only keeps the ``[T, k]`` routing (and ``expert_out``, which it does not copy, when
the weights need a gradient). Measured on CPU, fp32, k=2, E=16, capacity factor 1.25, dispatch -> ``2 * rows``
-> combine, forward + backward, 2 threads (peak of the live tensor bytes allocated / best time):

================  ================  ================  ==================
T, H              explicit          autograd          dense einsums
================  ================  ================  ==================
2048, 256         22.2 MB / 4.2 ms  27.4 MB / 4.7 ms  200 MB / 255 ms
4096, 1024        177 MB / 24 ms    218 MB / 79 ms    889 MB / 2.8 s
================  ================  ================  ==================

The Triton path needs explicit backwards anyway, and one Function serves both backends.

Precision: rows are copied exactly; weighted sums and the weights' gradient accumulate in fp32 for fp16/bf16
rows (and in the rows' dtype for fp32/fp64), then round once to the output's dtype. Gradients come back in their
inputs' dtypes (``weights`` keeps its own, often fp32 with bf16 rows).

Checks: shapes, dtypes and devices always. Index *values* (a kept choice's expert out of ``[0, E)``, a slot
``>= C``, a slot used twice) are checked on CPU only: on CUDA the check would synchronize with the host,
so there the indices are trusted, as the gate produced them. Dropped choices (negative slots) may hold any
expert and any weight (NaN included): both are ignored. Not twice differentiable.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = [
    "KERNELS_ENV",
    "combine",
    "combine_backward_torch",
    "dense_combine",
    "dense_dispatch",
    "dispatch",
    "gather_rows_torch",
    "kernel_backend",
    "scatter_rows_torch",
    "to_dense",
]

KERNELS_ENV = "MICROSPEED_MOE_KERNELS"
"""Environment variable that forces the implementation: ``triton``, ``torch``, or unset / ``auto``."""

_HALF = (torch.float16, torch.bfloat16)


# -- argument checks -----------------------------------------------------------------------------------------------


def _check_tensor(name: str, t: Any, ndim: int, floating: bool, device: torch.device | None = None,
                  shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Check that ``t`` is an ``ndim``-D floating-point (or integer) tensor (on ``device``, of ``shape``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    if not floating and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"{name}: expected an integer tensor, got dtype {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def _check_count(name: str, n: Any, minimum: int) -> int:
    """Return ``n`` if it is an int of at least ``minimum``, else raise ``ValueError``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {n!r}")
    return n


def _flat_rows(experts: Any, slots: Any, tokens: int, num_experts: int, capacity: int,
               device: torch.device) -> torch.Tensor:
    """int64[T, k], contiguous: ``experts * capacity + slots`` for the kept choices, ``-1`` for the dropped.

    Checks the shapes (``[tokens, k]`` both), and on CPU the values (see the module's docstring).
    """
    _check_tensor("experts", experts, 2, floating=False, device=device)
    if experts.shape[0] != tokens:
        raise ValueError(f"experts: expected {tokens} rows (one per token), got shape {tuple(experts.shape)}")
    _check_tensor("slots", slots, 2, floating=False, device=device, shape=tuple(experts.shape))
    experts, slots = experts.to(torch.int64), slots.to(torch.int64)
    kept = slots >= 0
    flat = torch.where(kept, experts * capacity + slots, -1).contiguous()
    if device.type == "cpu" and flat.numel():
        if bool(((experts < 0) | (experts >= num_experts)).logical_and_(kept).any()):
            raise ValueError(f"experts: a kept choice names an expert outside [0, {num_experts})")
        if bool((slots >= capacity).any()):
            raise ValueError(f"slots: a slot is past the capacity ({capacity} rows per expert)")
        if int(torch.bincount(flat[kept], minlength=1).max()) > 1:
            raise ValueError("slots: two kept choices share one expert's slot (slots must be unique per expert)")
    return flat


def _check_weights(weights: Any, flat: torch.Tensor) -> torch.Tensor:
    """Check that ``weights`` is a floating-point tensor shaped like the routing, on its device."""
    return _check_tensor("weights", weights, 2, floating=True, device=flat.device, shape=tuple(flat.shape))


# -- backend choice ------------------------------------------------------------------------------------------------


def kernel_backend(t: torch.Tensor) -> str:
    """``'triton'`` or ``'torch'``: which implementation :func:`dispatch` and :func:`combine` use for tensors like t.

    ``MICROSPEED_MOE_KERNELS=triton`` forces the Triton kernels (on CPU tensors they need the Triton
    interpreter, ``TRITON_INTERPRET=1`` set before :mod:`microspeed_moe.kernels` is imported);
    ``MICROSPEED_MOE_KERNELS=torch`` forces the PyTorch index path. Otherwise (unset, empty or ``auto``)
    the kernels run for CUDA tensors when Triton imports, the index path for everything else.
    """
    from microspeed.plugin_api import kernel_backend as choose

    return choose(t, KERNELS_ENV)


def _kernels() -> Any:
    """Import :mod:`microspeed_moe.kernels`, explaining a failure to import Triton."""
    try:
        from microspeed_moe import kernels
    except ImportError as exc:
        raise ImportError(f"microspeed_moe's Triton kernels were selected ({KERNELS_ENV}="
                          f"{os.environ.get(KERNELS_ENV, 'auto')!r}) but cannot be imported: {exc}. "
                          f"Install triton, or set {KERNELS_ENV}=torch") from exc
    return kernels


def _primitives(backend: str) -> tuple[Any, Any, Any]:
    """``(scatter_rows, gather_rows, combine_backward)`` of ``backend`` (``'triton'`` or ``'torch'``)."""
    if backend == "triton":
        k = _kernels()
        return k.scatter_rows_triton, k.gather_rows_triton, k.combine_backward_triton
    return scatter_rows_torch, gather_rows_torch, combine_backward_torch


# -- the PyTorch index path ----------------------------------------------------------------------------------------


def scatter_rows_torch(src: torch.Tensor, flat: torch.Tensor, num_rows: int,
                       weights: torch.Tensor | None = None) -> torch.Tensor:
    """``out[num_rows, H]`` (``src``'s dtype), zeros except ``out[flat[t, j]] = weights[t, j] * src[t]`` (or
    ``src[t]`` when ``weights`` is None) for every ``flat[t, j] >= 0``.

    ``src`` is ``[T, H]``, ``flat`` int64 ``[T, k]`` (kept rows unique, dropped ``-1``), ``weights`` ``[T, k]``.
    Dispatch's forward and the expert rows' gradient of combine. Written as ``k`` ``index_copy_`` of whole
    ``[T, H]`` sources into a zeroed buffer with one spare row that takes the dropped choices (so no boolean
    indexing, no host synchronization, no ``[T*k, H]`` temporary).
    """
    tokens, hidden = src.shape
    buf = src.new_zeros(num_rows + 1, hidden)
    dest = torch.where(flat >= 0, flat, num_rows)
    tmp = None if weights is None else torch.empty_like(src)
    for j in range(flat.shape[1]):
        rows = src
        if weights is not None:
            rows = torch.mul(src, weights[:, j:j + 1], out=tmp)  # fp32 product for fp32 weights, rounded once
        buf.index_copy_(0, dest[:, j], rows)
    return buf[:num_rows]


def _masked_columns(flat: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``[T, k]`` of ``dtype``: ``weights`` (or ones) where the choice is kept, zero where it is dropped."""
    kept = flat >= 0
    if weights is None:
        return kept.to(dtype)
    return torch.where(kept, weights.to(dtype), 0)


def gather_rows_torch(src: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``out[T, H]`` (``src``'s dtype): ``out[t] = sum_j weights[t, j] * src[flat[t, j]]`` over ``flat[t, j] >= 0``
    (weights 1 when None).

    ``src`` is ``[R, H]``, ``flat`` int64 ``[T, k]``, ``weights`` ``[T, k]``. Combine's forward and dispatch's
    backward. One ``index_select`` per choice into a reused ``[T, H]`` buffer, multiply-added in order
    ``j = 0 .. k-1`` into an accumulator (fp32 for fp16/bf16 rows). A dropped choice's weight is replaced by 0
    before use; its row index by 0, so a non-finite ``src[0]`` would still leak in as NaN (as in the dense
    einsum, where every row meets every token).
    """
    tokens, k = flat.shape
    hidden = src.shape[1]
    acc_dtype = torch.float32 if src.dtype in _HALF else src.dtype
    if k == 0 or src.shape[0] == 0:
        return src.new_zeros(tokens, hidden)
    cols = _masked_columns(flat, weights, acc_dtype)
    index = flat.clamp(min=0)
    first = src.index_select(0, index[:, 0])
    acc = first.mul_(cols[:, :1]) if acc_dtype == src.dtype else torch.mul(first, cols[:, :1])
    tmp = first if acc is not first else torch.empty_like(first) if k > 1 else None
    for j in range(1, k):
        torch.index_select(src, 0, index[:, j], out=tmp)
        acc.addcmul_(tmp, cols[:, j:j + 1])
    return acc.to(src.dtype)


def combine_backward_torch(grad: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor,
                           expert_out: torch.Tensor | None, num_rows: int | None
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of :func:`gather_rows_torch` (with weights) given ``grad = d loss / d out`` (``[T, H]``).

    Returns ``(grad_src, grad_weights)``. ``grad_src[num_rows, H]`` (``grad``'s dtype) holds ``weights[t, j] *
    grad[t]`` in row ``flat[t, j]`` and zeros in the rows no choice took; None when ``num_rows`` is None.
    ``grad_weights[T, k]`` (``weights``' dtype) is ``dot(grad[t], expert_out[flat[t, j]])`` for the kept choices
    and 0 for the dropped (accumulated in fp32 for fp16/bf16 rows); None when ``expert_out`` (``[R, H]``) is None.
    """
    grad_src = None if num_rows is None else scatter_rows_torch(grad, flat, num_rows, weights)
    if expert_out is None:
        return grad_src, None
    tokens, k = flat.shape
    acc_dtype = torch.float32 if expert_out.dtype in _HALF else expert_out.dtype
    grad_weights = torch.zeros(tokens, k, dtype=acc_dtype, device=grad.device)
    if expert_out.shape[0] and tokens:
        g = grad.to(acc_dtype)
        index = flat.clamp(min=0)
        tmp = torch.empty(tokens, expert_out.shape[1], dtype=expert_out.dtype, device=grad.device)
        for j in range(k):
            rows = torch.index_select(expert_out, 0, index[:, j], out=tmp).to(acc_dtype)
            torch.sum(rows.mul_(g), dim=1, out=grad_weights[:, j])  # in place: no temporary beyond the row buffer
    return grad_src, torch.where(flat >= 0, grad_weights, 0).to(weights.dtype)


# -- autograd ------------------------------------------------------------------------------------------------------


class _Dispatch(torch.autograd.Function):
    """``x[T, H] -> [E*C, H]`` through the chosen backend; backward gathers the rows back and sums over ``k``."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, flat: torch.Tensor, num_rows: int,  # type: ignore[override]
                backend: str) -> torch.Tensor:
        """Scatter the rows of ``x`` (saving only the ``[T, k]`` routing for backward)."""
        ctx.save_for_backward(flat)
        ctx.backend = backend
        scatter_rows, _, _ = _primitives(backend)
        return scatter_rows(x.contiguous(), flat, num_rows, None)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        """``grad_x[t] = sum_j grad[flat[t, j]]`` over the kept choices."""
        (flat,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        _, gather_rows, _ = _primitives(ctx.backend)
        return gather_rows(grad.contiguous(), flat, None), None, None, None


class _Combine(torch.autograd.Function):
    """``(expert_out[E*C, H], weights[T, k]) -> [T, H]`` through the chosen backend, differentiable in both."""

    @staticmethod
    def forward(ctx: FunctionCtx, expert_out: torch.Tensor, weights: torch.Tensor,  # type: ignore[override]
                flat: torch.Tensor, backend: str) -> torch.Tensor:
        """Weighted gather; saves ``expert_out`` only when the weights need a gradient (for their dot products)."""
        expert_out, weights = expert_out.contiguous(), weights.contiguous()
        ctx.save_for_backward(expert_out if ctx.needs_input_grad[1] else None, weights, flat)
        ctx.backend, ctx.num_rows = backend, expert_out.shape[0]
        _, gather_rows, _ = _primitives(backend)
        return gather_rows(expert_out, flat, weights)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        """Scatter ``weights * grad`` to the expert rows; ``grad_weights = dot(grad[t], expert_out[row])``."""
        expert_out, weights, flat = ctx.saved_tensors
        need_rows, need_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_rows or need_weights):
            return None, None, None, None
        _, _, combine_backward = _primitives(ctx.backend)
        grad_rows, grad_weights = combine_backward(grad.contiguous(), flat, weights,
                                                   expert_out if need_weights else None,
                                                   ctx.num_rows if need_rows else None)
        return grad_rows, grad_weights, None, None


def dispatch(x: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor, num_experts: int,
             capacity: int) -> torch.Tensor:
    """``[num_experts, capacity, H]``: ``out[experts[t, j], slots[t, j]] = x[t]`` for every ``slots[t, j] >= 0``.

    ``x`` is ``[T, H]`` floating point; ``experts`` and ``slots`` are integer ``[T, k]`` (a dropped choice has a
    negative slot, -1); the rows no token took are zero; the result has ``x``'s dtype and device. Differentiable
    in ``x``: ``grad_x[t] = sum_j grad_out[experts[t, j], slots[t, j]]`` over the kept choices.
    """
    _check_tensor("x", x, 2, floating=True)
    num_experts, capacity = _check_count("num_experts", num_experts, 1), _check_count("capacity", capacity, 0)
    flat = _flat_rows(experts, slots, x.shape[0], num_experts, capacity, x.device)
    out = _Dispatch.apply(x, flat, num_experts * capacity, kernel_backend(x))
    return out.view(num_experts, capacity, x.shape[1])


def combine(expert_out: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
    """``out[T, H]``: ``out[t] = sum_j weights[t, j] * expert_out[experts[t, j], slots[t, j]]`` over the kept
    choices (``slots[t, j] >= 0``; the dropped ones add nothing, whatever their weight).

    ``expert_out`` is ``[E, C, H]`` floating point, ``experts`` and ``slots`` integer ``[T, k]``, ``weights``
    floating point ``[T, k]`` (any float dtype; often fp32 with bf16 rows). The result has ``expert_out``'s
    dtype. Differentiable in ``expert_out`` (``weights[t, j] * grad_out[t]`` in row ``(e, s)``) and in ``weights``
    (``dot(grad_out[t], expert_out[e, s])``; the gate's gradient).
    """
    _check_tensor("expert_out", expert_out, 3, floating=True)
    num_experts, capacity, hidden = expert_out.shape
    if num_experts < 1:
        raise ValueError(f"expert_out: expected at least one expert, got shape {tuple(expert_out.shape)}")
    tokens = experts.shape[0] if isinstance(experts, torch.Tensor) and experts.dim() == 2 else -1
    flat = _flat_rows(experts, slots, tokens, num_experts, capacity, expert_out.device)
    _check_weights(weights, flat)
    rows = expert_out.reshape(num_experts * capacity, hidden)
    return _Combine.apply(rows, weights, flat, kernel_backend(expert_out))


# -- the dense formulation (DeepSpeed's), for tests and benchmarks -------------------------------------------------


def to_dense(experts: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, num_experts: int,
             capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(combine_weights, dispatch_mask)``, both ``[T, num_experts, capacity]``: DeepSpeed's dense routing.

    ``combine_weights`` (``weights``' dtype) holds ``weights[t, j]`` at ``[t, experts[t, j], slots[t, j]]`` for the
    kept choices and 0 elsewhere, differentiably in ``weights``; ``dispatch_mask`` (bool) is True exactly there.
    ``T * E * C`` values each: for tests and benchmarks, not for training.
    """
    num_experts, capacity = _check_count("num_experts", num_experts, 1), _check_count("capacity", capacity, 0)
    tokens = experts.shape[0] if isinstance(experts, torch.Tensor) and experts.dim() == 2 else -1
    flat = _flat_rows(experts, slots, tokens, num_experts, capacity, experts.device)
    _check_weights(weights, flat)
    rows = num_experts * capacity
    kept = flat >= 0
    cell = (torch.arange(tokens, device=flat.device)[:, None] * rows + flat)[kept]
    combine_weights = weights.new_zeros(tokens * rows).index_put((cell,), weights[kept])
    dispatch_mask = torch.zeros(tokens * rows, dtype=torch.bool, device=flat.device).index_fill_(0, cell, True)
    shape = (tokens, num_experts, capacity)
    return combine_weights.view(shape), dispatch_mask.view(shape)


def dense_dispatch(x: torch.Tensor, dispatch_mask: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's dispatch: ``einsum("sec,sm->ecm", dispatch_mask.type_as(x), x)``, ``[E, C, H]``."""
    return torch.einsum("sec,sm->ecm", dispatch_mask.type_as(x), x)


def dense_combine(expert_out: torch.Tensor, combine_weights: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's combine: ``einsum("sec,ecm->sm", combine_weights.type_as(expert_out), expert_out)``, ``[T, H]``."""
    return torch.einsum("sec,ecm->sm", combine_weights.type_as(expert_out), expert_out)
