"""Block-sparse matrix products in Triton: ``sdd`` (dense x dense -> sparse), ``dsd`` (sparse x dense -> dense)
and ``dds`` (dense x sparse -> dense), forward and backward.

A *layout* is an integer ``(heads, rows, cols)`` tensor of 0/1 over ``block x block`` tiles. A block-sparse tensor
holds only the tiles the layout keeps, as ``(batch, nnz, block, block)``, ordered like ``layout.nonzero()``: head,
then block row, then block column. Dense operands are ``(batch, heads, rows, cols)``.

:class:`MatMul` builds the lookup tables of a layout once (copied once to each device that uses them) and is
called like a function, with autograd. Two kernels do all the work:

* ``_sdd_kernel``: one program per kept tile and batch entry, a ``block x block`` product over the inner
  dimension (any size; walked in ``BLOCK_K`` columns, the tail masked).
* ``_dsd_kernel``: one program per (head, block row of the sparse operand, ``BLOCK_N`` output columns, batch
  entry), summing over the row's kept tiles only. ``dds`` is ``dsd`` on the transposes (``C^T = B^T A^T``),
  which costs nothing: every operand is passed by its strides, so a transpose is a view, never a copy.

The backward of each mode is a product of the other modes on the same layout (see :class:`_MatMulFunction`).
Half inputs (fp16, bf16) multiply in their own type and accumulate in fp32; fp32 inputs use TF32 exactly when
``torch.backends.cuda.matmul.allow_tf32`` says so, as ``torch.matmul`` does.

The kernels run wherever Triton runs: CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was in the
environment before this module was first imported (:func:`triton_available` tells which).
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports, so callers can ask triton_available() and pick another backend
    triton = None
    tl = None

__all__ = ["BLOCK_SIZES", "INTERPRETED", "LayoutTables", "MatMul", "MODES", "SUPPORTED_DTYPES", "check_layout",
           "dds_product", "dsd_product", "ensure_triton", "sdd_product", "triton_available", "triton_jit"]

BLOCK_SIZES = (16, 32, 64, 128)
"""The block (tile) sizes the kernels support."""

MODES = ("sdd", "dsd", "dds")
"""The products :class:`MatMul` computes: which of output, first and second operand are (s)parse or (d)ense."""

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The floating types the kernels accept (half types accumulate in fp32)."""


def triton_jit(fn: Any) -> Any:
    """``triton.jit`` where Triton is installed; otherwise the plain function (never launched: the ops call
    :func:`ensure_triton` first), so this package imports without Triton."""
    return triton.jit(fn) if triton is not None else fn


# -- kernels ---------------------------------------------------------------------------------------------------------


