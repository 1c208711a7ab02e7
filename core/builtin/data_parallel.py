"""Data-parallel gradient reduction: bucketed all-reduce overlapped with backward.

At the accumulation boundary each parameter's post-accumulate-grad hook marks it ready; when
every parameter of a bucket is ready, the bucket is flattened and its all-reduce launched
asynchronously, while autograd goes on computing earlier layers' gradients (buckets are filled
in reverse parameter order, the order backward produces them). ``reduce_gradients`` then waits
for the launched buckets, reduces any left (parameters that got no gradient this step) and
writes the averages back.

Scaling follows DeepSpeed: by default each bucket is divided by ``gradient_predivide_factor``
before the sum and multiplied by ``factor / world`` after; with ``prescale_gradients`` it is
divided by the world size before the sum. ``communication_data_type`` casts buckets for the wire.
Parameters marked ``allreduce = False`` (expert parameters) are neither broadcast nor reduced here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from microspeed import comm
from microspeed.capabilities import Role
from microspeed.config import Field, Section, positive
from microspeed.gradients import ReplicaGroup, reduced_over_data_parallel, replica_group  # noqa: F401
from microspeed.hookspecs import hookimpl
from microspeed.topology import Topology

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Bucket:
    """A group of same-dtype gradient tensors reduced as one flat buffer.

    The flat buffer and its per-tensor views are allocated once, when the bucket is built, and
    reused every step.
    """

    __slots__ = ("tensors", "index", "ready", "work", "flat", "views")

    def __init__(self, index: int, tensors: list[torch.Tensor]) -> None:
        self.index = index
        self.tensors = tensors  # parameters (overlap mode) or gradient buffers
        self.ready = 0
        self.work: Any = None
        self.flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for t in tensors:
            self.views.append(self.flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class Reducer:
    """Buckets gradients and all-reduces them over a data-parallel group with DeepSpeed's scaling."""

    def __init__(self, group: Any, world: int, bucket_size: int, prescale: bool, predivide: float,
                 comm_dtype: torch.dtype | None) -> None:
        self.group, self.world, self.bucket_size = group, world, bucket_size
        self.prescale, self.predivide, self.comm_dtype = prescale, predivide, comm_dtype
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}
        self.built_for: list[int] = []

    def build(self, tensors: list[torch.Tensor]) -> None:
        """Split ``tensors`` (in backward order) into buckets of at most ``bucket_size`` elements."""
        ids = [id(t) for t in tensors]
        if ids == self.built_for:
            return
        groups: list[list[torch.Tensor]] = []
        size = 0
        for t in tensors:
            if not groups or size + t.numel() > self.bucket_size or groups[-1][0].dtype != t.dtype:
                groups.append([])
                size = 0
            groups[-1].append(t)
            size += t.numel()
        self.buckets = [Bucket(i, g) for i, g in enumerate(groups)]
        self.bucket_of = {id(t): b for b in self.buckets for t in b.tensors}
        self.built_for = ids

    def _pre(self, flat: torch.Tensor) -> torch.Tensor:
        wire = flat.to(self.comm_dtype) if self.comm_dtype is not None and flat.dtype != self.comm_dtype else flat
        if self.prescale:
            wire.mul_(1.0 / self.world)
        elif self.predivide != 1.0:
            wire.mul_(1.0 / self.predivide)
        return wire

    def _post(self, wire: torch.Tensor, flat: torch.Tensor) -> None:
        if not self.prescale and self.predivide != self.world:
            wire.mul_(self.predivide / self.world)
        if wire is not flat:
            flat.copy_(wire)

    def launch(self, bucket: Bucket, grads: list[torch.Tensor | None]) -> None:
        """Copy ``grads`` (zeros for ``None``) into the bucket and start its asynchronous all-reduce."""
        present = [(v, g) for v, g in zip(bucket.views, grads, strict=True) if g is not None]
        if len(present) != len(bucket.views):
            bucket.flat.zero_()
        if present:
            torch._foreach_copy_([v for v, _ in present], [g for _, g in present])
        wire = self._pre(bucket.flat)
        bucket.work = (comm.all_reduce(wire, group=self.group, async_op=True), wire)

    def finish(self, bucket: Bucket) -> list[torch.Tensor]:
        """Wait for the bucket, scale, and return the reduced gradients (views of its buffer)."""
        work, wire = bucket.work
        if work is not None:
            work.wait()
        self._post(wire, bucket.flat)
        bucket.work, bucket.ready = None, 0
        return bucket.views


