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
* ``grad_norm_rules``: each expert's squares count in the global gradient norm summed over its
  expert-parallel group (whose ranks hold different experts), added once to the replicated
  parameters' squares — the kernel's one norm (``engine.grad_norm``) does the sums, whoever clips.

Each expert parameter is marked with its :class:`~microspeed.plugin_api.ReplicaGroup` (the
expert-data-parallel group). When another plugin owns gradient reduction, the reducing hook above
stands down: the owner must state a :class:`~microspeed.plugin_api.GradientPartitioning` capability that
``keeps_replica_groups`` (it partitions, reduces and steps expert parameters over that group, as ZeRO
stages 1 and 2 do); any other owner is refused at ``initialize()``, naming the key that turned it on.

Checkpoints need nothing more: experts are named by global index (see
:mod:`microspeed_moe.experts`), so the core's union of the ranks' names is the whole model, and a
checkpoint saved with ``ep_size`` 2 loads with 1 or 4.
"""

from __future__ import annotations

from typing import Any

import torch

from microspeed.plugin_api import (
    ConfigError,
    Feature,
    GradientPartitioning,
    LossScaling,
    NormRule,
    Refusal,
    ReplicaGroup,
    Role,
    comm,
    hookimpl,
)
from microspeed_moe.compositions import (
    FEATURES,
    MOE_WITH_FP32_ACCUMULATION,
    MOE_WITH_MODEL_PARALLEL,
    MOE_WITH_ZERO_3,
    REFUSALS,
)
from microspeed_moe.groups import ExpertGroups, get_expert_groups
from microspeed_moe.layer import MoE


class MoEPlugin:
    """Synchronises expert parameters over expert-data-parallel groups (see the module docstring)."""

    def __init__(self) -> None:
        self.layers: list[MoE] = []
        self.expert_params: list[tuple[torch.nn.Parameter, ExpertGroups]] = []

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
        topo = engine.topology
        if topo.model_parallel_size > 1:
            raise MOE_WITH_MODEL_PARALLEL[0].error(f"MoE layers with a model-parallel size of "
                                                   f"{topo.model_parallel_size} (pipeline or tensor parallelism)")
        if topo.data_parallel_size != topo.world_size:
            raise MOE_WITH_MODEL_PARALLEL[0].error(f"MoE layers with a data-parallel group of "
                                                   f"{topo.data_parallel_size} of {topo.world_size} ranks")
        precision = engine.capabilities.get(LossScaling)
        if precision is not None and precision.accumulate_fp32 and precision.dtype is torch.bfloat16:
            raise MOE_WITH_FP32_ACCUMULATION[0].error("data_types.grad_accum_dtype=fp32 with MoE layers")
        owner = engine.owner(Role.GRADIENT_REDUCTION)
        if owner is None:
            return
        part = engine.capabilities.get(GradientPartitioning)
        if part is not None and engine.capabilities.provider(GradientPartitioning) == owner:
            if part.keeps_replica_groups:
                return
            hint = f"{part.config_key}={part.stage} ({MOE_WITH_ZERO_3[0].message()})"
        else:
            hint = "turn that feature off"
        raise ConfigError(f"MoE layers: the plugin {owner!r} reduces gradients but cannot keep expert parameters "
                          f"apart (each rank holds different experts): {hint}.")

    @hookimpl(wrapper=True)
    def microspeed_reduce_gradients(self, engine: Any) -> Any:
        """After the rest is reduced: sum expert gradients over their copies, divide by the data-parallel size.

        Stands down when another plugin owns gradient reduction (it reduces experts over their replica groups).
        """
        result = yield
        if self.expert_params and engine.owner(Role.GRADIENT_REDUCTION) is None:
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
    def microspeed_grad_norm_rules(self, engine: Any) -> dict[str, NormRule] | None:
        """Each expert's squares are summed over its expert-parallel group (its siblings hold other experts)."""
        if not self.expert_params:
            return None
        names = {id(p): n for n, p in engine.module.named_parameters()}
        return {names[id(p)]: NormRule(groups=(g.ep_group,)) for p, g in self.expert_params if id(p) in names}

    @hookimpl
    def microspeed_features(self) -> list[Feature]:
        """Mixture of experts, for the composition matrix."""
        return list(FEATURES)

    @hookimpl
    def microspeed_refusals(self) -> list[Refusal]:
        """The pairs this plugin refuses at ``initialize()`` (:mod:`microspeed_moe.compositions`)."""
        return list(REFUSALS)
