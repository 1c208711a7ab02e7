"""Gradient reduction for ZeRO: every rank ends up with the average of its own slice.

* **Stage 1** accumulates whole gradients in one flat buffer per segment (the parameters'
  ``.grad`` are views of it, so autograd accumulates in place) and reduces each segment once,
  at the accumulation boundary, launched from autograd hooks as soon as backward has produced
  its last gradient (overlapped with the rest of backward); only the rank's slice of the buffer
  is reduced (the rest keeps local sums).
* **Stages 2 and 3** reduce every micro-step: when a segment's gradients are all there, they are
  copied into a staging bucket, the parameters' ``.grad`` freed, and the bucket reduced
  asynchronously; the rank's slice of the result is added to its gradient partition. At most
  two buckets are in flight, so gradient memory stays a partition plus two buckets. With the optimizer on
  NVMe the partition itself is not in memory: the slice is read back (from the second micro-step of a
  window on, launched with the reduction), added to and written to the files
  (:class:`~microspeed_zero.grad_swap.GradientSwapper`). When a schedule
  runs several chunks (an interleaved pipeline), the end of a chunk's backward reduces that chunk's
  segments only (the runtime cuts segments within one chunk). On one rank the gradients are added
  straight into the partition (nothing to exchange, no staging).
* **A segment larger than** ``reduce_bucket_size`` or :data:`~microspeed_zero.chunking.CHUNK_NUMEL` (one
  parameter larger than the bucket, such as a token embedding, or a stage-3 module) is reduced, at stages 2
  and 3, in column chunks where the collective allows it (gloo's ``all_to_all_single``): chunk ``k`` carries elements
  ``[a, b)`` of every rank's slice, copied straight from the gradients into a buffer of
  ``world * (b - a)`` values, at most the smaller of the two, so the buffers never hold a whole
  embedding's gradient twice. The first chunk starts at once, one more at each following gradient
  hook (backward computes meanwhile; one per hook whatever has completed, so every rank issues its
  collectives in the same order), all before the next segment's. The sums are the same, element by
  element and in the same order, as reducing the segment whole.

The collective is chosen per backend (``reduce_scatter: true``,
:class:`microspeed_zero.collectives.PartitionedReduce`): gloo ``all_to_all_single`` plus a local
sum, NCCL ``reduce_scatter_tensor``; ``reduce_scatter: false`` all-reduces the whole bucket. Between the ranks of
one host the gloo exchange goes through shared memory, which sums each round into the rank's slice as it receives
it (:meth:`~microspeed_zero.collectives.PartitionedReduce.start_into`): no receive buffer, the same sums.
Staging and receive buffers come from a small pool (:class:`BufferPool`), allocated once (fresh large
allocations cost page faults every step on CPU) and no more of them than were ever in use at once.
Scaling follows DeepSpeed's ``prescale_gradients`` / ``gradient_predivide_factor``.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import Any

import torch

from microspeed_zero.chunking import MAX_IN_FLIGHT, chunk_cap, column_width
from microspeed_zero.collectives import PartitionedReduce, partitioned_reduce
from microspeed_zero.partition import Segment

SUMMED = "summed"
"""A pending reduction's marker (in place of its columns) when the transport summed it into the slice itself
(:meth:`~microspeed_zero.collectives.PartitionedReduce.start_into`): nothing is left to add at its wait."""


class Scaling:
    """DeepSpeed's gradient averaging: pre-divide before the sum, the rest after."""

    def __init__(self, world: int, prescale: bool, predivide: float) -> None:
        self.pre = 1.0 / world if prescale else 1.0 / predivide
        self.post = 1.0 if prescale else predivide / world


