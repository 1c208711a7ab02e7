"""ZeRO-Infinity-style NVMe offload of the optimizer: masters and the optimizer's state stream from files.

With ``zero_optimization.offload_optimizer.device = "nvme"`` this rank's fp32 master partition
and the optimizer's element-wise state — Adam's two moments (three with AMSGrad), or the tensors an
optimizer declares through :class:`~microspeed.plugin_api.ElementwiseState` — live in files under
a fresh private folder ``<nvme_path>/microspeed_zero/rank<r>-optimizer-<random>`` (mode 0700, one per
swapper: :meth:`microspeed_zero.nvme.TensorFileStore.private`, so engines sharing ``nvme_path`` never share
files and nobody else can plant one), not in memory.

Layout: the elements of this rank's optimizer *runs* (:attr:`ZeroOptimizer.runs` — the stretches
of each segment's slice whose parameters share a param group; padding and frozen parameters are
not stored) are concatenated over ``rt.optimized`` in order and cut into *sub-groups* of at most
``zero_optimization.sub_group_size`` elements. A sub-group may span several segments and runs, or
hold a piece of one. Each sub-group has one file per tensor (``master``, ``exp_avg``,
``exp_avg_sq``, ...: :attr:`OptimizerSwapper.tensor_names`); a slot of the in-memory streaming
buffers holds one sub-group of each.

The step (:meth:`OptimizerSwapper.step`): sub-groups go through ``buffer_count`` slots with a
:class:`~microspeed_zero.nvme.Prefetcher` — while Adam runs on one sub-group the next ones are
read, and each stepped sub-group is written back asynchronously. Sub-groups are visited so that
segments complete in the forward order the runtime passes; a segment's new values are written
into the parameters' slice as each of its pieces is stepped, and the segment is published
(all-gathered, or refreshed at stage 3) as soon as all of its pieces are done — always in that
order, so every rank issues the same collectives in the same order. Adam is torch's own
functional kernel (``torch.optim.adam.adam``: the same single-tensor / foreach / fused path the
param group asks for), on each run piece with its group's live hyper-parameters and its run's
step count, so the results equal ``torch.optim.Adam``/``AdamW`` on the whole partition.

Any other optimizer must declare its state element-wise (:class:`~microspeed.plugin_api.ElementwiseState`:
the 1-bit Adam, 0/1 Adam and 1-bit LAMB do): its declared tensors are streamed (files start at the
declared initial values), its scalar state (``step``, schedules) stays in ``inner.state[run view]``,
and each sub-group is stepped by the optimizer's own ``step()`` with the sub-group's pieces as its
parameters — views of the slot carrying their gradient slice, the run view's attributes and
``partition_pieces`` cut to the piece, their state the run's scalars as they were before the step plus
views of the slot's state tensors. Element-wise, that equals the optimizer stepping the whole partition.
An optimizer that needs sums over whole parameters (:class:`~microspeed.plugin_api.ParameterSums`:
1-bit LAMB's trust ratios) first gets a read-only pass over every sub-group for its partial sums and one
collective over the group, then the update pass: its state is read twice and written once per step
(Adam: once each).

Gradients: at stages 2 and 3 the gradient partition lives in these files too, one more file per sub-group
(:class:`~microspeed_zero.grad_swap.GradientSwapper`, :attr:`OptimizerSwapper.gradients`): backward writes each
reduced segment's pieces into them, the step reads each sub-group's gradient through slots of its own beside
the masters and moments, and the runtime never holds the gradient partition. At stage 1 (whole gradients in
memory) the step takes the runtime's fp32 gradient partition instead.

The masters are written from the parameters' shards one segment at a time (a file-resident stage-3 shard is
read for it and dropped), and the step writes each piece's new values into the parameters' shard (a
file-resident one piece by piece: :meth:`~microspeed_zero.runtime.ZeroRuntime.store_params`), so nothing in
the swapper's life holds the whole partition.

Resident memory between steps: the slots only, ``buffer_count x largest sub-group x (4 bytes x
tensors per sub-group)`` (:meth:`OptimizerSwapper.budget_bytes`), plus the gradient buffers
(:meth:`~microspeed_zero.grad_swap.GradientSwapper.budget_bytes`). The step adds Adam's temporaries (a few
sub-group-sized tensors).

Checkpoints stream too: a save hands each master and state tensor as :class:`SwapPiece` s (on-demand
checkpoint pieces that read exactly their elements from the sub-group files when the core writes them,
through its bounded buffer), and a load fills one sub-group at a time in a slot
(:meth:`OptimizerSwapper.load_subgroups`) and writes it back, so neither holds more than a slot and one
read window, whatever the partition's size. User reads (``safe_get_full_fp32_param``) see the state through
:meth:`OptimizerSwapper.resident` (read everything into fresh tensors for the duration) or
:meth:`OptimizerSwapper.materialize` / :meth:`OptimizerSwapper.evict` (fill in place, then write back).
:attr:`OptimizerSwapper.peak_held_bytes` records the most optimizer-state bytes held beside the slots.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.adam import adam as _adam

from microspeed.plugin_api import ConfigError, ElementwiseState, ParameterSums
from microspeed_zero.aio import aligned_empty
from microspeed_zero.grad_swap import GradientSwapper
from microspeed_zero.nvme import Prefetcher, SwapHandle, TensorFileStore

MOMENTS: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
"""Adam's element-wise state tensors kept in files (``max_exp_avg_sq`` is added when a group uses AMSGrad)."""

