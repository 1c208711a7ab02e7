"""The ``moe`` plugin: expert parameters synchronised over their own groups, through the core's hooks.

Active when the model contains :class:`~microspeed_moe.layer.MoE` layers. Expert parameters are marked
``allreduce = False``, so the built-in data-parallel reducer neither broadcasts nor averages them; this
plugin does, over each layer's *expert-data-parallel* group (the ranks holding the same experts):

* ``after_model_ready``: create each layer's groups (collectively, in module order) and start the
  copies of each expert equal (broadcast from the first rank of its expert-data-parallel group);
* ``reduce_gradients`` (a wrapper around whoever reduces the rest): sum each expert gradient over the
  expert-data-parallel group and divide by the data-parallel size. An expert's gradient already holds
  the contributions of every rank of its expert-parallel group (the all-to-all's backward brings them),
  so this is the average over all ranks' micro-batches — what one process on the whole batch computes;
* ``clip_gradients``: the global norm adds each expert's square once (summed over the expert-parallel
  group) to the replicated parameters' squares.

With ZeRO stages 1 and 2 the plugin only marks each expert parameter with its
:class:`~microspeed.builtin.data_parallel.ReplicaGroup` (the expert-data-parallel group): ZeRO partitions,
reduces and steps expert parameters over that group, so the two hooks above stand down. A gradient
reducer that cannot do so (ZeRO stage 3) is refused at ``initialize()``.

Checkpoints need nothing more: experts are named by global index (see
:mod:`microspeed_moe.experts`), so the core's union of the ranks' names is the whole model, and a
checkpoint saved with ``ep_size`` 2 loads with 1 or 4.
"""

from __future__ import annotations

from typing import Any

import torch

from microspeed import comm
from microspeed.builtin.data_parallel import ReplicaGroup
from microspeed.errors import ConfigError
from microspeed.hookspecs import hookimpl
from microspeed_moe.groups import ExpertGroups, get_expert_groups
from microspeed_moe.layer import MoE


class MoEPlugin:
    """Synchronises expert parameters over expert-data-parallel groups (see the module docstring)."""

    def __init__(self) -> None:
        self.layers: list[MoE] = []
        self.expert_params: list[tuple[torch.nn.Parameter, ExpertGroups]] = []
        self.config: Any = None

    @hookimpl
    def microspeed_configure(self, config: Any) -> None:
        """Keep the config (for the clipping threshold)."""
        self.config = config

    @hookimpl
    def microspeed_after_model_ready(self, engine: Any, model: torch.nn.Module) -> None:
        """Find the MoE layers; make their groups; start every expert's copies equal."""
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        if not self.layers:
            return
        self._check(engine)
        for layer in self.layers:
            groups = get_expert_groups(layer.ep_size)  # a layer built before init_distributed gets them here
            layer.deepspeed_moe._set_ep_group(groups.ep_group)
            layer.deepspeed_moe.experts.place()
            for p in layer.deepspeed_moe.experts.parameters():
                p.replica_group = ReplicaGroup(groups.edp_group, groups.edp_ranks)
                self.expert_params.append((p, groups))
        with torch.no_grad():
            for p, g in self.expert_params:
                if g.edp_size > 1:
                    comm.broadcast(p.data, src=g.edp_ranks[0], group=g.edp_group)
        engine.set_plugin_state("moe", self)

    def _check(self, engine: Any) -> None:
        topo, cfg = engine.topology, engine.config
        if topo.model_parallel_size > 1:
            raise ConfigError("MoE layers with pipeline or tensor parallelism are not supported: expert groups are "
                              "built over a pure data-parallel world. Use data parallelism with ep_size.")
        if topo.data_parallel_size != topo.world_size:
            raise ConfigError("MoE layers need the data-parallel group to be the whole world.")
        if (cfg.get("data_types.grad_accum_dtype") or None) in ("fp32",) and cfg.get("bf16.enabled", False):
            raise ConfigError("data_types.grad_accum_dtype=fp32 with MoE layers is not supported: expert "
                              "gradients are summed from the parameters' own gradients. Remove the key.")
        owner = engine.owner("gradient_reduction")
        if owner is not None and not getattr(engine.plugin_state(owner), "supports_replica_groups", False):
            stage = cfg.get("zero_optimization.stage", 0) or 0
            hint = (f"zero_optimization.stage={stage} partitions every parameter over the whole data-parallel "
                    f"group (DeepSpeed refuses ZeRO-3 with MoE too); use stage 1 or 2" if owner == "zero"
                    else "turn that feature off")
            raise ConfigError(f"MoE layers: the plugin {owner!r} reduces gradients but cannot keep expert parameters "
                              f"apart (each rank holds different experts): {hint}.")

    @hookimpl(wrapper=True)
    def microspeed_reduce_gradients(self, engine: Any) -> Any:
        """After the rest is reduced: sum expert gradients over their copies, divide by the data-parallel size.

        Stands down when another plugin owns gradient reduction (it reduces experts over their replica groups).
        """
        result = yield
        if self.expert_params and engine.owner("gradient_reduction") is None:
            world = engine.topology.data_parallel_size
            for p, g in self.expert_params:
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if g.edp_size > 1:
                    comm.all_reduce(p.grad, group=g.edp_group)
                if world > 1:
                    p.grad.div_(world)
        return result

    @hookimpl
    def microspeed_clip_gradients(self, engine: Any, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """Global norm: replicated squares once, expert squares summed over each expert-parallel group."""
        if not self.expert_params or engine.owner("gradient_reduction") is not None:
            return None
        from microspeed.builtin.gradient_clipping import clip_

        expert_ids = {id(p) for p, _ in self.expert_params}
        names = {id(p): n for n, p in engine.module.named_parameters()}
        expert_names = {names[i] for i in expert_ids if i in names}
        for extra in engine.hook.microspeed_optimizer_param_names(engine=engine):
            names.update(extra or {})
        group_of = {names[id(p)]: g for p, g in self.expert_params if id(p) in names}
        by_group: dict[int, tuple[ExpertGroups, list[torch.Tensor]]] = {}
        expert_grads = set()
        for group in engine.optimizer.param_groups:
            for p in group["params"]:
                name = names.get(id(p))
                if p.grad is not None and name in expert_names:
                    g = group_of[name]
                    by_group.setdefault(g.ep_size, (g, []))[1].append(p.grad)
                    expert_grads.add(id(p.grad))
        grads = [g for g in grads if g is not None]
        dense = [g for g in grads if id(g) not in expert_grads]
        device = grads[0].device if grads else torch.device("cpu")
        sq = _square_sum(dense, device)
        for g, tensors in by_group.values():
            part = _square_sum(tensors, device)
            if g.ep_size > 1:
                comm.all_reduce(part, group=g.ep_group)
            sq = sq + part
        norm = sq.sqrt()
        max_norm = self.config["gradient_clipping"] if self.config is not None else 0.0
        if max_norm > 0:
            clip_(grads, max_norm, norm)
        return norm


def _square_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([n.float() for n in torch._foreach_norm(tensors, 2.0)]).square().sum()