class BufferPool:
    """Reusable flat buffers by (dtype, device), handed out as views of the smallest free one that fits.

    A request that no free buffer fits allocates one of exactly its size and drops the smallest free
    buffer, so the pool never keeps more buffers than were in use at once, each as large as the largest
    request it served (buffers keyed by exact size kept one set per distinct segment size: on the
    45M-parameter GPT at stage 2 on 4 ranks that was 232 MB, against about 72 MB this way).
    """

    def __init__(self) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def get(self, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``size`` elements (contents undefined)."""
        free = self.free.setdefault((dtype, str(device)), [])
        fits = [i for i, b in enumerate(free) if b.numel() >= size]
        if fits:
            return free.pop(min(fits, key=lambda i: free[i].numel()))[:size]
        if free:  # replaced by a larger one: the pool does not grow in count
            free.pop(min(range(len(free)), key=lambda i: free[i].numel()))
        return torch.empty(size, dtype=dtype, device=device)

    def put(self, buf: torch.Tensor | None) -> None:
        """Give ``buf`` (from :meth:`get`) back for reuse."""
        if buf is not None:
            base = buf._base if buf._base is not None else buf
            self.free.setdefault((base.dtype, str(base.device)), []).append(base)


class GradientReducer:
    """Reduces segment gradients into each rank's partition; see the module docstring."""

    def __init__(self, segments: list[Segment], stage: int, scaling: Scaling,
                 accumulators: dict[int, torch.Tensor], wire_dtype: torch.dtype | None, reduce_scatter: bool,
                 contiguous: bool, compression: Any = None, bucket_numel: int | None = None) -> None:
        self.segments, self.stage, self.scaling = segments, stage, scaling
        self.bucket_numel = chunk_cap(bucket_numel)  # a larger segment goes in column chunks (where it can)
        self.acc = accumulators  # segment index -> stage 1: whole flat gradient; stage 2/3: this rank's slice
        self.wire_dtype = wire_dtype
        self.contiguous = contiguous
        # one collective per group the segments are split over (the data-parallel group, replica groups)
        self.collectives: dict[int, PartitionedReduce] = {}
        for seg in segments:
            if id(seg.group) not in self.collectives:
                self.collectives[id(seg.group)] = partitioned_reduce(seg.group, seg.world, seg.rank, reduce_scatter,
                                                                     compression)  # 1-bit: GradientCompression
        self.pool = BufferPool()
        self.ready: dict[int, int] = {}
        self.launched: set[int] = set()
        self.deferred: set[int] = set()
        """Segments launched only by :meth:`flush`, in index order: those of ZeRO-3 leaf modules, whose parameters
        get gradients in a data-dependent order (experts some ranks did not run), so the ranks agree on the order."""
        self.pending: deque[tuple[Segment, tuple, Any]] = deque()
        self.on_reduced: Any = None  # stage 3: release a segment's parameters once its gradients are staged
        self.gradients: Any = None  # optimizer on NVMe: the GradientSwapper holding the partitions in files
        self.by_param: dict[int, Segment] = {id(p): s for s in segments for p in s.params}
        self.held_slices: dict[int, torch.Tensor] = {}  # NVMe: a column-chunked segment's slice, acquired once
        self.queued: deque[Any] = deque()  # column chunks of the segment being launched, one per gradient hook

    # -- autograd hook entry -----------------------------------------------------------------

    def grad_ready(self, param: torch.Tensor) -> None:
        """A parameter's gradient for this backward is complete; launch its segment when all are."""
        if self.queued:
            self._pump()
        seg = self.by_param.get(id(param))
        if seg is None or seg.index in self.launched or seg.index in self.deferred:
            return
        n = self.ready.get(seg.index, 0) + 1
        self.ready[seg.index] = n
        if n == seg.trainable:
            self.launch(seg)

    def launch(self, seg: Segment) -> None:
        """Start reducing ``seg`` (gradients of parameters that have none count as zeros)."""
        self.launched.add(seg.index)
        if self._adds_directly(seg):
            self._add_directly(seg)
            return
        self._drain_queue()  # the chunks of an earlier segment first (bounds the gradients held unreduced)
        width = self._column_width(seg)
        if width:
            self._queue_columns(seg, width)
            self._pump()  # its first chunk now, the rest at the next gradient hooks
            return
        self._wait_below(MAX_IN_FLIGHT)
        pooled = None
        if self.stage == 1:
            wire = self.acc[seg.index]
            if self.wire_dtype is not None and wire.dtype != self.wire_dtype:
                pooled = self.pool.get(wire.numel(), self.wire_dtype, wire.device)
                wire = pooled.copy_(wire)
        else:
            wire, pooled = self._stage(seg)
            if self.on_reduced is not None:  # the reduction reads the staged gradients, not the parameters
                self.on_reduced(seg)
            if self.gradients is not None and self.gradients.holds(seg.index):
                self.gradients.prefetch(seg.index)  # read back what this window holds, behind the collective
        if self.scaling.pre != 1.0:
            wire.mul_(self.scaling.pre)
        collective = self.collectives[id(seg.group)]
        target = self._sum_target(seg)
        work = (collective.start_into(wire, target, self.scaling.post, self.stage >= 2) if target is not None
                else None)
        if work is not None:  # the transport sums into the slice as it receives: no receive buffer
            self.pending.append((seg, (wire, None, pooled), work, SUMMED))
            return
        out = (self.pool.get(collective.out_numel(wire.numel()), wire.dtype, wire.device) if collective.needs_out
               else None)
        work = collective.start(wire, out, seg)
        self.pending.append((seg, (wire, out, pooled), work, None))

    def _sum_target(self, seg: Segment) -> torch.Tensor | None:
        """Where ``seg``'s reduced slice is summed when the transport can sum into it: stage 1, this rank's slice
        of the accumulator; stages 2, 3, its partition slice when in memory (``None`` with the slice in the NVMe
        files, read back only when the reduction is finished)."""
        acc = self.acc.get(seg.index)
        if acc is None:
            return None
        if self.stage == 1:
            start, _ = seg.slice_of(seg.rank)
            return acc[start:start + seg.shard_size]
        if self.gradients is not None and self.gradients.holds(seg.index):
            return None
        return acc[:seg.shard_size]

    def _wait_below(self, n: int) -> None:
        """Finish the oldest reductions until fewer than ``n`` are in flight (bounds the pooled buffers)."""
        while len(self.pending) >= n:
            self._finish(*self.pending.popleft())

    def _pump(self) -> None:
        """At a gradient hook while chunks are queued: finish the reductions that completed (oldest first; local
        work only), then start exactly one queued chunk, waiting for a slot if none is free. One per hook, whatever
        has completed, so every rank issues its collectives in the same order (backward goes on computing between
        hooks while a large segment's chunks go out)."""
        while self.pending and _completed(self.pending[0][2]):
            self._finish(*self.pending.popleft())
        if self.queued:
            self._wait_below(MAX_IN_FLIGHT)
            self.queued.popleft()()

    def _drain_queue(self) -> None:
        """Start every queued chunk, waiting for slots."""
        while self.queued:
            self._wait_below(MAX_IN_FLIGHT)
            self.queued.popleft()()

    def _adds_directly(self, seg: Segment) -> bool:
        """Stages 2, 3 on one rank: nothing to exchange, so the gradients are added to the partition as they are
        (no staging buffer), where that is the same arithmetic (no pre-division, the wire in the gradients' dtype)."""
        if self.stage == 1 or seg.world != 1 or self.scaling.pre != 1.0:
            return False
        return self.wire_dtype is None or all(p.grad is None or p.grad.dtype == self.wire_dtype for p in seg.params)

    def _add_directly(self, seg: Segment) -> None:
        """Add ``seg``'s gradients (times the post-scaling) into its partition slice and free them."""
        files = self.gradients if self.gradients is not None and self.gradients.holds(seg.index) else None
        whole = files.acquire(seg.index) if files is not None else self.acc[seg.index]
        for off, n, p in zip(seg.offsets, seg.numels, seg.params, strict=True):
            if p.grad is not None:
                whole[off:off + n].add_(p.grad.reshape(-1), alpha=self.scaling.post)
            p.grad = None
        if self.on_reduced is not None:
            self.on_reduced(seg)
        if files is not None:
            files.release(seg.index, whole)

    def _column_width(self, seg: Segment) -> int:
        """Columns per chunk when ``seg`` is reduced in column chunks, else 0 (it fits a bucket, or the collective
        cannot: an all-reduce, or a compressed exchange, which lays out whole segments; or stage 1, whose
        accumulator is reduced in place, where chunks would add a copy of it and bound only the receive buffer)."""
        if self.stage == 1 or not getattr(self.collectives[id(seg.group)], "column_wise", False):
            return 0
        return column_width(seg.padded, seg.world, self.bucket_numel)

    def _queue_columns(self, seg: Segment, width: int) -> None:
        """Queue ``seg``'s column chunks (stages 2, 3): chunk ``[a, b)`` is columns ``a:b`` of every rank's slice,
        copied from the gradients into a ``world x (b - a)`` buffer when it starts, reduced like a segment; the
        gradients are freed once the last chunk is staged."""
        sources = [(off, n, None if p.grad is None else p.grad.reshape(-1))
                   for off, n, p in zip(seg.offsets, seg.numels, seg.params, strict=True)]
        dtype, device = self.wire_dtype or seg.dtype, seg.params[0].device
        if self.gradients is not None and self.gradients.holds(seg.index):
            self.gradients.prefetch(seg.index)
        for a in range(0, seg.shard_size, width):
            b = min(seg.shard_size, a + width)
            self.queued.append(partial(self._start_columns, seg, sources, dtype, device, a, b))

    def _start_columns(self, seg: Segment, sources: list, dtype: torch.dtype, device: torch.device, a: int,
                       b: int) -> None:
        """Stage and launch chunk ``[a, b)`` of ``seg`` (see :meth:`_queue_columns`)."""
        world, shard = seg.world, seg.shard_size
        wire = self.pool.get(world * (b - a), dtype, device)
        rows = wire.view(world, b - a)
        for q in range(world):
            _copy_span(sources, q * shard + a, q * shard + b, rows[q])
        if self.scaling.pre != 1.0:
            wire.mul_(self.scaling.pre)
        collective = self.collectives[id(seg.group)]
        files = self.gradients is not None and self.gradients.holds(seg.index)
        work = None if files else collective.start_into(wire, self.acc[seg.index][a:b], self.scaling.post, True)
        if work is not None:  # summed into the partition's columns as received: no receive buffer
            self.pending.append((seg, (wire, None, wire), work, SUMMED))
        else:
            out = self.pool.get(collective.out_numel(wire.numel()), dtype, device)
            work = collective.start(wire, out, seg)
            self.pending.append((seg, (wire, out, wire), work, (a, b)))
        if b == shard:
            for p in seg.params:
                p.grad = None
            sources.clear()
            if self.on_reduced is not None:  # every chunk is staged: the parameters are not read again
                self.on_reduced(seg)

    def _stage(self, seg: Segment) -> tuple[torch.Tensor, torch.Tensor | None]:
        params = seg.params
        dtype = self.wire_dtype or seg.dtype
        if (not self.contiguous and not self.collectives[id(seg.group)].needs_out and len(params) == 1
                and params[0].grad is not None and params[0].grad.dtype == dtype):
            grad = params[0].grad  # reduce the gradient itself, no staging copy
            params[0].grad = None
            return grad.view(-1), None
        buf = self.pool.get(seg.padded, dtype, seg.params[0].device)
        buf[seg.numel:].zero_()  # padding; every parameter's stretch is written below
        views = seg.views(buf)
        present = [(v, p.grad) for v, p in zip(views, params, strict=True) if p.grad is not None]
        if present:
            torch._foreach_copy_([v for v, _ in present], [g for _, g in present])
        for v, p in zip(views, params, strict=True):
            if p.grad is None:
                v.zero_()
            p.grad = None
        return buf, buf

    def _finish(self, seg: Segment, bufs: tuple, work: Any, columns: tuple[int, int] | str | None) -> None:
        if work is not None:
            work.wait()
        wire, out, pooled = bufs
        if columns is SUMMED:  # the transport summed it into the slice already
            self.pool.put(pooled)
            return
        if columns is not None:
            self._finish_columns(seg, wire, out, columns)
            self.pool.put(out)
            self.pool.put(pooled)
            return
        acc = self.acc.get(seg.index)  # None: the slice lives in the NVMe files (self.gradients)
        post = self.scaling.post
        collective = self.collectives[id(seg.group)]
        if self.stage == 1 and not collective.needs_out:  # whole bucket all-reduced in place
            if post != 1.0:
                wire.mul_(post)
            if wire is not acc:
                acc.copy_(wire)
        else:
            rows = collective.rows(wire, out, seg.shard_size)
            if self.stage == 1:
                start, _ = seg.slice_of(seg.rank)
                target = acc[start:start + seg.shard_size]
                target.copy_(rows[0])
                for row in rows[1:]:
                    target.add_(row)
                if post != 1.0:
                    target.mul_(post)
            else:
                files = self.gradients if self.gradients is not None and self.gradients.holds(seg.index) else None
                whole = acc = files.acquire(seg.index) if files is not None else acc
                if rows[0].numel() < acc.numel():  # a single-parameter segment reduced without padding
                    acc = acc[:rows[0].numel()]
                for row in rows:
                    acc.add_(row, alpha=post)
                if files is not None:
                    files.release(seg.index, whole)
        self.pool.put(out)
        self.pool.put(pooled)

    def _finish_columns(self, seg: Segment, wire: torch.Tensor, out: torch.Tensor, columns: tuple[int, int]) -> None:
        """Add chunk ``columns`` of the reduced slice into this rank's accumulator (NVMe: the slice is acquired at
        the segment's first chunk and released, written, at its last)."""
        a, b = columns
        rows = self.collectives[id(seg.group)].rows(wire, out, b - a)
        post = self.scaling.post
        files = self.gradients if self.gradients is not None and self.gradients.holds(seg.index) else None
        if files is None:
            whole = self.acc[seg.index]
        elif a == 0:
            whole = self.held_slices[seg.index] = files.acquire(seg.index)
        else:
            whole = self.held_slices[seg.index]
        target = whole[a:b]
        for row in rows:
            target.add_(row, alpha=post)
        if files is not None and b == seg.shard_size:
            files.release(seg.index, self.held_slices.pop(seg.index))

    # -- end of backward / boundary ----------------------------------------------------------

    def flush(self, only: set[int] | None = None) -> None:
        """Launch every segment not launched yet (in index order; of ``only`` when given: the segments of the chunk
        whose backward ends), wait for all, reset counters."""
        for seg in self.segments:
            if seg.index not in self.launched and seg.trainable and (only is None or seg.index in only):
                self.launch(seg)
        self._drain_queue()
        self._wait_below(1)
        self.ready.clear()
        self.launched.clear()


def _copy_span(sources: list[tuple[int, int, torch.Tensor | None]], lo: int, hi: int, dst: torch.Tensor) -> None:
    """Write flat elements ``[lo, hi)`` of a segment into ``dst``: ``sources`` are ``(offset, numel, flat)`` in order
    (``flat`` ``None``: no gradient, zeros); what no source covers (the padding) is zero."""
    pos = lo
    for off, n, flat in sources:
        s, e = max(lo, off), min(hi, off + n)
        if s >= e:
            continue
        if s > pos:
            dst[pos - lo:s - lo].zero_()
        if flat is None:
            dst[s - lo:e - lo].zero_()
        else:
            dst[s - lo:e - lo].copy_(flat[s - off:e - off])
        pos = e
    if pos < hi:
        dst[pos - lo:].zero_()


def _completed(work: Any) -> bool:
    """Whether ``work`` finished (asked without waiting; a work that cannot say counts as running)."""
    if work is None:
        return True
    done = getattr(work, "is_completed", None)
    return bool(done()) if done is not None else False
