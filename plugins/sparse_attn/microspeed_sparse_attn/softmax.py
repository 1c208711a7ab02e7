"""Block-sparse softmax in Triton, forward and backward.

The input is a block-sparse score tensor ``(batch, nnz, block, block)`` on a layout (see :mod:`.matmul`). Each
query row is normalised over the keys of its kept tiles only; keys of dropped tiles count as ``-inf``. Before the
softmax the scores are ``x * scale``, then ``+ rpe``, then the key-padding mask and the attention mask, each either
'add' (its values added) or 'mul' (``-inf`` where it is 0, unchanged elsewhere), and ``causal`` excludes every key
after the query (inside diagonal tiles too). A row whose every key is excluded gives zeros and zero gradients.

One program per (head, block row, batch entry) holds a ``block x block`` tile: the forward walks the row's kept
tiles twice (an online max and sum in fp32, then the normalised values), the backward twice too (the row sums of
``y * dy``, then ``dx = scale * y * (dy - sum)``). Additive inputs that require grad (``rpe`` and 'add' masks) get
gradients too, reduced from the sparse score gradient with PyTorch.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from microspeed_sparse_attn.blocksparse_reference import to_dense
from microspeed_sparse_attn.matmul import (
    SUPPORTED_DTYPES,
    LayoutTables,
    check_layout,
    ensure_triton,
    tl,
    triton_jit,
)

__all__ = ["MASK_MODES", "Softmax"]

MASK_MODES = ("add", "mul")
"""How a mask applies: 'add' adds its values to the scores; 'mul' excludes (``-inf``) the scores where it is 0."""


@triton_jit
def _masked_scores(x_ptr, rpe_ptr, kpm_ptr, am_ptr, scale, z, h, q, k,
                   srpe_h, srpe_m, srpe_n, skpm_z, skpm_n, sam_h, sam_m, sam_n,
                   HAS_RPE: tl.constexpr, HAS_KPM: tl.constexpr, KPM_MUL: tl.constexpr, HAS_AM: tl.constexpr,
                   AM_MUL: tl.constexpr, CAUSAL: tl.constexpr):
    """One tile's scores in fp32: ``x * scale + rpe``, then the masks; ``q``/``k`` are its query/key indices."""
    s = tl.load(x_ptr).to(tl.float32) * scale
    if HAS_RPE:
        s += tl.load(rpe_ptr + h * srpe_h + q[:, None] * srpe_m + k[None, :] * srpe_n).to(tl.float32)
    if HAS_KPM:
        kpm = tl.load(kpm_ptr + z * skpm_z + k * skpm_n)
        if KPM_MUL:
            s = tl.where((kpm != 0)[None, :], s, float("-inf"))
        else:
            s += kpm.to(tl.float32)[None, :]
    if HAS_AM:
        am = tl.load(am_ptr + h * sam_h + q[:, None] * sam_m + k[None, :] * sam_n)
        if AM_MUL:
            s = tl.where(am != 0, s, float("-inf"))
        else:
            s += am.to(tl.float32)
    if CAUSAL:
        s = tl.where(k[None, :] > q[:, None], float("-inf"), s)
    return s


