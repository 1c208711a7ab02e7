"""Dense reference for block-sparse attention, and the pieces both fast paths share.

:func:`dense_reference_attention` expands the block layout to an element mask (:func:`expand_layout`) and runs
plain softmax attention over the whole ``(seq_len, seq_len)`` score matrix: quadratic in memory, for tests and
small inputs only. The fused Triton kernels (:mod:`microspeed_sparse_attn.fused`) and the chunked PyTorch path
(:mod:`microspeed_sparse_attn.cpu_attention`) compute the same function without that matrix; they share the
argument checks (:func:`check_attention_args`) and the per-layout index tables (:func:`layout_index`).

Conventions: ``q``, ``k``, ``v`` are ``(batch, heads, seq_len, head_dim)``; the layout is ``(heads, seq_len //
block, seq_len // block)`` of 0/1 (row: query block, column: key block). ``scores = (q @ k^T) * scale`` (``scale``
defaults to ``head_dim ** -0.5``), plus the ADDITIVE float masks ``key_padding_mask`` ``(batch, seq_len)`` and
``attn_mask`` ``(seq_len, seq_len)``; keys in zero blocks of the layout, and with ``causal=True`` keys past the
query, are excluded; the softmax runs over the rest. A query row with every key excluded gives output 0 and zero
gradients.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "SUPPORTED_BLOCKS",
    "LayoutIndex",
    "check_attention_args",
    "dense_reference_attention",
    "expand_layout",
    "layout_index",
]

SUPPORTED_BLOCKS = (16, 32, 64, 128)
"""The block sizes the layouts (and the kernels) use."""


def check_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor, block: int,
                         key_padding_mask: torch.Tensor | None = None,
                         attn_mask: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """Check the arguments of a block-sparse attention call; returns ``(batch, heads, seq_len, head_dim)``.

    Raises ValueError (TypeError for wrong types) naming the argument and what to pass instead: q, k, v of one
    shape ``(batch, heads, seq_len, head_dim)``, one floating dtype and one device; ``block`` one of
    :data:`SUPPORTED_BLOCKS`; ``seq_len`` a multiple of ``block``; the layout ``(heads, seq_len // block, seq_len //
    block)`` of integers or bools; the masks floating (additive) of shapes ``(batch, seq_len)`` and ``(seq_len,
    seq_len)``.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("layout", layout)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected (batch, heads, seq_len, head_dim), got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name}: expected the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected dtype {q.dtype} on {q.device} like q, got {t.dtype} on {t.device}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q: expected a floating dtype (float32, float16, bfloat16), got {q.dtype}")
    batch, heads, seq_len, head_dim = q.shape
    if block not in SUPPORTED_BLOCKS:
        raise ValueError(f"block: expected one of {SUPPORTED_BLOCKS}, got {block!r}")
    if seq_len % block != 0:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of block ({block}); pad the inputs with "
                         "SparseAttentionUtils.pad_to_block_size first")
    blocks = seq_len // block
    if layout.shape != (heads, blocks, blocks):
        raise ValueError(f"layout: expected shape (heads, seq_len // block, seq_len // block) = "
                         f"{(heads, blocks, blocks)}, got {tuple(layout.shape)}")
    if layout.dtype.is_floating_point or layout.is_complex():
        raise ValueError(f"layout: expected an integer (int64) or bool tensor of 0/1, got {layout.dtype}")
    for name, mask, shape in (("key_padding_mask", key_padding_mask, (batch, seq_len)),
                              ("attn_mask", attn_mask, (seq_len, seq_len))):
        if mask is None:
            continue
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(mask).__name__}")
        if tuple(mask.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(mask.shape)}")
        if not mask.dtype.is_floating_point:
            raise ValueError(f"{name}: expected an additive float mask (0 keeps, -inf drops), got {mask.dtype}; "
                             "convert a 'mul' mask with torch.where(mask != 0, 0.0, float('-inf'))")
    return batch, heads, seq_len, head_dim


def expand_layout(layout: torch.Tensor, block: int) -> torch.Tensor:
    """The element mask of a block layout: bool ``(heads, seq_len, seq_len)``, True where the key is allowed."""
    if layout.dim() != 3:
        raise ValueError(f"layout: expected (heads, blocks, blocks), got shape {tuple(layout.shape)}")
    allowed = layout != 0
    return allowed.repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)


