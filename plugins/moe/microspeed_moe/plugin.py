"""The ``moe`` plugin: expert parameters synchronised over their own groups, through the core's hooks.

Active when the model contains :class:`~microspeed_moe.layer.MoE` layers. Expert parameters are marked
``allreduce = False``, so the built-in data-parallel reducer neither broadcasts nor averages them; this
plugin does, over each layer's *expert-data-parallel* group (the ranks holding the same experts):

* ``setup``: create each layer's groups inside the topology's data-parallel group (the world, or a
  pipeline stage's / tensor rank's data axis; collectively over the world), mark the experts with
  their replica group and start the copies of each expert equal (broadcast from the first rank of its
  expert-data-parallel group) — before any plugin partitions parameters;
* ``after_model_ready``: refuse a gradient-reduction owner that cannot keep expert parameters apart;
* ``reduce_gradients`` (a wrapper around whoever reduces the rest): sum each expert gradient over the
  expert-data-parallel group and divide by the data-parallel size — the tensor that holds it at the
  boundary: ``p.grad``, or the fp32 buffer mixed precision summed the micro-steps into
  (``data_types.grad_accum_dtype`` fp32, found through :class:`~microspeed.plugin_api.LossScaling`'s
  ``accumulated_grad``; the built-in reducer averages only replicated parameters' buffers, so each
  expert is divided exactly once). An expert's gradient already holds
  the contributions of every rank of its expert-parallel group (the all-to-all's backward brings them),
  so this is the average over all ranks' micro-batches — what one process on the whole batch computes;
* ``grad_norm_rules``: each expert's squares count in the global gradient norm summed over its
  expert-parallel group (whose ranks hold different experts), added once to the replicated
  parameters' squares — the kernel's one norm (``engine.grad_norm``) does the sums, whoever clips.

Each expert parameter is marked with its :class:`~microspeed.plugin_api.ReplicaGroup` (the
expert-data-parallel group). When another plugin owns gradient reduction, the reducing hook above
stands down: the owner must state a :class:`~microspeed.plugin_api.GradientPartitioning` capability that
``keeps_replica_groups`` (it partitions, reduces and steps expert parameters over that group, as ZeRO
stages 1, 2 and 3 do); any other owner is refused at ``initialize()``, naming the key that turned it on.

With a grid the norm needs nothing more either: a tensor rank > 0's experts are tensor-parallel
duplicates (same tokens, same experts), which the pipeline plugin's rules skip, and the kernel sums
the stages over the slice group.

Checkpoints need nothing more: experts are named by global index (see
:mod:`microspeed_moe.experts`), so the core's union of the ranks' names is the whole model, and a
checkpoint saved with ``ep_size`` 2 loads with 1 or 4. ``save_16bit_model`` writes rank 0's dict
only: ``consolidated_state_dict`` (a wrapper around whoever consolidates the rest — the default
``module.state_dict()`` or ZeRO stage 3's gather) brings every rank's experts to rank 0 under their
global names (:mod:`microspeed_moe.consolidate`), so the file loads into a model with any ``ep_size``.
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
from microspeed_moe.compositions import FEATURES, REFUSALS
from microspeed_moe.consolidate import expert_prefixes, gather_experts
from microspeed_moe.groups import ExpertGroups, make_expert_groups
from microspeed_moe.layer import MoE


class MoEPlugin:
    """Synchronises expert parameters over expert-data-parallel groups (see the module docstring)."""

    def __init__(self) -> None:
        self.layers: list[MoE] = []
        self.expert_params: list[tuple[torch.nn.Parameter, ExpertGroups]] = []
        self.spread = False

    @hookimpl
    def microspeed_setup(self, engine: Any) -> None:
        """Find the MoE layers; make their groups inside the data-parallel group; mark and sync the experts.

        At set-up, before any plugin partitions parameters (ZeRO stage 3 in ``after_model_ready``), so
        the experts carry their :class:`ReplicaGroup` when a partitioner looks. Under a grid (pipeline
        stages, tensor ranks) ranks may hold different layers: the groups are made collectively from
        every rank's needs (:func:`~microspeed_moe.groups.make_expert_groups`).
        """
        topo = engine.topology
        self.layers = [m for m in engine.module.modules() if isinstance(m, MoE)]
        spread = self.spread = topo.model_parallel_size > 1
        if not self.layers and not spread:
            return
        dp_group = topo.data_parallel_group if topo.data_parallel_size != topo.world_size else None
        made = make_expert_groups({layer.ep_size for layer in self.layers}, dp_group, everywhere=spread)
        for layer in self.layers:
            groups = made[layer.ep_size]
            layer.deepspeed_moe._set_ep_group(groups.ep_group)
            layer.deepspeed_moe.experts.place(groups.ep_rank)
            for p in layer.deepspeed_moe.experts.parameters():
                p.replica_group = ReplicaGroup(groups.edp_group, groups.edp_ranks)
                self.expert_params.append((p, groups))
        with torch.no_grad():
            for p, g in self.expert_params:
                if g.edp_size > 1:
                    comm.broadcast(p.data, src=g.edp_ranks[0], group=g.edp_group)
        if self.layers:
            engine.set_plugin_state("moe", self)

    @hookimpl
    def microspeed_after_model_ready(self, engine: Any, model: torch.nn.Module) -> None:
        """Refuse what cannot keep the experts apart (the owners of gradient reduction are known now)."""
        if self.layers:
            self._check(engine)

    def _check(self, engine: Any) -> None:
        owner = engine.owner(Role.GRADIENT_REDUCTION)
        if owner is None:
            return
        part = engine.capabilities.get(GradientPartitioning)
        if part is not None and engine.capabilities.provider(GradientPartitioning) == owner:
            if part.keeps_replica_groups:
                return
            hint = (f"{part.config_key}={part.stage} partitions every parameter over the whole data-parallel group; "
                    f"{part.disable_hint}")
        else:
            hint = "turn that feature off"
        raise ConfigError(f"MoE layers: the plugin {owner!r} reduces gradients but cannot keep expert parameters "
                          f"apart (each rank holds different experts): {hint}.")

    @hookimpl(wrapper=True)
    def microspeed_reduce_gradients(self, engine: Any) -> Any:
        """After the rest is reduced: sum expert gradients over their copies, divide by the data-parallel size.

        Reduces the tensor holding each expert's accumulated gradient (``LossScaling.accumulated_grad``:
        an fp32 accumulation buffer, else ``p.grad``). Stands down when another plugin owns gradient
        reduction (it reduces experts over their replica groups).
        """
        result = yield
        if self.expert_params and engine.owner(Role.GRADIENT_REDUCTION) is None:
            world = engine.topology.data_parallel_size
            precision = engine.capabilities.get(LossScaling)
            buffer_of = precision.accumulated_grad if precision is not None else None
            for p, g in self.expert_params:
                if not p.requires_grad:
                    continue
                grad = buffer_of(p) if buffer_of is not None else None
                if grad is None:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grad = p.grad
                if g.edp_size > 1:
                    comm.all_reduce(grad, group=g.edp_group)
                if world > 1:
                    grad.div_(world)
        return result

    @hookimpl(wrapper=True)
    def microspeed_consolidated_state_dict(self, engine: Any) -> Any:
        """Around whoever consolidates the rest: every rank's experts gathered to rank 0, by global index.

        Without a consolidator each rank's own state dict holds its experts whole (the default);
        a partitioner (ZeRO stage 3) returns, on ranks other than 0, the whole parameters of which
        it holds the first copy in their replica group. Collective: every rank of an engine with
        MoE layers (or of a grid, whose stages may lack them) joins. A refusal passes through.
        """
        result = yield
        if not (self.layers or self.spread) or (result is not None and "__skip__" in result):
            return result
        experts = [layer.deepspeed_moe.experts for layer in self.layers]
        prefixes = expert_prefixes(engine.module, experts)
        if result is None:
            local = engine.module.state_dict()
        else:  # a partitioner's answer: its tensors, plus the experts' buffers (never partitioned)
            local = dict(result)
            buffers = {n for n, _ in engine.module.named_buffers()}
            for k, v in engine.module.state_dict().items():
                if k in buffers and k not in local and prefixes and k.startswith(prefixes):
                    local[k] = v
        return gather_experts(local, prefixes)

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
