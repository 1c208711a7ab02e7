"""Plain PyTorch references of the block-sparse ops (:mod:`.matmul`, :mod:`.softmax`), for tests and checks.

Each computes densely and then gathers or scatters the layout's tiles: simple rather than fast. A block-sparse
tensor is ``(batch, nnz, block, block)`` with the tiles ordered like ``layout.nonzero()`` (head, block row, block
column); a layout is ``(heads, rows // block, cols // block)`` of 0/1. Every function is differentiable with
autograd. Half inputs are computed in fp32 and the results cast back to the input dtype; fp32 and fp64 inputs are
computed in their own type (give fp64 inputs for a tight reference).
"""

from __future__ import annotations

import torch

__all__ = ["dds_reference", "dense_attention_reference", "dsd_reference", "from_dense", "layout_to_mask",
           "sdd_reference", "softmax_reference", "to_dense"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, else the type itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _op(t: torch.Tensor, trans: bool) -> torch.Tensor:
    """``t`` or its transpose over the last two dimensions."""
    return t.transpose(-1, -2) if trans else t


def layout_to_mask(layout: torch.Tensor, block: int) -> torch.Tensor:
    """The element mask of ``layout``: a bool ``(heads, rows, cols)`` tensor, True inside the kept tiles."""
    return layout.bool().repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)


def to_dense(sparse: torch.Tensor, layout: torch.Tensor, block: int) -> torch.Tensor:
    """The dense ``(batch, heads, rows, cols)`` tensor of ``sparse`` ``(batch, nnz, block, block)``, zeros outside
    the layout's tiles."""
    heads, rows, cols = layout.shape
    batch = sparse.shape[0]
    tiles = sparse.new_zeros(batch, heads, rows, cols, block, block)
    h, i, j = layout.nonzero(as_tuple=True)
    tiles = _scatter(tiles, sparse, h, i, j)
    return tiles.permute(0, 1, 2, 4, 3, 5).reshape(batch, heads, rows * block, cols * block)


def _scatter(tiles: torch.Tensor, sparse: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
             j: torch.Tensor) -> torch.Tensor:
    """``tiles[:, h, i, j] = sparse`` out of place (differentiable)."""
    device = sparse.device
    index = (h.to(device) * tiles.shape[2] + i.to(device)) * tiles.shape[3] + j.to(device)
    flat = tiles.reshape(tiles.shape[0], -1, *tiles.shape[4:])
    flat = flat.index_copy(1, index, sparse)
    return flat.reshape(tiles.shape)


def from_dense(dense: torch.Tensor, layout: torch.Tensor, block: int) -> torch.Tensor:
    """The layout's tiles of ``dense`` ``(batch, heads, rows, cols)`` as ``(batch, nnz, block, block)``."""
    heads, rows, cols = layout.shape
    batch = dense.shape[0]
    tiles = dense.reshape(batch, heads, rows, block, cols, block).permute(0, 1, 2, 4, 3, 5)
    h, i, j = (t.to(dense.device) for t in layout.nonzero(as_tuple=True))
    return tiles[:, h, i, j]


def sdd_reference(a: torch.Tensor, b: torch.Tensor, layout: torch.Tensor, block: int, trans_a: bool = False,
                  trans_b: bool = False) -> torch.Tensor:
    """``op(a) @ op(b)`` (dense) kept on the layout's tiles: ``(batch, nnz, block, block)``."""
    dtype = _compute_dtype(a.dtype)
    product = _op(a.to(dtype), trans_a) @ _op(b.to(dtype), trans_b)
    return from_dense(product, layout, block).to(a.dtype)


def dsd_reference(a: torch.Tensor, b: torch.Tensor, layout: torch.Tensor, block: int, trans_a: bool = False,
                  trans_b: bool = False) -> torch.Tensor:
    """``op(a) @ op(b)`` with ``a`` sparse on ``layout`` and ``b`` dense: a dense ``(batch, heads, M, N)``."""
    dtype = _compute_dtype(b.dtype)
    return (_op(to_dense(a.to(dtype), layout, block), trans_a) @ _op(b.to(dtype), trans_b)).to(b.dtype)


