"""Stage 3: parameters partitioned; gathered before a module runs, released after, prefetched.

Each module's own parameters form a segment (parameters of at most
``stage3_param_persistence_threshold`` elements form a separate *persistent* segment that stays
whole, as DeepSpeed keeps small parameters). Between uses a parameter's ``.data`` is an empty
placeholder (``p.ds_shape`` / ``p.ds_numel`` give its real shape); the rank keeps only its shard.

* **Forward**: a module's pre-hook gathers the segments its parameters live in (one
  ``all_gather_into_tensor`` each, straight into the segment's flat buffer, of which the
  parameters become views) and launches the gathers of the segments that come next in the
  recorded execution order, up to ``stage3_prefetch_bucket_size`` elements ahead and at most
  ``stage3_max_live_parameters`` gathered at once. Its post-hook releases them, unless the
  recorded order shows the segment used again within ``stage3_max_reuse_distance`` elements.
* **Backward**: a hook on the module's outputs gathers the segments again (prefetching in
  reverse order) before autograd runs the module's backward. When all of a segment's gradients
  are accumulated, the reducer stages them for reduction into the gradient partition and the
  segment is released (the reduction reads the staged copy, not the parameters).

* **Across passes**: when the next compute pass is known — a schedule announces it through the core's
  ``next_pass`` notification (a pipeline: the backward of a micro-batch, the next micro-batch's forward,
  another chunk), and without one a forward with gradients is followed by its backward and a backward
  inside an accumulation window by the next forward — prefetching runs on from the end of the current
  pass into the next pass's recorded order (within the same budgets), and a segment the next pass uses
  within ``stage3_max_reuse_distance`` elements stays gathered instead of being released and gathered
  again (the last layers of a forward are the first of its backward), as long as at most
  ``stage3_max_live_parameters`` elements stay gathered. Nothing stays gathered over an optimizer step
  (its first forward gathers the updated parameters). :attr:`ParameterPartitioner.stats` counts gathers.

With ``offload_param.device = "nvme"`` a shard beyond the first ``offload_param.max_in_cpu`` elements is
written to a file as soon as its module is partitioned (the model is never held whole), read for each gather
and dropped after it; the optimizer's step writes its new values into the file piece by piece
(:meth:`ParameterPartitioner.write_piece`). A prefetch also starts reading the shards of the next
``stage3_prefetch_bucket_size`` elements beyond the gathers it launches (:meth:`ParameterPartitioner._read_ahead`):
the reads run while the modules before them compute, and the gathers, launched where they always are (the same
points, in the same order, on every rank: no collective depends on when a read finished), find the shard in memory.
No read-ahead outlives an optimizer step or a write into its file.

Releasing shrinks the flat buffer's storage to zero bytes (as FSDP does) and points the
parameters at the placeholder: tensors autograd saved from the forward keep referring to the
same storage, which the backward gather fills again, so any module works unchanged. On CPU a segment
of 1 MiB or more instead keeps a buffer of its own (:class:`~microspeed_zero.host_memory.ReleasablePages`):
refilling a storage grown again faults once per 4 KiB page, which cost more CPU than the gather itself.
Without offload a release marks its pages free for the kernel to take back when it needs memory; with
``offload_param`` (a budgeted peak RSS) it gives them back at once, and the buffer sits on 2 MiB huge pages,
so that the refill faults once per 2 MiB.

* **Parameters used outside their module** (``nn.MultiheadAttention`` reads ``out_proj.weight``
  without calling ``out_proj``; a tied embedding used through ``F.linear``): leaf modules
  (:mod:`microspeed_zero.leaf`; ``MultiheadAttention`` and the Transformer layers by default)
  gather their whole sub-tree; parameters registered with ``register_external_parameter`` are
  gathered with the module that uses them; and a released parameter used by any torch function
  during forward (see :mod:`microspeed_zero.access`) is gathered on the spot and registered as
  external to the innermost running module — gathered again before that module's backward, and
  with it (prefetched) from the next forward on. Used outside any module (a regulariser in the
  loss), it stays gathered until its gradient is reduced.

* **Parameters of some ranks only** (a Mixture-of-Experts layer's experts, marked with a
  :class:`~microspeed.plugin_api.ReplicaGroup`): their segments are split over that group instead of
  the data-parallel group — broadcast from its first rank, gathered over it, and their gradients
  reduced over it and averaged by the data-parallel size (the reducer's scaling), as stages 1 and 2
  do. A module's own parameters form one segment per replica group.

Each parameter carries DeepSpeed's ``ds_id``, ``ds_shape``, ``ds_numel`` and ``ds_status``
(:class:`~microspeed_zero.leaf.ZeroParamStatus`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist

from microspeed.plugin_api import comm, replica_group
from microspeed_zero.access import unwatch, watch
from microspeed_zero.aio import ALIGN, AlignedPool, aligned_empty
from microspeed_zero.collectives import gather_slices
from microspeed_zero.host_memory import ReleasablePages
from microspeed_zero.leaf import ZeroParamStatus, assign_ds_id, external_parameters, is_leaf, mark_leaf_parameters
from microspeed_zero.partition import Segment

RELEASED, INFLIGHT, AVAILABLE = 0, 1, 2
_DS_STATUS = {RELEASED: ZeroParamStatus.NOT_AVAILABLE, INFLIGHT: ZeroParamStatus.INFLIGHT,
              AVAILABLE: ZeroParamStatus.AVAILABLE}
_NO_GATHER = frozenset({
    "grad_fn", "requires_grad", "is_leaf", "dtype", "device", "grad", "layout", "is_cuda", "is_meta",
    "is_sparse", "is_quantized", "is_mkldnn", "_base", "output_nr", "_version", "_cdata", "names", "__class__",
    "requires_grad_", "is_floating_point", "is_complex", "element_size", "get_device", "_is_view",
    "__reduce_ex__", "__deepcopy__", "__hash__", "__eq__", "__ne__", "data", "shape", "size", "dim", "ndim",
    "numel", "nelement", "__repr__", "__format__", "__str__", "stride", "is_contiguous", "storage_offset",
    "untyped_storage", "data_ptr", "__len__", "__setstate__", "__getstate__", "register_hook",
    "register_post_accumulate_grad_hook", "retain_grad", "retains_grad", "_backward_hooks",
    "_post_accumulate_grad_hooks", "__dict__",
})
"""Uses of a released parameter that read only what its placeholder also answers: no gather."""

PAGED_MIN_BYTES = 1 << 20
"""Segments of at least this many bytes get a :class:`~microspeed_zero.host_memory.ReleasablePages` buffer (CPU);
smaller ones, which glibc serves from its heap, resize their storage."""


class _Frame:
    """A module whose forward is running: the segments it holds (gathered for it or on access)."""

    __slots__ = ("module", "indices", "leaf")

    def __init__(self, module: torch.nn.Module, indices: list[int], leaf: bool) -> None:
        self.module, self.indices, self.leaf = module, indices, leaf


def _gather_into(flat: torch.Tensor, shard: torch.Tensor, group: Any, async_op: bool) -> Any:
    return gather_slices(flat, shard, comm.get_rank(group), comm.get_world_size(group), group, async_op)


class ParameterPartitioner:
    """Stage-3 parameter partitions of one model and the module hooks that gather them."""

    def __init__(self, runtime: Any, model: torch.nn.Module) -> None:
        self.rt, self.cfg = runtime, runtime.cfg
        self.model = model
        self.group, self.world, self.rank = runtime.group, runtime.world, runtime.rank
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.segments: list[Segment] = []
        self.shards: dict[int, torch.Tensor] = {}
        self.flats: dict[int, torch.Tensor] = {}
        self.status: dict[int, int] = {}
        self.works: dict[int, Any] = {}
        self.uses: dict[int, int] = {}
        self.module_segments: dict[torch.nn.Module, list[int]] = {}
        self.subtree: dict[torch.nn.Module, list[int]] = {}
        self.auto_external: dict[torch.nn.Module, set[int]] = {}  # found by gather-on-access
        self.seg_of: dict[int, int] = {}  # id(param) -> segment index
        self.stack: list[_Frame] = []
        self.leaf_depth = 0
        self.active = False  # a forward (and its backward) is running: released parameters gather on use
        self.held: set[int] = set()  # gathered on use outside any module: kept until reduced
        self.order: list[int] = []
        self.trace: list[int] = []
        self.position: dict[int, list[int]] = {}
        self.orders: dict[frozenset, tuple[list[int], dict[int, list[int]]]] = {}  # one per kind of forward
        self.handles: list[Any] = []
        # across passes: what the schedule announced for the pass now running ((kind, chunk), upcoming)
        self.plan: tuple[Any, Any] | None = None
        self.chunk_orders: dict[Any, tuple[list[int], dict[int, list[int]]]] = {}  # announced chunk -> forward order
        self.in_backward = False
        self.busy: set[int] = set()  # fetched for a backward whose gradients are not reduced yet
        self.bw_cursor = -1  # position in the backward order of the module whose backward runs
        self._upcoming: list[int] | None = None  # the next pass's order (cached for the running pass)
        self.live = 0  # elements of non-persistent segments gathered or in flight
        self.stats = {"gathers": 0, "sync": 0, "peak_live": 0, "read_ahead": 0}
        """Counters: every all-gather of a non-persistent segment, those launched synchronously (the segment
        was needed and not prefetched or kept), the most elements gathered at once, and the gathers of
        file-resident shards a prefetch had read ahead."""
        self.placeholders: dict[tuple, torch.Tensor] = {}
        self.offload = self.cfg.offload_param in ("cpu", "nvme")  # shards in host memory (or files)
        self.pin = self.offload and self.cfg.pin_memory and torch.cuda.is_available()
        self.store: Any = None  # offload_param nvme: shards beyond max_in_cpu live in files
        self.in_files: set[int] = set()
        self.loaded: dict[int, torch.Tensor] = {}  # file-resident shards read in whole (user reads, checkpoints)
        self.peak_loaded_bytes = 0
        """The most bytes of file-resident shards held whole at once so far (:meth:`local_shard`, checkpoint
        loads one segment at a time: :meth:`note_loaded`); reset it to measure a span."""
        self.deferred: set[int] = set()  # file-resident shards a checkpoint load fills one at a time (checkpointing)
        self.kept = 0  # elements of non-persistent shards kept in memory (at most offload_param.max_in_cpu)
        # CPU: large segments' flat buffers on pages of their own, released without resizing (returned at once
        # with offload_param: its peak RSS is budgeted)
        self.pages: dict[int, ReleasablePages] = {}
        self.paged = self.device.type == "cpu"
        # the step's writes into shard files: handle, bytes, and the byte range of the staging ring it reads
        self._piece_writes: deque[tuple[Any, int, tuple[int, int]]] = deque()
        self._piece_bytes = 0
        self._ring: torch.Tensor | None = None  # the step's staging for those writes (see _stage)
        self._ring_head = 0
        self._cap: int | None = None  # _piece_cap, once known
        self.reads: dict[int, tuple[Any, torch.Tensor]] = {}  # read-ahead of file-resident shards: handle, buffer
        self.shard_pool: AlignedPool | None = None  # buffers for shards read from files (see _launch)
        if self.cfg.offload_param == "nvme":
            from microspeed_zero.nvme import TensorFileStore

            self.store = TensorFileStore.private(self.cfg.offload_param_nvme_path, comm.get_rank(), "params",
                                                 **self.cfg.aio.store_options())  # the aio section: direct I/O
        self._partition(model)
        if self.in_files:  # shards read from files: a prefetch bucket's read ahead, and the largest (room to reuse)
            item = max(s.dtype.itemsize for s in self.segments)
            largest = max(self.segments[i].shard_size for i in self.in_files)
            self.shard_pool = AlignedPool((-(-self.cfg.prefetch_bucket_size // self.world) + largest) * item)
        mark_leaf_parameters(model)
        self._install_hooks(model)

    # -- partitioning ----------------------------------------------------------------------------

    def _placeholder(self, p: torch.Tensor) -> torch.Tensor:
        key = (p.dtype, p.device)
        if key not in self.placeholders:
            self.placeholders[key] = torch.empty(0, dtype=p.dtype, device=p.device)
        return self.placeholders[key]

    def _partition(self, model: torch.nn.Module) -> None:
        from microspeed_zero.init import materialize

        names = self.rt.names
        assigned: dict[int, int] = {}
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        threshold = self.cfg.param_persistence_threshold
        for module in model.modules():
            own = [p for p in module._parameters.values() if p is not None and id(p) not in assigned]
            by_group: dict[Any, list[torch.nn.Parameter]] = {}
            for p in own:  # the data-parallel group first, then each replica group (experts)
                by_group.setdefault(replica_group(p), []).append(p)
            for rg, members in sorted(by_group.items(), key=lambda kv: kv[0] is not None):
                self._partition_params(members, rg, names, assigned, threshold, src, materialize)
        for module in model.modules():
            needed = sorted({assigned[id(p)] for p in module._parameters.values() if p is not None})
            if needed:
                self.module_segments[module] = needed
        self.seg_of = dict(assigned)
        with torch.no_grad():
            for b in model.buffers():
                comm.broadcast(b.data, src=src, group=self.group)

    def _partition_params(self, own: list[torch.nn.Parameter], rg: Any, names: dict[int, str],
                          assigned: dict[int, int], threshold: int, dp_src: int, materialize: Any) -> None:
        """One module's parameters of one replica group (``None``: the data-parallel group) into segments."""
        world, rank, group = (self.world, self.rank, self.group) if rg is None else (rg.size, rg.rank, rg.group)
        src = dp_src if rg is None else rg.ranks[0]
        materialize(own, group)
        small = {id(p): p.numel() <= threshold for p in own}
        for persistent in (False, True):
            params = [p for p in own if small[id(p)] == persistent]
            if not params:
                continue
            seg = Segment(len(self.segments), params, [names.get(id(p), "?") for p in params],
                          [None] * len(params), world, rank, group=group)
            seg.persistent = persistent
            self.segments.append(seg)
            if self.paged and not persistent and seg.padded * seg.dtype.itemsize >= PAGED_MIN_BYTES:
                self.pages[seg.index] = ReleasablePages(seg.padded, seg.dtype, returned=self.offload)  # zeros
                flat = self.pages[seg.index].tensor
            else:
                flat = torch.zeros(seg.padded, dtype=seg.dtype, device=self.device)
            with torch.no_grad():
                for p, view in zip(params, seg.views(flat), strict=True):
                    view.copy_(p.detach())
            comm.broadcast(flat, src=src, group=group)
            start, end = seg.slice_of(rank)
            for p in params:
                assigned[id(p)] = seg.index
                p.ds_shape, p.ds_numel = tuple(p.shape), p.numel()
                assign_ds_id(p)
            if persistent:
                self.shards[seg.index] = flat[start:end]
                self.flats[seg.index] = flat
                self._point(seg, flat)
                self._set_status(seg, AVAILABLE)
            else:
                shard = flat[start:end]
                self.shards[seg.index] = (shard.to("cpu", copy=True).pin_memory() if self.pin else
                                          shard.to("cpu", copy=True)) if self.offload else shard.clone()
                self.flats[seg.index] = flat
                self._drop(seg)
                if self.store is not None:
                    self._spill(seg)
            self._tag_local(seg)

    def _tag_local(self, seg: Segment) -> None:
        """DeepSpeed's ``p.ds_tensor``: this rank's elements of each parameter of ``seg``, a view of its shard in
        memory (empty where it owns none; absent for a shard that lives in a file)."""
        shard = self.shards[seg.index]
        if shard is None:
            return
        for p in seg.params:
            p.ds_tensor = shard[:0]
        for i, a, s in seg.pieces(seg.rank):
            seg.params[i].ds_tensor = shard[s:s + seg.param_range(i, seg.rank)[1] - a]

    def _spill(self, seg: Segment) -> None:
        """offload_param nvme: keep shards in memory while they fit ``max_in_cpu`` elements (in partitioning
        order), write the others to files now."""
        shard = self.shards[seg.index]
        if self.kept + shard.numel() <= self.cfg.max_in_cpu:
            self.kept += shard.numel()
            return
        self.store.write(f"shard{seg.index}", shard.contiguous())
        self.shards[seg.index] = None
        self.in_files.add(seg.index)

    def in_file(self, index: int) -> bool:
        """Whether segment ``index``'s shard is in its file only (not read in whole)."""
        return index in self.in_files and index not in self.loaded

    def read_shard(self, index: int) -> torch.Tensor:
        """This rank's shard of segment ``index``, a file-resident one read for the caller and not kept."""
        if not self.in_file(index):
            return self.local_shard(index)
        return self.store.read(f"shard{index}", torch.empty(self.segments[index].shard_size,
                                                            dtype=self.segments[index].dtype))

    def write_piece(self, index: int, start: int, values: torch.Tensor) -> None:
        """Write ``values`` (converted to the parameters' dtype) into elements ``[start, start + numel)`` of the
        file-resident shard of segment ``index``, asynchronously: a later gather reads it after the write (the store
        keeps one key's order). At most two sub-groups' worth of writes are in flight."""
        self.forget_read(index)
        piece, region = self._stage(values.numel(), self.segments[index].dtype, start)
        piece.copy_(values)
        self._piece_writes.append((self.store.write_async(f"shard{index}", piece, offset=start), piece.nbytes, region))
        self._piece_bytes += piece.nbytes
        while self._piece_bytes > 2 * self._piece_cap():
            self._wait_piece()

    def _piece_cap(self) -> int:
        """The most bytes one piece the step writes can have (a sub-group's share of the largest shard)."""
        if self._cap is None:
            item = max(s.dtype.itemsize for s in self.segments)
            self._cap = min(self.cfg.sub_group_size, max(s.shard_size for s in self.segments)) * item
        return self._cap

    def _stage(self, numel: int, dtype: torch.dtype, start: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """Room in the step's staging ring for ``numel`` ``dtype`` values written at element ``start`` of a shard:
        placed within a page as the file offset is, so the write goes ``O_DIRECT`` (see
        :meth:`~microspeed_zero.nvme.TensorFileStore.staging`), after waiting for the writes still reading that
        room. One ring per step (three pieces' worth: the two in flight and the next; released after the step)
        instead of a new mapping per piece, whose pages would fault in again at every copy."""
        if self._ring is None:
            self._ring = aligned_empty(3 * self._piece_cap() + 2 * ALIGN, torch.uint8)
            self._ring_head = 0
        nbytes = int(numel) * dtype.itemsize
        lead = int(start) * dtype.itemsize % ALIGN
        at = self._ring_head + (lead - self._ring_head) % ALIGN
        if at + nbytes > self._ring.numel():
            at = lead  # wrap around
        while any(a < at + nbytes and at < b for _, _, (a, b) in self._piece_writes):
            self._wait_piece()  # the oldest first: the ring is filled in order
        self._ring_head = at + nbytes
        return self._ring[at:at + nbytes].view(dtype), (at, at + nbytes)

    def staging_bytes(self) -> int:
        """Bytes of the step's staging ring (0 outside a step that writes shard files)."""
        return self._ring.numel() if self._ring is not None else 0

    def _wait_piece(self) -> None:
        handle, nbytes, _ = self._piece_writes.popleft()
        self._piece_bytes -= nbytes
        handle.wait()

    def bytes_on_disk(self) -> int:
        """Bytes of parameter shards in files (``offload_param.device`` nvme)."""
        return self.store.bytes_on_disk() if self.store is not None else 0

    def local_shard(self, index: int) -> torch.Tensor:
        """This rank's shard of segment ``index``; a file-resident one is read in (kept until :meth:`after_step`)."""
        if index not in self.in_files:
            return self.shards[index]
        if index not in self.loaded:
            seg = self.segments[index]
            buf = aligned_empty(seg.shard_size, seg.dtype, self.pin)  # page-aligned: O_DIRECT
            self.loaded[index] = self.store.read(f"shard{index}", buf)
            self.note_loaded(sum(t.nbytes for t in self.loaded.values()))
        return self.loaded[index]

    def note_loaded(self, nbytes: int) -> None:
        """Record that ``nbytes`` of file-resident shards are held whole (for :attr:`peak_loaded_bytes`)."""
        self.peak_loaded_bytes = max(self.peak_loaded_bytes, int(nbytes))

    def _set_status(self, seg: Segment, state: int) -> None:
        self.status[seg.index] = state
        for p in seg.params:
            p.ds_status = _DS_STATUS[state]

    def _point(self, seg: Segment, flat: torch.Tensor) -> None:
        for p, view in zip(seg.params, seg.views(flat), strict=True):
            unwatch(p)  # first: setting .data on a watched parameter would go through its __torch_function__
            p.data = view

    def _drop(self, seg: Segment) -> None:
        if not seg.persistent and self.status.get(seg.index, RELEASED) != RELEASED:
            self.live -= seg.padded
        for p in seg.params:
            p.data = self._placeholder(p)
            watch(p)  # last, for the same reason
        pages = self.pages.get(seg.index)
        if pages is not None:
            pages.release()
        else:
            self.flats[seg.index].untyped_storage().resize_(0)
        self._set_status(seg, RELEASED)

    # -- gather / release ------------------------------------------------------------------------

    def _launch(self, seg: Segment, async_op: bool) -> None:
        flat = self.flats[seg.index]
        if seg.index not in self.pages:
            flat.untyped_storage().resize_(seg.padded * flat.element_size())
        shard, pooled = self.shards[seg.index], None
        if seg.index in self.in_files:  # offload_param nvme: read for this gather only (unless held for a step)
            shard = self.loaded.get(seg.index)
            ahead = self.reads.pop(seg.index, None)
            if ahead is not None:  # read ahead by a prefetch: done by now, or soon
                ahead[0].wait()
                if shard is None:
                    shard = pooled = ahead[1]
                    self.stats["read_ahead"] += 1
                else:
                    self.shard_pool.give(ahead[1])
            elif shard is None:
                shard = pooled = self.store.read(f"shard{seg.index}", self.shard_pool.take(seg.shard_size, seg.dtype))
        if shard.device != flat.device:  # offload_param: host shard to the compute device first
            shard = shard.to(flat.device, non_blocking=True)
        work = _gather_into(flat, shard, seg.group, async_op)
        if pooled is not None:  # copied into the flat buffer (or to the device) already: free again
            self.shard_pool.give(pooled)
        self.works[seg.index] = work
        self._set_status(seg, INFLIGHT)
        self.live += seg.padded
        self.stats["gathers"] += 1
        self.stats["sync"] += not async_op
        self.stats["peak_live"] = max(self.stats["peak_live"], self.live)

    def fetch(self, index: int) -> None:
        """Make segment ``index``'s parameters whole (waiting for a prefetch, or gathering now)."""
        seg = self.segments[index]
        state = self.status[index]
        if state == RELEASED:
            self._launch(seg, async_op=False)
        work = self.works.pop(index, None)
        if work is not None:
            work.wait()
        if self.status[index] != AVAILABLE:
            self._point(seg, self.flats[index])
            self._set_status(seg, AVAILABLE)

    def release(self, index: int) -> None:
        """Give back segment ``index``'s gathered memory (persistent segments stay whole)."""
        seg = self.segments[index]
        if seg.persistent or self.status[index] == RELEASED:
            return
        self.held.discard(index)
        work = self.works.pop(index, None)
        if work is not None:
            work.wait()
        self._drop(seg)

    def live_elements(self) -> int:
        """Elements of non-persistent segments gathered or being gathered now."""
        return self.live

    def _prefetch(self, indices: Iterable[int]) -> None:
        """Launch the gathers of ``indices`` (in order of use), up to the prefetch and live budgets; then, with
        shards in files, start reading the shards of the next ``stage3_prefetch_bucket_size`` elements beyond."""
        budget = self.cfg.prefetch_bucket_size
        live = self.live
        ahead = 0
        rest = iter(indices)
        for index in rest:
            seg = self.segments[index]
            if seg.persistent or self.status[index] != RELEASED:
                continue
            if ahead >= budget or live + seg.padded > self.cfg.max_live_parameters:
                rest = chain((index,), rest)
                break
            self._launch(seg, async_op=True)
            ahead += seg.padded
            live += seg.padded
        if self.in_files:
            self._read_ahead(rest, budget)

    def _read_ahead(self, indices: Iterable[int], budget: int) -> None:
        """Start reading the file-resident shards of ``indices`` (in order of use) whose gathers are not launched,
        ``budget`` elements of segments in all (those read already count): the read runs while the modules before
        them compute, and their gathers, launched by a later prefetch or fetch at the same point on every rank as
        always, find the shard in memory. Reads only: no collective starts here."""
        ahead = 0
        for index in indices:
            seg = self.segments[index]
            if seg.persistent or self.status[index] != RELEASED or index in self.loaded:
                continue
            if ahead + seg.padded > budget:
                break
            ahead += seg.padded
            if index in self.in_files and index not in self.reads:
                buf = self.shard_pool.take(seg.shard_size, seg.dtype)  # page-aligned: O_DIRECT
                self.reads[index] = (self.store.read_async(f"shard{index}", buf), buf)

    def forget_read(self, index: int) -> None:
        """Drop segment ``index``'s read-ahead, if any, once it finished (its buffer is being written): before
        the shard's file changes, as a later gather must not send what the read found."""
        ahead = self.reads.pop(index, None)
        if ahead is not None:
            ahead[0].wait()
            self.shard_pool.give(ahead[1])

    # -- module hooks ----------------------------------------------------------------------------

    def _install_hooks(self, model: torch.nn.Module) -> None:
        for module in model.modules():  # the innermost running one owns what is gathered on use
            if module is not model and next(module.parameters(), None) is None and not hasattr(
                    module, "_external_params"):
                continue  # no parameter in its sub-tree (activations, dropout): its parent's frame serves
            self.handles.append(module.register_forward_pre_hook(lambda m, a: self._pre_forward(m)))
            self.handles.append(module.register_forward_hook(lambda m, a, out: self._post_forward(m, out)))

    def _needed(self, module: torch.nn.Module, leaf: bool) -> list[int]:
        """Segments ``module``'s forward needs: its own (a leaf: its sub-tree's) and its external ones."""
        if leaf:
            base = self.subtree.get(module)
            if base is None:
                base = sorted({self.seg_of[id(p)] for p in module.parameters() if id(p) in self.seg_of})
                self.subtree[module] = base
        else:
            base = self.module_segments.get(module, [])
        extra = self.auto_external.get(module)
        registered = getattr(module, "_external_params", None)
        if not extra and not registered:
            return base
        more = set(extra or ()) | {self.seg_of[id(p)] for p in external_parameters(module) if id(p) in self.seg_of}
        return sorted(set(base) | more)

    def _pre_forward(self, module: torch.nn.Module) -> None:
        if self.leaf_depth:
            return  # inside a leaf module: it gathered its whole sub-tree
        self.active = True
        leaf = is_leaf(module)
        needed = self._needed(module, leaf)
        self.stack.append(_Frame(module, list(needed), leaf))
        if leaf:
            self.leaf_depth += 1
        if not needed:
            return
        self._make_room(needed)
        for index in needed:
            self.fetch(index)
            self.uses[index] = self.uses.get(index, 0) + 1
            self.trace.append(index)
        n = len(self.trace)
        if not (n <= len(self.order) and self.order[n - 1] == self.trace[-1]):  # another forward (pipeline chunk)
            self._select_order(lambda order: order[:n] == self.trace)
        if self.order and n <= len(self.order) and self.order[n - 1] == self.trace[-1]:
            self._prefetch(chain(self.order[n:], self._next_order()))

    def _post_forward(self, module: torch.nn.Module, outputs: Any) -> None:
        if not self.stack or self.stack[-1].module is not module:
            return  # a child of a leaf module (no frame of its own)
        frame = self.stack.pop()
        if frame.leaf:
            self.leaf_depth -= 1
        needed = sorted(set(frame.indices))
        for index in frame.indices:
            self.uses[index] -= 1
        for index in needed:
            if self.uses[index] == 0 and index not in self.held and not self._reused_soon(index):
                self.release(index)
        if needed and torch.is_grad_enabled():
            tensors = [t for t in _tensors(outputs) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _grads, needed=needed: self._pre_backward(needed), mode="any")
        if not self.stack and not torch.is_grad_enabled():
            self.active = False  # no backward follows: stop gathering on use

    def on_access(self, params: list[torch.nn.Parameter], name: str) -> None:
        """A torch function ``name`` uses released ``params`` during forward: gather their segments now and
        register them with the innermost running module (see the module docstring)."""
        if name in _NO_GATHER or not self.active:
            return
        indices = sorted({p._zero[1] for p in params if self.status.get(p._zero[1], AVAILABLE) != AVAILABLE})
        for index in indices:
            self.fetch(index)
            if self.stack:
                frame = self.stack[-1]
                frame.indices.append(index)
                self.uses[index] = self.uses.get(index, 0) + 1
                self.auto_external.setdefault(frame.module, set()).add(index)
            elif not self.segments[index].persistent:
                self.held.add(index)

    def _reused_soon(self, index: int) -> bool:
        """Whether segment ``index`` is used again within ``stage3_max_reuse_distance`` elements — later in this
        pass or in the next one — and what is gathered until then fits ``stage3_max_live_parameters`` with it
        (keeping it never stalls a prefetch)."""
        limit = min(self.cfg.max_reuse_distance, self.cfg.max_live_parameters - self.live)
        if limit < 0:
            return False
        distance = 0
        for later in self._lookahead():
            if later == index:
                return True
            distance += self.segments[later].padded
            if distance > limit:
                return False
        return False

    def _lookahead(self) -> Iterator[int]:
        """The segments still to be used, in order: the rest of the running pass, then the next pass."""
        if self.in_backward:
            rest = reversed(self.order[:max(0, len(self.order) - 1 - self.bw_cursor)])
        else:
            rest = iter(self.order[len(self.trace):])
        return chain(rest, self._next_order())

    def _next_order(self) -> list[int]:
        """The order in which the next compute pass uses segments (``[]``: unknown, or the step comes first)."""
        if self._upcoming is None:
            self._upcoming = self._find_next_order()
        return self._upcoming

    def _find_next_order(self) -> list[int]:
        if self.plan is not None:  # announced by the schedule
            upcoming = self.plan[1]
            recorded = self.chunk_orders.get(upcoming[1]) if upcoming is not None else None
            if recorded is None:
                return []
            return list(recorded[0]) if upcoming[0] == "forward" else list(reversed(recorded[0]))
        if self.in_backward:  # engine.backward: the next micro-step's forward, unless the step comes first
            ctx = getattr(self.rt.engine, "ctx", None)
            return [] if ctx is None or ctx.boundary else list(self.order)
        if torch.is_grad_enabled():  # engine(x) with gradients: its backward follows
            return list(reversed(self.order))
        return []

    def _release_unless_next(self) -> None:
        """End of a pass: release every gathered segment but those the next pass uses early (within the reuse
        distance, and with what it gathers before them within the live budget), then prefetch the next pass's
        first segments."""
        upcoming = self._next_order()
        keep: set[int] = set()
        limit, room = self.cfg.max_reuse_distance, self.cfg.max_live_parameters
        live = sum(self.segments[i].padded for i in self.held if not self.segments[i].persistent)
        distance = 0
        for index in upcoming:
            seg = self.segments[index]
            if distance > limit:
                break
            if not seg.persistent and self.status[index] != RELEASED and index not in keep:
                if live + distance + seg.padded > room:
                    break
                keep.add(index)
                live += seg.padded
            distance += seg.padded
        for seg in self.segments:
            if seg.index not in self.held and seg.index not in keep:
                self.release(seg.index)
        self._prefetch(upcoming)

    def _make_room(self, needed: list[int]) -> None:
        """Before gathering ``needed``: release idle gathered segments (kept or prefetched ones no running
        module holds; the furthest next use first) until the gathers fit ``stage3_max_live_parameters``."""
        room = self.cfg.max_live_parameters
        need = sum(self.segments[i].padded for i in set(needed)
                   if not self.segments[i].persistent and self.status[i] == RELEASED)
        if self.live + need <= room:
            return
        protect = set(needed) | self.held | self.busy
        idle = [s.index for s in self.segments if not s.persistent and self.status[s.index] != RELEASED
                and not self.uses.get(s.index) and s.index not in protect]
        if not idle:
            return
        first_use: dict[int, int] = {}
        for pos, index in enumerate(self._lookahead()):
            first_use.setdefault(index, pos)
        for index in sorted(idle, key=lambda i: first_use.get(i, len(self.segments) * 4), reverse=True):
            if self.live + need <= room:
                break
            self.release(index)

    def announce(self, current: tuple[str, Any], upcoming: tuple[str, Any] | None) -> None:
        """A schedule starts pass ``current`` (``(kind, chunk)``) and runs ``upcoming`` next (``None``: the step)."""
        self.plan = (current, upcoming)
        self._upcoming = None
        recorded = self.chunk_orders.get(current[1])
        if recorded is not None:
            self.order, self.position = recorded

    def _select_order(self, matches: Any) -> None:
        """Prefetch along the most recent recorded order for which ``matches(order)`` holds, if any.

        A pipeline runs several different forwards per step (one per chunk, interleaved with backwards);
        each keeps its own recorded order, so prefetching follows the schedule across them.
        """
        for order, position in reversed(self.orders.values()):
            if matches(order):
                self.order, self.position = order, position
                return

    def _pre_backward(self, needed: list[int]) -> None:
        if not self.in_backward:
            self.in_backward = True
            self._upcoming = None
        self._make_room(needed)
        for index in needed:
            self.fetch(index)
        self.busy.update(needed)
        if any(i not in self.position for i in needed):  # the backward of another forward (pipeline chunk)
            self._select_order(lambda order: all(i in order for i in needed))
        if self.order:
            n = len(self.order)
            self.bw_cursor = first = min(n - 1 - max(self.position.get(i, [0])) for i in needed)
            self._prefetch(chain(reversed(self.order[:max(0, n - 1 - first)]), self._next_order()))

    # -- engine events ---------------------------------------------------------------------------

    def after_forward(self) -> None:
        """Record the execution order (for prefetching); release what a prefetch left gathered."""
        if self.trace:
            self.order = list(self.trace)
            self.position = {}
            for pos, index in enumerate(self.order):
                self.position.setdefault(index, []).append(pos)
            key = frozenset(self.order)
            self.orders.pop(key, None)
            self.orders[key] = (self.order, self.position)
            if len(self.orders) > 8:  # a model whose forwards differ freely: keep the recent ones
                del self.orders[next(iter(self.orders))]
            if self.plan is not None and self.plan[0][0] == "forward":
                self.chunk_orders[self.plan[0][1]] = (self.order, self.position)
        self.trace = []
        self.uses.clear()
        self.stack.clear()
        self.leaf_depth = 0
        if not torch.is_grad_enabled():
            self.active = False
        self.in_backward = False
        self._upcoming = None
        self._release_unless_next()
        self.plan, self._upcoming = None, None

    def after_reduced(self, seg: Segment) -> None:
        """A segment's gradients were staged for reduction: its parameters are not needed in this backward (kept when
        the next pass uses them soon)."""
        self.busy.discard(seg.index)
        if not self._reused_soon(seg.index):
            self.release(seg.index)

    def after_backward(self) -> None:
        """Release every segment still gathered (frozen parameters, unused prefetches) but those the next pass
        uses first."""
        self.active = False
        self.held.clear()
        self.in_backward = True  # a backward in which no module hook ran still ends as one
        self._upcoming = None
        self._release_unless_next()
        self.in_backward, self.bw_cursor = False, -1
        self.busy.clear()
        self.plan, self._upcoming = None, None

    def after_optimizer_step(self) -> None:
        """The shards were stepped: no whole copy may outlive the step (it would be stale); the step's writes into
        shard files are waited for (their errors surface here)."""
        while self._piece_writes:
            self._wait_piece()
        self._ring = None
        for seg in self.segments:
            self.release(seg.index)
            self.forget_read(seg.index)  # read before the step's writes (no prefetch crosses a step: spares)

    def after_step(self, seg: Segment) -> None:
        """A segment's shard was updated: refresh persistent segments' whole copy (lazily waited); write
        a file-resident shard back."""
        if seg.index in self.in_files:
            self.forget_read(seg.index)
            shard = self.loaded.pop(seg.index, None)  # else the step wrote its pieces into the file
            if shard is not None:
                self.store.write(f"shard{seg.index}", shard)
            return
        if seg.persistent:
            pending = self.works.pop(seg.index, None)
            if pending is not None:  # a refresh no module waited for (its module did not run)
                pending.wait()
            self.works[seg.index] = _gather_into(self.flats[seg.index], self.shards[seg.index], seg.group, True)
            self._set_status(seg, INFLIGHT)  # its next use waits (fetch), and so does a use on access
            for p in seg.params:
                watch(p)

    @contextlib.contextmanager
    def without_hooks(self) -> Iterator[None]:
        """The block runs without the module hooks (installed again after it), every segment gathered now kept
        gathered (an engine pass ending inside it releases none): for a caller that made every segment whole
        (:func:`microspeed_zero.generation.unwrap_model_for_generation`), so its forwards neither gather nor
        release per module, nor change the recorded order."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        held = {s.index for s in self.segments if self.status[s.index] == AVAILABLE and not s.persistent}
        self.held.update(held)
        try:
            yield
        finally:
            self.held.difference_update(held)
            self._install_hooks(self.model)

    def destroy(self) -> None:
        """The engine's ``destroy()``: finish the gathers and shard writes in flight, remove the module hooks and
        close the shard files (removed: the model's partitioned parameters cannot be gathered afterwards)."""
        for work in self.works.values():
            if work is not None:
                work.wait()
        self.works.clear()
        while self._piece_writes:
            self._wait_piece()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.store is not None:
            self.store.close()

    def wait_all(self) -> None:
        """Wait for every pending gather (before reading parameters outside forward)."""
        for index in list(self.works):
            self.fetch(index) if self.segments[index].persistent else self.release(index)

    def resident_bytes(self, size: Any) -> int:
        """Bytes of shards in memory (file-resident ones read in whole or ahead too) and persistent whole segments
        (``size`` counts each storage once)."""
        total = sum(size(s) for s in self.shards.values() if s is not None)
        total += sum(size(s) for s in self.loaded.values())
        total += sum(size(buf) for _, buf in self.reads.values())
        total += self.shard_pool.kept_bytes() if self.shard_pool is not None else 0
        return total + sum(size(self.flats[s.index]) for s in self.segments if s.persistent)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _refresh_persistent(self: ParameterPartitioner) -> None:
    """After shards were loaded from a checkpoint: write file-resident ones back, make persistent ones whole."""
    for index in list(self.in_files):
        if index in self.loaded:
            self.after_step(self.segments[index])
    for seg in self.segments:
        if seg.persistent:
            self.works.pop(seg.index, None)
            _gather_into(self.flats[seg.index], self.shards[seg.index], seg.group, False)


ParameterPartitioner.refresh_persistent = _refresh_persistent
