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
  segments only (the runtime cuts segments within one chunk).

The collective is chosen per backend (``reduce_scatter: true``,
:class:`microspeed_zero.collectives.PartitionedReduce`): gloo ``all_to_all_single`` plus a local
sum, NCCL ``reduce_scatter_tensor``; ``reduce_scatter: false`` all-reduces the whole bucket.
Staging and receive buffers come from a small pool, allocated once (fresh large allocations cost
page faults every step on CPU).
Scaling follows DeepSpeed's ``prescale_gradients`` / ``gradient_predivide_factor``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from microspeed_zero.collectives import PartitionedReduce, partitioned_reduce
from microspeed_zero.partition import Segment

MAX_IN_FLIGHT = 2


class Scaling:
    """DeepSpeed's gradient averaging: pre-divide before the sum, the rest after."""

    def __init__(self, world: int, prescale: bool, predivide: float) -> None:
        self.pre = 1.0 / world if prescale else 1.0 / predivide
        self.post = 1.0 if prescale else predivide / world


class BufferPool:
    """Reusable flat buffers by (dtype, size, device): allocated once, handed out again."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def get(self, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``size`` elements (contents undefined)."""
        bucket = self.free.get((size, dtype, str(device)))
        return bucket.pop() if bucket else torch.empty(size, dtype=dtype, device=device)

    def put(self, buf: torch.Tensor | None) -> None:
        """Give ``buf`` back for reuse."""
        if buf is not None:
            self.free.setdefault((buf.numel(), buf.dtype, str(buf.device)), []).append(buf)


class GradientReducer:
    """Reduces segment gradients into each rank's partition; see the module docstring."""

    def __init__(self, segments: list[Segment], stage: int, scaling: Scaling,
                 accumulators: dict[int, torch.Tensor], wire_dtype: torch.dtype | None, reduce_scatter: bool,
                 contiguous: bool, compression: Any = None) -> None:
        self.segments, self.stage, self.scaling = segments, stage, scaling
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
        self.pending: deque[tuple[Segment, tuple, Any]] = deque()
        self.on_reduced: Any = None  # stage 3: release a segment's parameters once its gradients are staged
        self.gradients: Any = None  # optimizer on NVMe: the GradientSwapper holding the partitions in files
        self.by_param: dict[int, Segment] = {id(p): s for s in segments for p in s.params}

    # -- autograd hook entry -----------------------------------------------------------------

    def grad_ready(self, param: torch.Tensor) -> None:
        """A parameter's gradient for this backward is complete; launch its segment when all are."""
        seg = self.by_param.get(id(param))
        if seg is None or seg.index in self.launched:
            return
        n = self.ready.get(seg.index, 0) + 1
        self.ready[seg.index] = n
        if n == seg.trainable:
            self.launch(seg)

    def launch(self, seg: Segment) -> None:
        """Start reducing ``seg`` (gradients of parameters that have none count as zeros)."""
        self.launched.add(seg.index)
        while len(self.pending) >= MAX_IN_FLIGHT:  # bounds the pooled receive/staging buffers
            self._finish(*self.pending.popleft())
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
        out = self.pool.get(wire.numel(), wire.dtype, wire.device) if collective.needs_out else None
        work = collective.start(wire, out, seg)
        self.pending.append((seg, (wire, out, pooled), work))

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

    def _finish(self, seg: Segment, bufs: tuple, work: Any) -> None:
        if work is not None:
            work.wait()
        wire, out, pooled = bufs
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

    # -- end of backward / boundary ----------------------------------------------------------

    def flush(self, only: set[int] | None = None) -> None:
        """Launch every segment not launched yet (in index order; of ``only`` when given: the segments of the chunk
        whose backward ends), wait for all, reset counters."""
        for seg in self.segments:
            if seg.index not in self.launched and seg.trainable and (only is None or seg.index in only):
                self.launch(seg)
        while self.pending:
            self._finish(*self.pending.popleft())
        self.ready.clear()
        self.launched.clear()