class DataParallelPlugin:
    """Default topology (pure data parallel) and default gradient reduction."""

    def __init__(self) -> None:
        self.reducer: Reducer | None = None
        self.overlap = True
        self.params: list[torch.nn.Parameter] = []
        self.hook_handles: list[Any] = []
        self.engine: Any = None

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """DeepSpeed's top-level reduction keys, and ``data_parallel`` (bucket size, overlap)."""
        return {
            "prescale_gradients": Field((bool,), False, "divide by world size before the all-reduce"),
            "gradient_predivide_factor": Field((float,), 1.0, "divide before the all-reduce by this, "
                                               "multiply by factor/world after", positive),
            "communication_data_type": Field((str, type(None)), None, "dtype of gradients on the wire",
                                             choices=(None, "fp32", "fp16", "bf16")),
            "data_parallel": Section({
                "reduce_bucket_size": Field((int,), 2_000_000, "elements per all-reduce bucket", positive),
                "overlap_comm": Field((bool,), True, "launch buckets from autograd hooks during backward"),
            }, doc="microspeed: data-parallel gradient reduction"),
        }

    @hookimpl(trylast=True)
    def microspeed_make_topology(self, mpu: Any) -> Topology:
        """Every rank a replica; or the data-parallel groups of a Megatron-style ``mpu``."""
        if mpu is None:
            return Topology.data_parallel()
        topo = Topology.data_parallel()
        topo.data_parallel_group = mpu.get_data_parallel_group()
        topo.data_parallel_size = mpu.get_data_parallel_world_size()
        topo.data_parallel_rank = mpu.get_data_parallel_rank()
        topo.model_parallel_group = mpu.get_model_parallel_group()
        topo.model_parallel_size = mpu.get_model_parallel_world_size()
        topo.model_parallel_rank = mpu.get_model_parallel_rank()
        return topo

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Read the reduction keys."""
        self.config = config

    @hookimpl
    def microspeed_after_model_ready(self, engine, model: torch.nn.Module) -> None:
        """Build buckets in backward order; install overlap hooks unless buffers are elsewhere."""
        self.engine = engine
        topo = engine.topology
        if topo.data_parallel_size == 1 or engine.owner(Role.GRADIENT_REDUCTION) is not None:
            return  # nothing to reduce, or another plugin (ZeRO) took reduction over
        c = self.config
        dtype = c["communication_data_type"]
        self.reducer = Reducer(topo.data_parallel_group, topo.data_parallel_size,
                               c["data_parallel"]["reduce_bucket_size"], c["prescale_gradients"],
                               c["gradient_predivide_factor"], DTYPES[dtype] if dtype else None)
        self.params = [p for p in model.parameters() if p.requires_grad and reduced_over_data_parallel(p)]
        self._broadcast_parameters(model, topo)
        elsewhere = engine.hook.microspeed_gradient_buffers(engine=engine) is not None
        self.overlap = c["data_parallel"]["overlap_comm"] and not elsewhere
        if self.overlap:
            self.reducer.build(list(reversed(self.params)))
            for p in self.params:
                self.hook_handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _broadcast_parameters(self, model: torch.nn.Module, topo: Topology) -> None:
        """Start every replica from the same weights (those of data-parallel rank 0)."""

        src = dist.get_global_rank(topo.data_parallel_group, 0) if topo.data_parallel_group is not None else 0
        with torch.no_grad():
            for t in [p for p in model.parameters() if reduced_over_data_parallel(p)] + list(model.buffers()):
                comm.broadcast(t.data, src=src, group=topo.data_parallel_group)

    @hookimpl
    def microspeed_destroy(self) -> None:
        """``engine.destroy()``: finish the bucket reductions in flight and remove the parameters' gradient hooks
        (held outside Python's collector, they would keep the engine alive)."""
        if self.reducer is not None:
            for bucket in self.reducer.buckets:
                if bucket.work is not None:
                    bucket.work.wait()
                    bucket.work = None
            self.reducer = None
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles.clear()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        engine = self.engine
        if not engine.ctx.reduce or self.reducer is None or engine.owner(Role.GRADIENT_REDUCTION) is not None:
            return
        bucket = self.reducer.bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.tensors):
            self.reducer.launch(bucket, [p.grad for p in bucket.tensors])

    @hookimpl(trylast=True)
    def microspeed_reduce_gradients(self, engine) -> bool:
        """Wait for launched buckets, reduce the rest, write the averages back."""
        if self.reducer is None or engine.owner(Role.GRADIENT_REDUCTION) is not None:
            return True  # nothing to reduce, or a plugin reduces (and answers this hook) itself
        buffers = engine.hook.microspeed_gradient_buffers(engine=engine)
        if buffers is not None:  # gradients live outside p.grad: reduce those, not overlapped
            self.reducer.build(buffers)
            for bucket in self.reducer.buckets:
                self.reducer.launch(bucket, list(bucket.tensors))
            for bucket in self.reducer.buckets:
                torch._foreach_copy_(bucket.tensors, self.reducer.finish(bucket))
            return True
        if not self.overlap:
            self.reducer.build(list(reversed(self.params)))
        for bucket in self.reducer.buckets:
            if bucket.work is None:
                self.reducer.launch(bucket, [p.grad for p in bucket.tensors])
        for bucket in self.reducer.buckets:
            reduced = self.reducer.finish(bucket)
            have = [(p.grad, r) for p, r in zip(bucket.tensors, reduced, strict=True) if p.grad is not None]
            if have:
                torch._foreach_copy_([g for g, _ in have], [r for _, r in have])
            for p, r in zip(bucket.tensors, reduced, strict=True):
                if p.grad is None:
                    p.grad = r.clone()
        return True
