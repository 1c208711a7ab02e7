"""Block-sparse attention in plain PyTorch, memory linear in ``seq_len``: the fast path on CPU (and a portable one).

:func:`cpu_block_sparse_attention` computes what :func:`~microspeed_sparse_attn.attention_reference.
dense_reference_attention` computes without the ``(seq_len, seq_len)`` score matrix, by batched matrix products
over gathered blocks. The query-block rows ``(batch, head, i)`` with at least one key block are sorted by their
number of key blocks and cut into chunks whose score buffer stays within ``chunk_bytes``. For a chunk of ``R`` rows
whose longest row has ``W`` blocks, each row's key and value blocks are gathered into ``(R, W * block, head_dim)``
tensors, so the scores, the softmax and the product with V are three batched kernels (``baddbmm``, ``softmax``,
``bmm``) on contiguous 3-D tensors. Shorter rows are padded in front with a repeated block whose scores the
``baddbmm`` bias sets to -inf (sorting keeps the padding small); the masks enter through the same bias. With
``causal`` the blocks above the diagonal are left out of the tables, so a row's diagonal block is its last one and
only that block gets a triangle of -inf.

The backward is hand-written (flash-attention style): the forward saves q, k, v, the output and each query's
logsumexp; the backward walks the same chunks, recomputes the probabilities ``P`` and forms ``dS = P * (dO V^T -
rowsum(dO * O))``, writes ``dQ = dS K * scale`` once per row and accumulates the key blocks' ``dK = dS^T Q *
scale`` and ``dV = P^T dO`` with ``index_put_(..., accumulate=True)`` (serial on the CPU, in chunk order: the
result is deterministic). That is five batched products per chunk, the fewest the backward allows without storing
``P`` (which would make the memory quadratic again).

All score-sized temporaries live in buffers allocated once per call and reused by every chunk (allocating and
first touching fresh memory per chunk costs about as much as a pass over it). Arithmetic is float32 (float64 for
float64 inputs): fp16/bf16 inputs are converted once and the results converted back. The masks receive no gradient.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from microspeed_sparse_attn.attention_reference import LayoutIndex, check_attention_args, layout_index

__all__ = ["DEFAULT_CHUNK_BYTES", "cpu_block_sparse_attention"]

DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
"""The default budget of one chunk's score buffer. The backward holds two score buffers and two gathered-block
buffers (``head_dim / block`` times the size of a score buffer), plus small ones; 2 MiB keeps the peak memory at
that of PyTorch's dense causal ``scaled_dot_product_attention`` while costing little speed against larger chunks."""

_NEG_INF = float("-inf")

_ROW_SHARE = 8
"""A chunk holds at most ``budget / _ROW_SHARE`` rows, so its query-side buffers (``R * block * head_dim``) stay an
eighth of the score buffer however short the rows are."""


@dataclass(frozen=True)
class _Chunk:
    """One chunk of ``R`` query-block rows padded (in front) to ``W`` key blocks each.

    ``*_flat`` block numbers index a tensor viewed as ``(batch * heads * blocks, block, ...)``.
    """

    own_flat: torch.Tensor  # (R,) int64: the row's query block
    batch: torch.Tensor  # (R,) int64: the row's batch index
    own: torch.Tensor  # (R,) int64: the row's query block number i within its sequence
    other: torch.Tensor  # (R, W) int64: the key blocks j, ascending (padding repeats the first real one)
    other_flat: torch.Tensor  # (R * W,) int64: the key blocks, flattened
    pad: torch.Tensor | None  # (R, W) bool: True on padding; None when no row is padded
    diag: torch.Tensor | None  # (R,) bool: the row holds its diagonal block (causal only; None: no row does)
    all_diag: bool  # every row holds its diagonal block