def dense_reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor, block: int,
                              scale: float | None = None, causal: bool = False,
                              key_padding_mask: torch.Tensor | None = None,
                              attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Block-sparse attention computed densely (quadratic memory; the ground truth for tests).

    Differentiable by autograd in q, k and v. Computes in float32 at least (float64 stays float64) and returns
    q's dtype. Rows with no allowed key give 0 and zero gradients.
    """
    check_attention_args(q, k, v, layout, block, key_padding_mask, attn_mask)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    work = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = q.to(work), k.to(work), v.to(work)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if key_padding_mask is not None:
        scores = scores + key_padding_mask.to(work)[:, None, None, :]
    if attn_mask is not None:
        scores = scores + attn_mask.to(work)
    allowed = expand_layout(layout.to(q.device), block)
    if causal:
        allowed = allowed & torch.ones(allowed.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    live = scores.amax(dim=-1, keepdim=True) > float("-inf")
    probs = torch.softmax(scores.masked_fill(~live, 0.0), dim=-1) * live
    return torch.matmul(probs, vf).to(q.dtype)


@dataclass(eq=False)
class LayoutIndex:
    """Index tables of one layout on one device, as both fast paths walk it (all int32 except where noted).

    Rows are the ``heads * blocks`` query-block rows ``h * blocks + i``; ``row_ptr``/``col_idx`` list each row's
    non-zero key blocks in increasing order (CSR). ``col_ptr``/``row_idx`` are the transpose: for each key-block
    column ``h * blocks + j`` the query blocks that use it (for the dK/dV pass). With ``causal`` the blocks above
    the diagonal (all keys past every query) are left out. ``counts`` (int64) is the number of blocks per row and
    ``diag_pos`` (int64) the position of the diagonal block in its row's list, -1 where the row lacks it.
    ``plans`` caches what the PyTorch path derives from the tables (keyed by its own arguments).
    """

    heads: int
    blocks: int
    causal: bool
    row_ptr: torch.Tensor
    col_idx: torch.Tensor
    col_ptr: torch.Tensor
    row_idx: torch.Tensor
    counts: torch.Tensor
    diag_pos: torch.Tensor
    plans: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def nnz(self) -> int:
        """The number of non-zero blocks kept (over all heads)."""
        return int(self.col_idx.numel())

    @property
    def max_row_blocks(self) -> int:
        """The most non-zero blocks in one row."""
        return int(self.counts.max()) if self.counts.numel() else 0


_CACHE_SIZE = 32
_cache: OrderedDict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], LayoutIndex]] = OrderedDict()
_cache_lock = threading.Lock()


def _build_index(layout: torch.Tensor, causal: bool, device: torch.device) -> LayoutIndex:
    """Compute the tables of :class:`LayoutIndex` (on the CPU, then moved to ``device``)."""
    heads, blocks, _ = layout.shape
    allowed = layout.detach().to("cpu") != 0
    if causal:
        allowed = allowed & torch.ones(blocks, blocks, dtype=torch.bool).tril()
    # Rows: nonzero() walks (head, row, col) in row-major order, so each row's columns come out sorted.
    nz = allowed.nonzero()
    counts = allowed.sum(dim=2).view(-1)
    row_ptr = torch.zeros(heads * blocks + 1, dtype=torch.int64)
    row_ptr[1:] = counts.cumsum(0)
    col_idx = nz[:, 2]
    # Columns: the same walk over the transposed layout.
    nzt = allowed.transpose(1, 2).nonzero()
    col_counts = allowed.sum(dim=1).view(-1)
    col_ptr = torch.zeros(heads * blocks + 1, dtype=torch.int64)
    col_ptr[1:] = col_counts.cumsum(0)
    row_idx = nzt[:, 2]
    # Position of the diagonal block within its row: the number of kept blocks left of it.
    before = (allowed & torch.ones(blocks, blocks, dtype=torch.bool).tril(-1)).sum(dim=2)
    diag = torch.arange(blocks)
    diag_pos = torch.where(allowed[:, diag, diag], before, -1).reshape(-1)

    def put(t: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    return LayoutIndex(heads=heads, blocks=blocks, causal=causal, row_ptr=put(row_ptr), col_idx=put(col_idx),
                       col_ptr=put(col_ptr), row_idx=put(row_idx), counts=put(counts, torch.int64),
                       diag_pos=put(diag_pos, torch.int64))


def layout_index(layout: torch.Tensor, causal: bool = False, device: torch.device | str | None = None
                 ) -> LayoutIndex:
    """The :class:`LayoutIndex` of ``layout`` on ``device`` (default: the layout's), built once and cached.

    The cache is keyed by the layout tensor itself (its storage pointer and version counter, so an in-place edit
    rebuilds the tables, plus a weak reference, so a new tensor at a freed address is never mistaken for the
    old one), ``causal`` and ``device``; it keeps the :data:`_CACHE_SIZE` most recently used entries.
    """
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(f"layout: expected (heads, blocks, blocks), got shape {tuple(layout.shape)}")
    device = torch.device(device) if device is not None else layout.device
    key = (layout.data_ptr(), layout._version, tuple(layout.shape), tuple(layout.stride()),
           layout.storage_offset(), str(layout.device), bool(causal), str(device))
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and hit[0]() is layout:
            _cache.move_to_end(key)
            return hit[1]
    index = _build_index(layout, bool(causal), device)
    with _cache_lock:
        _cache[key] = (weakref.ref(layout), index)
        _cache.move_to_end(key)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return index
