"""Fused layer normalization: :class:`FusedLayerNorm` (a drop-in :class:`torch.nn.LayerNorm`) and
:func:`fused_layer_norm`.

Triton path (see :mod:`microspeed.ops._triton` for when it runs; :func:`backend_for` says which):

* forward: one program per row of the ``[M, N]`` view (``N`` = the product of the normalized shape, at most
  :data:`MAX_COLUMNS`); the whole row sits in registers, mean and variance are computed in fp32 (two passes over
  the registers, no ``E[x^2] - E[x]^2`` cancellation), and the per-row ``mean`` and ``rstd`` (fp32) are saved for
  the backward.
* backward: a fixed number of programs, each walking a contiguous band of rows; per row it computes
  ``dx = rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy*xhat))`` and adds ``dy*xhat`` and ``dy`` to fp32
  accumulators for ``dweight`` and ``dbias``. Each program stores its partial sums in its own row of a
  ``[programs, N]`` buffer, which is then summed over programs: a two-stage reduction without atomics, so the
  gradients are deterministic.

Inputs may be fp32, fp16 or bf16 (``weight``/``bias`` any of those too); arithmetic is fp32, the output has the
input's dtype, and the parameter gradients the parameters' dtype. The PyTorch path is ``F.layer_norm``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from microspeed.ops import _triton
from microspeed.ops._triton import jit, tl

__all__ = ["INTERPRETED", "MAX_COLUMNS", "FusedLayerNorm", "backend_for", "fused_layer_norm", "layer_norm_reference"]

MAX_COLUMNS = 16384
"""The widest normalized size the Triton kernels take (a row lives in one program's registers)."""

_OP = "fused_layer_norm"


@jit
def _ln_forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, eps,
                       HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """``y[r] = (x[r] - mean) * rstd * w + b`` for row ``r = program_id``; stores mean and rstd (fp32)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=in_row, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    centered = tl.where(in_row, x - mean, 0.0)
    var = tl.sum(centered * centered, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    y = centered * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@jit
def _ln_backward_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, dw_part_ptr, db_part_ptr, M, N,
                        ROWS_PER_PROGRAM, HAS_W: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """``dx`` of rows ``[pid * R, (pid + 1) * R)``; partial ``dweight``/``dbias`` sums of them at row ``pid``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * ROWS_PER_PROGRAM
    last = tl.minimum(first + ROWS_PER_PROGRAM, M)
    for row in range(first, last):
        x = tl.load(x_ptr + row * N + cols, mask=in_row, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * N + cols, mask=in_row, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        xhat = tl.where(in_row, (x - mean) * rstd, 0.0)
        wdy = dy
        if HAS_W:
            wdy = dy * w
        c1 = tl.sum(xhat * wdy, axis=0) / N
        c2 = tl.sum(wdy, axis=0) / N
        dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(dx_ptr + row * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)
        if NEED_DW:
            dw_acc += dy * xhat
        if NEED_DB:
            db_acc += dy
    if NEED_DW:
        tl.store(dw_part_ptr + pid * N + cols, dw_acc, mask=in_row)
    if NEED_DB:
        tl.store(db_part_ptr + pid * N + cols, db_acc, mask=in_row)


INTERPRETED: bool = _triton.is_interpreted(_ln_forward_kernel)
"""Whether this module's kernels were decorated under the Triton interpreter (they then run on CPU tensors)."""


def backend_for(t: torch.Tensor) -> str:
    """``'triton'`` or ``'torch'``: the implementation :func:`fused_layer_norm` uses for an input like ``t``
    (``MICROSPEED_OPS_BACKEND`` forces one; see :mod:`microspeed.ops._triton`)."""
    return _triton.select_backend(t, INTERPRETED, _OP)


def _backward_programs(rows: int, device: torch.device) -> int:
    """How many programs share the backward's rows: a few per SM on CUDA, a handful elsewhere."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 8
    return max(1, min(rows, target))


class _FusedLayerNormFunction(torch.autograd.Function):
    """Autograd wrapper of the Triton kernels over a ``[M, N]`` view of the input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                n: int, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, n).contiguous()
        w = weight.reshape(-1).contiguous() if weight is not None else None
        b = bias.reshape(-1).contiguous() if bias is not None else None
        m = x2.shape[0]
        y = torch.empty_like(x2)
        mean = torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        block = _triton.next_power_of_2(n)
        if m > 0:
            _ln_forward_kernel[(m,)](x2, w if w is not None else x2, b if b is not None else x2, y, mean, rstd,
                                     n, eps, HAS_W=w is not None, HAS_B=b is not None, BLOCK_N=block,
                                     num_warps=_triton.num_warps_for(block))
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.shape, ctx.n = shape, n
        ctx.weight_shape = None if weight is None else weight.shape
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, w, mean, rstd = ctx.saved_tensors
        n = ctx.n
        m = x2.shape[0]
        dy2 = dy.reshape(-1, n).contiguous()
        need_dw = w is not None and ctx.needs_input_grad[1]
        need_db = ctx.bias_shape is not None and ctx.needs_input_grad[2]
        dx = torch.empty_like(x2)
        programs = _backward_programs(m, x2.device)
        partial_shape = (programs, n)
        dw_part = torch.zeros(partial_shape, dtype=torch.float32, device=x2.device) if need_dw else None
        db_part = torch.zeros(partial_shape, dtype=torch.float32, device=x2.device) if need_db else None
        block = _triton.next_power_of_2(n)
        if m > 0:
            _ln_backward_kernel[(programs,)](
                x2, w if w is not None else x2, dy2, dx, mean, rstd,
                dw_part if dw_part is not None else mean, db_part if db_part is not None else mean,
                m, n, math.ceil(m / programs), HAS_W=w is not None, NEED_DW=need_dw, NEED_DB=need_db,
                BLOCK_N=block, num_warps=_triton.num_warps_for(block))
        dweight = dw_part.sum(0).to(w.dtype).view(ctx.weight_shape) if need_dw else None
        dbias = db_part.sum(0).to(ctx.bias_dtype).view(ctx.bias_shape) if need_db else None
        return dx.view(ctx.shape), dweight, dbias, None, None


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                         eps: float = 1e-5, normalized_shape: Sequence[int] | None = None) -> torch.Tensor:
    """The textbook formula, differentiable, in fp32 (or ``x``'s wider dtype): ``(x - mean) / sqrt(var + eps) *
    weight + bias`` over the trailing ``normalized_shape`` dims (default: ``weight``'s shape, else the last dim);
    output in ``x``'s dtype."""
    dims = len(_normalized_shape(x, weight, bias, normalized_shape))
    xf = x.to(_triton.compute_dtype(x))
    axes = tuple(range(-dims, 0))
    mean = xf.mean(dim=axes, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=axes, keepdim=True)
    y = (xf - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype)


