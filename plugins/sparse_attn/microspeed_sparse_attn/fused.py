"""Fused block-sparse flash attention in Triton: the scores never leave the chip.

:func:`fused_block_sparse_attention` computes what :func:`~microspeed_sparse_attn.attention_reference.
dense_reference_attention` computes, in three kernels over the layout's index tables
(:func:`~microspeed_sparse_attn.attention_reference.layout_index`, built once per layout and cached):

* forward, one program per (batch * head, query block): walks the row's non-zero key blocks with an online
  softmax (running max, running sum, rescaled fp32 accumulator) and stores the output and each query's logsumexp;
* backward (flash-attention-2 split, deterministic, no atomics): ``delta = rowsum(dO * O)`` (a PyTorch
  reduction), then a dK/dV kernel, one program per (batch * head, key block), walking the key block's query blocks
  (the transposed table), and a dQ kernel, one program per (batch * head, query block). Both recompute the
  probabilities from the saved logsumexp.

Inputs may be float32, float16 or bfloat16 (products accumulate in fp32; float32 products use exact IEEE fp32,
not TF32), ``block`` 16, 32, 64 or 128, ``head_dim`` 16, 32, 64 or 128. The kernels need CUDA tensors, or CPU
tensors under the Triton interpreter (``TRITON_INTERPRET=1`` in the environment before this module is first
imported; see :data:`INTERPRETED`). The masks receive no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from microspeed_sparse_attn.attention_reference import LayoutIndex, check_attention_args, layout_index

__all__ = ["INTERPRETED", "SUPPORTED_HEAD_DIMS", "fused_block_sparse_attention"]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
"""The head sizes the kernels take (powers of two: a program loads a whole row of q, k or v)."""

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32 (exact fp32 products for fp32 inputs). ``UPCAST`` multiplies in fp32 (the
    interpreter's bf16 products are wrong; the operands are already rounded to their dtype, so the result is the
    same up to the accumulation order)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _scores(q, k, q_rows, k_rows, b, S, scale, kpm_ptr, am_ptr,
            HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """The masked fp32 scores of one (query block, key block) pair: ``q @ k^T * scale`` plus the masks."""
    s = _dot(q, tl.trans(k), UPCAST) * scale
    if HAS_KPM:
        s += tl.load(kpm_ptr + b * S + k_rows)[None, :]
    if HAS_AM:
        s += tl.load(am_ptr + q_rows[:, None] * S + k_rows[None, :])
    if CAUSAL:
        s = tl.where(k_rows[None, :] <= q_rows[:, None], s, float("-inf"))
    return s


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, kpm_ptr, am_ptr, row_ptr, col_idx,
                scale, H, NB, S,
                HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr):
    """One query block of one (batch, head): online softmax over the row's non-zero key blocks."""
    m_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    base = bh.to(tl.int64) * S * D
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    q_rows = (m_blk * BLOCK + offs).to(tl.int64)
    q = tl.load(q_ptr + base + q_rows[:, None] * D + offs_d[None, :])
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D], tl.float32)
    start = tl.load(row_ptr + h * NB + m_blk)
    end = tl.load(row_ptr + h * NB + m_blk + 1)
    for idx in range(start, end):
        n_blk = tl.load(col_idx + idx).to(tl.int64)
        k_rows = n_blk * BLOCK + offs
        k = tl.load(k_ptr + base + k_rows[:, None] * D + offs_d[None, :])
        v = tl.load(v_ptr + base + k_rows[:, None] * D + offs_d[None, :])
        s = _scores(q, k, q_rows, k_rows, b, S, scale, kpm_ptr, am_ptr, HAS_KPM, HAS_AM, CAUSAL, UPCAST)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet: exp(-inf - 0) = 0
        p = tl.exp(s - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    live = l_i > 0
    out = acc / tl.where(live, l_i, 1.0)[:, None]
    lse = tl.where(live, m_i + tl.log(tl.where(live, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + base + q_rows[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + bh.to(tl.int64) * S + q_rows, lse)


@triton.jit
def _probs(s, lse):
    """``exp(s - lse)`` per query row; 0 in rows with no key left (``lse = -inf``)."""
    return tl.exp(s - tl.where(lse == float("-inf"), float("inf"), lse)[:, None])


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, kpm_ptr, am_ptr, row_ptr, col_idx,
               scale, H, NB, S,
               HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr):
    """dQ of one query block of one (batch, head): ``sum_j dS_j K_j * scale`` over the row's key blocks."""
    m_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    base = bh.to(tl.int64) * S * D
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    q_rows = (m_blk * BLOCK + offs).to(tl.int64)
    q = tl.load(q_ptr + base + q_rows[:, None] * D + offs_d[None, :])
    do = tl.load(do_ptr + base + q_rows[:, None] * D + offs_d[None, :])
    lse = tl.load(lse_ptr + bh.to(tl.int64) * S + q_rows)
    delta = tl.load(delta_ptr + bh.to(tl.int64) * S + q_rows)
    dq = tl.zeros([BLOCK, D], tl.float32)
    start = tl.load(row_ptr + h * NB + m_blk)
    end = tl.load(row_ptr + h * NB + m_blk + 1)
    for idx in range(start, end):
        n_blk = tl.load(col_idx + idx).to(tl.int64)
        k_rows = n_blk * BLOCK + offs
        k = tl.load(k_ptr + base + k_rows[:, None] * D + offs_d[None, :])
        v = tl.load(v_ptr + base + k_rows[:, None] * D + offs_d[None, :])
        p = _probs(_scores(q, k, q_rows, k_rows, b, S, scale, kpm_ptr, am_ptr, HAS_KPM, HAS_AM, CAUSAL, UPCAST), lse)
        dp = _dot(do, tl.trans(v), UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST)
    tl.store(dq_ptr + base + q_rows[:, None] * D + offs_d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty))


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, kpm_ptr, am_ptr, col_ptr, row_idx,
                 scale, H, NB, S,
                 HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr, CAUSAL: tl.constexpr,
                 BLOCK: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr):
    """dK and dV of one key block of one (batch, head), over the query blocks that use it (transposed table)."""
    n_blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    base = bh.to(tl.int64) * S * D
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    k_rows = (n_blk * BLOCK + offs).to(tl.int64)
    k = tl.load(k_ptr + base + k_rows[:, None] * D + offs_d[None, :])
    v = tl.load(v_ptr + base + k_rows[:, None] * D + offs_d[None, :])
    dk = tl.zeros([BLOCK, D], tl.float32)
    dv = tl.zeros([BLOCK, D], tl.float32)
    start = tl.load(col_ptr + h * NB + n_blk)
    end = tl.load(col_ptr + h * NB + n_blk + 1)
    for idx in range(start, end):
        m_blk = tl.load(row_idx + idx).to(tl.int64)
        q_rows = m_blk * BLOCK + offs
        q = tl.load(q_ptr + base + q_rows[:, None] * D + offs_d[None, :])
        do = tl.load(do_ptr + base + q_rows[:, None] * D + offs_d[None, :])
        lse = tl.load(lse_ptr + bh.to(tl.int64) * S + q_rows)
        delta = tl.load(delta_ptr + bh.to(tl.int64) * S + q_rows)
        p = _probs(_scores(q, k, q_rows, k_rows, b, S, scale, kpm_ptr, am_ptr, HAS_KPM, HAS_AM, CAUSAL, UPCAST), lse)
        dv += _dot(tl.trans(p.to(do.dtype)), do, UPCAST)
        dp = _dot(do, tl.trans(v), UPCAST)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, UPCAST)
    tl.store(dk_ptr + base + k_rows[:, None] * D + offs_d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty))
    tl.store(dv_ptr + base + k_rows[:, None] * D + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty))