@triton_jit
def _sdd_kernel(a_ptr, b_ptr, c_ptr, lut_ptr, K,
                sa_z, sa_h, sa_m, sa_k,
                sb_z, sb_h, sb_k, sb_n,
                sc_z, sc_n, sc_r, sc_c,
                BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """``c[z, n] = a[z, h, rows i] @ b[z, h, :, cols j]`` for the kept tile ``n = (h, i, j)`` read from the LUT."""
    n = tl.program_id(0).to(tl.int64)
    z = tl.program_id(1).to(tl.int64)
    h = tl.load(lut_ptr + 3 * n).to(tl.int64)
    i = tl.load(lut_ptr + 3 * n + 1).to(tl.int64)
    j = tl.load(lut_ptr + 3 * n + 2).to(tl.int64)
    r = tl.arange(0, BLOCK)
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + z * sa_z + h * sa_h + (i * BLOCK + r)[:, None] * sa_m
    b_cols = b_ptr + z * sb_z + h * sb_h + (j * BLOCK + r)[None, :] * sb_n
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_rows + kk[None, :] * sa_k, mask=kk[None, :] < K, other=0.0)
        b = tl.load(b_cols + kk[:, None] * sb_k, mask=kk[:, None] < K, other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    c = c_ptr + z * sc_z + n * sc_n + r[:, None] * sc_r + r[None, :] * sc_c
    tl.store(c, acc.to(c_ptr.dtype.element_ty))


@triton_jit
def _dsd_kernel(s_ptr, d_ptr, c_ptr, offsets_ptr, lut_ptr, N, ROWS,
                ss_z, ss_n, ss_r, ss_c,
                sd_z, sd_h, sd_k, sd_n,
                sc_z, sc_h, sc_m, sc_n,
                BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """``c[z, h, row tile, cols] = sum over the row's kept tiles (t, k) of s[z, t] @ d[z, h, rows k, cols]``.

    The row's tiles are ``lut[offsets[p]:offsets[p + 1]]`` as (tile index, block column) pairs, ``p = h * ROWS +
    row``; ``(ss_r, ss_c)`` are the strides of a tile's rows and columns (swapped for a transposed operand)."""
    p = tl.program_id(0).to(tl.int64)
    pn = tl.program_id(1).to(tl.int64)
    z = tl.program_id(2).to(tl.int64)
    h = p // ROWS
    row = p % ROWS
    start = tl.load(offsets_ptr + p)
    end = tl.load(offsets_ptr + p + 1)
    r = tl.arange(0, BLOCK)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = rn[None, :] < N
    tile_offsets = r[:, None] * ss_r + r[None, :] * ss_c
    d_cols = d_ptr + z * sd_z + h * sd_h + rn[None, :] * sd_n
    acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)
    for t in range(start, end):
        tile = tl.load(lut_ptr + 2 * t).to(tl.int64)
        kb = tl.load(lut_ptr + 2 * t + 1).to(tl.int64)
        s = tl.load(s_ptr + z * ss_z + tile * ss_n + tile_offsets)
        d = tl.load(d_cols + (kb * BLOCK + r)[:, None] * sd_k, mask=in_n, other=0.0)
        if DOT_FP32:
            s = s.to(tl.float32)
            d = d.to(tl.float32)
        acc += tl.dot(s, d, input_precision=PRECISION)
    c = c_ptr + z * sc_z + h * sc_h + (row * BLOCK + r)[:, None] * sc_m + rn[None, :] * sc_n
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=in_n)


INTERPRETED = triton is not None and type(_sdd_kernel).__name__ == "InterpretedFunction"
"""Whether the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` when this module was imported)."""


# -- backend checks ----------------------------------------------------------------------------------------------------


def triton_available(device: torch.device | str) -> bool:
    """Whether the kernels can run on tensors of ``device``: Triton is installed and the device is CUDA (with a
    GPU present) or, under the Triton interpreter (``TRITON_INTERPRET=1`` before this module was imported), CPU."""
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and INTERPRETED


def ensure_triton(tensor: torch.Tensor, name: str, op: str) -> None:
    """Raise a clear ``RuntimeError`` naming ``op`` and the argument ``name`` when ``tensor``'s device cannot run the
    Triton kernels (see :func:`triton_available`)."""
    if triton_available(tensor.device):
        return
    if triton is None:
        raise RuntimeError(f"{op}: Triton is not installed; `pip install triton` to run the block-sparse kernels, "
                           f"or use a dense attention backend")
    raise RuntimeError(f"{op}: {name} is on {tensor.device}, where the Triton kernels cannot run: use CUDA tensors, "
                       f"or set TRITON_INTERPRET=1 in the environment before microspeed_sparse_attn is imported to "
                       f"interpret them on CPU (slow), or use a dense attention backend")


# -- layouts and lookup tables ---------------------------------------------------------------------------------------


