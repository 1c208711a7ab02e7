"""Fused bias + GELU: :func:`fused_bias_gelu` computes ``gelu(x + bias)`` in one pass, forward and backward.

Triton path (see :mod:`microspeed.ops._triton` for when it runs; :func:`backend_for` says which):

* forward: one program per ``BLOCK`` elements of the flattened ``[M, N]`` input (``bias`` indexed by column);
  ``x + bias`` is never stored: the backward recomputes it from the saved ``x`` and ``bias``.
* backward: a 2-D grid of ``[row band, column block]`` programs; each walks its band of rows ``BLOCK_M`` at a
  time, stores ``dx = dy * gelu'(x + bias)`` and keeps an fp32 column sum of ``dx``, stored in its own row of a
  ``[bands, N]`` buffer that is then summed over bands for ``dbias`` (deterministic, no atomics).

``approximate='none'`` is the exact GELU ``z * Phi(z)`` (erf); ``'tanh'`` is the tanh approximation, as in
``torch.nn.functional.gelu``. Inputs may be fp32, fp16 or bf16 (``bias`` any of those); arithmetic is fp32.
The PyTorch path is ``F.gelu(x + bias)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from microspeed.ops import _triton
from microspeed.ops._triton import jit, tl

__all__ = ["INTERPRETED", "backend_for", "bias_gelu_reference", "fused_bias_gelu"]

_OP = "fused_bias_gelu"
_BLOCK = 1024  # elements per forward program
_BLOCK_M = 16  # rows per step of a backward program
_BAND_BLOCKS = 8  # row steps per backward program (a band is _BLOCK_M * _BAND_BLOCKS rows)
# The kernels spell their constants out: 0.7071067811865476 = 1/sqrt(2), 0.3989422804014327 = 1/sqrt(2*pi),
# 0.7978845608028654 = sqrt(2/pi), 0.044715 = the tanh approximation's cubic coefficient.


@jit
def _tanh_and_sech2(a):
    """``(tanh(a), 1 - tanh(a)^2)`` from ``e = exp(-2|a|)``: no overflow, and ``1 - tanh^2 = 4e / (1 + e)^2``
    keeps its precision where ``tanh`` saturates."""
    e = tl.exp(-2.0 * tl.abs(a))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(a < 0, -t, t)
    return t, 4.0 * e / ((1.0 + e) * (1.0 + e))


@jit
def _gelu(z, TANH: tl.constexpr):
    """GELU of fp32 ``z``: exact (erf) or the tanh approximation."""
    if TANH:
        t, _ = _tanh_and_sech2(0.7978845608028654 * (z + 0.044715 * z * z * z))
        y = 0.5 * z * (1.0 + t)
    else:
        y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    return y


@jit
def _gelu_grad(z, TANH: tl.constexpr):
    """``d gelu(z) / dz`` for fp32 ``z``."""
    if TANH:
        t, sech2 = _tanh_and_sech2(0.7978845608028654 * (z + 0.044715 * z * z * z))
        g = 0.5 * (1.0 + t) + 0.5 * z * sech2 * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
    else:
        g = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    return g


@jit
def _bias_gelu_forward_kernel(x_ptr, b_ptr, y_ptr, total, N, TANH: tl.constexpr, BLOCK: tl.constexpr):
    """``y = gelu(x + b[col])`` over ``BLOCK`` elements of the flat input."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < total
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs % N, mask=inside, other=0.0).to(tl.float32)
    y = _gelu(x + b, TANH)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)


@jit
def _bias_gelu_backward_kernel(x_ptr, b_ptr, dy_ptr, dx_ptr, db_part_ptr, M, N, BAND_ROWS,
                               TANH: tl.constexpr, NEED_DB: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr):
    """``dx = dy * gelu'(x + b)`` over rows ``[band * BAND_ROWS, ...)`` and one column block; the band's column
    sums of ``dx`` (fp32) go to row ``band`` of the partial buffer."""
    band = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    b = tl.load(b_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = band.to(tl.int64) * BAND_ROWS
    for r0 in range(0, BAND_ROWS, BLOCK_M):
        rows = first + r0 + tl.arange(0, BLOCK_M)
        inside = ((rows < M) & (r0 + tl.arange(0, BLOCK_M) < BAND_ROWS))[:, None] & in_cols[None, :]
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        dx = dy * _gelu_grad(x + b[None, :], TANH)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=inside)
        if NEED_DB:
            acc += tl.sum(tl.where(inside, dx, 0.0), axis=0)
    if NEED_DB:
        tl.store(db_part_ptr + band * N + cols, acc, mask=in_cols)