def _normalized_shape(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      normalized_shape: Sequence[int] | None) -> tuple[int, ...]:
    """The trailing shape normalized over, checked against ``x``, ``weight`` and ``bias``."""
    if normalized_shape is not None:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
            raise ValueError(f"normalized_shape: expected positive ints, got {normalized_shape!r}")
    elif weight is not None:
        shape = tuple(weight.shape)
    elif bias is not None:
        shape = tuple(bias.shape)
    else:
        shape = tuple(x.shape[-1:])
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"x: its trailing dims {tuple(x.shape)} do not match the normalized shape {shape}; "
                         "pass an input whose last dims equal the layer's normalized_shape")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} (the normalized shape), got {tuple(p.shape)}")
    if math.prod(shape) == 0:
        raise ValueError(f"x: the normalized shape {shape} is empty; layer norm needs at least one element per row")
    return shape


def fused_layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     eps: float = 1e-5, normalized_shape: Sequence[int] | None = None) -> torch.Tensor:
    """Layer normalization of ``x`` over its trailing ``normalized_shape`` dims (default: ``weight``'s shape, else
    the last dim), then ``* weight + bias`` (each optional). Same result as ``F.layer_norm``; autograd-correct.

    Runs the Triton kernels or ``F.layer_norm`` as :func:`backend_for` says. Raises ``ValueError`` for shapes
    that do not match, non-float dtypes, a non-positive ``eps``, or (Triton path) rows wider than
    :data:`MAX_COLUMNS` elements.
    """
    _triton.check_float_tensor("x", x, min_dim=1)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            _triton.check_float_tensor(name, p)
            if p.device != x.device:
                raise ValueError(f"{name}: on {p.device} but x is on {x.device}; move them to one device")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: expected a positive number, got {eps!r}")
    shape = _normalized_shape(x, weight, bias, normalized_shape)
    if backend_for(x) == "torch":
        return F.layer_norm(x, shape, None if weight is None else weight.to(x.dtype),
                            None if bias is None else bias.to(x.dtype), float(eps))
    n = math.prod(shape)
    if n > MAX_COLUMNS:
        raise ValueError(f"x: the normalized size {n} exceeds the Triton kernels' MAX_COLUMNS={MAX_COLUMNS}; "
                         "use MICROSPEED_OPS_BACKEND=torch (or torch.nn.LayerNorm) for rows this wide")
    return _FusedLayerNormFunction.apply(x, weight, bias, n, float(eps))


class FusedLayerNorm(nn.LayerNorm):
    """Drop-in :class:`torch.nn.LayerNorm` whose forward is :func:`fused_layer_norm` (Triton kernels on CUDA).

    Same constructor, parameters (``weight``, ``bias``), state dict and ``isinstance`` as ``nn.LayerNorm``;
    ``backend`` is the implementation used by the last forward (``None`` before the first).
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        self.backend: str | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` over its trailing ``normalized_shape`` dims (then the affine transform)."""
        self.backend = backend_for(input) if isinstance(input, torch.Tensor) else None
        return fused_layer_norm(input, self.weight, self.bias, self.eps, self.normalized_shape)