def _largest_fit(counts: list[int], start: int, budget: int) -> int:
    """The most rows from ``start`` (at least one, at most ``budget // _ROW_SHARE``) whose padded size ``rows *
    counts[last]`` fits ``budget``; ``counts`` is non-decreasing, so the padded size grows with the number of rows.
    """
    lo, hi = 1, max(1, min(len(counts) - start, budget // _ROW_SHARE))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * counts[start + mid - 1] <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class _Plan:
    """The chunks of one layout for one batch size, split into parts that touch disjoint ``(batch, head)`` pairs
    (one part per worker thread), and the rows no chunk holds (no key block: output 0)."""

    parts: list[list[_Chunk]]
    empty_flat: torch.Tensor  # (n,) int64: the query blocks with no key block

    @property
    def chunks(self) -> list[_Chunk]:
        """Every chunk, part after part."""
        return [ch for part in self.parts for ch in part]


def _split_pairs(work: list[int], parts: int) -> list[list[int]]:
    """Deal the ``(batch, head)`` pairs (their work given) into at most ``parts`` groups of about equal work:
    heaviest first, each to the lightest group so far; pairs with no work are left out."""
    loads = [0] * parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    for pair in sorted(range(len(work)), key=lambda i: -work[i]):
        if work[pair] == 0:
            continue
        lightest = loads.index(min(loads))
        groups[lightest].append(pair)
        loads[lightest] += work[pair]
    return [sorted(g) for g in groups if g]


def _plan(index: LayoutIndex, batch: int, block: int, chunk_bytes: int, elem_size: int, workers: int) -> _Plan:
    """The row chunks for ``batch`` sequences under ``index``, scores of ``elem_size`` bytes, at most
    ``chunk_bytes`` of scores each, in up to ``workers`` parts (cached on the index).

    Within a part, rows are taken shortest first, so a chunk's rows have about the same length and little
    padding. Padding goes in front: with causal tables (key blocks ``j <= i`` only) every row's diagonal block is
    then its last.
    """
    key = ("cpu_chunks", batch, block, chunk_bytes, elem_size, workers)
    cached = index.plans.get(key)
    if cached is not None:
        return cached
    heads, blocks = index.heads, index.blocks
    device = index.counts.device
    budget = max(1, chunk_bytes // (block * block * elem_size))
    ptr, idx = index.row_ptr.to("cpu", torch.int64), index.col_idx.to("cpu", torch.int64)
    has_diag = (index.diag_pos.to("cpu") >= 0) if index.causal else None
    counts = ptr[1:] - ptr[:-1]
    empty = (counts == 0).nonzero().view(-1)  # head rows h * blocks + i
    empty_flat = ((torch.arange(batch)[:, None] * heads + empty // blocks) * blocks + empty % blocks).view(-1)
    per_head = counts.view(heads, blocks).sum(dim=1).tolist()
    parts: list[list[_Chunk]] = []
    for pairs in _split_pairs([per_head[pair % heads] for pair in range(batch * heads)], workers):
        pair = torch.tensor(pairs)
        lines = ((pair % heads)[:, None] * blocks + torch.arange(blocks)).view(-1)  # head rows h * blocks + i
        batches = (pair // heads)[:, None].expand(-1, blocks).reshape(-1)
        keep = counts[lines] > 0
        lines, batches = lines[keep], batches[keep]
        order = torch.argsort(counts[lines], stable=True)
        lines, batches = lines[order], batches[order]
        per_row = counts[lines].tolist()
        chunks: list[_Chunk] = []
        start = 0
        while start < len(per_row):
            rows = _largest_fit(per_row, start, budget)
            line, b = lines[start:start + rows], batches[start:start + rows]
            head, own = line // blocks, line % blocks
            base = (b * heads + head) * blocks
            width = per_row[start + rows - 1]
            n = counts[line][:, None]
            pos = torch.arange(width)[None, :] - (width - n)
            pad = pos < 0
            other = idx[ptr[line][:, None] + pos.clamp(min=0)]
            diag = None if has_diag is None else has_diag[line]
            if diag is not None and not bool(diag.any()):
                diag = None
            chunks.append(_Chunk(own_flat=(base + own).to(device), batch=b.to(device), own=own.to(device),
                                 other=other.to(device), other_flat=(base[:, None] + other).view(-1).to(device),
                                 pad=pad.to(device) if bool(pad.any()) else None,
                                 diag=None if diag is None else diag.to(device),
                                 all_diag=diag is not None and bool(diag.all())))
            start += rows
        parts.append(chunks)
    plan = _Plan(parts=parts, empty_flat=empty_flat.to(device))
    index.plans[key] = plan
    return plan


def _run_parts(work: Callable[[list[_Chunk]], None], parts: list[list[_Chunk]]) -> None:
    """``work(part)`` for every part: in this thread if there is one part, else one thread per part, each
    running its torch ops single-threaded.

    Many small parallel regions (a dozen per chunk) scale badly: every region ends in a barrier, and on a busy
    machine a barrier waits for a descheduled OpenMP thread while the others spin. Parts touch disjoint
    ``(batch, head)`` pairs, so the threads write disjoint rows of every output and need no synchronisation;
    each pair is walked by one thread in a fixed order, so the result does not depend on the timing.
    ``torch.set_num_threads(1)`` in a worker sets that thread's OpenMP and MKL thread counts; the process-wide
    default it also sets is put back when the workers are done.
    """
    if len(parts) <= 1:
        with torch.no_grad():
            for part in parts:
                work(part)
        return
    restore = torch.get_num_threads()
    errors: list[BaseException] = []

    def run(part: list[_Chunk]) -> None:
        try:
            torch.get_num_threads()  # initialise this thread's count first, or the first op would reset it
            torch.set_num_threads(1)
            with torch.no_grad():  # grad mode is per thread; a new one starts enabled
                work(part)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(part,), name="microspeed-sparse-attn") for part in parts]
    try:
        for t in threads:
            t.start()
    finally:
        for t in threads:
            if t.is_alive() or t.ident is not None:
                t.join()
        torch.set_num_threads(restore)
    if errors:
        raise errors[0]


@dataclass(frozen=True)
class _Operands:
    """One call's tensors in the shapes the chunks index (contiguous, in the working dtype)."""

    qb: torch.Tensor  # (batch * heads * blocks, block, head_dim): q
    kb: torch.Tensor  # the same view of k
    vb: torch.Tensor  # the same view of v
    kpm: torch.Tensor | None  # (batch * blocks, block): key_padding_mask
    am: torch.Tensor | None  # (blocks, block, blocks, block): attn_mask
    upper: torch.Tensor | None  # (block, block) bool: the strict upper triangle (causal only)
    blocks: int
    block: int
    scale: float

    def queries(self, ch: _Chunk, out: torch.Tensor) -> torch.Tensor:
        """The chunk's scaled queries ``(R, block, head_dim)`` into ``out`` (scaling a chunk beats scaling q)."""
        return torch.index_select(self.qb, 0, ch.own_flat, out=out).mul_(self.scale)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the arithmetic runs in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kpm: torch.Tensor | None,
              am: torch.Tensor | None, block: int, scale: float, causal: bool) -> _Operands:
    """Reshape (and convert to the working dtype) one call's inputs for the chunk loops."""
    batch, heads, seq_len, head_dim = q.shape
    blocks = seq_len // block
    work = _work_dtype(q.dtype)

    def blocked(t: torch.Tensor) -> torch.Tensor:
        return t.to(work).contiguous().view(batch * heads * blocks, block, head_dim)

    upper = None
    if causal:
        upper = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)
    return _Operands(
        qb=blocked(q), kb=blocked(k), vb=blocked(v),
        kpm=None if kpm is None else kpm.to(work).contiguous().view(batch * blocks, block),
        am=None if am is None else am.to(work).contiguous().view(blocks, block, blocks, block),
        upper=upper, blocks=blocks, block=block, scale=scale)


class _Workspace:
    """Reused buffers for the chunk loops: allocating (and first touching) fresh memory for every chunk costs about
    as much as a pass over it, so every chunk-sized temporary lives in one of these, sized for the largest chunk.
    A name's first letter gives the size: ``s`` scores (``R * block * W * block``), ``b`` gathered blocks (``R * W *
    block * head_dim``), ``r`` the rows' own blocks (``R * block * head_dim``)."""

    def __init__(self, chunks: list[_Chunk], block: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 names: tuple[str, ...]) -> None:
        most = max((ch.other.numel() for ch in chunks), default=0)
        rows = max((ch.other.shape[0] for ch in chunks), default=0)
        size = {"s": most * block * block, "b": most * block * head_dim, "r": rows * block * head_dim}
        self._buffers = {name: torch.empty(size[name[0]], dtype=dtype, device=device) for name in names}

    def whole(self, name: str) -> torch.Tensor:
        """Buffer ``name``, flat."""
        return self._buffers[name]

    def take(self, name: str, *shape: int) -> torch.Tensor:
        """Buffer ``name`` viewed as ``shape`` (its contents are garbage)."""
        n = 1
        for size in shape:
            n *= size
        return self._buffers[name][:n].view(shape)


def _gather(t: torch.Tensor, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The blocks ``flat`` of ``t`` (``(n, block, head_dim)``) into ``out`` (``(lines, width * block, head_dim)``)."""
    torch.index_select(t, 0, flat, out=out.view(flat.shape[0], t.shape[1], t.shape[2]))
    return out


def _mask_diagonal(s: torch.Tensor, ch: _Chunk, triangle: torch.Tensor, block: int) -> None:
    """Set ``triangle`` of each row's diagonal block (its last, causal tables being right-aligned) to -inf."""
    lines, width = ch.other.shape
    diag = s.view(lines, block, width, block)[:, :, width - 1, :]  # (R, block, block): a strided view
    mask = triangle if ch.all_diag else triangle & ch.diag[:, None, None]
    diag.masked_fill_(mask, _NEG_INF)


def _row_scores(ch: _Chunk, ops: _Operands, qc: torch.Tensor, kg: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A row chunk's masked scores ``(R, block, W * block)`` (into ``out``) from its scaled queries ``qc`` and
    gathered keys ``kg``."""
    rows, width = ch.other.shape
    block = ops.block
    bias = None
    if ops.kpm is not None or ch.pad is not None:
        if ops.kpm is not None:
            col_bias = ops.kpm.index_select(0, (ch.batch[:, None] * ops.blocks + ch.other).view(-1))
            col_bias = col_bias.view(rows, width, block)
        else:
            col_bias = torch.zeros(rows, width, block, dtype=qc.dtype, device=qc.device)
        if ch.pad is not None:
            col_bias.masked_fill_(ch.pad[:, :, None], _NEG_INF)
        bias = col_bias.view(rows, 1, width * block)
    if ops.am is not None:
        tile = ops.am[ch.own[:, None], :, ch.other, :]  # (R, W, block_q, block_k)
        tile = tile.permute(0, 2, 1, 3).reshape(rows, block, width * block)
        bias = tile if bias is None else tile.add_(bias)
    if bias is None:
        s = torch.bmm(qc, kg.transpose(1, 2), out=out)
    else:
        s = torch.baddbmm(bias, qc, kg.transpose(1, 2), out=out)
    if ops.upper is not None and ch.diag is not None:
        _mask_diagonal(s, ch, ops.upper, block)
    return s


def _forward(plan: _Plan, ops: _Operands, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (working dtype, ``shape``) and each query's logsumexp (``shape[:-1]``; -inf where no key is
    left)."""
    block, head_dim = ops.block, shape[-1]
    dtype, device = ops.qb.dtype, ops.qb.device
    out, lse = torch.empty(shape, dtype=dtype, device=device), torch.empty(shape[:-1], dtype=dtype, device=device)
    out_b, lse_b = out.view(ops.qb.shape), lse.view(ops.qb.shape[:2])
    out_b.index_fill_(0, plan.empty_flat, 0.0)
    lse_b.index_fill_(0, plan.empty_flat, _NEG_INF)

    def work(chunks: list[_Chunk]) -> None:
        ws = _Workspace(chunks, block, head_dim, dtype, device, ("s", "b_kv", "r_q"))
        for ch in chunks:
            rows, width = ch.other.shape
            keys = width * block
            qc = ops.queries(ch, ws.take("r_q", rows, block, head_dim))
            kg = _gather(ops.kb, ch.other_flat, ws.take("b_kv", rows, keys, head_dim))
            s = _row_scores(ch, ops, qc, kg, ws.take("s", rows, block, keys))
            row_max = s.amax(dim=-1)
            p = torch.softmax(s, dim=-1, out=s)  # in place: the kernel reads a row before writing it
            # P at the row's maximum is exp(max - lse), so lse = max - log(max P): no exp pass of our own.
            chunk_lse = row_max - p.amax(dim=-1).log()
            dead = row_max == _NEG_INF
            if bool(dead.any()):
                p.masked_fill_(dead[:, :, None], 0.0)
                chunk_lse.masked_fill_(dead, _NEG_INF)
            vg = _gather(ops.vb, ch.other_flat, ws.take("b_kv", rows, keys, head_dim))
            out_b.index_copy_(0, ch.own_flat, torch.bmm(p, vg, out=qc))
            lse_b.index_copy_(0, ch.own_flat, chunk_lse)

    _run_parts(work, plan.parts)
    return out, lse


def _row_dots(a: torch.Tensor, b: torch.Tensor, step: int) -> torch.Tensor:
    """``(a * b).sum(-1)`` for ``(n, block, head_dim)`` tensors, ``step`` blocks at a time (no temporary the size
    of ``a``)."""
    n, block, head_dim = a.shape
    step = max(1, step)
    out = torch.empty(a.shape[:2], dtype=a.dtype, device=a.device)
    buffer = torch.empty(min(n, step) * block * head_dim, dtype=a.dtype, device=a.device)
    for start in range(0, n, step):
        stop = min(n, start + step)
        prod = torch.mul(a[start:stop], b[start:stop], out=buffer[:(stop - start) * block * head_dim].view(
            stop - start, block, head_dim))
        torch.sum(prod, dim=-1, out=out[start:stop])
    return out


def _backward(plan: _Plan, ops: _Operands, d_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              chunk_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the working dtype, shaped like q: one pass over the row chunks; dQ is written once per
    row, the key blocks' dK/dV contributions are accumulated with ``index_put_`` (serial on the CPU, in chunk
    order: deterministic)."""
    block, head_dim = ops.block, out.shape[-1]
    blocked = ops.qb.shape
    dq = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    dk, dv = (torch.zeros(out.shape, dtype=out.dtype, device=out.device) for _ in range(2))
    do_b, lse_b = d_out.view(blocked), lse.view(blocked[:2])
    dq_b, dk_b, dv_b = dq.view(blocked), dk.view(blocked), dv.view(blocked)
    dq_b.index_fill_(0, plan.empty_flat, 0.0)
    # rowsum(dO * O) = sum_j P_ij dP_ij, a chunk's worth of blocks at a time
    delta_b = _row_dots(do_b, out.view(blocked), chunk_bytes // (block * head_dim * out.element_size()))

    def work(chunks: list[_Chunk]) -> None:
        ws = _Workspace(chunks, block, head_dim, out.dtype, out.device, ("s", "s_dp", "b_k", "b_v", "r_q", "r_do"))
        for ch in chunks:
            rows, width = ch.other.shape
            keys = width * block
            qc = ops.queries(ch, ws.take("r_q", rows, block, head_dim))
            kg = _gather(ops.kb, ch.other_flat, ws.take("b_k", rows, keys, head_dim))
            vg = _gather(ops.vb, ch.other_flat, ws.take("b_v", rows, keys, head_dim))
            s = _row_scores(ch, ops, qc, kg, ws.take("s", rows, block, keys))
            p = torch.softmax(s, dim=-1, out=s)
            dead = lse_b.index_select(0, ch.own_flat) == _NEG_INF
            if bool(dead.any()):
                p.masked_fill_(dead[:, :, None], 0.0)
            do_c = torch.index_select(do_b, 0, ch.own_flat, out=ws.take("r_do", rows, block, head_dim))
            dp = torch.bmm(do_c, vg.transpose(1, 2), out=ws.take("s_dp", rows, block, keys))
            dv_c = torch.bmm(p.transpose(1, 2), do_c, out=vg)
            dv_b.index_put_((ch.other_flat,), dv_c.view(rows * width, block, head_dim), accumulate=True)
            ds = dp.sub_(delta_b.index_select(0, ch.own_flat)[:, :, None]).mul_(p)  # the scaled scores' gradient
            dq_b.index_copy_(0, ch.own_flat, torch.bmm(ds, kg, out=do_c).mul_(ops.scale))
            dk_c = torch.bmm(ds.transpose(1, 2), qc, out=kg)  # qc carries the scale
            dk_b.index_put_((ch.other_flat,), dk_c.view(rows * width, block, head_dim), accumulate=True)

    _run_parts(work, plan.parts)
    return dq, dk, dv


class _CpuBlockSparseAttention(torch.autograd.Function):
    """The autograd function behind :func:`cpu_block_sparse_attention` (masks are constants)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kpm: torch.Tensor | None,
                am: torch.Tensor | None, plan: _Plan, block: int, scale: float, causal: bool, chunk_bytes: int
                ) -> torch.Tensor:
        ops = _operands(q, k, v, kpm, am, block, scale, causal)
        out, lse = _forward(plan, ops, q.shape)
        ctx.save_for_backward(q, k, v, out, lse, kpm, am)
        ctx.plan, ctx.block, ctx.scale, ctx.causal, ctx.chunk_bytes = plan, block, scale, causal, chunk_bytes
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, kpm, am = ctx.saved_tensors
        ops = _operands(q, k, v, kpm, am, ctx.block, ctx.scale, ctx.causal)
        dq, dk, dv = _backward(ctx.plan, ops, grad_out.to(out.dtype).contiguous(), out, lse, ctx.chunk_bytes)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def cpu_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor, block: int,
                               scale: float | None = None, causal: bool = False,
                               key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                               *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """Block-sparse softmax attention, memory linear in ``seq_len``, differentiable in q, k and v.

    Args:
        q, k, v: ``(batch, heads, seq_len, head_dim)``, one floating dtype and device (any device works; this is
            the path meant for CPU). ``seq_len`` must be a multiple of ``block``.
        layout: ``(heads, seq_len // block, seq_len // block)`` of 0/1: which key blocks each query block sees.
        block: the block size, one of 16, 32, 64, 128.
        scale: multiplies ``q @ k^T``; None means ``head_dim ** -0.5``.
        causal: also exclude keys past the query (inside the diagonal blocks too).
        key_padding_mask: additive float ``(batch, seq_len)`` (0 keeps a key, -inf drops it), or None.
        attn_mask: additive float ``(seq_len, seq_len)``, or None.
        chunk_bytes: the budget of one chunk's score buffer (float32, float64 for float64 inputs); smaller saves
            memory, larger saves per-chunk overhead. A chunk holds at least one query-block row whatever the
            budget.

    Returns:
        ``(batch, heads, seq_len, head_dim)`` in q's dtype; 0 for queries with no key left.
    """
    _, heads, _, head_dim = check_attention_args(q, k, v, layout, block, key_padding_mask, attn_mask)
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes: expected a positive int (bytes of one chunk's scores), got {chunk_bytes!r}")
    if scale is None:
        scale = head_dim ** -0.5
    index = layout_index(layout, causal=causal, device=q.device)
    workers = min(torch.get_num_threads(), q.shape[0] * heads) if q.device.type == "cpu" else 1
    plan = _plan(index, q.shape[0], block, chunk_bytes, _work_dtype(q.dtype).itemsize, workers)
    kpm = None if key_padding_mask is None else key_padding_mask.detach()
    am = None if attn_mask is None else attn_mask.detach()
    return _CpuBlockSparseAttention.apply(q, k, v, kpm, am, plan, block, float(scale), bool(causal), chunk_bytes)
