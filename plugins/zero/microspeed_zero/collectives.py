"""The collectives ZeRO runs, each chosen per backend for speed (measured in BENCHMARKS.md).

On gloo (CPU) the ring all-gather and reduce-scatter are slow: for 45M fp32 values on 2 ranks
here ``all_gather_into_tensor`` took 411 ms where sending each rank's slice straight to every
peer (``batch_isend_irecv``) took 124 ms (4 ranks: 682 vs 236 ms), and ``reduce_scatter_tensor``
took about twice an all-reduce. So on gloo a segment is gathered with point-to-point sends into
the flat buffer's slices, and reduced with ``all_to_all_single`` (each rank receives every rank's
copy of its own slice) followed by a local sum. Between the ranks of one host both go through shared memory
instead (:mod:`microspeed_zero.shm`), counted and told to the observers as the collective they implement
(``comm.observed``). NCCL keeps its native collectives.

With a :class:`~microspeed.plugin_api.GradientCompression` attached (the 1-bit optimizers),
:class:`CompressedPartitionedReduce` replaces the exact reduction of the steps the optimizer marks
compressible by an error-feedback 1-bit reduce-scatter (:func:`partitioned_reduce` picks it). The reducer
makes one per group its segments are split over: the data-parallel group, and each replica group of MoE
experts (whose segments' sender errors are named with the group's ranks, so a checkpoint restores them only
into the same group).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from microspeed.plugin_api import comm, replica_group
from microspeed_zero.shm import local_exchange


def backend_of(group: Any) -> str:
    """``"nccl"``, ``"gloo"``, ... for ``group`` (``"none"`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return "none"
    return str(dist.get_backend(group)).lower()


class Works:
    """Several pending works waited as one."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        """Wait for every work."""
        for w in self.works:
            w.wait()
        self.works = []


def gather_slices(flat: torch.Tensor, local: torch.Tensor, rank: int, world: int, group: Any, async_op: bool,
                  lo: int = 0, hi: int | None = None) -> Any:
    """Fill ``flat`` (``world`` equal slices) with every rank's ``local`` slice (elements ``lo:hi`` of each).

    ``local`` may be ``flat``'s own slice (in place). Returns a work with ``wait()`` (or ``None``).
    """
    size = local.numel()
    hi = size if hi is None else hi
    mine = flat[rank * size:(rank + 1) * size]
    if local.data_ptr() != mine.data_ptr():
        mine[lo:hi].copy_(local[lo:hi])
    if world == 1:
        return None
    if backend_of(group) != "gloo":
        if lo == 0 and hi == size:
            return comm.all_gather_into_tensor(flat, mine, group=group, async_op=async_op)
        outs = [flat[q * size + lo:q * size + hi] for q in range(world)]
        return comm.all_gather(outs, outs[rank], group=group, async_op=async_op)
    exchange = local_exchange(group, rank, world)
    if exchange is not None:  # the ranks of one host: through shared memory, counted and observed as the gather
        work = comm.observed("all_gather_into_tensor", mine[lo:hi], group, True, exchange.gather, flat, lo, hi)
        if not async_op:
            work.wait()
            return None
        return work
    ops = []
    for q in range(world):
        if q == rank:
            continue
        peer = dist.get_global_rank(group, q) if group is not None else q
        ops.append(dist.P2POp(dist.isend, mine[lo:hi], peer, group))
        ops.append(dist.P2POp(dist.irecv, flat[q * size + lo:q * size + hi], peer, group))
    comm.stats.record("all_gather_p2p", (hi - lo) * flat.element_size() * (world - 1))
    works = Works(dist.batch_isend_irecv(ops))
    if not async_op:
        works.wait()
        return None
    return works


class PartitionedReduce:
    """Sum a padded buffer over the group so that each rank gets its own slice (per-backend collective).

    ``start(wire, out)`` launches: gloo ``all_to_all_single`` into ``out`` (same size as ``wire``);
    NCCL ``reduce_scatter_tensor`` into ``out[:slice]``; or an all-reduce of ``wire`` in place.
    ``result(wire, out)`` then yields the rows to sum for this rank's slice.
    """

    def __init__(self, group: Any, world: int, rank: int, reduce_scatter: bool) -> None:
        self.group, self.world, self.rank = group, world, rank
        backend = backend_of(group)
        self.mode = "all_reduce" if not reduce_scatter or world == 1 else {
            "gloo": "all_to_all", "nccl": "reduce_scatter"}.get(backend, "all_reduce")

    @property
    def needs_out(self) -> bool:
        """Whether :meth:`start` needs an output buffer."""
        return self.mode != "all_reduce"

    @property
    def column_wise(self) -> bool:
        """Whether a wire of ``world`` rows may be reduced in column chunks (``world x c`` wires, each row chunk a
        piece of one rank's slice): true for gloo's ``all_to_all_single``, which moves each row to its rank."""
        return self.mode == "all_to_all"

    def out_numel(self, numel: int) -> int:
        """Elements of the output buffer :meth:`start` needs for a wire of ``numel`` elements."""
        return numel // self.world if self.mode == "reduce_scatter" else numel

    def start(self, wire: torch.Tensor, out: torch.Tensor | None, key: Any = None) -> Any:
        """Launch the reduction of ``wire`` asynchronously (``key``: which segment; unused here)."""
        if self.mode == "all_to_all":
            exchange = local_exchange(self.group, self.rank, self.world)
            if exchange is not None:  # the ranks of one host: through shared memory, counted and observed the same
                return comm.observed("all_to_all_single", wire, self.group, True, exchange.all_to_all, out, wire)
            return comm.all_to_all_single(out, wire, group=self.group, async_op=True)
        if self.mode == "reduce_scatter":
            return comm.reduce_scatter_tensor(out[:wire.numel() // self.world], wire, group=self.group,
                                              async_op=True)
        return comm.all_reduce(wire, group=self.group, async_op=True)

    def start_into(self, wire: torch.Tensor, target: torch.Tensor, post: float, accumulate: bool) -> Any:
        """Launch the reduction of ``wire`` summed straight into ``target`` (this rank's slice, ``target.numel()``
        columns of every row) where the transport can sum as it receives — the shared-memory exchange between the
        ranks of one host, no receive buffer — and return its work; ``None`` where it cannot (then :meth:`start`).
        ``accumulate``: ``target += row * post`` per rank's row, else ``target = sum(rows) * post``; either in rank
        order, as the reducer sums :meth:`rows`. Counted and observed as the ``all_to_all_single`` it replaces (the
        same bytes cross between the ranks)."""
        if self.mode != "all_to_all":
            return None
        exchange = local_exchange(self.group, self.rank, self.world)
        if exchange is None:
            return None
        return comm.observed("all_to_all_single", wire, self.group, True, exchange.reduce_scatter, wire, target, post,
                             accumulate)

    def rows(self, wire: torch.Tensor, out: torch.Tensor | None, shard: int) -> list[torch.Tensor]:
        """After the wait: tensors whose sum is this rank's reduced slice (of length ``shard``)."""
        if self.mode == "all_to_all":
            return list(out.view(self.world, -1)[:, :shard].unbind(0))
        if self.mode == "reduce_scatter":
            return [out[:shard]]
        start = self.rank * shard
        return [wire[start:min(start + shard, wire.numel())]]


class CompressedPartitionedReduce:
    """:class:`PartitionedReduce` whose exchange is 1-bit with error feedback on the steps the optimizer allows.

    ``compressed_next()`` (from :meth:`GradientCompression.attach`) is asked at every launch: false, the
    exact collective runs; true, each rank adds its *sender error* for the segment to the wire, cuts it
    into the ``world`` chunks of the partition and lays every parameter's piece of a chunk out from a
    block boundary (so that no scale mixes two parameters' magnitudes, as DeepSpeed's per-tensor
    scales), compresses the chunks to signs plus one fp32 scale per block (the capability's codec) and
    keeps what the code dropped as its new error; one ``all_to_all_single`` brings rank ``r`` every
    rank's code of chunk ``r``, which it decodes and sums. The receiver uses the sum at full precision
    (nothing is compressed again, so it keeps no error). Per call, ``sum_r decode_r = sum_r (x_r + e_r -
    e'_r)``: what one call drops is sent with the next, so the partition gradients summed over steps
    equal the exact ones up to the bounded error buffers. The errors (fp32, one whole padded gradient
    per segment on every rank) are kept across steps and micro-steps by the capability's provider
    (``error(key, numel, device)``), which checkpoints them per rank.
    """

    def __init__(self, exact: PartitionedReduce, compression: Any, compressed_next: Callable[[], bool]) -> None:
        self.exact, self.codec, self.compressed_next = exact, compression, compressed_next
        self.group, self.world, self.rank = exact.group, exact.world, exact.rank
        self.layouts: dict[Any, _Layout] = {}
        self.in_flight: dict[int, tuple[torch.Tensor, _Layout]] = {}
        self.last_wire_bytes = 0

    def compressing(self) -> bool:
        """Whether the reductions of this step are compressed (asked again at every launch)."""
        return self.world > 1 and bool(self.compressed_next())

    @property
    def needs_out(self) -> bool:
        """Whether :meth:`start` needs an output buffer (compressed: yes, the reducer then sums :meth:`rows`)."""
        return self.exact.needs_out or self.compressing()

    def out_numel(self, numel: int) -> int:
        """Elements of the output buffer of a wire of ``numel`` (the exact collective's; a compressed step has its
        own receive buffer)."""
        return self.exact.out_numel(numel)

    def start_into(self, wire: torch.Tensor, target: torch.Tensor, post: float, accumulate: bool) -> Any:
        """The exact collective's :meth:`PartitionedReduce.start_into` on a step that is not compressed; ``None``
        on one that is (its chunks are decoded and summed by :meth:`rows`)."""
        return None if self.compressing() else self.exact.start_into(wire, target, post, accumulate)

    def layout(self, segment: Any, numel: int) -> _Layout:
        """Where each value of a wire of ``numel`` values goes in the compressed chunks (built once per segment)."""
        key = getattr(segment, "index", segment)
        lay = self.layouts.get(key)
        if lay is None or lay.numel != numel:
            lay = self.layouts[key] = _Layout(segment, numel, self.world, self.rank, self.codec.block_size)
        return lay

    def start(self, wire: torch.Tensor, out: torch.Tensor | None, key: Any = None) -> Any:
        """Launch the reduction of ``wire`` (``world`` equal chunks); ``key`` is the segment (its error, its layout)."""
        if not self.compressing():
            return self.exact.start(wire, out)
        lay = self.layout(key, wire.numel())
        x = torch.zeros(self.world * lay.chunk, dtype=torch.float32, device=wire.device)
        x.index_copy_(0, lay.dst.to(wire.device), wire.reshape(-1)[lay.src.to(wire.device)].float())
        error = self.codec.error(_error_key(key), x.numel(), wire.device)
        bits, scales = self.codec.compress(x, error, lay.block)
        error.index_fill_(0, lay.pad.to(wire.device), 0.0)  # the padding carries no error
        if not bool(torch.isfinite(scales).all()):  # an fp16 overflow: the step is skipped, the error restarts
            error.zero_()
        nbits = lay.chunk // 8
        send = torch.empty(self.world, nbits + 4 * (lay.chunk // lay.block), dtype=torch.uint8, device=wire.device)
        send[:, :nbits].copy_(bits.view(self.world, nbits))
        send[:, nbits:].copy_(scales.view(self.world, -1).contiguous().view(torch.uint8))
        recv = torch.empty_like(send)
        before = comm.stats.total_wire_bytes()
        work = comm.all_to_all_single(recv, send, group=self.group, async_op=True)
        self.last_wire_bytes = comm.stats.total_wire_bytes() - before
        self.in_flight[wire.data_ptr()] = (recv, lay)
        return work

    def rows(self, wire: torch.Tensor, out: torch.Tensor | None, shard: int) -> list[torch.Tensor]:
        """After the wait: this rank's slice of the sum (one row: every rank's decoded chunk added up)."""
        ctx = self.in_flight.pop(wire.data_ptr(), None)
        if ctx is None:
            return self.exact.rows(wire, out, shard)
        recv, lay = ctx
        nbits = lay.chunk // 8
        total = torch.zeros(lay.chunk, dtype=torch.float32, device=recv.device)
        for q in range(self.world):
            scales = recv[q, nbits:].contiguous().view(torch.float32)
            self.codec.decompress(recv[q, :nbits].contiguous(), scales, lay.block, out=total, accumulate=True)
        mine = torch.zeros(shard, dtype=torch.float32, device=recv.device)
        mine.index_copy_(0, lay.mine_local.to(recv.device), total[lay.mine_pos.to(recv.device)])
        return [mine]


def _error_key(segment: Any) -> str:
    """The name of ``segment``'s sender error: ``zero.segment<index>``, plus ``@<ranks>`` for a segment of a replica
    group (MoE experts), so that a checkpoint restores it only into the same group."""
    name = f"zero.segment{getattr(segment, 'index', segment)}"
    params = getattr(segment, "params", None)
    rg = replica_group(params[0]) if params else None
    return name if rg is None else f"{name}@{','.join(map(str, rg.ranks))}"


class _Layout:
    """The compressed layout of one segment's wire: every parameter's piece of a chunk from a block boundary.

    ``src``/``dst``: wire positions and their places in the ``world`` rows of ``chunk`` values; ``pad``: the
    places no value lands in; ``mine_pos``/``mine_local``: this rank's row places and their positions in its
    slice. A ``segment`` without ``offsets``/``numels`` counts as one parameter.
    """

    def __init__(self, segment: Any, numel: int, world: int, rank: int, max_block: int) -> None:
        shard = numel // world
        if shard * world != numel:
            raise ValueError(f"compressed reduce-scatter: {numel} values do not split into {world} chunks")
        spans = list(zip(getattr(segment, "offsets", [0]), getattr(segment, "numels", [numel]), strict=True))
        rows = [[(max(o, q * shard), min(o + n, (q + 1) * shard)) for o, n in spans
                 if max(o, q * shard) < min(o + n, (q + 1) * shard)] for q in range(world)]
        # the block: a power of two no longer than the median piece (a chunk boundary may leave a few values of a
        # parameter as a piece of their own; they get a padded block rather than shrinking every block)
        pieces = sorted(hi - lo for row in rows for lo, hi in row) or [64]
        self.block = min(max_block, max(64, 1 << (pieces[len(pieces) // 2].bit_length() - 1)))
        blk = self.block
        lengths = [sum(-(-(hi - lo) // blk) * blk for lo, hi in row) for row in rows]
        self.chunk = max(max(lengths), blk)
        self.numel = numel
        src, dst = [], []
        for q, row in enumerate(rows):
            pos = q * self.chunk
            for lo, hi in row:
                src.append(torch.arange(lo, hi))
                dst.append(torch.arange(pos, pos + hi - lo))
                pos += -(-(hi - lo) // blk) * blk
        self.src = torch.cat(src) if src else torch.zeros(0, dtype=torch.long)
        self.dst = torch.cat(dst) if dst else torch.zeros(0, dtype=torch.long)
        used = torch.zeros(world * self.chunk, dtype=torch.bool)
        used[self.dst] = True
        self.pad = (~used).nonzero().view(-1)
        in_mine = (self.dst >= rank * self.chunk) & (self.dst < (rank + 1) * self.chunk)
        self.mine_pos = self.dst[in_mine] - rank * self.chunk
        self.mine_local = self.src[in_mine] - rank * shard


def partitioned_reduce(group: Any, world: int, rank: int, reduce_scatter: bool,
                       compression: tuple[Any, Callable[[], bool]] | None = None
                       ) -> PartitionedReduce | CompressedPartitionedReduce:
    """The reduction of one group: exact, or compressed on the steps ``compression`` allows.

    ``compression``: ``(GradientCompression, compressed_next)`` from the capability's ``attach``, or ``None``.
    """
    exact = PartitionedReduce(group, world, rank, reduce_scatter)
    if compression is None:
        return exact
    return CompressedPartitionedReduce(exact, *compression)
