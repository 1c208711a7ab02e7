"""Triton kernels of the MoE routing: row scatter (dispatch), weighted row gather (combine) and combine's backward.

Same arguments and results as the PyTorch index path of :mod:`microspeed_moe.routing` (which documents the
routing and dispatches here):

* :func:`scatter_rows_triton`: one program per *output* row ``r`` of the ``[R, H]`` expert buffer. An inverse
  map ``inv[r] = t * k + j`` (or -1), built with one small scatter of ``T * k`` ints, names the choice that took
  the row; the program copies ``src[t]`` (times ``weights[t, j]``) there, or writes zeros. So every output row is
  written once and nothing is zero-filled beforehand. Dispatch's forward; the rows' gradient of combine.
* :func:`gather_rows_triton`: one program per token, adding its ``k`` rows (times their weights) in fp32 and
  storing once. Combine's forward; dispatch's backward.
* :func:`combine_backward_triton`: one program per output row, fusing the rows' gradient (``weights * grad``
  scattered, as above) with the weights' gradient (``dot(grad[t], expert_out[r])``, fp32, stored at ``t * k +
  j``). A row belongs to at most one choice and a kept choice to exactly one row, so no atomics are needed and
  the results are deterministic.

Every program walks the hidden dimension in ``BLOCK_H`` columns (a power of two, at most :data:`MAX_BLOCK_H`),
masking the tail, so any ``H`` works. Rows may be fp32, fp16 or bf16 (weights any float dtype); arithmetic is
fp32. Indices are int64 and offsets are computed in int64. On CPU tensors the kernels run only under the Triton
interpreter: ``TRITON_INTERPRET=1`` must be in the environment before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microspeed_moe import routing

__all__ = ["INTERPRETED", "MAX_BLOCK_H", "combine_backward_triton", "gather_rows_triton", "scatter_rows_triton"]

MAX_BLOCK_H = 1024
"""The widest column block a program loads at once; wider rows are walked in several blocks."""


@triton.jit
def _scatter_rows_kernel(src_ptr, inv_ptr, w_ptr, out_ptr, H, K, HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[r] = w[p] * src[p // K]`` with ``p = inv[r]``, or zeros where ``p < 0``."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.load(inv_ptr + r)
    kept = p >= 0
    p = tl.where(kept, p, 0)  # a safe address; the loads below read nothing when the row is empty
    width = tl.where(kept, H, 0)  # the columns to read
    src_row = src_ptr + (p // K) * H
    out_row = out_ptr + r * H
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        in_row = cols < H
        v = tl.load(src_row + cols, mask=cols < width, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            v = v * tl.load(w_ptr + p).to(tl.float32)
        tl.store(out_row + cols, v.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _gather_rows_kernel(src_ptr, flat_ptr, w_ptr, out_ptr, H, K, HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[t] = sum_j w[t, j] * src[flat[t, j]]`` over ``flat[t, j] >= 0``, in fp32, j in order."""
    t = tl.program_id(0).to(tl.int64)
    out_row = out_ptr + t * H
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        in_row = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in range(0, K):
            r = tl.load(flat_ptr + t * K + j)
            kept = r >= 0
            v = tl.load(src_ptr + tl.where(kept, r, 0) * H + cols, mask=cols < tl.where(kept, H, 0),
                        other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                w = tl.load(w_ptr + t * K + j).to(tl.float32)
                v = v * tl.where(kept, w, 0.0)  # a dropped choice's weight may be anything, NaN included
            acc += v
        tl.store(out_row + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _combine_backward_kernel(grad_ptr, rows_ptr, inv_ptr, w_ptr, grad_rows_ptr, grad_w_ptr, H, K,
                             NEED_ROWS: tl.constexpr, NEED_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr):
    """For output row ``r`` taken by choice ``p = inv[r]`` of token ``t = p // K``: ``grad_rows[r] = w[p] *
    grad[t]`` (zeros when no choice took it) and ``grad_w[p] = dot(grad[t], rows[r])``."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.load(inv_ptr + r)
    kept = p >= 0
    p = tl.where(kept, p, 0)
    width = tl.where(kept, H, 0)
    grad_row = grad_ptr + (p // K) * H
    w = tl.load(w_ptr + p).to(tl.float32)
    dot = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        in_row = cols < H
        g = tl.load(grad_row + cols, mask=cols < width, other=0.0).to(tl.float32)
        if NEED_ROWS:
            tl.store(grad_rows_ptr + r * H + cols, (g * w).to(grad_rows_ptr.dtype.element_ty), mask=in_row)
        if NEED_WEIGHTS:
            dot += g * tl.load(rows_ptr + r * H + cols, mask=cols < width, other=0.0).to(tl.float32)
    if NEED_WEIGHTS:
        tl.store(grad_w_ptr + p, tl.sum(dot, axis=0).to(grad_w_ptr.dtype.element_ty), mask=kept)


INTERPRETED = type(_scatter_rows_kernel).__name__ == "InterpretedFunction"
"""Whether the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` when this module was imported)."""


def _launch_shape(hidden: int) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` for rows of ``hidden`` values: the next power of two (16 to :data:`MAX_BLOCK_H`),
    and about 8 values per thread (1 warp up to 256 columns, 4 at 1024); untuned."""
    block = max(16, min(MAX_BLOCK_H, triton.next_power_of_2(max(hidden, 1))))
    return block, max(1, min(8, block // 256))


def _check_device(t: torch.Tensor, name: str) -> None:
    """Refuse CPU tensors unless the kernels run in the interpreter."""
    if not t.is_cuda and not INTERPRETED:
        raise ValueError(f"{name}: the Triton kernels need CUDA tensors (got one on {t.device}); for CPU tensors "
                         f"use the PyTorch path ({routing.KERNELS_ENV}=torch), or set TRITON_INTERPRET=1 "
                         "before microspeed_moe.kernels is imported")


def _inverse(flat: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64[num_rows]: ``inv[flat[t, j]] = t * k + j`` for the kept choices, -1 in the rows none took.

    The dropped choices all land in one spare row, cut off at the end (which of them wins it does not matter).
    """
    inv = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=flat.device)
    dest = torch.where(flat >= 0, flat, num_rows).view(-1)
    inv.scatter_(0, dest, torch.arange(dest.numel(), dtype=torch.int64, device=flat.device))
    return inv[:num_rows]


def scatter_rows_triton(src: torch.Tensor, flat: torch.Tensor, num_rows: int,
                        weights: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton implementation of :func:`microspeed_moe.routing.scatter_rows_torch` (same arguments, result)."""
    _check_device(src, "src")
    src, flat = src.contiguous(), flat.contiguous()
    hidden = src.shape[1]
    if src.shape[0] == 0 or flat.shape[1] == 0:  # nothing to copy (and no rows for a kernel to point at)
        return src.new_zeros(num_rows, hidden)
    out = torch.empty(num_rows, hidden, dtype=src.dtype, device=src.device)
    if num_rows and hidden:
        block, warps = _launch_shape(hidden)
        w = src if weights is None else weights.contiguous()
        _scatter_rows_kernel[(num_rows,)](src, _inverse(flat, num_rows), w, out, hidden, flat.shape[1],
                                          HAS_WEIGHTS=weights is not None, BLOCK_H=block, num_warps=warps)
    return out


def gather_rows_triton(src: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton implementation of :func:`microspeed_moe.routing.gather_rows_torch` (same arguments, result)."""
    _check_device(src, "src")
    src, flat = src.contiguous(), flat.contiguous()
    tokens, k = flat.shape
    hidden = src.shape[1]
    if k == 0 or src.shape[0] == 0:
        return src.new_zeros(tokens, hidden)
    out = torch.empty(tokens, hidden, dtype=src.dtype, device=src.device)
    if tokens and hidden:
        block, warps = _launch_shape(hidden)
        w = src if weights is None else weights.contiguous()
        _gather_rows_kernel[(tokens,)](src, flat, w, out, hidden, k, HAS_WEIGHTS=weights is not None,
                                       BLOCK_H=block, num_warps=warps)
    return out


def combine_backward_triton(grad: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor,
                            expert_out: torch.Tensor | None, num_rows: int | None
                            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The Triton implementation of :func:`microspeed_moe.routing.combine_backward_torch` (same arguments,
    result), both gradients from one fused kernel."""
    _check_device(grad, "grad")
    need_rows, need_weights = num_rows is not None, expert_out is not None
    if not (need_rows or need_weights):
        return None, None
    grad, flat, weights = grad.contiguous(), flat.contiguous(), weights.contiguous()
    rows = num_rows if need_rows else expert_out.shape[0]
    tokens, hidden = grad.shape
    grad_weights = torch.zeros_like(weights) if need_weights else None  # the dropped choices keep their 0
    if tokens == 0 or flat.shape[1] == 0:  # no choice took a row
        return grad.new_zeros(rows, hidden) if need_rows else None, grad_weights
    grad_rows = torch.empty(rows, hidden, dtype=grad.dtype, device=grad.device) if need_rows else None
    if rows and hidden:
        block, warps = _launch_shape(hidden)
        _combine_backward_kernel[(rows,)](grad, expert_out.contiguous() if need_weights else grad,
                                          _inverse(flat, rows), weights, grad_rows if need_rows else grad,
                                          grad_weights if need_weights else weights, hidden, flat.shape[1],
                                          NEED_ROWS=need_rows, NEED_WEIGHTS=need_weights, BLOCK_H=block,
                                          num_warps=warps)
    return grad_rows, grad_weights