def dds_reference(a: torch.Tensor, b: torch.Tensor, layout: torch.Tensor, block: int, trans_a: bool = False,
                  trans_b: bool = False) -> torch.Tensor:
    """``op(a) @ op(b)`` with ``a`` dense and ``b`` sparse on ``layout``: a dense ``(batch, heads, M, N)``."""
    dtype = _compute_dtype(a.dtype)
    return (_op(a.to(dtype), trans_a) @ _op(to_dense(b.to(dtype), layout, block), trans_b)).to(a.dtype)


def _masked_scores(scores: torch.Tensor, element_mask: torch.Tensor, rpe: torch.Tensor | None,
                   key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None, key_padding_mask_mode: str,
                   attn_mask_mode: str, causal: bool) -> torch.Tensor:
    """``scores`` (``(batch, heads, M, N)``, already scaled) plus ``rpe`` and the masks, ``-inf`` where excluded
    (outside ``element_mask``, by a 'mul' mask, above the diagonal when ``causal``)."""
    dtype = scores.dtype
    if rpe is not None:
        scores = scores + rpe.to(dtype)
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]
        if key_padding_mask_mode == "mul":
            scores = scores.masked_fill(kpm == 0, float("-inf"))
        else:
            scores = scores + kpm.to(dtype)
    if attn_mask is not None:
        if attn_mask_mode == "mul":
            scores = scores.masked_fill(attn_mask == 0, float("-inf"))
        else:
            scores = scores + attn_mask.to(dtype)
    excluded = ~element_mask
    if causal:
        rows, cols = scores.shape[-2:]
        excluded = excluded | torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu(1)
    return scores.masked_fill(excluded, float("-inf"))


def _safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension where rows whose every entry is ``-inf`` give zeros (and zero gradients)."""
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    return torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)


def softmax_reference(x: torch.Tensor, layout: torch.Tensor, block: int, scale: float = 1.0,
                      rpe: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
                      attn_mask: torch.Tensor | None = None, key_padding_mask_mode: str = "add",
                      attn_mask_mode: str = "add", causal: bool = False) -> torch.Tensor:
    """The block-sparse softmax of ``x`` ``(batch, nnz, block, block)``: each query row normalised over its kept
    tiles only, after ``x * scale``, ``+ rpe`` (``(rows, cols)`` or ``(heads, rows, cols)``), the key-padding mask
    ``(batch, cols)`` and the attention mask (``(rows, cols)`` or ``(heads, rows, cols)``), each 'add' (added) or
    'mul' (``-inf`` where 0), and ``causal`` (key > query excluded). Rows with nothing left give zeros."""
    dtype = _compute_dtype(x.dtype)
    scores = to_dense(x.to(dtype), layout, block) * scale
    element_mask = layout_to_mask(layout, block).to(x.device)
    scores = _masked_scores(scores, element_mask, rpe, key_padding_mask, attn_mask, key_padding_mask_mode,
                            attn_mask_mode, causal)
    return from_dense(_safe_softmax(scores), layout, block).to(x.dtype)


def dense_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor, block: int,
                              scale: float = 1.0, rpe: torch.Tensor | None = None,
                              key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                              key_padding_mask_mode: str = "add", attn_mask_mode: str = "add",
                              causal: bool = False) -> torch.Tensor:
    """Dense attention restricted to ``layout``: ``softmax(q k^T * scale + masks, -inf outside the layout's
    element mask) @ v`` with ``q, k, v`` ``(batch, heads, seq, head_dim)``; fully excluded rows give zeros."""
    dtype = _compute_dtype(q.dtype)
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    element_mask = layout_to_mask(layout, block).to(q.device)
    scores = _masked_scores(scores, element_mask, rpe, key_padding_mask, attn_mask, key_padding_mask_mode,
                            attn_mask_mode, causal)
    return (_safe_softmax(scores) @ v.to(dtype)).to(q.dtype)
