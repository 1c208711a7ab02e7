"""The ``pipeline`` plugin: 3D topologies, pipeline schedules and tensor-parallel bookkeeping.

Active when the model is a :class:`~microspeed_pipeline.module.PipelineModule` (it carries its
process grid) or when ``initialize(mpu=...)`` receives a :class:`~microspeed_pipeline.topology.ParallelGrid`
(tensor parallelism without a pipeline). Then, through the core's hooks:

* ``make_topology``: the data-parallel group is the grid's *data* axis (same stage, same tensor
  shard), so the built-in reducer — or ZeRO stage 1 — works on it unchanged; the model-parallel
  group is one replica's *slice* (every stage and tensor shard), over which norms are summed;
* ``train_batch`` / ``eval_batch``: the pipeline schedule (:mod:`microspeed_pipeline.runtime`);
  ``engine(x)`` is refused with more than one stage, as DeepSpeed's pipeline engine does;
* ``grad_norm_rules``: the global norm counts each gradient once — tied copies on later stages
  and tensor-parallel replicas (biases, norms) on tensor rank > 0 are skipped; the kernel sums the
  rest over the slice group (the topology's model-parallel group) and the built-in clips once;
* ``checkpoint_placements``: tensor-parallel shards are boxes of their full tensors, tied copies on
  later stages and tensor-replicated parameters on tensor rank > 0 are duplicates written by another
  rank, so checkpoints load under another number of stages or tensor-parallel size (ZeRO's pieces of
  a shard compose with the boxes in the core).

* ``conflicts``: a plugin that partitions gradients (ZeRO, asked through the typed
  :class:`~microspeed.plugin_api.GradientPartitioning` capability) combines with every stage count,
  tensor parallelism and tied weights when it states that it honours the norm rules
  (``honours_norm_rules``) and sums the tied copies it is handed marked (``sums_marked_gradients``);
  an owner that does not is refused those pairs.
"""

from __future__ import annotations

from typing import Any

import torch

from microspeed.plugin_api import (
    Capabilities,
    ConfigError,
    Feature,
    Field,
    GradientPartitioning,
    NormRule,
    Refusal,
    Section,
    Topology,
    hookimpl,
    non_negative,
)
from microspeed_pipeline.compositions import FEATURES, REFUSALS
from microspeed_pipeline.module import PipelineModule
from microspeed_pipeline.topology import ParallelGrid, get_default_grid, set_default_grid, using_grid

SCHEDULES = (None, "1f1b", "interleaved", "gpipe")
"""Values of ``pipeline.schedule``: ``null`` (the default) is ``interleaved`` for a module with ``num_chunks > 1``,
else ``1f1b``."""


#: DeepSpeed's ``pipeline`` keys that are accepted with a notice (DeepSpeed 0.19.8 does not act on the first
#: three either: the PipelineModule's own arguments decide).
PIPELINE_NOTICES = {
    "stages": "the PipelineModule's num_stages/topology decide the stages (DeepSpeed reads them there too)",
    "partition": "PipelineModule(partition_method=...) decides the split (DeepSpeed reads it there too)",
    "seed_layers": "PipelineModule(seed_layers=...) decides it (DeepSpeed reads it there too)",
}


