"""Triton kernels of random-LTD's token gather and scatter.

Same arguments and results as the PyTorch references of :mod:`microspeed_efficiency.random_ltd`
(``gather_tokens_torch``, ``scatter_tokens_torch``, ``zero_tokens_torch``), which document the layouts and
dispatch here:

* :func:`gather_tokens_triton`: ``out[b, k] = x[b, idx[b, k]]`` — the tokens a dropping layer processes;
* :func:`scatter_tokens_triton`: a copy of ``dst`` with ``dst[b, idx[b, k]] = src[b, k]`` — the layer's
  output put back among the tokens that skipped it;
* :func:`zero_tokens_triton`: a copy of ``x`` with the rows ``x[b, idx[b, k]]`` zeroed — the gradient that
  reaches the skipped tokens through the scatter.

``(b, s)`` addresses a token in either hidden-state order (``batch_first=True``: ``x`` is ``[B, S, H]``;
``False``: ``[S, B, H]``): the kernels take the batch and sequence strides and need only the hidden dimension
to be contiguous. One program per gathered token ``(b, k)`` walks the hidden dimension in ``BLOCK_H`` columns
(a power of two, at most :data:`MAX_BLOCK_H`), masking the tail, so any ``H`` works. A copy moves bits, so the
kernels are exact for every dtype. The indices of one row must be distinct (random-LTD samples without
replacement), so no two programs write the same row and the results are deterministic. Offsets are int64.

On CPU tensors the kernels run only under the Triton interpreter: ``TRITON_INTERPRET=1`` must be in the
environment before this module is first imported (:data:`INTERPRETED` tells whether it was).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "MAX_BLOCK_H", "gather_tokens_triton", "scatter_tokens_triton", "zero_tokens_triton"]

MAX_BLOCK_H = 1024
"""The widest column block a program copies at once; wider rows are walked in several blocks."""


@triton.jit
def _gather_tokens_kernel(x_ptr, idx_ptr, out_ptr, K, H, x_sb, x_ss, o_sb, o_ss, BLOCK_H: tl.constexpr):
    """``out[b, k, :] = x[b, idx[b, k], :]`` for the program ``p = b * K + k``."""
    p = tl.program_id(0).to(tl.int64)
    b = p // K
    k = p % K
    s = tl.load(idx_ptr + p).to(tl.int64)
    src = x_ptr + b * x_sb + s * x_ss
    dst = out_ptr + b * o_sb + k * o_ss
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        inside = cols < H
        tl.store(dst + cols, tl.load(src + cols, mask=inside), mask=inside)


@triton.jit
def _scatter_tokens_kernel(src_ptr, idx_ptr, out_ptr, K, H, s_sb, s_ss, o_sb, o_ss,
                           ZERO: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[b, idx[b, k], :] = src[b, k, :]`` (zeros when ``ZERO``) for the program ``p = b * K + k``."""
    p = tl.program_id(0).to(tl.int64)
    b = p // K
    k = p % K
    s = tl.load(idx_ptr + p).to(tl.int64)
    dst = out_ptr + b * o_sb + s * o_ss
    src = src_ptr + b * s_sb + k * s_ss
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        inside = cols < H
        if ZERO:
            v = tl.zeros([BLOCK_H], dtype=out_ptr.dtype.element_ty)
        else:
            v = tl.load(src + cols, mask=inside)
        tl.store(dst + cols, v, mask=inside)


INTERPRETED = type(_gather_tokens_kernel).__name__ == "InterpretedFunction"
"""Whether ``TRITON_INTERPRET=1`` was set when this module was imported (the kernels then accept CPU tensors)."""


def _block_h(h: int) -> int:
    return min(MAX_BLOCK_H, triton.next_power_of_2(max(h, 1)))


def _check(name: str, t: torch.Tensor) -> None:
    if not t.is_cuda and not INTERPRETED:
        raise RuntimeError(
            f"{name}: the random-LTD Triton kernels got a {t.device.type} tensor; they run on CUDA, or on CPU only "
            "under the Triton interpreter (TRITON_INTERPRET=1 set before microspeed_efficiency.random_ltd_kernels "
            "is imported). Use the PyTorch path instead (MICROSPEED_RANDOM_LTD_KERNELS=torch)."
        )


def _bs_strides(t: torch.Tensor, batch_first: bool) -> tuple[int, int]:
    """``(batch stride, sequence stride)`` of a ``[B, S, H]`` or ``[S, B, H]`` tensor."""
    return (t.stride(0), t.stride(1)) if batch_first else (t.stride(1), t.stride(0))


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gather_tokens_triton(x: torch.Tensor, idx: torch.Tensor, batch_first: bool = True) -> torch.Tensor:
    """The tokens ``idx`` (``[B, K]`` int64) of ``x``: ``[B, K, H]`` (``batch_first``) or ``[K, B, H]``."""
    _check("x", x)
    x = _rows_contiguous(x)
    idx = idx.contiguous()
    n_batch, k = idx.shape
    h = x.shape[-1]
    out = x.new_empty((n_batch, k, h) if batch_first else (k, n_batch, h))
    if out.numel():
        _gather_tokens_kernel[(n_batch * k,)](x, idx, out, k, h, *_bs_strides(x, batch_first),
                                              *_bs_strides(out, batch_first), BLOCK_H=_block_h(h))
    return out


def scatter_tokens_triton(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor,
                          batch_first: bool = True) -> torch.Tensor:
    """A copy of ``dst`` whose tokens ``idx`` (``[B, K]`` int64) are ``src`` (``[B, K, H]`` or ``[K, B, H]``)."""
    _check("dst", dst)
    out = dst.clone(memory_format=torch.contiguous_format)
    src = _rows_contiguous(src.to(out.dtype))
    idx = idx.contiguous()
    n_batch, k = idx.shape
    h = out.shape[-1]
    if idx.numel() and h:
        _scatter_tokens_kernel[(n_batch * k,)](src, idx, out, k, h, *_bs_strides(src, batch_first),
                                               *_bs_strides(out, batch_first), ZERO=False, BLOCK_H=_block_h(h))
    return out


def zero_tokens_triton(x: torch.Tensor, idx: torch.Tensor, batch_first: bool = True) -> torch.Tensor:
    """A copy of ``x`` whose tokens ``idx`` (``[B, K]`` int64) are zero."""
    _check("x", x)
    out = x.clone(memory_format=torch.contiguous_format)
    idx = idx.contiguous()
    n_batch, k = idx.shape
    h = out.shape[-1]
    if idx.numel() and h:
        strides = _bs_strides(out, batch_first)
        _scatter_tokens_kernel[(n_batch * k,)](out, idx, out, k, h, *strides, *strides, ZERO=True,
                                               BLOCK_H=_block_h(h))
    return out
