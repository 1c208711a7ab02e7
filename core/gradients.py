"""What every plugin shares about parameters and their gradients: replica groups, overflow, the global norm.

* **Replica groups.** A parameter is replicated over the data-parallel group unless a plugin says
  otherwise (:class:`ReplicaGroup`, DeepSpeed's ``param.allreduce = False``: the experts of a
  Mixture-of-Experts layer live on some ranks only).
* **Overflow.** :func:`has_inf_or_nan`, one host sync per device, for loss scaling; and
  :meth:`GradNorm.finite`, the one non-finite check of every step (fp32, bf16, fp16 after unscaling): a
  NaN or inf loss or gradient skips the step on every rank.
* **The global gradient norm**, computed in one place (:func:`global_grad_norm`). The kernel sums
  every gradient's squares once: over the topology's model-parallel group by default, and over
  whatever else a plugin declares for a parameter through the collected hook
  ``microspeed_grad_norm_rules`` — a :class:`NormRule` per parameter name: *skip* a copy whose
  squares another rank counts (a tied weight on a later pipeline stage, a tensor-parallel
  duplicate), or sum over extra *groups* (an expert's squares over its expert-parallel group).
  No plugin needs to know another's groups: each describes its own parameters, and
  :func:`clip_` scales once. A gradient-partitioning owner passes its shards cut into pieces of one
  rule each (``rules=``, :meth:`GradNorm.rule_for`), so the rules hold for partitions too.
* **Gradient sums.** A plugin that keeps copies of one parameter on several ranks whose gradients
  must be summed (a tied weight on several pipeline stages) marks it with a :class:`GradientSum`
  (``param.summed_over``). A gradient-reduction owner that states
  ``GradientPartitioning.sums_marked_gradients`` sums them itself; otherwise the marking plugin does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from microspeed import comm

if TYPE_CHECKING:
    from microspeed.engine import Engine


# ------------------------------------------------------------------------------ replica groups


@dataclass(frozen=True)
class ReplicaGroup:
    """The ranks holding copies of a parameter that is not replicated over the whole data-parallel group.

    A plugin that gives data-parallel ranks different parameters (the experts of a Mixture-of-Experts
    layer) marks each with ``param.allreduce = False`` and ``param.replica_group = ReplicaGroup(group,
    ranks)``. A gradient-reduction owner whose :class:`~microspeed.capabilities.GradientPartitioning`
    capability says ``keeps_replica_groups`` (ZeRO stages 1 and 2) partitions and reduces such a
    parameter over its group, still averaging by the data-parallel size; the others leave it to the
    plugin that made it.
    """

    group: Any
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's position in the group."""
        me = dist.get_rank() if dist.is_initialized() else 0
        if me not in self.ranks:
            raise ValueError(f"ReplicaGroup{self.ranks}: rank {me} is not a member")
        return self.ranks.index(me)


def replica_group(param: torch.Tensor) -> ReplicaGroup | None:
    """The :class:`ReplicaGroup` ``param`` is replicated over, or ``None`` for the data-parallel group."""
    return getattr(param, "replica_group", None)


def reduced_over_data_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is replicated over the data-parallel group (broadcast at start, gradients averaged).

    ``param.allreduce = False`` is DeepSpeed's mark for parameters that differ across data-parallel
    ranks (the experts of a Mixture-of-Experts layer); the plugin that made them synchronises them.
    """
    return getattr(param, "allreduce", True) is not False


@dataclass(frozen=True)
class GradientSum:
    """A parameter whose gradient must be summed over its copies on other ranks (``param.summed_over``).

    ``group``/``ranks``: the process group of the ranks holding a copy (one per pipeline stage of a
    tied weight, at the same data and tensor coordinates); ``key``: a name equal on every rank of the
    group for the same parameter (the tied key), so an owner can give each copy the same layout. The
    copies' gradients are summed after each rank's own reduction; every copy then holds the sum.
    """

    group: Any
    ranks: tuple[int, ...]
    key: str


def summed_over(param: torch.Tensor) -> GradientSum | None:
    """The :class:`GradientSum` of ``param``, or ``None`` when its gradient is this rank's alone."""
    return getattr(param, "summed_over", None)