def check_layout(layout: Any, block: Any, op: str) -> torch.Tensor:
    """Validate a layout and block size; return the layout as a CPU int64 tensor of 0/1.

    Raises ``TypeError``/``ValueError`` naming ``layout`` or ``block`` and the fix."""
    if not isinstance(block, int) or isinstance(block, bool) or block not in BLOCK_SIZES:
        raise ValueError(f"{op}: block must be one of {BLOCK_SIZES}, got {block!r}")
    if not isinstance(layout, torch.Tensor):
        raise TypeError(f"{op}: layout must be a torch.Tensor of shape (heads, rows, cols), got {type(layout)}")
    if layout.dim() != 3:
        raise ValueError(f"{op}: layout must have shape (heads, rows // block, cols // block), "
                         f"got {tuple(layout.shape)}")
    if layout.is_floating_point() or layout.is_complex():
        raise TypeError(f"{op}: layout must be an integer (or bool) tensor of 0/1, got {layout.dtype}")
    layout = layout.detach().to("cpu", torch.int64)
    if ((layout != 0) & (layout != 1)).any():
        raise ValueError(f"{op}: layout must hold only 0 and 1, got values {torch.unique(layout).tolist()}")
    return layout


def _row_lut(layout: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles of each block row of ``layout`` (of its transpose when ``transposed``): ``offsets`` (int32, one
    per (head, row) plus one) and ``lut`` (int32 pairs: tile index in the sparse tensor's order, block column)."""
    heads = layout.shape[0]
    index = torch.full(layout.shape, -1, dtype=torch.int64)
    kept = layout != 0
    index[kept] = torch.arange(int(kept.sum()))  # row-major, the order of layout.nonzero()
    if transposed:
        layout, index = layout.transpose(1, 2), index.transpose(1, 2)
    h, row, col = layout.nonzero(as_tuple=True)
    offsets = torch.zeros(heads * layout.shape[1] + 1, dtype=torch.int64)
    offsets[1:] = layout.sum(-1).reshape(-1).cumsum(0)
    lut = torch.stack([index[h, row, col], col], dim=1)
    return offsets.to(torch.int32), lut.reshape(-1).to(torch.int32)


class LayoutTables:
    """The lookup tables of one layout, built once on CPU and copied once to each device asked for.

    ``sdd``: (head, row, col) of each kept tile; ``rows``/``cols``: ``(offsets, lut)`` of each block row of the
    layout / of its transpose (see ``_row_lut``)."""

    def __init__(self, layout: torch.Tensor) -> None:
        self.layout = layout
        self.nnz = int(layout.sum())
        self._cpu = {"sdd": layout.nonzero().reshape(-1).to(torch.int32),
                     "rows": _row_lut(layout, transposed=False),
                     "cols": _row_lut(layout, transposed=True)}
        self._by_device: dict[torch.device, dict[str, Any]] = {}

    def on(self, device: torch.device) -> dict[str, Any]:
        """The tables on ``device`` (copied on first use, then cached)."""
        tables = self._by_device.get(device)
        if tables is None:
            tables = {name: tuple(t.to(device) for t in value) if isinstance(value, tuple) else value.to(device)
                      for name, value in self._cpu.items()}
            self._by_device[device] = tables
        return tables


# -- launchers on logical views ------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype, device: torch.device) -> tuple[str, bool]:
    """``(input_precision, DOT_FP32)`` for products of ``dtype`` on ``device``: fp32 operands multiply exactly
    ("ieee") unless torch allows TF32 matmuls on CUDA (the setting only concerns fp32); bf16 operands are widened to
    fp32 under the interpreter (its bf16 ``tl.dot`` gives wrong results)."""
    exact = dtype == torch.float32 and not (device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    return ("ieee" if exact else "tf32"), (INTERPRETED and dtype == torch.bfloat16)


def _launch_options(tile: int, stage_elements: int, dtype: torch.dtype) -> dict[str, int]:
    """``num_warps`` for a ``block x tile`` accumulator and ``num_stages`` so that the pipelined operand tiles
    (``stage_elements`` values per stage) fit in :data:`_SHARED_MEMORY_BUDGET` bytes."""
    stage_bytes = stage_elements * dtype.itemsize
    stages = max(1, min(3, _SHARED_MEMORY_BUDGET // stage_bytes))
    return {"num_warps": 8 if tile >= 128 else 4, "num_stages": stages}


_SHARED_MEMORY_BUDGET = 96 * 1024
"""Bytes of shared memory the pipelined operand tiles of one program may take (fits every recent NVIDIA GPU)."""


def sdd_product(x: torch.Tensor, y: torch.Tensor, tables: LayoutTables, block: int) -> torch.Tensor:
    """``(x @ y)`` restricted to the layout's tiles, as a ``(batch, nnz, block, block)`` tensor. ``x`` is
    ``(batch, heads, M, K)`` and ``y`` ``(batch, heads, K, N)``, any strides (transposes are views)."""
    batch, _, _, inner = x.shape
    out = torch.empty(batch, tables.nnz, block, block, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if inner == 0:
        return out.zero_()
    block_k = max(16, min(64, triton.next_power_of_2(inner)))
    precision, dot_fp32 = _precision(x.dtype, x.device)
    _sdd_kernel[(tables.nnz, batch)](
        x, y, out, tables.on(x.device)["sdd"], inner, *x.stride(), *y.stride(), *out.stride(),
        BLOCK=block, BLOCK_K=block_k, PRECISION=precision, DOT_FP32=dot_fp32,
        **_launch_options(block, 2 * block * block_k, x.dtype))
    return out


def dsd_product(s: torch.Tensor, transposed: bool, y: torch.Tensor, out: torch.Tensor, tables: LayoutTables,
                block: int) -> torch.Tensor:
    """``out = op(s) @ y`` with ``op(s)`` the dense matrix of the sparse ``s`` (transposed when ``transposed``),
    ``y`` ``(batch, heads, K, N)`` and ``out`` ``(batch, heads, M, N)``, any strides; returns ``out``."""
    batch, heads, rows, width = out.shape
    if out.numel() == 0:
        return out
    if tables.nnz == 0:
        return out.zero_()
    offsets, lut = tables.on(s.device)["cols" if transposed else "rows"]
    s_strides = s.stride()
    if transposed:
        s_strides = (s_strides[0], s_strides[1], s_strides[3], s_strides[2])
    block_n = max(16, min(64 if block == 128 else 128, triton.next_power_of_2(width)))
    precision, dot_fp32 = _precision(s.dtype, s.device)
    grid = (heads * (rows // block), triton.cdiv(width, block_n), batch)
    _dsd_kernel[grid](
        s, y, out, offsets, lut, width, rows // block, *s_strides, *y.stride(), *out.stride(),
        BLOCK=block, BLOCK_N=block_n, PRECISION=precision, DOT_FP32=dot_fp32,
        **_launch_options(max(block, block_n), block * (block + block_n), s.dtype))
    return out


def dds_product(x: torch.Tensor, s: torch.Tensor, transposed: bool, out: torch.Tensor, tables: LayoutTables,
                block: int) -> torch.Tensor:
    """``out = x @ op(s)``, computed as ``out^T = op(s)^T @ x^T`` by :func:`dsd_product` on transposed views."""
    dsd_product(s, not transposed, x.mT, out.mT, tables, block)
    return out


def _op(t: torch.Tensor, trans: bool) -> torch.Tensor:
    """``t`` or its transpose over the last two dimensions (a view)."""
    return t.mT if trans else t


class _MatMulFunction(torch.autograd.Function):
    """Autograd of :class:`MatMul`. With ``X = op(a)``, ``Y = op(b)`` and ``S`` the sparse operand:

    * sdd ``C = X Y`` on the layout: ``dX = dsd(dC, Y^T)``, ``dY = dds(X^T, dC)``;
    * dsd ``C = op(S) Y``: ``dS = sdd(dC, Y^T)`` (or ``sdd(Y, dC^T)`` when ``S`` is transposed),
      ``dY = dsd(op(S)^T, dC)``;
    * dds ``C = X op(S)``: ``dX = dds(dC, op(S)^T)``, ``dS = sdd(X^T, dC)`` (or ``sdd(dC^T, X)``).

    Gradients of transposed dense operands are written through transposed views of contiguous buffers."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, op: MatMul) -> torch.Tensor:
        """Compute the product of ``op.mode`` (operands already validated)."""
        ctx.op = op
        ctx.save_for_backward(a, b)
        tables, block = op.tables, op.block
        if op.mode == "sdd":
            return sdd_product(_op(a, op.trans_a), _op(b, op.trans_b), tables, block)
        if op.mode == "dsd":
            y = _op(b, op.trans_b)
            out = torch.empty(*y.shape[:2], op.output_rows, y.shape[3], dtype=b.dtype, device=b.device)
            return dsd_product(a, op.trans_a, y, out, tables, block)
        x = _op(a, op.trans_a)
        out = torch.empty(*x.shape[:3], op.output_cols, dtype=a.dtype, device=a.device)
        return dds_product(x, b, op.trans_b, out, tables, block)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        """Gradients of both operands through the other modes' kernels (only those autograd asks for)."""
        op: MatMul = ctx.op
        a, b = ctx.saved_tensors
        tables, block = op.tables, op.block
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_a = grad_b = None
        if op.mode == "sdd":
            x, y = _op(a, op.trans_a), _op(b, op.trans_b)
            if need_a:
                grad_a = torch.empty_like(a, memory_format=torch.contiguous_format)
                dsd_product(grad, False, y.mT, _op(grad_a, op.trans_a), tables, block)
            if need_b:
                grad_b = torch.empty_like(b, memory_format=torch.contiguous_format)
                dds_product(x.mT, grad, False, _op(grad_b, op.trans_b), tables, block)
        elif op.mode == "dsd":
            y = _op(b, op.trans_b)
            if need_a:
                grad_a = sdd_product(y, grad.mT, tables, block) if op.trans_a else sdd_product(grad, y.mT, tables,
                                                                                                  block)
            if need_b:
                grad_b = torch.empty_like(b, memory_format=torch.contiguous_format)
                dsd_product(a, not op.trans_a, grad, _op(grad_b, op.trans_b), tables, block)
        else:
            x = _op(a, op.trans_a)
            if need_a:
                grad_a = torch.empty_like(a, memory_format=torch.contiguous_format)
                dds_product(grad, b, not op.trans_b, _op(grad_a, op.trans_a), tables, block)
            if need_b:
                grad_b = sdd_product(grad.mT, x, tables, block) if op.trans_b else sdd_product(x.mT, grad, tables,
                                                                                                  block)
        return grad_a, grad_b, None


class MatMul:
    """A block-sparse product on a fixed layout, called like a function: ``MatMul(layout, block, mode)(a, b)``.

    ``mode`` (see :data:`MODES`):

    * ``'sdd'``: ``op(a) @ op(b)`` kept only on the layout's tiles, with ``a`` ``(batch, heads, M, K)`` and ``b``
      ``(batch, heads, K, N)`` (after the optional transposes); result ``(batch, nnz, block, block)``. E.g. the
      attention scores ``Q K^T`` with ``trans_b=True``.
    * ``'dsd'``: ``op(a) @ op(b)`` with ``a`` sparse ``(batch, nnz, block, block)`` and ``b`` dense; result dense
      ``(batch, heads, M, N)``. E.g. ``P V``.
    * ``'dds'``: ``op(a) @ op(b)`` with ``a`` dense and ``b`` sparse; result dense.

    ``trans_a``/``trans_b`` transpose an operand's last two dimensions (a transposed sparse operand's dense matrix
    is the transpose of the layout's). The layout's ``(rows, cols)`` block grid is that of the sparse operand or
    result *before* any transpose. Forward and backward run in Triton (see the module docs for where it can run).
    """

    def __init__(self, layout: torch.Tensor, block: int, mode: str, trans_a: bool = False,
                 trans_b: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"MatMul: mode must be one of {MODES}, got {mode!r}")
        for name, value in (("trans_a", trans_a), ("trans_b", trans_b)):
            if not isinstance(value, bool):
                raise TypeError(f"MatMul: {name} must be a bool, got {value!r}")
        self.layout = check_layout(layout, block, "MatMul")
        self.block, self.mode, self.trans_a, self.trans_b = block, mode, trans_a, trans_b
        self.tables = LayoutTables(self.layout)
        self.heads = self.layout.shape[0]
        self.rows, self.cols = self.layout.shape[1] * block, self.layout.shape[2] * block
        sparse_trans = trans_a if mode == "dsd" else trans_b
        # the dense shape of op(sparse operand) (dsd/dds) or of the result (sdd)
        self.output_rows = self.cols if (mode == "dsd" and sparse_trans) else self.rows
        self.output_cols = self.rows if (mode == "dds" and sparse_trans) else self.cols

    def __repr__(self) -> str:
        return (f"MatMul(mode={self.mode!r}, block={self.block}, layout={tuple(self.layout.shape)}, "
                f"nnz={self.tables.nnz}, trans_a={self.trans_a}, trans_b={self.trans_b})")

    def _check_sparse(self, t: torch.Tensor, name: str) -> None:
        """``t`` must be ``(batch, nnz, block, block)`` for this layout."""
        expected = (self.tables.nnz, self.block, self.block)
        if t.dim() != 4 or tuple(t.shape[1:]) != expected:
            raise ValueError(f"MatMul({self.mode}): {name} is sparse and must have shape (batch, {expected[0]}, "
                             f"{expected[1]}, {expected[2]}) for this layout (nnz={expected[0]}, block={self.block}),"
                             f" got {tuple(t.shape)}")

    def _check_dense(self, t: torch.Tensor, name: str, trans: bool, rows: int | None, cols: int | None) -> None:
        """``op(t)`` must be ``(batch, heads, rows, cols)`` (``None``: any size)."""
        if t.dim() != 4:
            raise ValueError(f"MatMul({self.mode}): {name} must be dense (batch, heads, rows, cols), got "
                             f"{tuple(t.shape)}")
        if t.shape[1] != self.heads:
            raise ValueError(f"MatMul({self.mode}): {name} has {t.shape[1]} heads but the layout has {self.heads}; "
                             f"give the layout one (rows, cols) grid per head")
        shape = _op(t, trans).shape[2:]
        for axis, size, want in (("rows", shape[0], rows), ("columns", shape[1], cols)):
            if want is not None and size != want:
                transposed = " (after trans)" if trans else ""
                raise ValueError(f"MatMul({self.mode}): {name}{transposed} has {size} {axis}, expected {want} to "
                                 f"match the layout (block {self.block}) and the other operand; if seq_len is not a "
                                 f"multiple of block, pad it with SparseAttentionUtils.pad_to_block_size")

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The product of :attr:`mode` (see the class docs), differentiable in both operands."""
        op = f"MatMul({self.mode})"
        for name, t in (("a", a), ("b", b)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t)}")
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{op}: {name} has dtype {t.dtype}; use one of {SUPPORTED_DTYPES}")
        if a.dtype != b.dtype:
            raise TypeError(f"{op}: a and b must have the same dtype, got {a.dtype} and {b.dtype}; cast one")
        if a.device != b.device:
            raise ValueError(f"{op}: a and b must be on the same device, got {a.device} and {b.device}")
        if self.mode == "sdd":
            self._check_dense(a, "a", self.trans_a, self.rows, None)
            inner = _op(a, self.trans_a).shape[3]
            self._check_dense(b, "b", self.trans_b, inner, self.cols)
        elif self.mode == "dsd":
            self._check_sparse(a, "a")
            inner = self.rows if self.trans_a else self.cols
            self._check_dense(b, "b", self.trans_b, inner, None)
        else:
            self._check_sparse(b, "b")
            inner = self.cols if self.trans_b else self.rows
            self._check_dense(a, "a", self.trans_a, None, inner)
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"{op}: a and b must have the same batch size, got {a.shape[0]} and {b.shape[0]}")
        ensure_triton(a, "a", op)
        return _MatMulFunction.apply(a, b, self)
