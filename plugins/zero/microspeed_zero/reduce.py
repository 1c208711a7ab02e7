"""Gradient reduction for ZeRO: every rank ends up with the average of its own slice.

* **Stage 1** accumulates whole gradients in one flat buffer per segment (the parameters'
  ``.grad`` are views of it, so autograd accumulates in place) and reduces each segment once,
  at the accumulation boundary, launched from autograd hooks as soon as backward has produced
  its last gradient (overlapped with the rest of backward).
* **Stages 2 and 3** reduce every micro-step: when a segment's gradients are all there, they are
  copied into a staging bucket, the parameters' ``.grad`` freed, and the bucket reduced
  asynchronously; the rank's slice of the result is added to its gradient partition. At most
  two buckets are in flight, so gradient memory stays a partition plus two buckets.

The collective is chosen per backend (``reduce_scatter: true``): gloo's all-reduce is faster
than its reduce-scatter (the ring moves the same bytes, its reduce-scatter does not use it), so
on gloo a bucket is all-reduced and each rank keeps its slice; NCCL reduce-scatters.
Scaling follows DeepSpeed's ``prescale_gradients`` / ``gradient_predivide_factor``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from microspeed import comm
from microspeed_zero.partition import Segment

MAX_IN_FLIGHT = 2


def prefers_reduce_scatter(group: Any) -> bool:
    """Whether the group's backend reduce-scatters faster than it all-reduces (NCCL yes, gloo no)."""
    try:
        backend = dist.get_backend(group)
    except Exception:
        return False
    return str(backend).lower() == "nccl"


class Scaling:
    """DeepSpeed's gradient averaging: pre-divide before the sum, the rest after."""

    def __init__(self, world: int, prescale: bool, predivide: float) -> None:
        self.pre = 1.0 / world if prescale else 1.0 / predivide
        self.post = 1.0 if prescale else predivide / world


class GradientReducer:
    """Reduces segment gradients into each rank's partition; see the module docstring."""

    def __init__(self, segments: list[Segment], stage: int, group: Any, scaling: Scaling,
                 accumulators: dict[int, torch.Tensor], wire_dtype: torch.dtype | None, reduce_scatter: bool,
                 contiguous: bool) -> None:
        self.segments, self.stage, self.group, self.scaling = segments, stage, group, scaling
        self.acc = accumulators  # segment index -> stage 1: whole flat gradient; stage 2/3: this rank's slice
        self.wire_dtype = wire_dtype
        self.use_rs = reduce_scatter and prefers_reduce_scatter(group)
        self.contiguous = contiguous
        self.world, self.rank = segments[0].world if segments else 1, segments[0].rank if segments else 0
        self.ready: dict[int, int] = {}
        self.launched: set[int] = set()
        self.pending: deque[tuple[Segment, torch.Tensor, Any]] = deque()
        self.on_reduced: Any = None  # stage 3: release a segment's parameters once its gradients left
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
        if self.stage == 1:
            wire = self.acc[seg.index]
            if self.wire_dtype is not None and wire.dtype != self.wire_dtype:
                wire = wire.to(self.wire_dtype)
        else:
            wire = self._stage(seg)
        if self.scaling.pre != 1.0:
            wire.mul_(self.scaling.pre)
        while len(self.pending) >= MAX_IN_FLIGHT and self.stage != 1:
            self._finish(*self.pending.popleft())
        if self.use_rs:
            out = torch.empty(seg.shard_size, dtype=wire.dtype, device=wire.device)
            work = comm.reduce_scatter_tensor(out, wire, group=self.group, async_op=True)
            self.pending.append((seg, (wire, out), work))
        else:
            work = comm.all_reduce(wire, group=self.group, async_op=True)
            self.pending.append((seg, (wire, None), work))

    def _stage(self, seg: Segment) -> torch.Tensor:
        params = seg.params
        dtype = self.wire_dtype or seg.dtype
        if (not self.contiguous and not self.use_rs and len(params) == 1 and params[0].grad is not None
                and params[0].grad.dtype == dtype):
            grad = params[0].grad  # reduce the gradient itself, no staging copy
            params[0].grad = None
            return grad.view(-1)
        buf = torch.empty(seg.padded, dtype=dtype, device=seg.params[0].device)
        buf[seg.numel:].zero_()  # padding; every parameter's stretch is written below
        views = seg.views(buf)
        present = [(v, p.grad) for v, p in zip(views, params, strict=True) if p.grad is not None]
        if present:
            torch._foreach_copy_([v for v, _ in present], [g for _, g in present])
        for v, p in zip(views, params, strict=True):
            if p.grad is None:
                v.zero_()
        for p in params:
            p.grad = None
        return buf

    def _finish(self, seg: Segment, bufs: tuple[torch.Tensor, torch.Tensor | None], work: Any) -> None:
        if work is not None:
            work.wait()
        wire, out = bufs
        acc = self.acc[seg.index]
        if self.stage == 1:
            if self.scaling.post != 1.0:
                wire.mul_(self.scaling.post)
            if wire is not acc:
                acc.copy_(wire)
            return
        start, end = seg.slice_of(self.rank)
        mine = out if out is not None else wire[start:min(end, wire.numel())]
        if mine.numel() < acc.numel():  # a single-parameter segment reduced without padding
            acc = acc[:mine.numel()]
        if self.scaling.post != 1.0:
            acc.add_(mine.to(acc.dtype), alpha=self.scaling.post)
        else:
            acc.add_(mine.to(acc.dtype))
        if self.on_reduced is not None:
            self.on_reduced(seg)

    # -- end of backward / boundary ----------------------------------------------------------

    def flush(self) -> None:
        """Launch every segment not launched yet (in index order), wait for all, reset counters."""
        for seg in self.segments:
            if seg.index not in self.launched and seg.trainable:
                self.launch(seg)
        while self.pending:
            self._finish(*self.pending.popleft())
        self.ready.clear()
        self.launched.clear()