ADAM: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizers the swapper steps with torch's functional Adam itself (others must declare :class:`ElementwiseState`)."""

_PLACEHOLDER = torch.zeros(1)  # what a run view points at while nothing is resident (reads 0, refuses writes)


@dataclass(frozen=True)
class Piece:
    """A stretch of one run inside one sub-group.

    ``run``: index into ``rt.optimizer.runs``; ``seg``: the segment's index; ``start:end``: the
    range within the rank's slice of the segment; ``lo:hi``: the same elements within the sub-group.
    """

    run: int
    seg: int
    start: int
    end: int
    lo: int
    hi: int


@dataclass
class SubGroup:
    """One unit of streaming: ``numel`` elements, made of :class:`Piece` s, one file per tensor (``keys``)."""

    index: int
    numel: int
    pieces: list[Piece] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    @property
    def segments(self) -> list[int]:
        """Indices of the segments this sub-group holds pieces of (each once, in layout order)."""
        return list(dict.fromkeys(p.seg for p in self.pieces))


class SwapPiece:
    """Elements ``[start, end)`` of this rank's slice of segment ``seg``, of state tensor ``tensor_names[j]``.

    A checkpoint piece read on demand (:class:`~microspeed.plugin_api.OnDemandPiece`): :meth:`read_into`
    reads exactly the asked elements from the sub-group files; slicing (``piece[a:b]``, offsets from
    ``start``) gives a narrower piece, as slicing the slice's tensor would.
    """

    def __init__(self, swapper: OptimizerSwapper, seg: int, j: int, start: int, end: int) -> None:
        self.swapper, self.seg, self.j, self.start, self.end = swapper, seg, j, int(start), int(end)
        self.numel = self.end - self.start
        self.dtype = torch.float32

    def __getitem__(self, item: slice) -> SwapPiece:
        a, b, _ = item.indices(self.numel)
        return SwapPiece(self.swapper, self.seg, self.j, self.start + a, self.start + max(a, b))

    def read_into(self, out: torch.Tensor, offset: int = 0) -> None:
        """Fill ``out`` (1-D, contiguous fp32) with this piece's elements ``[offset, offset + out.numel())``."""
        a = self.start + int(offset)
        if a + out.numel() > self.end:
            raise ValueError(f"SwapPiece.read_into: elements {offset}..{offset + out.numel()} of {self.numel}")
        self.swapper.read_range(self.seg, self.j, a, out)


def _global_rank(rt: Any) -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(rt.rank)