INTERPRETED: bool = _triton.is_interpreted(_bias_gelu_forward_kernel)
"""Whether this module's kernels were decorated under the Triton interpreter (they then run on CPU tensors)."""


def backend_for(t: torch.Tensor) -> str:
    """``'triton'`` or ``'torch'``: the implementation :func:`fused_bias_gelu` uses for an input like ``t``
    (``MICROSPEED_OPS_BACKEND`` forces one; see :mod:`microspeed.ops._triton`)."""
    return _triton.select_backend(t, INTERPRETED, _OP)


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints."""
    return -(-a // b)


class _FusedBiasGeluFunction(torch.autograd.Function):
    """Autograd wrapper of the Triton kernels over a ``[M, N]`` view of the input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
        n = bias.numel()
        xc = x.contiguous()
        bc = bias.contiguous()
        y = torch.empty_like(xc)
        total = xc.numel()
        if total > 0:
            _bias_gelu_forward_kernel[(_cdiv(total, _BLOCK),)](xc, bc, y, total, n, TANH=tanh, BLOCK=_BLOCK,
                                                                      num_warps=4)
        ctx.save_for_backward(xc, bc)
        ctx.tanh = tanh
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, b = ctx.saved_tensors
        n = b.numel()
        m = x.numel() // n
        dyc = dy.contiguous()
        dx = torch.empty_like(x)
        need_db = ctx.needs_input_grad[1]
        block_n = min(_triton.next_power_of_2(n), 128)
        band_rows = _BLOCK_M * _BAND_BLOCKS
        bands = max(1, _cdiv(m, band_rows))
        db_part = torch.zeros((bands, n), dtype=torch.float32, device=x.device) if need_db else None
        if m > 0:
            _bias_gelu_backward_kernel[(bands, _cdiv(n, block_n))](
                x, b, dyc, dx, db_part if db_part is not None else b, m, n, band_rows, TANH=ctx.tanh,
                NEED_DB=need_db, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, num_warps=4)
        dbias = db_part.sum(0).to(b.dtype) if need_db else None
        return dx.view(dy.shape), dbias, None


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x + bias)`` computed in fp32 (or ``x``'s wider dtype; differentiable), returned in ``x``'s dtype."""
    dtype = _triton.compute_dtype(x)
    return F.gelu(x.to(dtype) + bias.to(dtype), approximate=approximate).to(x.dtype)


def fused_bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)`` with ``bias`` (shape ``[N]``) added along ``x``'s last dim (size ``N``); autograd-correct
    (gradients for ``x`` and ``bias``). ``approximate`` is ``'none'`` (exact, erf) or ``'tanh'``.

    Runs the Triton kernels or ``F.gelu(x + bias)`` as :func:`backend_for` says. Raises ``ValueError`` for a bias
    that is not 1-D of size ``x.shape[-1]``, non-float dtypes, another device, or an unknown ``approximate``.
    """
    _triton.check_float_tensor("x", x, min_dim=1)
    _triton.check_float_tensor("bias", bias)
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias: expected shape ({x.shape[-1]},) (x's last dim), got {tuple(bias.shape)}")
    if bias.device != x.device:
        raise ValueError(f"bias: on {bias.device} but x is on {x.device}; move them to one device")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    if backend_for(x) == "torch":
        return F.gelu(x + bias.to(x.dtype), approximate=approximate)
    if x.numel() == 0:  # nothing for a kernel to do; keep autograd's bookkeeping
        return F.gelu(x + bias.to(x.dtype), approximate=approximate)
    return _FusedBiasGeluFunction.apply(x, bias, approximate == "tanh")