# ------------------------------------------------------------------------------------ overflow


def has_inf_or_nan(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether any of ``tensors`` (typically gradients) holds an inf, -inf or nan.

    ``None`` entries, empty tensors and non-floating-point tensors are skipped; sparse tensors are checked
    on their stored values. Tensors are grouped by device and dtype; each group takes one
    ``torch._foreach_norm(..., inf)`` (max-abs, which propagates nan and is exact, so it cannot overflow
    for finite inputs), and the host synchronises once per device, not once per tensor.
    """
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    for t in tensors:
        if t is None:
            continue
        if t.is_sparse:
            t = t._values()
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        groups.setdefault(t.device, {}).setdefault(t.dtype, []).append(t.detach())

    for by_dtype in groups.values():
        flags = []
        for group in by_dtype.values():
            norms = torch._foreach_norm(group, math.inf)
            flags.append(torch.isfinite(torch.stack(norms)).all())
        if not bool(torch.stack(flags).all()):
            return True
    return False


# ----------------------------------------------------------------------------------- the norm


@dataclass(frozen=True)
class NormRule:
    """How one parameter's gradient counts in the global norm (answer of ``microspeed_grad_norm_rules``).

    ``skip``: this rank's copy is counted elsewhere (a tied weight's copy on a later pipeline stage, a
    tensor-parallel duplicate on tensor rank > 0). ``groups``: process groups, besides the model-parallel
    group, over which this gradient's squares are summed (the expert-parallel group of an expert,
    whose siblings hold different experts). Rules from several plugins for one parameter combine:
    skip wins, groups add up.
    """

    skip: bool = False
    groups: tuple[Any, ...] = ()


def square_sum(tensors: Sequence[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """Sum of the squares of every element of ``tensors``, as a 0-d fp32 tensor (no host sync)."""
    present = [t for t in tensors if t is not None and t.numel()]
    if not present:
        return torch.zeros((), dtype=torch.float32, device=device)
    per_tensor = torch._foreach_norm(present, 2.0)
    return torch.stack([n.float() for n in per_tensor]).square().sum()


NOT_PARTITIONED = object()
"""Default of :meth:`GradNorm.__call__`'s ``partitioned_over``: every rank holds whole gradients."""


def _local_norm(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    per_tensor = torch._foreach_norm(list(tensors), 2.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in per_tensor]), 2.0)


def combine_rules(answers: Iterable[dict[str, NormRule] | None]) -> dict[str, NormRule]:
    """Merge the plugins' ``{fqn: NormRule}`` answers: skip wins, groups add up (each group once)."""
    merged: dict[str, NormRule] = {}
    for answer in answers:
        for name, rule in (answer or {}).items():
            if not isinstance(rule, NormRule):
                raise TypeError(f"microspeed_grad_norm_rules: the rule for {name!r} is a {type(rule).__name__}, "
                                f"not a microspeed.plugin_api.NormRule")
            old = merged.get(name)
            if old is None:
                merged[name] = rule
                continue
            groups = old.groups + tuple(g for g in rule.groups if not any(g is h for h in old.groups))
            merged[name] = NormRule(skip=old.skip or rule.skip, groups=groups)
    return merged