@triton_jit
def _softmax_forward_kernel(x_ptr, y_ptr, offsets_ptr, lut_ptr, rpe_ptr, kpm_ptr, am_ptr, scale, ROWS,
                            sx_z, sx_n, sx_r, sx_c, sy_z, sy_n, sy_r, sy_c,
                            srpe_h, srpe_m, srpe_n, skpm_z, skpm_n, sam_h, sam_m, sam_n,
                            HAS_RPE: tl.constexpr, HAS_KPM: tl.constexpr, KPM_MUL: tl.constexpr,
                            HAS_AM: tl.constexpr, AM_MUL: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """``y`` = the softmax of block row ``p % ROWS`` of head ``p // ROWS`` (batch entry ``z``) over its kept tiles."""
    p = tl.program_id(0).to(tl.int64)
    z = tl.program_id(1).to(tl.int64)
    h = p // ROWS
    start = tl.load(offsets_ptr + p)
    end = tl.load(offsets_ptr + p + 1)
    r = tl.arange(0, BLOCK)
    q = (p % ROWS) * BLOCK + r
    x_tile = x_ptr + z * sx_z + r[:, None] * sx_r + r[None, :] * sx_c
    y_tile = y_ptr + z * sy_z + r[:, None] * sy_r + r[None, :] * sy_c
    row_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    for t in range(start, end):  # online max and sum
        tile = tl.load(lut_ptr + 2 * t).to(tl.int64)
        k = tl.load(lut_ptr + 2 * t + 1).to(tl.int64) * BLOCK + r
        s = _masked_scores(x_tile + tile * sx_n, rpe_ptr, kpm_ptr, am_ptr, scale, z, h, q, k,
                           srpe_h, srpe_m, srpe_n, skpm_z, skpm_n, sam_h, sam_m, sam_n,
                           HAS_RPE, HAS_KPM, KPM_MUL, HAS_AM, AM_MUL, CAUSAL)
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all excluded so far: nothing to rescale
        row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(s - shift[:, None]), axis=1)
        row_max = new_max
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    inverse = tl.where(row_sum > 0, 1.0 / tl.where(row_sum > 0, row_sum, 1.0), 0.0)  # dead rows: zeros
    for t in range(start, end):
        tile = tl.load(lut_ptr + 2 * t).to(tl.int64)
        k = tl.load(lut_ptr + 2 * t + 1).to(tl.int64) * BLOCK + r
        s = _masked_scores(x_tile + tile * sx_n, rpe_ptr, kpm_ptr, am_ptr, scale, z, h, q, k,
                           srpe_h, srpe_m, srpe_n, skpm_z, skpm_n, sam_h, sam_m, sam_n,
                           HAS_RPE, HAS_KPM, KPM_MUL, HAS_AM, AM_MUL, CAUSAL)
        y = tl.exp(s - shift[:, None]) * inverse[:, None]
        tl.store(y_tile + tile * sy_n, y.to(y_ptr.dtype.element_ty))


@triton_jit
def _softmax_backward_kernel(y_ptr, dy_ptr, dx_ptr, offsets_ptr, lut_ptr, scale,
                             sy_z, sy_n, sy_r, sy_c, sdy_z, sdy_n, sdy_r, sdy_c, sdx_z, sdx_n, sdx_r, sdx_c,
                             BLOCK: tl.constexpr):
    """``dx = scale * y * (dy - rowsum(y * dy))`` over the kept tiles of one block row (program as the forward)."""
    p = tl.program_id(0).to(tl.int64)
    z = tl.program_id(1).to(tl.int64)
    start = tl.load(offsets_ptr + p)
    end = tl.load(offsets_ptr + p + 1)
    r = tl.arange(0, BLOCK)
    y_tile = y_ptr + z * sy_z + r[:, None] * sy_r + r[None, :] * sy_c
    dy_tile = dy_ptr + z * sdy_z + r[:, None] * sdy_r + r[None, :] * sdy_c
    dx_tile = dx_ptr + z * sdx_z + r[:, None] * sdx_r + r[None, :] * sdx_c
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for t in range(start, end):
        tile = tl.load(lut_ptr + 2 * t).to(tl.int64)
        y = tl.load(y_tile + tile * sy_n).to(tl.float32)
        dy = tl.load(dy_tile + tile * sdy_n).to(tl.float32)
        dot += tl.sum(y * dy, axis=1)
    for t in range(start, end):
        tile = tl.load(lut_ptr + 2 * t).to(tl.int64)
        y = tl.load(y_tile + tile * sy_n).to(tl.float32)
        dy = tl.load(dy_tile + tile * sdy_n).to(tl.float32)
        dx = y * (dy - dot[:, None]) * scale
        tl.store(dx_tile + tile * sdx_n, dx.to(dx_ptr.dtype.element_ty))


