"""Gradient partitions in the NVMe optimizer's files: stage 2/3 gradients are never held whole in memory.

With ``zero_optimization.offload_optimizer.device = "nvme"`` at stage 2 or 3, this rank's reduced gradient
of every optimized segment lives beside the masters and moments of :class:`~microspeed_zero.swap.OptimizerSwapper`:
one more file per sub-group (``subgroup<k>/grad``, in the accumulation dtype — fp32 with
``data_types.grad_accum_dtype`` fp32, else the model's), laid out like the sub-group's pieces.

* **Backward**: when the reducer finishes a segment, its slice passes through one of a few segment-sized
  buffers: zeros at the first micro-step of an accumulation window, else read back from the files (the read
  starts when the segment's reduction is launched); the reduced rows are added, and the slice is written piece
  by piece into the sub-group files. A buffer is reused once its writes finished. As each slice is written,
  the pieces the global norm needs (their L2 norms, in fp32) and, with a loss scaler, whether it is finite
  are kept — so the step clips and checks for overflow without another pass over the gradients.
* **Step**: the swapper reads each sub-group's gradient file beside its masters and moments (through slots
  of its own, in the same order, read ahead as far), converts it to fp32 and applies the unscaling/clipping
  coefficient (:meth:`GradientSwapper.fp32`). Segments not written in this window read as zeros.

Elements of a slice that no sub-group stores (padding, parameters in no param group) are not kept, and count
zero in the norm. Resident memory: at most ``buffers`` segment buffers (allocated as needed, each reused for
any slice it holds, so a model with one large embedding keeps one large buffer), the step's slots and one fp32
sub-group — bounded by :meth:`GradientSwapper.budget_bytes` whatever the model's size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from microspeed.plugin_api import has_inf_or_nan
from microspeed_zero.aio import ALIGN, aligned_empty
from microspeed_zero.nvme import Prefetcher, SwapHandle

BUFFERS = 4
"""Segment-sized buffers: two reductions in flight (each with its read-back), one being added to, one writing."""

NORM_CHUNK = 1 << 20
"""Elements of a 16-bit slice converted to fp32 at a time for its norm (``linalg.vector_norm(dtype=fp32)`` would
convert the whole slice at once: twice the largest layer's gradient in memory for a moment)."""


class GradientSwapper:
    """This rank's gradient partition in the sub-group files of an :class:`OptimizerSwapper` (see the module doc).

    ``norm_inputs(index, slice) -> (tensors, rules)`` cuts a segment's slice into the pieces the kernel's norm
    takes (the runtime's rule runs); ``check_finite``: keep each slice's finiteness for the loss scaler.
    """

    def __init__(self, swapper: Any, dtype: torch.dtype,
                 norm_inputs: Callable[[int, torch.Tensor], tuple[list[torch.Tensor], list[Any] | None]],
                 check_finite: bool, buffers: int = BUFFERS) -> None:
        rt = swapper.rt
        self.store = swapper.store
        self.dtype = dtype
        self.norm_inputs = norm_inputs
        self.check_finite = check_finite
        self.keys = [f"subgroup{sg.index:05d}/grad" for sg in swapper.subgroups]
        for sg, key in zip(swapper.subgroups, self.keys, strict=True):
            self.store.allocate(key, sg.numel, dtype)  # sparse: costs nothing until written
        self.layout: dict[int, list[tuple[str, int, int, int]]] = {}  # segment -> [(key, start, end, offset)]
        for sg in swapper.subgroups:
            for p in sg.pieces:
                self.layout.setdefault(p.seg, []).append((self.keys[sg.index], p.start, p.end, p.lo))
        self.size = {seg.index: seg.shard_size for seg in rt.optimized if seg.index in self.layout}
        self.gaps: dict[int, list[tuple[int, int]]] = {}  # segment -> ranges of its slice no file stores
        for index, pieces in self.layout.items():
            gaps, at = [], 0
            for _key, start, end, _off in sorted(pieces, key=lambda x: x[1]):
                if start > at:
                    gaps.append((at, start))
                at = end
            if at < self.size[index]:
                gaps.append((at, self.size[index]))
            self.gaps[index] = gaps
        self._largest = max(self.size.values(), default=0)
        # Where a segment's slice starts in its buffer: placed so that its largest piece's elements sit at the same
        # place within a page as their file offset, so its whole pages move with O_DIRECT (the store's rule); the
        # buffers are page-aligned with one page to spare.
        self._pad = ALIGN // dtype.itemsize
        self._lead: dict[int, int] = {}
        for index, pieces in self.layout.items():
            _key, start, _end, off = max(pieces, key=lambda x: x[2] - x[1])
            self._lead[index] = (off - start) % self._pad
        self._buffers: list[torch.Tensor | None] = [None] * max(3, int(buffers))  # allocated on demand
        self._free = list(range(len(self._buffers)))
        self._reads: dict[int, tuple[int, list[SwapHandle]]] = {}
        self._held: dict[int, int] = {}
        self._writes: deque[tuple[int, list[SwapHandle]]] = deque()
        self.written: set[int] = set()
        """Segments whose pieces in the files hold this accumulation window's gradient (others read as zeros)."""
        self.norms: dict[int, tuple[list[torch.Tensor], list[Any] | None]] = {}
        self.finite: dict[int, bool] = {}
        widest = max((sg.numel for sg in swapper.subgroups), default=0)
        self._slots = [[aligned_empty(widest, dtype)] for _ in swapper._slots]  # page-aligned: direct reads
        self._fp32 = torch.empty(widest if dtype != torch.float32 else 0, dtype=torch.float32)
        self._norm_fp32 = torch.empty(min(self._largest, NORM_CHUNK) if dtype != torch.float32 else 0,
                                      dtype=torch.float32)
        self._subgroups = swapper.subgroups
        self._prefetchers: dict[tuple[int, ...], Prefetcher] = {}

    # -- backward: the reducer's accumulators --------------------------------------------------

    def holds(self, index: int) -> bool:
        """Whether segment ``index``'s gradient lives in the files (it has optimized elements)."""
        return index in self.layout

    def _take(self, numel: int) -> int:
        """A free buffer of at least ``numel`` elements: the smallest free one that fits (buffers whose writes
        finished are free again), else the oldest one writing that fits (waited for), else an unallocated one or
        the largest free one, replaced by one of ``numel`` — so large buffers exist only as many as are needed at
        once."""
        bufs = self._buffers
        while self._writes and all(h.done() for h in self._writes[0][1]):
            self._reclaim()
        while True:
            fits = [b for b in self._free if bufs[b] is not None and bufs[b].numel() >= numel]
            if fits:
                b = min(fits, key=lambda i: bufs[i].numel())
                break
            if any(bufs[w].numel() >= numel for w, _ in self._writes) or (self._writes and not self._free):
                self._reclaim()  # the oldest write; its buffer (or a later one) serves
                continue
            if not self._free:
                raise RuntimeError("GradientSwapper: every gradient buffer is held by a reduction in flight; "
                                   "more reductions are pending than the buffers allow")
            b = max(self._free, key=lambda i: -1 if bufs[i] is None else bufs[i].numel())
            bufs[b] = None  # freed before its successor is allocated
            bufs[b] = aligned_empty(numel, self.dtype)
            break
        self._free.remove(b)
        return b

    def _reclaim(self) -> None:
        """Wait for the oldest write and free its buffer."""
        b, handles = self._writes.popleft()
        for h in handles:
            h.wait()
        self._free.append(b)

    def _view(self, b: int, index: int) -> torch.Tensor:
        lead = self._lead[index]
        return self._buffers[b][lead:lead + self.size[index]]

    def prefetch(self, index: int) -> None:
        """The reduction of ``index`` starts: read back what this window accumulated so far (asynchronously)."""
        if index not in self.written or index in self._reads or index in self._held:
            return
        b = self._take(self.size[index] + self._pad)
        view = self._view(b, index)
        self._reads[index] = (b, [self.store.read_async(key, view[start:end], offset=off)
                                  for key, start, end, off in self.layout[index]])

    def acquire(self, index: int) -> torch.Tensor:
        """Segment ``index``'s accumulated slice (zeros at the first micro-step of a window), to add to and then
        hand back with :meth:`release`."""
        if index in self._held:
            raise RuntimeError(f"GradientSwapper: segment {index} is acquired twice without release()")
        if index not in self._reads:
            self.prefetch(index)
        read = self._reads.pop(index, None)
        if read is None:
            b = self._take(self.size[index] + self._pad)
            view = self._view(b, index).zero_()
        else:
            b, handles = read
            for h in handles:
                h.wait()
            view = self._view(b, index)
        self._held[index] = b
        return view

    def release(self, index: int, acc: torch.Tensor) -> None:
        """Store ``acc`` (from :meth:`acquire`) as segment ``index``'s slice: keep its norm pieces (and finiteness),
        start the writes of its pieces; the buffer is reused once they finished."""
        b = self._held.pop(index)
        for start, end in self.gaps[index]:
            acc[start:end].zero_()
        tensors, rules = self.norm_inputs(index, acc)
        kept = [(t, r) for t, r in zip(tensors, rules or [None] * len(tensors), strict=True) if t.numel()]
        self.norms[index] = ([self._norm(t) for t, _ in kept], None if rules is None else [r for _, r in kept])
        if self.check_finite:
            self.finite[index] = not has_inf_or_nan([acc])
        self._writes.append((b, [self.store.write_async(key, acc[start:end], offset=off)
                                 for key, start, end, off in self.layout[index]]))
        self.written.add(index)

    def _norm(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s L2 norm as a 1-element fp32 tensor, as the kernel's norm computes it on fp32 gradients (a 16-bit
        slice: chunk by chunk through a small fp32 buffer, the chunks' norms combined)."""
        if t.dtype == torch.float32:
            return torch._foreach_norm([t], 2.0)[0].reshape(1)
        step, scratch = self._norm_fp32.numel(), self._norm_fp32
        parts = [torch._foreach_norm([scratch[:min(step, t.numel() - a)].copy_(t[a:a + step])], 2.0)[0]
                 for a in range(0, t.numel(), step)]
        return torch.stack(parts).double().square().sum().sqrt().float().reshape(1)

    def read_segment(self, index: int) -> torch.Tensor:
        """A fresh copy of segment ``index``'s accumulated slice (zeros where nothing is stored)."""
        out = torch.zeros(self.size[index], dtype=self.dtype)
        if index in self.written:
            for h in [self.store.read_async(key, out[start:end], offset=off)
                      for key, start, end, off in self.layout[index]]:
                h.wait()
        return out

    def zero(self) -> None:
        """A new accumulation window: every segment reads as zeros again (the files are not touched)."""
        for b, handles in self._reads.values():
            for h in handles:
                h.wait()
            self._free.append(b)
        self._reads.clear()
        self.written.clear()
        self.norms.clear()
        self.finite.clear()

    # -- step ----------------------------------------------------------------------------------

    def overflow(self) -> bool:
        """Whether a slice written in this window holds an inf or nan (kept only with ``check_finite``)."""
        return not all(self.finite.get(i, True) for i in self.written)

    def norm_pieces(self, index: int) -> tuple[list[torch.Tensor], list[Any] | None]:
        """Segment ``index``'s norm pieces as 1-element fp32 tensors (their norms) and their rules; nothing when it
        was not written in this window."""
        return self.norms.get(index, ([], None))

    def stream(self, visit: list[int]) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """Iterate the gradient files of sub-groups ``visit`` (in that order), read ahead through the slots."""
        key = tuple(visit)
        pf = self._prefetchers.get(key)
        if pf is None:
            pf = Prefetcher(self.store, [[self.keys[k]] for k in visit], buffers=self._slots)
            self._prefetchers[key] = pf
        return iter(pf)

    def fp32(self, k: int, grad: torch.Tensor, coef: Any) -> torch.Tensor:
        """Sub-group ``k``'s gradient (``grad``, as read by :meth:`stream`) in fp32, unwritten segments zeroed,
        multiplied by ``coef`` (``None``: not scaled). The result is valid until the next call."""
        sg = self._subgroups[k]
        for p in sg.pieces:
            if p.seg not in self.written:
                grad[p.lo:p.hi].zero_()
        out = grad if grad.dtype == torch.float32 else self._fp32[:sg.numel].copy_(grad)
        if coef is not None:
            out.mul_(coef)
        return out

    # -- accounting ----------------------------------------------------------------------------

    def resident_bytes(self) -> int:
        """Bytes of the buffers now: segment buffers allocated so far, step slots and the fp32 sub-group."""
        tensors = [*(b for b in self._buffers if b is not None), *(t for slot in self._slots for t in slot), self._fp32,
                   self._norm_fp32]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def budget_bytes(self) -> int:
        """What :meth:`resident_bytes` may reach: every segment buffer as large as the largest segment's slice, the
        step's slots and fp32 sub-group — fixed by the largest segment and sub-group, not by the model."""
        fixed = sum(t.untyped_storage().nbytes() for t in [*(t for slot in self._slots for t in slot), self._fp32,
                                                             self._norm_fp32])
        return fixed + len(self._buffers) * self._largest * self.dtype.itemsize

    def bytes_on_disk(self) -> int:
        """Bytes of the gradient files (one element per optimized element of this rank's partition)."""
        return sum(self.store.numel(k) * self.dtype.itemsize for k in self.keys)

    def close(self) -> None:
        """Wait for the writes in flight and drop the buffers (the files go with the swapper's store)."""
        while self._writes:
            _b, handles = self._writes.popleft()
            for h in handles:
                h._join()
        self._prefetchers.clear()
        self._buffers, self._free, self._slots = [], [], []
        self._fp32 = self._norm_fp32 = torch.empty(0)