class OptimizerSwapper:
    """This rank's masters and optimizer state (Adam/AdamW's, or declared) in NVMe files, streamed through buffers.

    Built by the ZeRO plugin right after ``rt.wrap(optimizer)`` with
    ``offload_optimizer.device = "nvme"``: it lays the runs out in sub-groups, writes the masters
    (and the initial state) to the files and drops the in-memory masters (``rt.masters`` becomes
    ``{}``; the run views of ``rt.optimizer`` point at a zero-stride placeholder while nothing is
    resident). See the module docstring for the layout and the step.
    """

    def __init__(self, rt: Any) -> None:
        opt, cfg = rt.optimizer, rt.cfg
        self.adam = opt.base_class in ADAM
        if not self.adam and not isinstance(opt.inner, ElementwiseState):
            name = opt.base_class.__name__
            raise ConfigError(
                f"zero_optimization.offload_optimizer.device='nvme' with the optimizer {name}: the NVMe swapper "
                f"streams optimizer state it knows to be element-wise, that of torch.optim.Adam/AdamW or of an "
                f"optimizer declaring it (microspeed.plugin_api.ElementwiseState: the 1-bit optimizers), and {name} "
                f"declares none; use optimizer.type 'Adam'/'AdamW', or offload_optimizer.device 'cpu' or 'none'.")
        if not cfg.offload_optimizer_nvme_path:
            raise ConfigError("zero_optimization.offload_optimizer.device='nvme' needs "
                              "zero_optimization.offload_optimizer.nvme_path (a folder to keep the state in).")
        self.rt = rt
        self.keys: set[int] = set(rt.masters)
        self.closed = False
        if self.adam:
            self.amsgrad = any(bool(g.get("amsgrad", False)) for g in opt.param_groups)
            self.initial: dict[str, float] = dict.fromkeys(MOMENTS + (("max_exp_avg_sq",) if self.amsgrad else ()),
                                                           0.0)
        else:
            self.amsgrad = False
            self.initial = {str(k): float(v) for k, v in opt.inner.elementwise_state().items()}
        self.tensor_names: tuple[str, ...] = ("master", *self.initial)
        self._runs = list(opt.runs)
        self._steps: list[float] = [0.0] * len(self._runs)
        self._scalars: list[dict[str, Any]] = [{} for _ in self._runs]  # non-Adam: the state's scalars (resident())
        self.subgroups = self._layout(max(1, int(cfg.sub_group_size)))
        self._parts = {p: self._piece_parts(p) for sg in self.subgroups for p in sg.pieces}
        self._cover: dict[int, int] = {}
        for sg in self.subgroups:
            for s in sg.segments:
                self._cover[s] = self._cover.get(s, 0) + 1
        largest = max((sg.numel for sg in self.subgroups), default=0)
        pin = bool(cfg.pin_memory) and torch.cuda.is_available()
        count = min(int(cfg.buffer_count), len(self.subgroups))
        self._slots = [[aligned_empty(largest, torch.float32, pin) for _ in self.tensor_names]
                       for _ in range(count)]
        self._budget = int(cfg.buffer_count) * largest * 4 * len(self.tensor_names)
        self._prefetchers: dict[tuple[Any, ...], Prefetcher] = {}
        self.gradients: GradientSwapper | None = None
        """Stages 2, 3: the gradient partition in the sub-group files (see the module docstring)."""
        self._where: dict[int, list[tuple[int, int, SubGroup, int]]] = {}  # seg -> (start, end, sub-group, lo)
        for sg in self.subgroups:
            for p in sg.pieces:
                self._where.setdefault(p.seg, []).append((p.start, p.end, sg, p.lo))
        for spans in self._where.values():
            spans.sort(key=lambda w: w[0])
        self.peak_held_bytes = 0
        """The most bytes of optimizer state held in memory beside the slots so far (:meth:`resident` /
        :meth:`materialize` copies; a checkpoint load's read windows); reset it to measure a span."""
        self._depth = 0  # nesting of resident()
        self._resident = False
        self._with_states = False
        self._materialized = False
        self._writeback = False
        self.store = TensorFileStore.private(cfg.offload_optimizer_nvme_path, _global_rank(rt), "optimizer",
                                             **cfg.aio.store_options())  # the aio section: direct I/O
        try:
            self._write_initial(dict(rt.masters))
            if rt.streams_gradients:
                self.gradients = GradientSwapper(self, rt.grad_dtype, rt.norm_inputs, rt.scaler is not None)
        except BaseException:
            self.store.close()
            raise
        self._release_masters()

    # -- layout and set-up ---------------------------------------------------------------------

    def _layout(self, cap: int) -> list[SubGroup]:
        """Cut the concatenated runs (over ``rt.optimized`` in order) into sub-groups of <= ``cap`` elements."""
        position = {seg.index: i for i, seg in enumerate(self.rt.optimized)}
        order = sorted(range(len(self._runs)),
                       key=lambda r: (position.get(self._runs[r][0].index, len(position)), self._runs[r][2]))
        subgroups: list[SubGroup] = []
        current: SubGroup | None = None
        for r in order:
            seg, _g, start, end, _view = self._runs[r]
            a = start
            while a < end:
                if current is None or current.numel == cap:
                    current = SubGroup(len(subgroups), 0)
                    subgroups.append(current)
                b = min(end, a + cap - current.numel)
                current.pieces.append(Piece(r, seg.index, a, b, current.numel, current.numel + b - a))
                current.numel += b - a
                a = b
        for sg in subgroups:
            sg.keys = [f"subgroup{sg.index:05d}/{name}" for name in self.tensor_names]
        return subgroups

    def _piece_parts(self, piece: Piece) -> tuple[int, tuple[tuple[int, int, int], ...]] | None:
        """The run view's ``partition_pieces`` cut to ``piece`` (offsets from the piece's start), or ``None``."""
        _seg, _g, run_start, _end, view = self._runs[piece.run]
        parts = getattr(view, "partition_pieces", None)
        if parts is None:
            return None
        off, n = piece.start - run_start, piece.end - piece.start
        return parts[0], tuple((i, max(lo, off) - off, min(hi, off + n) - off) for i, lo, hi in parts[1]
                               if max(lo, off) < min(hi, off + n))

    def _write_initial(self, masters: dict[int, torch.Tensor]) -> None:
        """Masters into their files (staged through the slots, one write in flight per slot); state tensors that
        start at zero as zero (sparse) files, which cost no memory, the others filled with their initial value.

        A master the runtime did not build (``rt.lazy_masters``) is taken from the parameters' shard
        (:meth:`~microspeed_zero.runtime.ZeroRuntime.initial_master`), one segment held at a time."""
        pending: list[list[SwapHandle]] = [[] for _ in self._slots]
        held: tuple[int, torch.Tensor] | None = None
        for k, sg in enumerate(self.subgroups):
            slot = k % len(self._slots)
            for h in pending[slot]:
                h.wait()
            buf = self._slots[slot][0][:sg.numel]
            for p in sg.pieces:
                master = masters[p.seg]
                if p.seg in self.rt.lazy_masters:
                    if held is None or held[0] != p.seg:
                        held = (p.seg, self.rt.initial_master(self.rt.segments[p.seg]))
                    master = held[1]
                buf[p.lo:p.hi].copy_(master[p.start:p.end])
            pending[slot] = [self.store.write_async(sg.keys[0], buf)]
            for j, (key, value) in enumerate(zip(sg.keys[1:], self.initial.values(), strict=True), start=1):
                if value == 0.0:
                    self.store.allocate(key, sg.numel, torch.float32)
                else:
                    pending[slot].append(self.store.write_async(key, self._slots[slot][j][:sg.numel].fill_(value)))
        for handles in pending:
            for h in handles:
                h.wait()

    def _release_masters(self) -> None:
        """Drop the in-memory masters: run views point at a placeholder, masters lose their storage (an offloaded
        optimizer's masters are never the parameters themselves)."""
        rt = self.rt
        for *_, view in self._runs:
            view.data = _PLACEHOLDER.expand(view.numel())
        for master in rt.masters.values():
            master.data = torch.empty(0, dtype=master.dtype)  # the views above were its last other users
        rt.masters = {}
        rt.lazy_masters.clear()

    def _prefetcher(self, order: list[int], names: int) -> Prefetcher:
        """A :class:`Prefetcher` over sub-groups ``order`` (first ``names`` tensors of each), on the shared slots."""
        key = (tuple(order), names)
        pf = self._prefetchers.get(key)
        if pf is None:
            pf = Prefetcher(self.store, [self.subgroups[k].keys[:names] for k in order], buffers=self._slots)
            self._prefetchers[key] = pf
        return pf

    # -- the step ------------------------------------------------------------------------------

    def step(self, order: list[Any], g32: dict[int, torch.Tensor], coef: Any) -> None:
        """One optimizer step of this rank's partition, streamed from the files.

        ``order``: the optimized segments in the order to publish them (forward order);
        ``g32[seg.index]``: this rank's averaged fp32 CPU gradient slice of each (scaled in place by
        ``coef``, a float or 0-d tensor folding loss unscaling and clipping) — unused when the gradients
        are in the files (:attr:`gradients`: each sub-group's is read beside its state, converted and
        scaled in a buffer). New master values are written into the parameters' slice
        (``rt.store_params``) and each segment is published (``rt.publish``) once all
        of its sub-groups are stepped. Adam/AdamW: torch's functional Adam on each sub-group's pieces.
        Another optimizer (:class:`ElementwiseState`): its own ``step()`` on the pieces, as parameters
        viewing the slot (see :meth:`_step_pieces`); one asking for whole-parameter sums
        (:class:`ParameterSums`) first gets a read-only pass over every sub-group and one collective.
        """
        self._check_open()
        if self._depth:
            raise RuntimeError("OptimizerSwapper.step() inside swapper.resident(): the resident copy would be "
                               "stale; leave the with-block first.")
        if self._materialized:
            self.evict()
        rt = self.rt
        pos = {seg.index: i for i, seg in enumerate(order)}
        far = len(order)
        visit = sorted(range(len(self.subgroups)),
                       key=lambda k: (min(pos.get(s, far) for s in self.subgroups[k].segments), k))
        remaining = dict(self._cover)
        done = 0
        scale = not (isinstance(coef, float) and coef == 1.0)
        if scale and isinstance(coef, torch.Tensor):
            coef = coef.to(device="cpu", dtype=torch.float32)
        inner = rt.optimizer.inner
        before = after = None
        sums = False
        streamed = self.gradients is not None
        pass_coef = coef if scale else None  # applied as each sub-group's gradients are taken
        with torch.no_grad():
            if not self.adam:  # the state's scalars as they were before the step: every piece of a run starts there
                before = [self._scalar_state(inner.state.get(view, {})) for *_, view in self._runs]
                after = [dict(b) for b in before]
                if scale and not streamed:  # in memory: scaled once, in place, for both passes
                    for sg in self.subgroups:
                        for p in sg.pieces:
                            g32[p.seg][p.start:p.end].mul_(coef)
                    pass_coef = None
                sums = isinstance(inner, ParameterSums) and inner.needs_parameter_sums()
                if sums:
                    self._first_pass(visit, g32, pass_coef, before)
            try:
                if self.subgroups:
                    pf = self._prefetcher(visit, len(self.tensor_names))
                    for sg, tensors, grads in self._with_grads(pf, visit, g32, pass_coef):
                        if self.adam:
                            self._adam(sg, tensors, grads)
                        else:
                            self._step_pieces(sg, tensors, grads, before, after)
                        for p in sg.pieces:
                            rt.store_params(p.seg, p.start, tensors[0][p.lo:p.hi])
                        pf.mark_dirty()
                        for s in sg.segments:
                            remaining[s] -= 1
                        while done < len(order) and remaining.get(order[done].index, 0) == 0:
                            rt.publish(order[done])
                            done += 1
                for seg in order[done:]:
                    rt.publish(seg)
            finally:
                if sums:
                    inner.use_parameter_sums(None)
        if self.adam:
            self._steps = [s + 1.0 for s in self._steps]
        else:
            for (*_, view), scalars in zip(self._runs, after, strict=True):
                inner.state[view] = scalars

    def _scalar_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` without its streamed tensors (nor any other tensor shaped like a parameter)."""
        return {k: v for k, v in state.items()
                if k not in self.initial and not (isinstance(v, torch.Tensor) and v.dim() > 0)}

    def _with_grads(self, pf: Prefetcher, visit: list[int], g32: dict[int, torch.Tensor],
                    coef: Any) -> Iterator[tuple[SubGroup, list[torch.Tensor], list[torch.Tensor]]]:
        """Iterate ``pf`` (over sub-groups ``visit``) with each sub-group's gradients: ``(sg, tensors, grads)``,
        ``grads[j]`` the fp32 gradient of ``sg.pieces[j]`` multiplied by ``coef`` (``None``: as it is) — read from
        the gradient files in step with ``pf`` when they hold them, else slices of ``g32`` (scaled in place)."""
        files = self.gradients
        gs = files.stream(visit) if files is not None else None
        try:
            for i, tensors in pf:
                sg = self.subgroups[visit[i]]
                if gs is not None:
                    _, (grad,) = next(gs)
                    g = files.fp32(sg.index, grad, coef)
                    grads = [g[p.lo:p.hi] for p in sg.pieces]
                else:
                    grads = [g32[p.seg][p.start:p.end] for p in sg.pieces]
                    if coef is not None:
                        for g in grads:
                            g.mul_(coef)
                yield sg, tensors, grads
            if gs is not None:
                next(gs, None)  # lets the gradient stream finish its loop
        finally:
            if gs is not None:
                gs.close()

    @contextlib.contextmanager
    def _installed(self, sg: SubGroup, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                   before: list[dict[str, Any]]) -> Iterator[list[tuple[Piece, torch.Tensor]]]:
        """The inner optimizer over ``sg``'s pieces only, as parameters viewing the slot ``tensors``.

        Each piece's parameter views ``tensors[0]``, carries its gradient (``grads``, by piece) as ``grad`` and the
        run view's
        attributes (``partition_pieces`` cut to the piece); its state is the run's scalars from ``before`` plus
        the declared tensors, views of the slot. On exit the groups get their run views back, the pieces' state
        entries are removed and the optimizer :meth:`~ElementwiseState.forget` s them.
        """
        inner = self.rt.optimizer.inner
        saved = [group["params"] for group in inner.param_groups]
        lists: list[list[torch.Tensor]] = [[] for _ in saved]
        pieces: list[tuple[Piece, torch.Tensor]] = []
        for p, grad in zip(sg.pieces, grads, strict=True):
            _seg, g, _s, _e, view = self._runs[p.run]
            param = tensors[0][p.lo:p.hi]
            for key, value in vars(view).items():
                setattr(param, key, value)
            parts = self._parts[p]
            if parts is not None:
                param.partition_pieces = parts
            param.grad = grad
            state = copy.deepcopy(before[p.run])  # a piece's step must not move another's scalars (0-d tensors)
            for j, name in enumerate(self.initial, start=1):
                state[name] = tensors[j][p.lo:p.hi]
            inner.state[param] = state
            lists[g].append(param)
            pieces.append((p, param))
        try:
            for group, params in zip(inner.param_groups, lists, strict=True):
                group["params"] = params
            yield pieces
        finally:
            for group, params in zip(inner.param_groups, saved, strict=True):
                group["params"] = params
            for _, param in pieces:
                inner.state.pop(param, None)
                param.grad = None
            inner.forget([param for _, param in pieces])

    def _step_pieces(self, sg: SubGroup, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                     before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
        """The inner optimizer's own ``step()`` on ``sg``'s pieces (:meth:`_installed`); the scalars it leaves in a
        piece's state become its run's (``after``; every piece of a run leaves the same)."""
        inner = self.rt.optimizer.inner
        with self._installed(sg, tensors, grads, before) as pieces:
            inner.step()
            for p, param in pieces:
                after[p.run] = self._scalar_state(inner.state[param])

    def _first_pass(self, visit: list[int], g32: dict[int, torch.Tensor], coef: Any,
                    before: list[dict[str, Any]]) -> None:
        """For a :class:`ParameterSums` optimizer: stream every sub-group once, read-only, for the partial sums of
        the coming step; combine them over the group (one collective) and hand them to the optimizer."""
        inner = self.rt.optimizer.inner
        totals = None
        if self.subgroups:
            pf = self._prefetcher(visit, len(self.tensor_names))
            for sg, tensors, grads in self._with_grads(pf, visit, g32, coef):
                with self._installed(sg, tensors, grads, before):
                    totals = inner.parameter_sums(totals)
        else:  # nothing held here: zero partial sums (the groups hold the run views, without gradients)
            totals = inner.parameter_sums(None)
        inner.use_parameter_sums(inner.reduce_parameter_sums(totals))

    def _adam(self, sg: SubGroup, tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """torch's functional Adam on each piece of ``sg`` (grouped by param group; ``grads`` by piece), in the slot
        ``tensors``."""
        opt = self.rt.optimizer
        lists: dict[int, tuple[list[torch.Tensor], ...]] = {}
        for p, grad in zip(sg.pieces, grads, strict=True):
            g = self._runs[p.run][1]
            L = lists.setdefault(g, ([], [], [], [], [], []))
            L[0].append(tensors[0][p.lo:p.hi])
            L[1].append(grad)
            L[2].append(tensors[1][p.lo:p.hi])
            L[3].append(tensors[2][p.lo:p.hi])
            if self.amsgrad:
                L[4].append(tensors[3][p.lo:p.hi])
            L[5].append(torch.tensor(self._steps[p.run], dtype=torch.float32))
        for g, (params, grads, exp_avgs, exp_avg_sqs, maxes, steps) in lists.items():
            group = opt.param_groups[g]
            amsgrad = bool(group.get("amsgrad", False))
            if amsgrad and not self.amsgrad:
                raise RuntimeError(f"param group {g} turned amsgrad on after the NVMe swapper was built; AMSGrad "
                                   f"must be set when the optimizer is created.")
            beta1, beta2 = group["betas"]
            _adam(params, grads, exp_avgs, exp_avg_sqs, maxes if amsgrad else [], steps,
                  foreach=group.get("foreach"), fused=group.get("fused"), capturable=False, differentiable=False,
                  grad_scale=None, found_inf=None, has_complex=False,
                  decoupled_weight_decay=bool(group.get("decoupled_weight_decay",
                                                        opt.base_class is torch.optim.AdamW)),
                  amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=group["eps"], maximize=bool(group.get("maximize", False)))

    # -- checkpoints: streamed, a sub-group at a time ---------------------------------------------

    def read_range(self, seg: int, j: int, start: int, out: torch.Tensor) -> None:
        """Read elements ``[start, start + out.numel())`` of this rank's slice of segment ``seg``, tensor
        ``tensor_names[j]``, from the sub-group files into ``out`` (every element must be in a run)."""
        self._check_open()
        end = start + out.numel()
        covered = 0
        for a, b, sg, lo in self._where.get(seg, []):
            x0, x1 = max(a, start), min(b, end)
            if x0 < x1:
                self.store.read(sg.keys[j], out[x0 - start:x1 - start], offset=lo + x0 - a)
                covered += x1 - x0
        if covered != out.numel():
            raise ValueError(f"NVMe swapper: elements {start}..{end} of segment {seg} are not all optimizer state "
                             f"({covered} of {out.numel()} are)")

    def piece(self, seg: Any, j: int) -> SwapPiece:
        """The whole of this rank's slice of ``seg`` (a segment) for tensor ``tensor_names[j]``, as a :class:`SwapPiece`
        indexed like the slice (only the elements of runs may be read)."""
        return SwapPiece(self, seg.index, j, 0, seg.shard_size)

    def run_tensor_names(self, r: int) -> tuple[str, ...]:
        """The streamed state tensors run ``r`` holds (as its state dict under :meth:`resident` would)."""
        if not self.adam:
            return tuple(self.initial)
        amsgrad = self.amsgrad and bool(self.rt.optimizer.param_groups[self._runs[r][1]].get("amsgrad", False))
        return MOMENTS + (("max_exp_avg_sq",) if amsgrad else ())

    def run_scalars(self, r: int) -> dict[str, Any]:
        """Run ``r``'s scalar state (Adam: ``step`` as a 0-d float tensor), as :meth:`resident` presents it."""
        if self.adam:
            return {"step": torch.tensor(self._steps[r], dtype=torch.float32)}
        return self._scalar_state(self.rt.optimizer.inner.state.get(self._runs[r][4], {}))

    def set_run_scalars(self, r: int, scalars: dict[str, Any]) -> None:
        """Replace run ``r``'s scalar state by ``scalars`` (a checkpoint's; names absent there keep their value)."""
        if self.adam:
            step = scalars.get("step")
            if step is not None:
                self._steps[r] = float(step.item() if isinstance(step, torch.Tensor) else step)
            return
        view = self._runs[r][4]
        state = self.rt.optimizer.inner.state
        state[view] = {**self._scalar_state(state.get(view, {})),
                       **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()}}

    def load_subgroups(self, plan: Callable[[SubGroup], tuple[list[bool], Callable[[list[torch.Tensor]], None]]],
                       names: int) -> None:
        """Fill the first ``names`` tensors of every sub-group in turn, in a slot, and write them back.

        ``plan(sg)`` returns ``(whole, fill)``: per tensor, whether ``fill`` overwrites every element (else the
        tensor is first read from its file), and ``fill(bufs)``, which fills the tensors (views of the slot). The
        whole load holds one slot beside what ``fill`` reads with.
        """
        self._check_open()
        if self._depth or self._resident:
            raise RuntimeError("swapper.load_subgroups() while the state is resident; leave resident() / evict() "
                               "first.")
        slot = self._slots[0] if self._slots else []
        for sg in self.subgroups:
            bufs = [t[:sg.numel] for t in slot[:names]]
            whole, fill = plan(sg)
            for key, buf, covered in zip(sg.keys, bufs, whole, strict=False):
                if not covered:
                    self.store.read(key, buf)
            fill(bufs)
            for key, buf in zip(sg.keys, bufs, strict=False):
                self.store.write(key, buf)

    def note_held(self, nbytes: int) -> None:
        """Record that ``nbytes`` of optimizer state are held beside the slots (for :attr:`peak_held_bytes`)."""
        self.peak_held_bytes = max(self.peak_held_bytes, int(nbytes))

    # -- resident copies -----------------------------------------------------------------------

    def _load(self, states: bool) -> None:
        """Read the files into fresh per-segment tensors; fill ``rt.masters`` and (``states``) the inner state."""
        rt, opt = self.rt, self.rt.optimizer
        masters: dict[int, torch.Tensor] = {}
        for seg in rt.optimized:
            if seg.index in self.keys:
                local = rt.local_params(seg)
                m = torch.empty(seg.shard_size, dtype=torch.float32)
                m.copy_(local.detach().reshape(-1)[:seg.shard_size])  # padding and frozen elements: the parameters
                masters[seg.index] = m
        names = self.tensor_names if states else self.tensor_names[:1]
        moments = {name: {i: torch.full_like(m, self.initial[name]) for i, m in masters.items()} for name in names[1:]}
        if self.subgroups:
            for i, tensors in self._prefetcher(list(range(len(self.subgroups))), len(names)):
                for p in self.subgroups[i].pieces:
                    masters[p.seg][p.start:p.end].copy_(tensors[0][p.lo:p.hi])
                    for name, t in zip(names[1:], tensors[1:], strict=True):
                        moments[name][p.seg][p.start:p.end].copy_(t[p.lo:p.hi])
        rt.masters = masters
        self.note_held(sum(m.nbytes for m in masters.values())
                       + sum(t.nbytes for per in moments.values() for t in per.values()))
        for r, (seg, g, start, end, view) in enumerate(self._runs):
            view.data = masters[seg.index][start:end]
            if not self.adam:  # the scalars stay in the inner state between steps; the tensors join them here
                self._scalars[r] = self._scalar_state(opt.inner.state.get(view, {}))
                if states:
                    opt.inner.state[view] = {**self._scalars[r],
                                             **{name: moments[name][seg.index][start:end] for name in self.initial}}
            elif states:
                st: dict[str, Any] = {"step": torch.tensor(self._steps[r], dtype=torch.float32)}
                for name in MOMENTS:
                    st[name] = moments[name][seg.index][start:end]
                if opt.param_groups[g].get("amsgrad", False) and "max_exp_avg_sq" in moments:
                    st["max_exp_avg_sq"] = moments["max_exp_avg_sq"][seg.index][start:end]
                opt.inner.state[view] = st
        self._resident, self._with_states = True, states

    def _store_resident(self) -> None:
        """Write the resident masters (and state, if loaded) back into the files, synchronously."""
        rt, opt = self.rt, self.rt.optimizer
        names = self.tensor_names if self._with_states else self.tensor_names[:1]
        states = [opt.inner.state.get(view, {}) for *_, view in self._runs] if self._with_states else []
        pending: list[list[SwapHandle]] = [[] for _ in self._slots]
        for k, sg in enumerate(self.subgroups):
            slot = k % len(self._slots)
            for h in pending[slot]:
                h.wait()
            bufs = [t[:sg.numel] for t in self._slots[slot][:len(names)]]
            for p in sg.pieces:
                bufs[0][p.lo:p.hi].copy_(rt.masters[p.seg][p.start:p.end])
                run_start = self._runs[p.run][2]
                for name, buf in zip(names[1:], bufs[1:], strict=True):
                    value = states[p.run].get(name)
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 0:
                        buf[p.lo:p.hi].copy_(value.reshape(-1)[p.start - run_start:p.end - run_start])
                    elif (isinstance(value, torch.Tensor) and value.numel() == 1) or \
                            (isinstance(value, (int, float)) and not isinstance(value, bool)):
                        buf[p.lo:p.hi].fill_(float(value))  # one value for the whole parameter (a scalar state)
                    else:  # a fresh (or dropped) state starts from its initial value
                        buf[p.lo:p.hi].fill_(self.initial[name])
            pending[slot] = [self.store.write_async(key, buf) for key, buf in zip(sg.keys, bufs, strict=True)]
        for handles in pending:
            for h in handles:
                h.wait()
        for r, st in enumerate(states):
            if not self.adam:
                self._scalars[r] = self._scalar_state(st)
                continue
            step = st.get("step")
            self._steps[r] = float(step.item() if isinstance(step, torch.Tensor) else step or 0.0)

    def _drop(self) -> None:
        """Forget the resident tensors (their storage lives on wherever a reader still holds a view)."""
        opt = self.rt.optimizer
        for r, (*_, view) in enumerate(self._runs):
            if self.adam:
                opt.inner.state.pop(view, None)
            else:  # back to the scalars (as stored, or as they were when loaded)
                opt.inner.state[view] = dict(self._scalars[r])
            view.data = _PLACEHOLDER.expand(view.numel())
        self.rt.masters = {}
        self._resident = self._with_states = self._materialized = self._writeback = False

    @contextlib.contextmanager
    def resident(self, writeback: bool = False) -> Iterator[OptimizerSwapper]:
        """Hold the masters and the optimizer state in memory for the ``with`` block.

        Inside, ``rt.masters`` maps every optimized segment to a fresh fp32 CPU tensor of its shard
        size and ``rt.optimizer.inner.state[view]`` holds ``step`` (0-d float tensor), ``exp_avg`` and
        ``exp_avg_sq`` (and ``max_exp_avg_sq`` with AMSGrad) — or, for a declared optimizer, its scalars
        and declared tensors — as views of resident buffers laid out like the runs; the run views
        themselves view the resident masters. On exit the references
        are dropped (the storage is not freed in place: a checkpoint writer may still hold views).
        ``writeback=True``: changes made inside are written to the files on exit (the outermost
        exit when nested). Inside an earlier :meth:`materialize`, the materialized copy is used.
        """
        self._check_open()
        if not self._resident:
            self._load(states=True)
        elif not self._with_states:
            raise RuntimeError("swapper.resident() inside materialize(load_states=False): the optimizer state is "
                               "not in memory; evict() first.")
        self._depth += 1
        self._writeback = self._writeback or writeback
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0 and not self._materialized:
                if self._writeback:
                    self._store_resident()
                self._drop()

    def materialize(self, load_states: bool) -> None:
        """Bring masters (and with ``load_states`` the optimizer state) into memory until :meth:`evict`.

        As entering :meth:`resident`; used by checkpoint loading, which fills the tensors in place
        after this returns and then calls :meth:`evict`.
        """
        self._check_open()
        if self._depth:
            raise RuntimeError("swapper.materialize() inside swapper.resident(); leave the with-block first.")
        if self._resident:
            self._drop()
        self._load(states=bool(load_states))
        self._materialized = True

    def evict(self) -> None:
        """Write the resident masters (and state) back to the files, synchronously, and drop them.

        A no-op when nothing is resident, or inside :meth:`resident` (whose exit decides).
        """
        if not self._resident or self._depth:
            return
        self._store_resident()
        self._drop()

    # -- accounting and lifetime ---------------------------------------------------------------

    def bytes_on_disk(self) -> int:
        """Bytes of optimizer state in the swap files (masters and moments of every sub-group; the gradient files
        are :meth:`GradientSwapper.bytes_on_disk`)."""
        if self.closed:
            return 0
        return self.store.bytes_on_disk() - (self.gradients.bytes_on_disk() if self.gradients is not None else 0)

    def resident_bytes(self) -> int:
        """Bytes of the streaming slots, which stay in memory between steps (<= :meth:`budget_bytes`).

        A copy held by :meth:`resident` / :meth:`materialize` is not included: it is visible as
        ``rt.masters`` and the inner optimizer's state, which ``rt.memory_breakdown()`` counts.
        """
        return sum(t.untyped_storage().nbytes() for slot in self._slots for t in slot)

    def budget_bytes(self) -> int:
        """The in-memory budget: ``buffer_count`` slots of the largest sub-group (4 bytes x tensors per sub-group)."""
        return self._budget

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the NVMe optimizer swapper is closed (its files were removed)")

    def close(self) -> None:
        """Wait for pending I/O, remove the swap files and free the slots. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._prefetchers.clear()
        if self.gradients is not None:
            self.gradients.close()
        self.store.close()
        self._slots = []

    def __repr__(self) -> str:
        return (f"OptimizerSwapper({self.store.folder!r}, sub_groups={len(self.subgroups)}, "
                f"slots={len(self._slots)}, on_disk={self.bytes_on_disk()}, resident={self.resident_bytes()})")