def _strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
    """``(head, row, col)`` strides of a ``(rows, cols)`` (head stride 0) or ``(heads, rows, cols)`` tensor."""
    if t is None:
        return 0, 0, 0
    return (0, *t.stride()) if t.dim() == 2 else tuple(t.stride())


def _kernel_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask as the kernels read it: bool viewed as uint8 (no copy), other types as they are."""
    if mask is not None and mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    return mask


class _SoftmaxFunction(torch.autograd.Function):
    """Autograd of :class:`Softmax`; ``x`` and the additive inputs ``rpe``/masks are differentiable."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rpe: torch.Tensor | None, kpm: torch.Tensor | None,
                attn_mask: torch.Tensor | None, softmax: Softmax, scale: float, kpm_mul: bool, am_mul: bool,
                causal: bool) -> torch.Tensor:
        """The softmax (inputs already validated)."""
        tables, block = softmax.tables, softmax.block
        batch = x.shape[0]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ctx.softmax, ctx.scale = softmax, scale
        ctx.bias_shapes = tuple(None if t is None else (t.shape, t.dtype) for t in (rpe, kpm, attn_mask))
        ctx.kpm_mul, ctx.am_mul = kpm_mul, am_mul
        ctx.save_for_backward(y)
        if y.numel() == 0:
            return y
        offsets, lut = tables.on(x.device)["rows"]
        kpm_k, am_k = _kernel_mask(kpm), _kernel_mask(attn_mask)
        grid = (softmax.heads * softmax.block_rows, batch)
        _softmax_forward_kernel[grid](
            x, y, offsets, lut, x if rpe is None else rpe, x if kpm_k is None else kpm_k,
            x if am_k is None else am_k, scale, softmax.block_rows, *x.stride(), *y.stride(),
            *_strides3(rpe), *((0, 0) if kpm_k is None else kpm_k.stride()), *_strides3(am_k),
            HAS_RPE=rpe is not None, HAS_KPM=kpm is not None, KPM_MUL=kpm_mul, HAS_AM=attn_mask is not None,
            AM_MUL=am_mul, CAUSAL=causal, BLOCK=block, num_warps=8 if block >= 64 else 4)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        """``dx`` in Triton; the gradients of additive inputs that need one, summed from the score gradient."""
        (y,) = ctx.saved_tensors
        softmax: Softmax = ctx.softmax
        rpe_meta, kpm_meta, am_meta = ctx.bias_shapes
        needs = ctx.needs_input_grad
        want_rpe = needs[1] and rpe_meta is not None
        want_kpm = needs[2] and kpm_meta is not None and not ctx.kpm_mul
        want_am = needs[3] and am_meta is not None and not ctx.am_mul
        want_bias = want_rpe or want_kpm or want_am
        if not (needs[0] or want_bias):
            return (None,) * 9
        scores_grad = torch.empty(y.shape, dtype=y.dtype, device=y.device)
        if y.numel():
            offsets, lut = softmax.tables.on(y.device)["rows"]
            kernel_scale = 1.0 if want_bias else ctx.scale  # the bias gradients need the unscaled one
            _softmax_backward_kernel[(softmax.heads * softmax.block_rows, y.shape[0])](
                y, grad, scores_grad, offsets, lut, kernel_scale, *y.stride(), *grad.stride(),
                *scores_grad.stride(), BLOCK=softmax.block, num_warps=8 if softmax.block >= 64 else 4)
        grad_x = grad_rpe = grad_kpm = grad_am = None
        if want_bias:
            dense = to_dense(scores_grad.float(), softmax.layout, softmax.block)  # (batch, heads, rows, cols)
            if want_rpe:
                grad_rpe = _reduce_to(dense.sum(0), *rpe_meta)
            if want_kpm:
                grad_kpm = dense.sum((1, 2)).to(kpm_meta[1])
            if want_am:
                grad_am = _reduce_to(dense.sum(0), *am_meta)
            if needs[0]:
                grad_x = scores_grad * ctx.scale
        elif needs[0]:
            grad_x = scores_grad
        return grad_x, grad_rpe, grad_kpm, grad_am, None, None, None, None, None


