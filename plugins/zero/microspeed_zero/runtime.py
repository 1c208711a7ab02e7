"""One engine's ZeRO state: segments, parameter buffers, gradient partitions, masters, the step.

Built by :class:`microspeed_zero.plugin.ZeroPlugin`; kept on the engine as
``engine.plugin_state("zero")``. The life of one optimizer step:

1. backward: gradients are reduced into this rank's partition (:mod:`microspeed_zero.reduce`);
2. ``step()``: overflow check (fp16) across ranks, global norm from the partitions (squares
   summed over the data-parallel group; a norm that is not finite skips the step on every rank through the
   kernel's ``engine.grad_norm.finite``), one coefficient for unscaling and clipping, the inner
   optimizer on this rank's runs, masters copied into the parameters' slice (with the optimizer on NVMe,
   :mod:`microspeed_zero.swap` streams masters, state and — stages 2, 3 — the gradient partition, which
   backward writes to its files as it reduces: :mod:`microspeed_zero.grad_swap`);
3. stages 1 and 2: each segment's updated slices are all-gathered into the flat parameter
   buffer. With ``overlap_comm`` segments are stepped in forward order, each gather launched as
   soon as its segment is stepped, and waited for only by the forward pre-hook of the first
   module that uses the segment: the gather runs behind the optimizer step and the next forward.
   Until then the segment's parameters are *watched* (:mod:`microspeed_zero.access`): any other
   use — ``p.data``, ``p.detach()``, ``state_dict()``, an EMA update reading ``named_parameters()``
   right after ``step()`` — waits for that segment's gather first, so the lazy gather is
   invisible. Stage 3 keeps only the shard (:mod:`microspeed_zero.stage3` gathers before use).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from microspeed.plugin_api import (
    ConfigError,
    GradientCompression,
    GradientSum,
    LossScaling,
    NormRule,
    StepOutcome,
    comm,
    has_inf_or_nan,
    replica_group,
    summed_over,
)
from microspeed_zero.access import unwatch, watch
from microspeed_zero.collectives import gather_slices
from microspeed_zero.config import ZeroConfig
from microspeed_zero.host_memory import keep_freed_memory, return_freed_memory
from microspeed_zero.optimizer import ZeroOptimizer, ZeroOptimizerStage3
from microspeed_zero.partition import Segment, cut_segments
from microspeed_zero.reduce import GradientReducer, Scaling

_METADATA = frozenset({
    "grad", "requires_grad", "grad_fn", "is_leaf", "dtype", "device", "shape", "size", "dim", "ndim", "numel",
    "layout", "is_cuda", "is_meta", "__hash__", "__eq__", "_backward_hooks", "_post_accumulate_grad_hooks",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "is_floating_point", "__class__",
})
"""Uses of a parameter that do not read its values: no need to wait for its pending gather."""

_LAZY_MASTER = torch.zeros(1)  # what an NVMe optimizer's masters view until its swapper writes them from the shards


class UnusedParametersError(RuntimeError, AssertionError):
    """``zero_optimization.ignore_unused_parameters`` is false and trainable parameters got no gradient in an
    accumulation window; raised by that window's ``step()``. Also an :class:`AssertionError`, the type DeepSpeed
    raises there (its ZeRO step asserts it), so handlers written for DeepSpeed catch it."""


class ZeroRuntime:
    """ZeRO stages 1–3 for one engine (see the module docstring)."""

    def __init__(self, engine: Any, cfg: ZeroConfig) -> None:
        self.engine, self.cfg, self.stage = engine, cfg, cfg.stage
        if "nvme" in (cfg.offload_param, cfg.offload_optimizer):  # what a step frees must leave the process
            return_freed_memory()
        elif cfg.host_memory_budget is None and cfg.stage >= 2 and torch.device(engine.device).type == "cpu":
            keep_freed_memory()  # autograd's fresh gradients reuse the last step's blocks instead of faulting
            # (not stage 1: its whole accumulators fragment the kept heap, raising the peak RSS)
        topo = engine.topology
        self.group = topo.data_parallel_group
        self.world, self.rank = topo.data_parallel_size, topo.data_parallel_rank
        self.mp_group = topo.model_parallel_group if topo.model_parallel_size > 1 else None
        self.master_device = torch.device("cpu") if cfg.offload_optimizer != "none" else None
        self.segments: list[Segment] = []
        self.flats: dict[int, torch.Tensor] = {}  # stages 1, 2: segment -> flat parameter buffer
        self.acc: dict[int, torch.Tensor] = {}  # gradient accumulators (see reduce.py)
        self.masters: dict[int, torch.Tensor] = {}
        self.gathers: dict[int, list[Any]] = {}  # segment -> pending all-gather works
        self.optimizer: ZeroOptimizer | None = None
        self.reducer: GradientReducer | None = None
        self.stage3: Any = None
        self.handles: list[Any] = []
        self.names: dict[int, str] = {}
        self.max_norm = float(engine.config["gradient_clipping"])
        c = engine.config
        self.scaling = Scaling(self.world, c["prescale_gradients"], c["gradient_predivide_factor"])
        wire = c["communication_data_type"]
        self.wire_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(wire)
        self._swapper: Any = None
        self.lazy_masters: set[int] = set()  # NVMe optimizer: masters not built yet (the swapper writes them)
        self.optimized: list[Segment] = []
        self.precision: LossScaling | None = engine.capabilities.get(LossScaling)
        self.used: set[int] = set()  # ignore_unused_parameters false: parameters with a gradient in this window
        self.unused: list[str] = []  # ... and the names of those that got none (raised at the window's step)
        self.ties: list[tuple[GradientSum, Segment]] = []  # segments of marked (tied) parameters, in key order
        self._norm_runs: dict[int, list[tuple[int, int, NormRule | None]]] | None = None
        self.chunk_of: dict[int, frozenset[int]] = {}  # id(param) -> the schedule's chunks using it (pass_parameters)
        self.chunk_segments: dict[int, set[int]] = {}  # chunk -> segments holding its parameters
        self.current_pass: tuple[str, Any] | None = None  # announced by a schedule (microspeed_next_pass)

    # -- set-up --------------------------------------------------------------------------------

    @property
    def scaler(self) -> Any:
        """The fp16 loss scaler of the :class:`LossScaling` capability (``None`` without fp16)."""
        return self.precision.scaler if self.precision is not None else None

    @property
    def accumulate_fp32(self) -> bool:
        """Whether gradients accumulate in fp32 (``data_types.grad_accum_dtype``) for a 16-bit model."""
        return bool(self.precision is not None and self.precision.accumulate_fp32)

    @property
    def swapper(self) -> Any:
        """The :class:`~microspeed_zero.swap.OptimizerSwapper` (optimizer on NVMe), or ``None``."""
        return self._swapper

    @swapper.setter
    def swapper(self, swapper: Any) -> None:
        self._swapper = swapper
        if self.reducer is not None:  # backward writes the gradients into its files
            self.reducer.gradients = getattr(swapper, "gradients", None)

    @property
    def streams_gradients(self) -> bool:
        """Whether the gradient partition lives in the NVMe optimizer's files (stages 2, 3 with the optimizer on
        NVMe): no accumulator is allocated for an optimized segment (:mod:`microspeed_zero.grad_swap`)."""
        return self.cfg.offload_optimizer == "nvme" and self.stage >= 2

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients accumulate in: fp32 (``grad_accum_dtype`` fp32, or parameters of several dtypes),
        else the parameters' own."""
        dtypes = {seg.dtype for seg in self.optimized}
        return torch.float32 if self.accumulate_fp32 or len(dtypes) != 1 else dtypes.pop()

    @property
    def gradients(self) -> Any:
        """The :class:`~microspeed_zero.grad_swap.GradientSwapper` holding the gradient partition, or ``None``."""
        return getattr(self.swapper, "gradients", None)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (the compute device)."""
        return self.engine.device if self.stage < 3 else self.stage3.device

    def partition_parameters(self, model: torch.nn.Module) -> None:
        """Stage 3, before the optimizer exists: cut the model into per-module segments and shard them."""
        from microspeed_zero.stage3 import ParameterPartitioner

        self.names = {id(p): n for n, p in model.named_parameters()}
        self.stage3 = ParameterPartitioner(self, model)
        self.segments = self.stage3.segments

    def wrap(self, optimizer: torch.optim.Optimizer) -> ZeroOptimizer:
        """Partition what the stage partitions and return the :class:`ZeroOptimizer` over it."""
        model = self.engine.module
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        model_ids = {id(p) for p in model.parameters()}
        foreign = [p for p in group_of if p not in model_ids]
        if foreign:
            raise ConfigError(f"zero_optimization: the optimizer holds {len(foreign)} tensor(s) that are not "
                              f"parameters of the model; ZeRO partitions the model's parameters — build the "
                              f"optimizer over model.parameters() (or subsets of them).")
        self.optimizer = (ZeroOptimizer if self.stage < 3 else ZeroOptimizerStage3)(optimizer, self)
        chunks = self.engine.hook.microspeed_pass_parameters(engine=self.engine) or []
        for c, params in enumerate(chunks):  # an interleaved pipeline: buckets stay within one chunk
            for p in params:
                self.chunk_of[id(p)] = self.chunk_of.get(id(p), frozenset()) | {c}
        if self.stage < 3:
            self.names = {id(p): n for n, p in model.named_parameters()}
            order = [(self.names[id(p)], p, group_of[id(p)]) for p in reversed(list(model.parameters()))
                     if id(p) in group_of and p.requires_grad]
            cap = self.cfg.reduce_bucket_size if self.cfg.contiguous_gradients else 1
            self.segments = self._cut(order, cap)
            self._flatten_parameters()
        else:
            for seg in self.segments:
                seg.groups = [group_of.get(id(p)) if p.requires_grad else None for p in seg.params]
        self._find_ties()
        for seg in self.segments:
            for p in seg.params:
                for c in self.chunk_of.get(id(p), ()):
                    self.chunk_segments.setdefault(c, set()).add(seg.index)
        self._make_masters()
        self._make_accumulators()
        for seg, _g, _s, _e, view in self.optimizer.runs:  # a replica group's slices say so (1-bit LAMB's sums)
            if replica_group(seg.params[0]) is not None:
                view.replica_group = replica_group(seg.params[0])
        self.optimized = [seg for seg in self.segments if seg.index in self.masters]
        codec = self.engine.capabilities.get(GradientCompression)  # 1-bit optimizers: compressed reduce-scatter
        compression = (codec, codec.attach(self.optimizer.inner)) if codec and codec.accepts(optimizer) else None
        self.reducer = GradientReducer(self.segments, 1 if self.stage == 1 else 2, self.scaling,
                                       self.acc, self.wire_dtype, self.cfg.reduce_scatter,
                                       self.cfg.contiguous_gradients, compression,
                                       bucket_numel=int(self.cfg.reduce_bucket_size))
        if self.stage3 is not None:
            self.reducer.on_reduced = self.stage3.after_reduced
            self.reducer.deferred = {seg.index for seg in self.segments  # leaf modules (microspeed_zero.leaf)
                                     if any(hasattr(p, "ds_z3_leaf_module") for p in seg.params)}
        self._install_grad_hooks()
        optimizer.state.clear()
        return self.optimizer

    def _cut(self, order: list[tuple[str, torch.nn.Parameter, int]], cap: int) -> list[Segment]:
        """Stages 1, 2: segments over the data-parallel group, then over each replica group (see ``ReplicaGroup``).

        Parameters are grouped first (each group keeps backward order) so that every segment has one
        :class:`NormRule` (the norm counts a segment's shard with one rule), holds the parameters of one
        chunk of a schedule (``pass_parameters``: a chunk's backward completes its segments, and only those
        are reduced) and the parameters marked with
        one :class:`GradientSum` key form segments of their own, ordered by name: the same layout on every
        rank of the sum's group, so the reduced shards are summed element by element.
        """
        norm = self.engine.grad_norm
        rules = norm.has_rules
        by_group: dict[Any, list[tuple[str, torch.nn.Parameter, int]]] = {}
        for item in order:
            rule = norm.rule_for(item[1]) if rules else None
            rule_key = None if rule is None else (rule.skip, tuple(id(g) for g in rule.groups))
            mark = summed_over(item[1])
            key = (replica_group(item[1]), mark.key if mark is not None else None, rule_key,
                   self.chunk_of.get(id(item[1])))
            by_group.setdefault(key, []).append(item)
        ordered = sorted(by_group.items(), key=lambda kv: kv[0][1] is not None)  # marked ones last
        segments: list[Segment] = []
        for (rg, tie, _, _), members in ordered:
            if tie is not None:
                members = sorted(members, key=lambda item: item[0])
            world, rank, group = (self.world, self.rank, self.group) if rg is None else (rg.size, rg.rank, rg.group)
            segments += cut_segments(members, world, rank, cap, start_index=len(segments), group=group)
        return segments

    def _find_ties(self) -> None:
        """The segments of parameters marked with a :class:`GradientSum` (all of a segment's, or none)."""
        ties = []
        for seg in self.segments:
            marks = [summed_over(p) for p in seg.params]
            if all(m is None for m in marks):
                continue
            keys = {m.key if m is not None else None for m in marks}
            if len(keys) != 1 or None in keys:
                raise ConfigError(f"zero_optimization.stage={self.stage}: the parameters {seg.names} form one "
                                  f"partition but only some of them are summed over other ranks (GradientSum "
                                  f"keys {sorted(str(k) for k in keys)}); put the tied weights in a module of "
                                  f"their own (e.g. a TiedLayerSpec whose module holds only them).")
            ties.append((marks[0], seg))
        self.ties = sorted(ties, key=lambda t: (t[0].key, t[1].names))

    def _flatten_parameters(self) -> None:
        """Stages 1, 2: each segment's parameters become views of one flat buffer, broadcast from its group's
        first rank."""
        for seg in self.segments:
            flat = torch.zeros(seg.padded, dtype=seg.dtype, device=seg.params[0].device)
            for p, view in zip(seg.params, seg.views(flat), strict=True):
                view.copy_(p.detach())
                p.data = view
            comm.broadcast(flat, src=seg.global_rank(0), group=seg.group)
            self.flats[seg.index] = flat
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for b in self.engine.module.buffers():
                comm.broadcast(b.data, src=src, group=self.group)
        if self.cfg.overlap_comm:
            self._install_wait_hooks()

    def _make_accumulators(self) -> None:
        for seg in self.segments:
            if not seg.trainable or (self.streams_gradients and seg.index in self.masters):
                continue  # an optimized segment's gradient goes to the NVMe optimizer's files
            dtype = torch.float32 if self.accumulate_fp32 else seg.dtype
            device = self.stage3.device if self.stage3 is not None else seg.params[0].device
            size = seg.padded if self.stage == 1 else seg.shard_size
            self.acc[seg.index] = torch.zeros(size, dtype=dtype, device=device)

    def _make_masters(self) -> None:
        lazy = self.cfg.offload_optimizer == "nvme"  # the swapper writes them from the shards, segment by segment
        for seg in self.segments:
            if not any(g is not None for g in seg.groups):
                continue
            if lazy:
                self.masters[seg.index] = _LAZY_MASTER.expand(seg.shard_size)
                self.lazy_masters.add(seg.index)
                continue
            local = self.local_params(seg)
            if local.dtype == torch.float32 and self.master_device is None:
                self.masters[seg.index] = local  # fp32 in place: the parameters' slice is the master
            else:
                device = self.master_device or local.device
                master = torch.empty(local.numel(), dtype=torch.float32, device=device,
                                     pin_memory=self.cfg.pin_memory and torch.cuda.is_available())
                master.copy_(local)
                self.masters[seg.index] = master
        self.optimizer.build_inner(self.masters)

    def local_params(self, seg: Segment) -> torch.Tensor:
        """This rank's slice of ``seg``'s parameters (a view: stages 1–2 of the flat buffer, stage 3 the shard)."""
        if self.stage3 is not None:
            return self.stage3.local_shard(seg.index)
        start, end = seg.slice_of(seg.rank)
        return self.flats[seg.index][start:end]

    def initial_master(self, seg: Segment) -> torch.Tensor:
        """This rank's slice of ``seg``'s parameters, to build its master from; a file-resident stage-3 shard is
        read for the call and not kept."""
        if self.stage3 is not None:
            return self.stage3.read_shard(seg.index)
        return self.local_params(seg)

    def store_params(self, index: int, start: int, values: torch.Tensor) -> None:
        """Write new ``values`` into elements ``[start, start + numel)`` of segment ``index``'s parameter slice
        (a file-resident stage-3 shard: written to its file, piece by piece, asynchronously)."""
        if self.stage3 is not None and self.stage3.in_file(index):
            self.stage3.write_piece(index, start, values)
            return
        self.local_params(self.segments[index])[start:start + values.numel()].copy_(values)

    def local_grads(self, seg: Segment) -> torch.Tensor:
        """This rank's reduced gradient slice of ``seg``."""
        acc = self.acc[seg.index]
        if self.stage == 1:
            start, end = seg.slice_of(seg.rank)
            return acc[start:end]
        return acc

    def _install_grad_hooks(self) -> None:
        for seg in self.segments:
            for p in seg.params:
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, param: torch.Tensor) -> None:
        if self.stage == 1 and (self.accumulate_fp32 or not self.engine.ctx.reduce):
            return  # stage 1 reduces once per window; with fp32 accumulation, after the window
        if not self.cfg.ignore_unused_parameters:
            self.used.add(id(param))
        self.reducer.grad_ready(param)

    def _install_wait_hooks(self) -> None:
        """Forward pre-hooks that wait for the all-gather of the segments a module's parameters live in."""
        seg_of = {id(p): seg.index for seg in self.segments for p in seg.params}
        for module in self.engine.module.modules():
            needed = sorted({seg_of[id(p)] for p in module.parameters(recurse=False) if id(p) in seg_of})
            if needed:
                self.handles.append(module.register_forward_pre_hook(
                    lambda _m, _a, needed=needed: self.wait_gathers(needed)))
        self.handles.append(self.engine.module.register_state_dict_pre_hook(lambda *_a, **_k: self.wait_gathers()))

    # -- micro-step ----------------------------------------------------------------------------

    def before_backward(self, ctx: Any) -> None:
        """Stage 1: attach the gradient views (autograd then accumulates into the flat buffers)."""
        if self.stage >= 2 and ctx.boundary and not ctx.reduce:
            raise RuntimeError("engine.no_sync() / backward(allreduce_gradients=False) cannot be used with "
                               f"zero_optimization.stage {self.stage}: gradients are partitioned as backward "
                               "produces them. Use stage 1 or drop no_sync.")
        if self.stage == 1 and not self.accumulate_fp32:
            for seg in self.segments:
                acc = self.acc.get(seg.index)
                if acc is None:
                    continue
                for p, view in zip(seg.params, seg.views(acc), strict=True):
                    if p.grad is None and p.requires_grad:
                        p.grad = view

    def after_backward(self, ctx: Any) -> None:
        """Stage 1 with fp32 accumulation: move this micro-step's gradients into the fp32 buffers.

        Stages 2, 3: finish this micro-step's reductions.
        """
        if self.stage == 1:
            if self.accumulate_fp32:
                for seg in self.segments:
                    acc = self.acc.get(seg.index)
                    if acc is None:
                        continue
                    for p, view in zip(seg.params, seg.views(acc), strict=True):
                        if p.grad is not None:
                            view.add_(p.grad.view_as(view))
                            p.grad = None
            return
        current, self.current_pass = self.current_pass, None
        only = None
        if current is not None and current[0] == "backward" and self.chunk_segments:
            only = self.chunk_segments.get(current[1], set())  # the other chunks' gradients are not here
        self.reducer.flush(only)
        if self.stage3 is not None:
            self.stage3.after_backward()

    def next_pass(self, current: tuple[str, Any], upcoming: tuple[str, Any] | None) -> None:
        """A schedule starts pass ``current`` and runs ``upcoming`` next (see ``microspeed_next_pass``)."""
        self.current_pass = current
        if self.stage3 is not None:
            self.stage3.announce(current, upcoming)

    def reduce_at_boundary(self) -> None:
        """Stage 1: reduce what was not launched during backward and wait for all. Every stage: sum the
        reduced shards of marked (tied) parameters over their :class:`GradientSum` groups."""
        if self.stage == 1:
            self.reducer.flush()
        elif not self.cfg.ignore_unused_parameters:
            # over the whole accumulation window: a pipeline's chunk uses only its own layers in each backward
            self.unused = [seg.names[i] for seg in self.segments for i, p in enumerate(seg.params)
                           if p.requires_grad and id(p) not in self.used]
            self.used.clear()
        files = self.gradients
        for mark, seg in self.ties:
            if len(mark.ranks) < 2:
                continue
            if files is not None and files.holds(seg.index):  # read, sum, write back (its norm pieces anew)
                acc = files.acquire(seg.index)
                comm.all_reduce(acc, group=mark.group)
                files.release(seg.index, acc)
            elif seg.index in self.acc:
                comm.all_reduce(self.local_grads(seg), group=mark.group)

    # -- step ----------------------------------------------------------------------------------

    def step(self) -> StepOutcome:
        """Overflow check, norm, clip, inner step, write-back and gathers; see the module docstring."""
        unused, self.unused = self.unused, []
        if unused:  # at the step, as DeepSpeed asserts it (in the step's norm): nothing of this window is applied
            raise UnusedParametersError(
                f"zero_optimization.ignore_unused_parameters is false and these parameters got no gradient in this "
                f"accumulation window: {unused[:10]}. Use them in forward, freeze them (requires_grad=False), or set "
                f"ignore_unused_parameters true.")
        engine, opt = self.engine, self.optimizer
        segs = self.optimized
        files = self.gradients  # stages 2, 3 with the optimizer on NVMe: the gradients are in its files
        grads = {s.index: self.local_grads(s) for s in segs if files is None or not files.holds(s.index)}
        scale = 1.0
        if self.scaler is not None:
            scale = self.scaler.loss_scale
            bad = has_inf_or_nan(list(grads.values())) or (files is not None and files.overflow())
            flag = torch.tensor([1.0 if bad else 0.0])
            comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if self.mp_group is not None:
                comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mp_group)
            overflow = bool(flag.item())
            self.scaler.update_scale(overflow)
            engine.metrics["loss_scale"] = self.scaler.loss_scale
            if overflow:
                self.zero_grad()
                return StepOutcome(applied=False, grad_norm=None)
        target = self.master_device or self.device
        grads = {i: g.to(device=target, dtype=torch.float32) for i, g in grads.items()}  # fp32 (a view when it is)
        norm = self._global_norm(grads) / scale
        if not engine.grad_norm.finite(norm):  # NaN/inf loss or gradient: summed over the group, so every rank agrees
            self.zero_grad()
            return StepOutcome(applied=False, grad_norm=norm, nonfinite=True)
        coef = 1.0 / scale
        if self.max_norm > 0:
            coef = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0) / scale
        opt.sync_hyperparameters()
        order = list(reversed(segs)) if self.stage < 3 else segs  # forward order: first layers gathered first
        if self.swapper is not None:  # NVMe: masters and state stream through a few buffers
            self.swapper.step(order, grads, coef)
        else:
            self._step_in_memory(order, grads, coef)
        opt.applied_steps += 1
        if self.stage3 is not None:
            self.stage3.after_optimizer_step()
        if not self.cfg.overlap_comm:
            self.wait_gathers()
        return StepOutcome(applied=True, grad_norm=norm)

    def _step_in_memory(self, order: list[Segment], grads: dict[int, torch.Tensor], coef: Any) -> None:
        opt = self.optimizer
        per_segment = self.cfg.overlap_comm and self.stage < 3 and len(order) > 1
        by_seg: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        g32 = grads
        for seg, _g, start, end, view in opt.runs:
            by_seg.setdefault(seg.index, []).append((view, g32[seg.index][start:end]))
        for seg in order:
            for view, g in by_seg.get(seg.index, []):
                view.grad = g
            if per_segment:  # step segment by segment, each gather launched behind it
                self._scale(by_seg.get(seg.index, []), coef)
                opt.inner.step()
                self._write_back(seg)
                for view, _ in by_seg.get(seg.index, []):
                    view.grad = None
        if not per_segment:
            self._scale([x for seg in order for x in by_seg.get(seg.index, [])], coef)
            opt.inner.step()
            for seg in order:
                self._write_back(seg)
            for view, _ in (x for v in by_seg.values() for x in v):
                view.grad = None

    @staticmethod
    def _scale(pairs: list[tuple[torch.Tensor, torch.Tensor]], coef: Any) -> None:
        grads = [g for _, g in pairs if g.numel()]
        if grads and not (isinstance(coef, float) and coef == 1.0):
            torch._foreach_mul_(grads, coef if isinstance(coef, float) else coef.to(grads[0].device))

    def _global_norm(self, grads: dict[int, torch.Tensor]) -> torch.Tensor:
        """The kernel's one norm over this rank's gradient partitions, disjoint across the data-parallel group.

        Every element is held by one rank of the group (parameters of a replica group by one rank of
        theirs, and the replica groups' ranks hold different parameters), so the squares are summed over
        the data-parallel group, then over the model-parallel group as for every gradient. When plugins
        gave :class:`NormRule` s, each shard is cut into runs of one rule (one run per segment at stages 1
        and 2, whose segments are cut by rule) and passed with them: copies another rank counts (tied
        weights on later stages, tensor-parallel duplicates) are skipped. A segment whose gradient is in the
        NVMe files contributes the norms of its pieces, kept when backward wrote them (the norm of a
        1-element tensor holding a piece's norm is that norm: the sum of squares is unchanged).
        """
        norm = self.engine.grad_norm
        files = self.gradients
        pieces, rules = [], []
        for seg in self.optimized:
            if seg.index in grads:
                tensors, these = self.norm_inputs(seg.index, grads[seg.index])
            else:
                tensors, these = files.norm_pieces(seg.index)
            pieces += tensors
            rules += these or []
        return norm(pieces, partitioned_over=self.group, rules=rules if norm.has_rules else None)

    def norm_inputs(self, index: int, g: torch.Tensor) -> tuple[list[torch.Tensor], list[NormRule | None] | None]:
        """Segment ``index``'s gradient slice ``g`` as the kernel's norm takes it: whole without rules, else cut
        into runs of one :class:`NormRule` each (with the rules)."""
        if not self.engine.grad_norm.has_rules:
            return [g], None
        if self._norm_runs is None:
            self._norm_runs = {seg.index: self._rule_runs(seg) for seg in self.optimized}
        runs = self._norm_runs[index]
        return [g[start:end] for start, end, _ in runs], [rule for _, _, rule in runs]

    def _rule_runs(self, seg: Segment) -> list[tuple[int, int, NormRule | None]]:
        """``[(start, end, rule), ...]``: this rank's slice of ``seg`` in maximal runs of one rule."""
        norm = self.engine.grad_norm
        runs: list[tuple[int, int, NormRule | None]] = []
        for i, a, start in seg.pieces(seg.rank):
            end = start + seg.param_range(i, seg.rank)[1] - a
            rule = norm.rule_for(seg.params[i])
            if runs and runs[-1][2] == rule and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], end, rule)
            else:
                runs.append((start, end, rule))
        return runs

    def _write_back(self, seg: Segment) -> None:
        """Copy the stepped master into the parameters' slice, then :meth:`publish` it."""
        local = self.local_params(seg)
        master = self.masters[seg.index]
        if master.data_ptr() != local.data_ptr():
            with torch.no_grad():
                local.copy_(master, non_blocking=True)
        self.publish(seg)

    def publish(self, seg: Segment) -> None:
        """The parameters' slice of ``seg`` holds new values: stages 1, 2 gather them; stage 3 refreshes."""
        if self.stage3 is not None:
            self.stage3.after_step(seg)
            return
        self.launch_gather(seg)

    def launch_gather(self, seg: Segment) -> None:
        """Stages 1, 2: gather every rank's updated slice into the flat buffer (asynchronously), in chunks
        of at most ``allgather_bucket_size`` elements over all ranks."""
        flat = self.flats[seg.index]
        S, r = seg.shard_size, seg.rank
        per = max(1, self.cfg.allgather_bucket_size // seg.world)
        mine = flat[r * S:(r + 1) * S]
        works = [gather_slices(flat, mine, r, seg.world, seg.group, True, c0, min(S, c0 + per))
                 for c0 in range(0, S, per)]
        pending = [w for w in works if w is not None]
        if pending:
            self.gathers[seg.index] = pending
            for p in seg.params:
                watch(p)

    def destroy(self) -> None:
        """The engine's ``destroy()``: finish the gathers and reductions in flight (their transports write into this
        runtime's buffers), remove every hook it and stage 3 installed (a parameter's hook is held outside Python's
        collector: its closure would keep this runtime and the engine alive), and close the swap files (removed)."""
        self.wait_gathers()
        if self.reducer is not None:
            for _seg, _bufs, work, _cols in self.reducer.pending:
                if work is not None:
                    work.wait()
            self.reducer.pending.clear()
            self.reducer.queued.clear()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.stage3 is not None:
            self.stage3.destroy()
        if self._swapper is not None:
            self._swapper.close()
        for seg in self.segments:  # a tensor's attributes are hidden from the collector while torch holds it too
            for p in seg.params:
                unwatch(p)
                p.__dict__.pop("_zero", None)

    def wait_gathers(self, indices: list[int] | None = None) -> None:
        """Wait for the pending parameter all-gathers of ``indices`` (all when ``None``)."""
        if not self.gathers:
            return
        for i in (list(self.gathers) if indices is None else indices):
            works = self.gathers.pop(i, None)
            if works is None:
                continue
            for work in works:
                work.wait()
            for p in self.segments[i].params:
                unwatch(p)

    def on_access(self, params: list[torch.nn.Parameter], name: str) -> None:
        """A watched parameter is used (see :mod:`microspeed_zero.access`): stage 3 gathers it if released;
        stages 1, 2 wait for its segment's pending all-gather (unless ``name`` reads only metadata)."""
        if self.stage3 is not None:
            self.stage3.on_access(params, name)
        elif name not in _METADATA:
            self.wait_gathers(sorted({p._zero[1] for p in params if p._zero[0] is self}))

    def zero_grad(self) -> None:
        """Zero the gradient accumulators (the model's ``.grad`` are cleared by the engine); gradients in the NVMe
        files read as zeros from now on."""
        for acc in self.acc.values():
            acc.zero_()
        if self.gradients is not None:
            self.gradients.zero()

    # -- whole tensors for user code (GatheredParameters, safe_get_*) --------------------------------

    def tag_parameters(self) -> None:
        """Mark every partitioned parameter with ``(runtime, segment index, position)``."""
        for seg in self.segments:
            for i, p in enumerate(seg.params):
                p._zero = (self, seg.index, i)

    def gather_for_user(self, indices: list[int]) -> None:
        """Make segments ``indices`` whole (stage 3 gathers; stages 1, 2 wait for pending gathers)."""
        if self.stage3 is None:
            self.wait_gathers(indices)
            return
        for i in indices:
            self.stage3.fetch(i)

    def release_for_user(self, indices: list[int], modified: bool) -> None:
        """After :meth:`gather_for_user`: take modified values into shards and masters, release."""
        resident = self.swapper.resident(writeback=True) if self.swapper is not None and modified \
            else contextlib.nullcontext()
        with resident:
            self._take_user_values(indices, modified)

    def _take_user_values(self, indices: list[int], modified: bool) -> None:
        for i in indices:
            seg = self.segments[i]
            if modified:
                start, end = seg.slice_of(seg.rank)
                flat = self.stage3.flats[i] if self.stage3 is not None else self.flats[i]
                local = self.local_params(seg)
                with torch.no_grad():
                    if local.data_ptr() != flat[start:end].data_ptr():
                        local.copy_(flat[start:end])
                    master = self.masters.get(i)
                    if master is not None and master.data_ptr() != local.data_ptr():
                        master.copy_(local)
            if self.stage3 is not None:
                self.stage3.release(i)

    def gather_full(self, param: torch.Tensor, local: torch.Tensor | None) -> torch.Tensor:
        """All-gather per-rank slices ``local`` (this rank's slice of ``param``'s segment) into ``param``'s shape.

        Collective over the data-parallel group: every rank calls it for the same parameter.
        """
        _, index, i = param._zero
        seg = self.segments[index]
        S = seg.shard_size
        if local is None:
            local = torch.zeros(S)
        piece = torch.zeros(S, dtype=local.dtype, device=local.device)
        piece[:min(S, local.numel())] = local.reshape(-1)[:S]
        full = torch.empty(S * seg.world, dtype=local.dtype, device=local.device)
        comm.all_gather_into_tensor(full, piece, group=seg.group)
        off = seg.offsets[i]
        return full[off:off + seg.numels[i]].view(seg.shapes[i]).clone()

    def master_slice(self, index: int) -> torch.Tensor | None:
        """This rank's fp32 master slice of segment ``index`` (full shard length)."""
        if self.swapper is not None:
            with self.swapper.resident():
                master = self.masters.get(index)
                return None if master is None else master.clone()
        return self.masters.get(index)

    def grad_slice(self, index: int) -> torch.Tensor | None:
        """This rank's reduced gradient slice of segment ``index`` (read from the NVMe files when it lives there)."""
        if self.gradients is not None and self.gradients.holds(index):
            return self.gradients.read_segment(index)
        if index not in self.acc:
            return None
        return self.local_grads(self.segments[index])

    def state_slice(self, index: int, name: str) -> torch.Tensor | None:
        """This rank's slice of the optimizer state ``name`` over segment ``index`` (zeros where none)."""
        if self.swapper is not None:
            with self.swapper.resident():
                return self._state_slice(index, name)
        return self._state_slice(index, name)

    def _state_slice(self, index: int, name: str) -> torch.Tensor | None:
        seg = self.segments[index]
        out = None
        for (rseg, _g, start, end, view), st in zip(self.optimizer.runs, self.optimizer.run_states(), strict=True):
            if rseg is not seg or name not in st or not isinstance(st[name], torch.Tensor):
                continue
            if st[name].numel() != view.numel():
                raise ValueError(f"optimizer state {name!r} is not element-wise (shape {tuple(st[name].shape)}); "
                                 f"it has no per-parameter slice.")
            if out is None:
                out = torch.zeros(seg.shard_size, dtype=st[name].dtype)
            out[start:end] = st[name].detach().to("cpu")
        return out

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Stage 3: the module's whole state dict on data-parallel rank 0, one segment at a time.

        Elsewhere: the whole parameters of which this rank holds the first copy in their
        :class:`ReplicaGroup` (experts, which rank 0 may not hold; ``{}`` without such), for the
        plugin that made them to gather to rank 0 (the core writes rank 0's dict only).
        """
        self.stage3.wait_all()
        whole: dict[int, torch.Tensor] = {}
        for seg in self.segments:
            self.stage3.fetch(seg.index)
            for p in seg.params:
                if self.rank == 0 or _first_copy(p):
                    whole[id(p)] = p.detach().cpu().clone()
            self.stage3.release(seg.index)
        if self.rank != 0:
            return {k: whole[id(p)] for k, p in self.engine.module.named_parameters(remove_duplicate=False)
                    if id(p) in whole}
        by_name = dict(self.engine.module.named_parameters(remove_duplicate=False))
        out = {}
        for k, v in self.engine.module.state_dict(keep_vars=True).items():
            p = by_name.get(k)
            out[k] = whole[id(p)] if p is not None and id(p) in whole else v.detach()
        return out

    # -- accounting ----------------------------------------------------------------------------

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (persistent allocations).

        ``parameters``: flat buffers (stages 1, 2) or shards plus persistent whole segments
        (stage 3); ``gradients``: the accumulators; ``optimizer_states``: fp32 masters that are not
        the parameters themselves plus every tensor of the inner optimizer's state. Counted by
        storage, so a view is not counted twice. Offloaded bytes are reported under ``*_cpu`` keys
        when the compute device is not the CPU; NVMe-resident state under ``optimizer_states_nvme``, the gradient
        files under ``gradients_nvme`` (their in-memory buffers count as ``gradients``) and file-resident
        parameter shards under ``parameters_nvme``.
        """
        seen: set[int] = set()

        def size(t: torch.Tensor) -> int:
            st = t.untyped_storage()
            if st.data_ptr() in seen or st.nbytes() == 0:
                return 0
            seen.add(st.data_ptr())
            return st.nbytes()

        params = sum(size(t) for t in self.flats.values())
        if self.stage3 is not None:
            params += self.stage3.resident_bytes(size)
        grads = sum(size(t) for t in self.acc.values())
        states = sum(size(m) for m in self.masters.values())
        for st in self.optimizer.run_states() if self.optimizer else []:
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    states += size(v)
        out = {"parameters": params, "gradients": grads, "optimizer_states": states}
        if self.swapper is not None:
            out["optimizer_states_nvme"] = self.swapper.bytes_on_disk()
            out["optimizer_states"] += self.swapper.resident_bytes()
        if self.gradients is not None:
            out["gradients"] += self.gradients.resident_bytes()
            out["gradients_nvme"] = self.gradients.bytes_on_disk()
        if self.stage3 is not None and self.stage3.store is not None:
            out["parameters_nvme"] = self.stage3.bytes_on_disk()
        return out


def _first_copy(param: torch.Tensor) -> bool:
    """Whether ``param`` carries a replica group whose first rank is this one (it writes that copy)."""
    rg = replica_group(param)
    return rg is not None and rg.rank == 0