class PipelinePlugin:
    """Pipeline, tensor and data parallelism through the core's hooks (see the module docstring)."""

    def __init__(self) -> None:
        self.grid: ParallelGrid | None = None
        self.module: PipelineModule | None = None
        self.config: Any = None
        self.runtime: Any = None

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """The ``pipeline`` section."""
        return {"pipeline": Section({
            "schedule": Field((str, type(None)), None, "pipeline schedule: 1f1b, interleaved (num_chunks > 1) or "
                              "gpipe (all forwards, then all backwards); null: interleaved when num_chunks > 1, "
                              "else 1f1b", choices=SCHEDULES),
            "activation_checkpoint_interval": Field((int,), 0, "as DeepSpeed's: when > 0, overrides the "
                                                    "PipelineModule's activation_checkpoint_interval",
                                                    check=non_negative),
            "use_reentrant": Field((bool, type(None)), None, "as DeepSpeed's: false makes the PipelineModule "
                                   "checkpoint with non_reentrant_checkpoint"),
            "pipe_partitioned": Field((bool,), True, "as DeepSpeed's: with tensor parallelism each tensor rank sends "
                                      "1/tp of an activation to the next stage, whose tensor ranks all-gather it"),
            "grad_partitioned": Field((bool,), True, "as DeepSpeed's: with tensor parallelism each tensor rank sends "
                                      "1/tp of a gradient to the previous stage, whose tensor ranks all-gather it"),
        }, doc="microspeed-pipeline: the schedule of a PipelineModule", notices=PIPELINE_NOTICES)}

    @hookimpl
    def microspeed_make_topology(self, world_size: int, mpu: Any, model: torch.nn.Module) -> Topology | None:
        """The grid's topology, when the model is a PipelineModule or ``mpu`` is a ParallelGrid."""
        if isinstance(model, PipelineModule):
            self.module, self.grid = model, model.mpu()
            if mpu is not None and mpu is not self.grid:
                raise ConfigError("initialize(mpu=...): a PipelineModule carries its own process grid; do not pass "
                                  "another mpu.")
            # DeepSpeed's initialize() hands the module's grid to deepspeed.utils.groups for the script's later
            # queries; the script's grid is that slot. The engine's own work runs under using_grid(its grid).
            set_default_grid(self.grid)
        elif isinstance(mpu, ParallelGrid):
            self.grid = mpu
        else:
            return None
        g = self.grid
        return Topology(world_size=world_size, rank=g.get_global_rank(),
                        data_parallel_size=g.get_data_parallel_world_size(),
                        data_parallel_rank=g.get_data_parallel_rank(),
                        data_parallel_group=g.get_data_parallel_group(),
                        model_parallel_size=g.get_slice_parallel_world_size(),
                        model_parallel_rank=g.get_slice_parallel_rank(),
                        model_parallel_group=g.get_slice_parallel_group())

    @hookimpl
    def microspeed_configure(self, config: Any) -> None:
        """Refuse what does not combine with a pipeline of several stages."""
        self.config = config
        if self.module is None:
            if config.is_set("pipeline"):
                raise ConfigError("pipeline: the section needs the model to be a microspeed.pipe.PipelineModule; "
                                  "build the model as PipelineModule(layers=..., num_stages=...) or remove the "
                                  "section.")
            return
        section = config["pipeline"]
        if section["activation_checkpoint_interval"] > 0:  # as DeepSpeed's PipelineEngine
            self.module.activation_checkpoint_interval = section["activation_checkpoint_interval"]
        if section["use_reentrant"] is False:
            from microspeed_pipeline.checkpointing import non_reentrant_checkpoint

            self.module.activation_checkpoint_func = non_reentrant_checkpoint
        if self.module.num_chunks > 1 and config["pipeline"]["schedule"] not in (None, "interleaved"):
            raise ConfigError(f"pipeline.schedule={config['pipeline']['schedule']!r}: the PipelineModule has "
                              f"num_chunks={self.module.num_chunks}, which only the 'interleaved' schedule runs.")

    @hookimpl
    def microspeed_conflicts(self, config: Any, capabilities: Capabilities) -> list[tuple[str, str]] | None:
        """What a grid cannot combine with when another plugin partitions gradients, by what it states.

        Asked through the typed :class:`GradientPartitioning` capability, whose ``config_key`` and
        ``disable_hint`` name the key and the fix. An owner that does not honour the norm rules on its
        partitions cannot serve tensor parallelism or clipped tied weights (the norm would count the
        copies another rank counts); one that partitions gradients during backward (stage >= 2) and does
        not sum marked gradients cannot serve cross-stage tied weights (their ``p.grad`` is gone by
        ``ReduceTiedGrads``). ZeRO states both, so none of these apply to it.
        """
        part = capabilities.get(GradientPartitioning)
        if self.module is None or part is None or part.stage < 1:
            return None
        key, setting = part.config_key, f"{part.config_key}={part.stage}"
        out = []
        tp = self.grid.get_model_parallel_world_size()
        if tp > 1 and not part.honours_norm_rules:
            out.append((key, f"{setting}: this gradient partitioning does not apply the norm rules to its "
                             f"partitions, so with tensor parallelism (model axis {tp}) the norm would count the "
                             f"replicated biases once per tensor rank; {part.disable_hint}."))
        tied = [k for k in self.module._tie_keys() if len(self.module.tied_owner_stages(k)) > 1]
        clipping = config["gradient_clipping"]
        if tied and clipping > 0 and not part.honours_norm_rules:
            out.append(("gradient_clipping", f"gradient_clipping={clipping}: with gradient partitioning ({setting}) "
                                             f"the gradient norm would count the tied weights {tied} once per stage "
                                             f"that holds them; set gradient_clipping to 0 or {part.disable_hint}."))
        if tied and part.stage >= 2 and not part.sums_marked_gradients:
            out.append((key, f"{setting}: this gradient partitioning reduces gradients during backward and does not "
                             f"sum the tied weights {tied} over their stages; {part.disable_hint}."))
        return out

    @hookimpl
    def microspeed_after_model_ready(self, engine: Any, model: torch.nn.Module) -> None:
        """Attach the runtime (a PipelineModule may have been wrapped; find it again)."""
        if self.module is None:
            return
        from microspeed_pipeline.runtime import PipelineRuntime

        section = self.config["pipeline"]
        self.runtime = PipelineRuntime(engine, self.module, section["schedule"])
        kinds = {kind for kind, key in (("act", "pipe_partitioned"), ("grad", "grad_partitioned")) if section[key]}
        self.runtime.p2p.partition(self.grid.get_model_parallel_group(), kinds)
        engine.set_plugin_state("pipeline", self.runtime)

    @hookimpl
    def microspeed_pass_parameters(self) -> list[list[torch.nn.Parameter]] | None:
        """Several chunks per rank (interleaved): each chunk's parameters, so gradient buckets stay in one chunk."""
        if self.runtime is None or self.runtime.chunks < 2:
            return None
        return self.runtime.chunk_parameters()

    @hookimpl
    def microspeed_features(self) -> list[Feature]:
        """Pipeline parallelism (1F1B, interleaved) and tensor parallelism, for the composition matrix."""
        return list(FEATURES)

    @hookimpl
    def microspeed_refusals(self) -> list[Refusal]:
        """The pairs :meth:`microspeed_conflicts` refuses (:mod:`microspeed_pipeline.compositions`)."""
        return list(REFUSALS)

    @hookimpl(wrapper=True)
    def microspeed_make_dataloader(self, engine: Any, dataset: Any, collate_fn: Any) -> Any:
        """Give a pipeline's ``train_batch()`` DeepSpeed's data order: this rank's shard, unshuffled, repeating.

        DeepSpeed's pipeline engine feeds ``train_batch()`` without an iterator from a loader of its own
        (``DistributedSampler(shuffle=False)`` over the data axis, repeating), not from the shuffled loader
        ``initialize()`` returns; a script ported from DeepSpeed sees the same samples in the same order.
        """
        loader = yield
        if self.runtime is not None and dataset is not None:
            from torch.utils.data import DataLoader
            from torch.utils.data.distributed import DistributedSampler

            from microspeed import RepeatingLoader

            topo = engine.topology
            sampler = DistributedSampler(dataset, num_replicas=topo.data_parallel_size,
                                         rank=topo.data_parallel_rank, shuffle=False)
            engine.set_dataiterator(RepeatingLoader(DataLoader(
                dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
                collate_fn=collate_fn, drop_last=engine.config["dataloader_drop_last"])))
        return loader

    @hookimpl
    def microspeed_before_forward(self, engine: Any) -> None:
        """Refuse ``engine(x)`` with several stages: only the schedule knows what each stage runs."""
        if self.module is not None and self.module.num_stages > 1 and self.runtime is not None \
                and not self.runtime.running:
            raise RuntimeError(f"engine(...): this model is a pipeline of {self.module.num_stages} stages; train "
                               f"with engine.train_batch(data_iter) and evaluate with engine.eval_batch(data_iter).")

    @hookimpl
    def microspeed_train_batch(self, engine: Any, data_iter: Any) -> torch.Tensor | None:
        """Run the pipeline schedule."""
        if self.runtime is None:
            return None
        with using_grid(self.grid):  # a loss function may ask for the tensor-parallel group
            return self.runtime.train_batch(data_iter)

    @hookimpl
    def microspeed_eval_batch(self, engine: Any, data_iter: Any, return_logits: bool, compute_loss: bool,
                              reduce_output: str | None, bcast_loss: bool, num_micro_batches: int | None) -> Any:
        """Run the inference schedule."""
        if self.runtime is None:
            return None
        with using_grid(self.grid):
            return self.runtime.eval_batch(data_iter, return_logits, compute_loss, reduce_output, bcast_loss,
                                           num_micro_batches)

    # -- gradient norm -------------------------------------------------------------------

    def duplicate_names(self, engine: Any) -> set[str]:
        """Names of this rank's parameters whose gradients another rank of the slice already counts.

        The copies of a tied weight on every stage but its first owner, and the parameters that are
        replicated across the tensor-parallel group (biases, norms) on tensor rank > 0.
        """
        from microspeed_pipeline.tensor_parallel import is_tensor_parallel_duplicate

        names = set(self.module.tied_duplicate_names()) if self.module is not None else set()
        group = self.grid.get_model_parallel_group()
        for name, p in engine.module.named_parameters():
            if is_tensor_parallel_duplicate(p, group=group):
                names.add(name)
        return names

    @hookimpl
    def microspeed_grad_norm_rules(self, engine: Any) -> dict[str, NormRule] | None:
        """Skip the copies another rank counts; the kernel sums the rest over the slice (model-parallel) group."""
        if self.grid is None:
            return None
        return {name: NormRule(skip=True) for name in sorted(self.duplicate_names(engine))}

    # -- checkpoints ---------------------------------------------------------------------

    @hookimpl
    def microspeed_checkpoint_placements(self, engine: Any) -> dict | None:
        """Tensor-parallel shards as boxes of their full tensors; who writes each tensor.

        One data-parallel replica writes a shard (``write``); copies that another rank of the same
        replica holds — a tied weight on every stage but its first owner, a replicated parameter
        (norms, row-parallel biases) on tensor rank > 0 — are marked ``duplicate`` and never written
        here. A plugin that also splits the tensor over the data axis (ZeRO) presents pieces of the
        local shard; the core moves them into the full tensor through these placements. Under
        ZeRO stage 3 the local shape is the parameter's ``ds_shape``.
        """
        if self.grid is None:
            return None
        from microspeed.plugin_api import Placement

        g = self.grid
        tp, tp_ranks = g.get_model_parallel_world_size(), g.group_ranks.get("model", [g.get_global_rank()])
        tied = self.module.tied_duplicate_names() if self.module is not None else set()
        replica_copy = tp > 1 and g.get_model_parallel_rank() > 0
        out = {}
        for name, p in engine.module.named_parameters():
            local = tuple(getattr(p, "ds_shape", None) or p.shape)
            split = tp > 1 and getattr(p, "tensor_model_parallel", False)
            if split:
                dim = p.partition_dim % len(local)
                if getattr(p, "partition_stride", 1) != 1:
                    raise ConfigError(f"checkpoint: {name} is split with partition_stride="
                                      f"{p.partition_stride}; only stride 1 shards can be saved as boxes.")
                shape = tuple(n * tp if d == dim else n for d, n in enumerate(local))
                pieces = tuple((q, tuple(i * local[dim] if d == dim else 0 for d in range(len(local))), local)
                               for i, q in enumerate(tp_ranks))
                out[name] = Placement(shape=shape, offsets=pieces[g.get_model_parallel_rank()][1], local=local,
                                      pieces=pieces, write=g.get_data_parallel_rank() == 0,
                                      duplicate=name in tied)
            elif name in tied or replica_copy:
                zeros = tuple(0 for _ in local)
                out[name] = Placement(shape=local, offsets=zeros, local=local,
                                      pieces=((g.get_global_rank(), zeros, local),), duplicate=True)
        return out or None


def default_grid() -> ParallelGrid | None:
    """The process's default grid (set by a PipelineModule or ``initialize_model_parallel``)."""
    return get_default_grid()
