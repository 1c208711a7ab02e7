"""Fused scale + mask + softmax: :func:`fused_scale_mask_softmax`, the attention-probabilities step.

``softmax(x * scale + mask, dim=-1)`` with an optional causal mask, forward and backward in one kernel each.
The input is viewed as ``[B, H, T_q, T_k]`` (4-D ``x``) or ``[1, R, T_q, T_k]`` (any other ``x`` with at least 2
dims: the leading dims are folded together). Supported additive ``mask`` shapes:

* ``None``;
* ``(T_q, T_k)`` (or ``(1, T_k)``/``(T_q, 1)``): the same mask for every leading index, any ``x`` rank >= 2;
* 4-D masks for 4-D ``x``: each dim equal to ``x``'s or 1, e.g. ``(B, 1, 1, T_k)`` (padding),
  ``(B, 1, T_q, T_k)`` (per-sample), ``(1, 1, T_q, T_k)``.

The mask may be fp32, fp16 or bf16 whatever ``x``'s dtype (it is read as fp32; use ``-inf`` or a large negative
number to mask out).
``causal=True`` additionally masks key ``j > i`` for query ``i`` (the upper triangle, aligned at the top left,
as ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` does). A row whose every entry is masked
(``-inf``) gives zeros, and zero gradients, instead of NaN.

Triton path (see :mod:`microspeed.ops._triton` for when it runs; :func:`backend_for` says which): one program
per row, the row (``T_k`` at most :data:`MAX_COLUMNS`) held in registers, fp32 arithmetic; the mask is read
through broadcast strides (never materialized). The backward computes
``dx = scale * y * (dy - sum(dy * y))`` from the saved output in one pass per row. A mask that requires grad gets
``dx / scale`` summed to its shape. The PyTorch path is the same arithmetic in eager ops (:func:`softmax_reference`,
with a shortcut when no row is fully masked).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from microspeed.ops import _triton
from microspeed.ops._triton import jit, tl

__all__ = ["INTERPRETED", "MAX_COLUMNS", "backend_for", "fused_scale_mask_softmax", "softmax_reference"]

MAX_COLUMNS = 32768
"""The longest softmax row (``T_k``) the Triton kernels take (a row lives in one program's registers)."""

_OP = "fused_scale_mask_softmax"


@jit
def _softmax_forward_kernel(x_ptr, mask_ptr, y_ptr, H, TQ, TK, scale, smb, smh, smq, smk,
                            HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """``y[r] = softmax(x[r] * scale + mask[b, h, q])`` for row ``r = ((b * H) + h) * TQ + q``."""
    row = tl.program_id(0).to(tl.int64)
    q = row % TQ
    bh = row // TQ
    cols = tl.arange(0, BLOCK)
    valid = cols < TK
    z = tl.load(x_ptr + row * TK + cols, mask=valid, other=0.0).to(tl.float32) * scale
    if HAS_MASK:
        m_row = mask_ptr + (bh // H) * smb + (bh % H) * smh + q * smq
        z += tl.load(m_row + cols * smk, mask=valid, other=0.0).to(tl.float32)
    if CAUSAL:
        valid = valid & (cols <= q)
    z = tl.where(valid, z, float("-inf"))
    z_max = tl.max(z, axis=0)
    z_max = tl.where(z_max == float("-inf"), 0.0, z_max)  # a fully masked row: every exp is then 0
    e = tl.exp(z - z_max)
    total = tl.sum(e, axis=0)
    y = e / tl.where(total > 0.0, total, 1.0)  # all zeros for a fully masked row
    tl.store(y_ptr + row * TK + cols, y.to(y_ptr.dtype.element_ty), mask=cols < TK)


@jit
def _softmax_backward_kernel(y_ptr, dy_ptr, dx_ptr, TK, scale, BLOCK: tl.constexpr):
    """``dx[r] = scale * y[r] * (dy[r] - sum(dy[r] * y[r]))``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < TK
    y = tl.load(y_ptr + row * TK + cols, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * TK + cols, mask=inside, other=0.0).to(tl.float32)
    dot = tl.sum(y * dy, axis=0)
    dx = scale * y * (dy - dot)
    tl.store(dx_ptr + row * TK + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)


INTERPRETED: bool = _triton.is_interpreted(_softmax_forward_kernel)
"""Whether this module's kernels were decorated under the Triton interpreter (they then run on CPU tensors)."""


def backend_for(t: torch.Tensor) -> str:
    """``'triton'`` or ``'torch'``: the implementation :func:`fused_scale_mask_softmax` uses for an input like ``t``
    (``MICROSPEED_OPS_BACKEND`` forces one; see :mod:`microspeed.ops._triton`)."""
    return _triton.select_backend(t, INTERPRETED, _OP)


def _as_4d(x: torch.Tensor, mask: torch.Tensor | None) -> tuple[tuple[int, int, int, int], torch.Tensor | None]:
    """``x``'s ``[B, H, T_q, T_k]`` view shape and ``mask`` expanded to it (strides of 0 where broadcast); checks
    the mask's shape against the supported ones."""
    tq, tk = x.shape[-2], x.shape[-1]
    shape4 = tuple(x.shape) if x.dim() == 4 else (1, math.prod(x.shape[:-2]), tq, tk)
    if mask is None:
        return shape4, None
    supported = ("supported: None, (T_q, T_k), or for 4-D x a 4-D mask whose dims equal x's or are 1, e.g. "
                 "(B, 1, 1, T_k) or (B, 1, T_q, T_k)")
    if mask.dim() == 2:
        mask = mask.view(1, 1, *mask.shape)
    elif mask.dim() != 4 or x.dim() != 4:
        raise ValueError(f"mask: shape {tuple(mask.shape)} is not supported for x of shape {tuple(x.shape)}; "
                         f"{supported}")
    if any(m not in (1, s) for m, s in zip(mask.shape, shape4, strict=True)):
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not broadcast to x's {tuple(x.shape)}; {supported}")
    return shape4, mask.expand(shape4)


def _causal_keep(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """``[T_q, T_k]`` bool: True where key ``j <= i`` for query ``i`` (top-left aligned)."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril()


def softmax_reference(x: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
                      causal: bool = False) -> torch.Tensor:
    """The eager PyTorch composition, differentiable, in fp32 (or ``x``'s wider dtype): ``x * scale + mask``,
    the causal ``-inf`` fill, ``torch.softmax``, fully masked rows set to 0; returned in ``x``'s dtype."""
    z = x.to(_triton.compute_dtype(x)) * scale
    if mask is not None:
        z = z + mask.to(z.dtype)
    if causal:
        z = z.masked_fill(~_causal_keep(x.shape[-2], x.shape[-1], x.device), float("-inf"))
    fully_masked = torch.isneginf(z).all(dim=-1, keepdim=True)
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    y = torch.softmax(torch.where(fully_masked, zero, z), dim=-1)  # no NaN, forward or backward
    return torch.where(fully_masked, zero, y).to(x.dtype)


def _softmax_torch(x: torch.Tensor, scale: float, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """The PyTorch path: :func:`softmax_reference`'s result with fewer passes over ``x``. Fully masked rows are
    found from the (usually much smaller) mask and the causal pattern alone, and only when there are some does it
    take the reference's NaN-free route; so here, unlike in the kernels, a row that is ``-inf`` in ``x`` itself
    gives NaN, as ``torch.softmax`` does."""
    if x.dtype != torch.float32:
        return softmax_reference(x, scale, mask, causal)
    if mask is not None:
        dead = torch.isneginf(mask)
        if causal:
            tq, tk = x.shape[-2], x.shape[-1]
            dead = dead | ~_causal_keep(tq, tk, x.device)
        if dead.all(dim=-1).any():
            return softmax_reference(x, scale, mask, causal)
    z = x * scale
    if mask is not None:
        z = z + mask
    if causal:
        z = z.masked_fill(~_causal_keep(x.shape[-2], x.shape[-1], x.device), float("-inf"))
    return torch.softmax(z, dim=-1)


class _FusedSoftmaxFunction(torch.autograd.Function):
    """Autograd wrapper of the Triton kernels."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
        shape4, mask4 = _as_4d(x, mask)
        xc = x.contiguous()
        y = torch.empty_like(xc)
        rows = xc.numel() // shape4[3]
        block = _triton.next_power_of_2(shape4[3])
        strides = mask4.stride() if mask4 is not None else (0, 0, 0, 0)
        if rows > 0:
            _softmax_forward_kernel[(rows,)](xc, mask4 if mask4 is not None else xc, y, shape4[1], shape4[2],
                                             shape4[3], scale, *strides, HAS_MASK=mask4 is not None,
                                             CAUSAL=causal, BLOCK=block, num_warps=_triton.num_warps_for(block))
        ctx.save_for_backward(y)
        ctx.scale = scale
        ctx.mask_shape = None if mask is None else mask.shape
        ctx.mask_dtype = None if mask is None else mask.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (y,) = ctx.saved_tensors
        tk = y.shape[-1]
        dyc = dy.contiguous()
        dx = torch.empty_like(y)
        rows = y.numel() // tk
        block = _triton.next_power_of_2(tk)
        if rows > 0:
            _softmax_backward_kernel[(rows,)](y, dyc, dx, tk, ctx.scale, BLOCK=block,
                                              num_warps=_triton.num_warps_for(block))
        dmask = None
        if ctx.needs_input_grad[1]:
            unscaled = dx.float() / ctx.scale if ctx.scale != 0 else _unscaled_grad(y, dyc)
            dmask = unscaled.sum_to_size(ctx.mask_shape).to(ctx.mask_dtype)
        return dx.view(dy.shape), dmask, None, None


def _unscaled_grad(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """``y * (dy - sum(dy * y))`` in fp32: the gradient of the softmax's input (the mask's), for ``scale == 0``."""
    yf, dyf = y.float(), dy.float()
    return yf * (dyf - (yf * dyf).sum(-1, keepdim=True))


def fused_scale_mask_softmax(x: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None,
                             causal: bool = False) -> torch.Tensor:
    """``softmax(x * scale + mask)`` over the last dim, with the causal upper triangle masked when ``causal``;
    fully masked rows give zeros. Autograd-correct (``x``, and ``mask`` when it requires grad). See the module
    docstring for the supported mask shapes.

    Runs the Triton kernels or :func:`softmax_reference` as :func:`backend_for` says. Raises ``ValueError`` for
    ``x`` with fewer than 2 dims, unsupported mask shapes or dtypes (a bool mask: convert it to an additive one,
    ``torch.zeros_like(m, dtype=x.dtype).masked_fill(m, float('-inf'))``), a non-finite ``scale``, or (Triton
    path) rows longer than :data:`MAX_COLUMNS`.
    """
    _triton.check_float_tensor("x", x, min_dim=2)
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale!r}")
    if mask is not None:
        if isinstance(mask, torch.Tensor) and not mask.is_floating_point():
            raise ValueError(f"mask: expected an additive floating-point mask, got dtype {mask.dtype}; convert a "
                             "boolean one with torch.zeros_like(m, dtype=x.dtype).masked_fill(m, float('-inf'))")
        _triton.check_float_tensor("mask", mask)
        if mask.device != x.device:
            raise ValueError(f"mask: on {mask.device} but x is on {x.device}; move them to one device")
        _as_4d(x, mask)  # shape checks, on both paths
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected True or False, got {causal!r}")
    if backend_for(x) == "torch":
        return _softmax_torch(x, float(scale), mask, causal)
    if x.shape[-1] > MAX_COLUMNS:
        raise ValueError(f"x: rows of {x.shape[-1]} exceed the Triton kernels' MAX_COLUMNS={MAX_COLUMNS}; use "
                         "MICROSPEED_OPS_BACKEND=torch for rows this long")
    return _FusedSoftmaxFunction.apply(x, mask, float(scale), causal)