def _reduce_to(per_head: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A ``(heads, rows, cols)`` gradient summed over heads when the input was ``(rows, cols)``, in ``dtype``."""
    return (per_head.sum(0) if len(shape) == 2 else per_head).to(dtype)


class Softmax:
    """The block-sparse softmax on a fixed layout, called like a function: ``Softmax(layout, block)(x, ...)``.

    See the module docs for what it computes. The layout's lookup tables are built once here and copied once to
    each device that uses them."""

    def __init__(self, layout: torch.Tensor, block: int) -> None:
        self.layout = check_layout(layout, block, "Softmax")
        self.block = block
        self.tables = LayoutTables(self.layout)
        self.heads, self.block_rows, self.block_cols = self.layout.shape
        self.rows, self.cols = self.block_rows * block, self.block_cols * block

    def __repr__(self) -> str:
        return f"Softmax(block={self.block}, layout={tuple(self.layout.shape)}, nnz={self.tables.nnz})"

    def _check_dense(self, t: Any, name: str, x: torch.Tensor, shapes: list[tuple[int, ...]], floating: bool) -> None:
        """``t`` must be a tensor on ``x``'s device with one of ``shapes`` (and floating when ``floating``)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"Softmax: {name} must be a torch.Tensor or None, got {type(t)}")
        if tuple(t.shape) not in shapes:
            raise ValueError(f"Softmax: {name} must have shape {' or '.join(map(str, shapes))} for this layout "
                             f"(block {self.block}) and x, got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"Softmax: {name} is on {t.device} but x is on {x.device}; move it to {x.device}")
        if floating and not t.is_floating_point():
            raise TypeError(f"Softmax: {name} is added to the scores and must be a floating tensor, got {t.dtype}; "
                            f"cast it, or use mode 'mul' for a 0/1 mask")

    def __call__(self, x: torch.Tensor, scale: float = 1.0, rpe: torch.Tensor | None = None,
                 key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                 key_padding_mask_mode: str = "add", attn_mask_mode: str = "add",
                 causal: bool = False) -> torch.Tensor:
        """The softmax of the block-sparse scores ``x`` ``(batch, nnz, block, block)``: a tensor like ``x``.

        ``rpe`` ``(rows, cols)`` or ``(heads, rows, cols)``; ``key_padding_mask`` ``(batch, cols)``; ``attn_mask``
        ``(rows, cols)`` or ``(heads, rows, cols)``; modes in :data:`MASK_MODES`; ``causal`` excludes keys after
        the query."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Softmax: x must be a torch.Tensor, got {type(x)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"Softmax: x has dtype {x.dtype}; use one of {SUPPORTED_DTYPES}")
        expected = (self.tables.nnz, self.block, self.block)
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(f"Softmax: x must have shape (batch, {expected[0]}, {expected[1]}, {expected[2]}) for "
                             f"this layout (nnz={expected[0]}, block={self.block}), got {tuple(x.shape)}")
        if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
            raise TypeError(f"Softmax: scale must be a real number, got {scale!r}")
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise ValueError(f"Softmax: {name} must be one of {MASK_MODES}, got {mode!r}")
        if not isinstance(causal, bool):
            raise TypeError(f"Softmax: causal must be a bool, got {causal!r}")
        square = [(self.rows, self.cols), (self.heads, self.rows, self.cols)]
        if rpe is not None:
            self._check_dense(rpe, "rpe", x, square, floating=True)
        if key_padding_mask is not None:
            self._check_dense(key_padding_mask, "key_padding_mask", x, [(x.shape[0], self.cols)],
                              floating=key_padding_mask_mode == "add")
        if attn_mask is not None:
            self._check_dense(attn_mask, "attn_mask", x, square, floating=attn_mask_mode == "add")
        ensure_triton(x, "x", "Softmax")
        return _SoftmaxFunction.apply(x, rpe, key_padding_mask, attn_mask, self, float(scale),
                                      key_padding_mask_mode == "mul", attn_mask_mode == "mul", causal)