class GradNorm:
    """The engine's global-norm bookkeeping: the merged rules and which tensors they name.

    One per engine (``engine.grad_norm``). The rules are asked of the plugins once, at the end of
    ``initialize()`` (:meth:`prepare`: parameters and optimizer are final by then) or at the first norm;
    :meth:`refresh` makes the next norm ask again.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._rules: dict[str, NormRule] | None = None
        self._slots: list[tuple[int, ...]] = []
        self._slot_of: dict[int, int] = {}  # id(param) -> slot index; params of no slot use slot 0
        self._skip: set[int] = set()
        self._groups: list[tuple[Any, ...]] = [()]
        self._slot_key: dict[tuple[int, ...], int] = {(): 0}
        self._rule_of: dict[int, NormRule] = {}
        self._within: dict[tuple[int, int], bool] = {}

    def refresh(self) -> None:
        """Forget the rules and the parameter map (parameters were replaced)."""
        self._rules = None

    def prepare(self) -> None:
        """Ask the plugins for their rules and map them onto the optimizer's and the module's parameters."""
        engine = self.engine
        self._rules = combine_rules(engine.hook.microspeed_grad_norm_rules(engine=engine))
        self._groups, self._slot_of, self._skip, self._rule_of = [()], {}, set(), {}
        self._slot_key = {(): 0}
        if not self._rules:
            return
        names = {id(p): n for n, p in engine.module.named_parameters()}
        for extra in engine.hook.microspeed_optimizer_param_names(engine=engine):
            names.update(extra or {})
        keys = self._slot_key
        by_name: dict[str, int] = {}
        for name, rule in self._rules.items():  # slots in rule order: the same on every rank
            key = tuple(id(g) for g in rule.groups)
            if key not in keys:
                keys[key] = len(self._groups)
                self._groups.append(rule.groups)
            by_name[name] = keys[key]
        params = [p for group in getattr(engine.optimizer, "param_groups", []) for p in group["params"]]
        params += list(engine.module.parameters())
        for p in params:
            rule = self._rules.get(names.get(id(p), ""))
            if rule is None:
                continue
            self._rule_of[id(p)] = rule
            if rule.skip:
                self._skip.add(id(p))
            else:
                self._slot_of[id(p)] = by_name[names[id(p)]]

    @property
    def has_rules(self) -> bool:
        """Whether any plugin gave a rule (without any, partitions need no per-parameter pieces)."""
        if self._rules is None:
            self.prepare()
        return bool(self._rules)

    def rule_for(self, param: torch.Tensor) -> NormRule | None:
        """The merged :class:`NormRule` of ``param`` (a parameter of the module or the optimizer), or ``None``.

        For an owner that partitions gradients: cut its shards into pieces of one rule each and pass the
        rules with them (``rules=``).
        """
        if self._rules is None:
            self.prepare()
        return self._rule_of.get(id(param))

    def _counted_groups(self, index: int, partitioned_over: Any) -> tuple[Any, ...]:
        """Slot ``index``'s groups, less those inside ``partitioned_over`` (the pieces are summed over it)."""
        groups = self._groups[index]
        if partitioned_over is NOT_PARTITIONED:
            return groups
        if partitioned_over is None:
            return ()
        kept = []
        for group in groups:
            key = (id(group), id(partitioned_over))
            if key not in self._within:
                outer = set(dist.get_process_group_ranks(partitioned_over))
                ranks = range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
                self._within[key] = set(ranks) <= outer
            if not self._within[key]:
                kept.append(group)
        return tuple(kept)

    def __call__(self, grads: Sequence[torch.Tensor | None], *, params: Sequence[torch.Tensor] | None = None,
                 partitioned_over: Any = NOT_PARTITIONED,
                 rules: Sequence[NormRule | None] | None = None) -> torch.Tensor:
        """The global L2 norm (0-d fp32 tensor) of ``grads``, each element counted once over all ranks.

        ``params`` (same length as ``grads``) names whose gradient each is, for the rules; without it the
        gradients are matched to the optimizer's parameters by identity. ``partitioned_over``: the group
        across which ``grads`` are disjoint pieces (ZeRO's flat gradient shards; ``None`` is the world),
        summed over it too. Pieces given without ``params`` or ``rules`` belong to no single parameter, so
        no rule applies to them: the partitioning owner has already placed every element in exactly one
        rank's piece (an expert's shards over its replica group are disjoint within ``partitioned_over``
        too). ``rules`` (same length as ``grads``): the :class:`NormRule` (or ``None``) of each piece, from
        :meth:`rule_for` — a piece whose rule skips is not counted, and a rule's groups are summed over
        unless they lie inside ``partitioned_over`` (whose sum already covers them).
        """
        if self._rules is None:
            self.prepare()
        device = next((g.device for g in grads if g is not None), torch.device("cpu"))
        topology = self.engine.topology
        pieces = partitioned_over is not NOT_PARTITIONED and params is None and rules is None
        if rules is not None:
            if len(rules) != len(grads):
                raise ValueError(f"grad_norm: {len(grads)} gradients but {len(rules)} rules")
            slots = [[] for _ in self._groups]
            for g, rule in zip(grads, rules, strict=True):
                if g is None or (rule is not None and rule.skip):
                    continue
                key = () if rule is None else tuple(id(h) for h in rule.groups)
                if key not in self._slot_key:
                    raise ValueError(f"grad_norm: {rule} is not a rule any plugin gave (use grad_norm.rule_for)")
                slots[self._slot_key[key]].append(g)
        elif pieces or (len(self._groups) == 1 and not self._skip):
            slots = [[g for g in grads if g is not None]]
            if partitioned_over is NOT_PARTITIONED and topology.model_parallel_size == 1:
                return _local_norm(slots[0], device)  # pure data parallelism: every rank holds it all
        else:
            slots = [[] for _ in self._groups]
            owner = self._owners(grads, params)
            for g, key in zip(grads, owner, strict=True):
                if g is None or key in self._skip:
                    continue
                slots[self._slot_of.get(key, 0)].append(g)
        total = square_sum(slots[0], device)
        for index in range(1, len(slots)):
            part = square_sum(slots[index], device)
            for group in self._counted_groups(index, partitioned_over):
                if comm.get_world_size(group) > 1:
                    comm.all_reduce(part, group=group)
            total = total + part
        if partitioned_over is not NOT_PARTITIONED and comm.get_world_size(partitioned_over) > 1:
            comm.all_reduce(total, group=partitioned_over)
        if topology.model_parallel_size > 1:
            comm.all_reduce(total, group=topology.model_parallel_group)
        return total.sqrt()

    def finite(self, norm: torch.Tensor | float) -> bool:
        """Whether this step's global ``norm`` (from :meth:`__call__`) is finite — the same answer on every rank.

        The kernel's one check of a step's numbers, made by whoever steps the optimizer between the norm
        and the step: ``False`` means skip the step (``StepOutcome(applied=False, nonfinite=True)``). A
        non-finite loss counts too: the built-in ``gradient_clipping`` plugin makes its gradients NaN, so a
        NaN or inf anywhere in the loss or the gradients reaches the norm. One host sync, no pass over the
        gradients (the norm is computed anyway). The norm is the same on every rank when the gradients were
        averaged (the built-in reduction), or when it was summed over their partitions (``partitioned_over``)
        and the model-parallel group; when a plugin that does not partition took the reduction over (a 1-bit
        optimizer's compressed phase: gradients stay local), the flag is agreed with one all-reduce over the
        data-parallel group, so every rank skips or none does.
        """
        from microspeed.capabilities import GradientPartitioning, Role

        flag = torch.isfinite(torch.as_tensor(norm)).logical_not().float().reshape(())
        engine = self.engine
        group = engine.topology.data_parallel_group
        local = engine.owner(Role.GRADIENT_REDUCTION) is not None and \
            engine.capabilities.get(GradientPartitioning) is None
        if local and comm.get_world_size(group) > 1:
            comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return not bool(flag)

    def _owners(self, grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor] | None) -> list[int]:
        if params is not None:
            return [id(p) for p in params]
        by_grad = {}
        for group in getattr(self.engine.optimizer, "param_groups", []):
            for p in group["params"]:
                if p.grad is not None:
                    by_grad[id(p.grad)] = id(p)
        for p in self.engine.module.parameters():
            if p.grad is not None:
                by_grad.setdefault(id(p.grad), id(p))
        return [by_grad.get(id(g), -1) if g is not None else -1 for g in grads]


def clip_(grads: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``grads`` in place so that their norm is at most ``max_norm`` (DeepSpeed's rule, no host sync).

    ``coef = max_norm / (norm + 1e-6)``, applied when below 1.
    """
    grads = [g for g in grads if g is not None]
    if grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))