INTERPRETED = type(_fwd_kernel).__name__ == "InterpretedFunction"
"""Whether the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` when this module was imported)."""


def _upcast(dtype: torch.dtype) -> bool:
    """Whether the kernels multiply in fp32: bf16 under the interpreter, whose bf16 ``tl.dot`` is wrong."""
    return INTERPRETED and dtype == torch.bfloat16


def _launch_options(block: int, head_dim: int) -> dict[str, int]:
    """``num_warps``/``num_stages`` for a block size (untuned: 4 warps, 8 for 128-wide blocks; one stage for the
    largest tiles so they fit in shared memory)."""
    big = block * head_dim >= 128 * 64
    return {"num_warps": 8 if block >= 128 else 4, "num_stages": 1 if big else 2}


def _check_device(q: torch.Tensor) -> None:
    """Refuse tensors the kernels cannot run on."""
    if not q.is_cuda and not INTERPRETED:
        raise RuntimeError(f"fused_block_sparse_attention: the Triton kernels need CUDA tensors (got q on "
                           f"{q.device}); on CPU use cpu_block_sparse_attention, or set TRITON_INTERPRET=1 before "
                           "microspeed_sparse_attn.fused is first imported to run the kernels in the interpreter")


class _FusedBlockSparseAttention(torch.autograd.Function):
    """The autograd function behind :func:`fused_block_sparse_attention` (masks are constants)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kpm: torch.Tensor | None,
                am: torch.Tensor | None, index: LayoutIndex, block: int, scale: float, causal: bool) -> torch.Tensor:
        batch, heads, seq_len, head_dim = q.shape
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, seq_len, dtype=torch.float32, device=q.device)
        grid = (seq_len // block, batch * heads)
        _fwd_kernel[grid](q, k, v, out, lse, kpm if kpm is not None else q, am if am is not None else q,
                          index.row_ptr, index.col_idx, scale, heads, index.blocks, seq_len,
                          HAS_KPM=kpm is not None, HAS_AM=am is not None, CAUSAL=causal, BLOCK=block, D=head_dim,
                          UPCAST=_upcast(q.dtype), **_launch_options(block, head_dim))
        ctx.save_for_backward(q, k, v, out, lse, kpm, am)
        ctx.index, ctx.block, ctx.scale, ctx.causal = index, block, scale, causal
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, kpm, am = ctx.saved_tensors
        index, block = ctx.index, ctx.block
        batch, heads, seq_len, head_dim = q.shape
        d_out = grad_out.to(q.dtype).contiguous()
        delta = (d_out.float() * out.float()).sum(dim=-1).contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        grid = (seq_len // block, batch * heads)
        flags = {"HAS_KPM": kpm is not None, "HAS_AM": am is not None, "CAUSAL": ctx.causal, "BLOCK": block,
                 "D": head_dim, "UPCAST": _upcast(q.dtype), **_launch_options(block, head_dim)}
        kpm_arg = kpm if kpm is not None else q
        am_arg = am if am is not None else q
        _dkdv_kernel[grid](q, k, v, d_out, lse, delta, dk, dv, kpm_arg, am_arg, index.col_ptr, index.row_idx,
                           ctx.scale, heads, index.blocks, seq_len, **flags)
        _dq_kernel[grid](q, k, v, d_out, lse, delta, dq, kpm_arg, am_arg, index.row_ptr, index.col_idx,
                         ctx.scale, heads, index.blocks, seq_len, **flags)
        return dq, dk, dv, None, None, None, None, None, None


def fused_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor,
                                 block: int, scale: float | None = None, causal: bool = False,
                                 key_padding_mask: torch.Tensor | None = None,
                                 attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Block-sparse softmax attention in fused Triton kernels, differentiable in q, k and v.

    Args:
        q, k, v: ``(batch, heads, seq_len, head_dim)`` CUDA tensors (CPU ones under the Triton interpreter) of
            one dtype, float32, float16 or bfloat16; ``head_dim`` one of :data:`SUPPORTED_HEAD_DIMS`, ``seq_len`` a
            multiple of ``block``.
        layout: ``(heads, seq_len // block, seq_len // block)`` of 0/1: which key blocks each query block sees.
        block: the block size, one of 16, 32, 64, 128.
        scale: multiplies ``q @ k^T``; None means ``head_dim ** -0.5``.
        causal: also exclude keys past the query (inside the diagonal blocks too).
        key_padding_mask: additive float ``(batch, seq_len)`` (0 keeps a key, -inf drops it), or None.
        attn_mask: additive float ``(seq_len, seq_len)``, or None.

    Returns:
        ``(batch, heads, seq_len, head_dim)`` in q's dtype; 0 for queries with no key left.
    """
    _, heads, _, head_dim = check_attention_args(q, k, v, layout, block, key_padding_mask, attn_mask)
    if q.dtype not in _DTYPES:
        raise ValueError(f"q: the fused kernels take float32, float16 or bfloat16, got {q.dtype}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim: the fused kernels take head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}; pad "
                         "q, k and v with zeros up to the next supported size (and pass scale=original ** -0.5), "
                         "or use cpu_block_sparse_attention")
    _check_device(q)
    if scale is None:
        scale = head_dim ** -0.5
    index = layout_index(layout, causal=causal, device=q.device)
    kpm = None if key_padding_mask is None else key_padding_mask.detach().to(q.device, torch.float32).contiguous()
    am = None if attn_mask is None else attn_mask.detach().to(q.device, torch.float32).contiguous()
    return _FusedBlockSparseAttention.apply(q, k, v, kpm, am, index, block, float(scale), bool(causal))
