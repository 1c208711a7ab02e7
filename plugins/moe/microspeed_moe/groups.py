"""Expert-parallel process groups: which ranks split the experts, which hold copies of the same ones.

Expert groups live *inside a data-parallel group*: the ranks that see different micro-batches of the
same parameters (the whole world in pure data parallelism; one pipeline stage's, one tensor rank's
data axis in a 3D grid). With that group's ranks ``D = [d_0, …, d_{W−1}]`` (sorted) and
``ep_size = E`` (``E`` divides ``W``), as DeepSpeed lays them out:

* an **expert-parallel group** is ``E`` consecutive members ``D[iE … iE + E − 1]``: together they
  hold every expert of a layer once (member ``iE + j`` holds experts ``j·n … (j + 1)·n − 1``, ``n``
  local experts each), and tokens are exchanged among them with ``all_to_all``;
* an **expert-data-parallel group** is the ``W / E`` members ``D[j], D[j + E], D[j + 2E], …`` holding
  the same experts: their expert gradients are summed over it.

Pipeline stages and tensor ranks thus get groups of their own (stage 1's experts are split over
stage 1's data axis, never across stages), and experts are replicated over the tensor axis: the
ranks of one tensor-parallel group see the same tokens and hold the same experts.

Creating groups is collective over the world (every rank makes every group, in the same order), but
a pipeline's stages hold different layers: :func:`make_expert_groups` therefore gathers, from every
rank, its data-parallel group and the ``ep_size`` values it needs, and every rank then makes the
groups of every (data-parallel group, ``ep_size``) pair, in one order.

Groups belong to their data-parallel group: they are kept with that group object (weakly), so
two engines with different grids do not share them, engines of one grid (or of one world, in pure
data parallelism) do, as they share torch's groups, and a world started anew gets its own. As
DeepSpeed's, a layer may be built before the process group exists: its rank comes from the
launcher's ``RANK`` variable and its groups are made at ``initialize`` (or its first forward, over
the whole world).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from microspeed.plugin_api import ConfigError


@dataclass(frozen=True)
class ExpertGroups:
    """The two groups of one ``ep_size`` for this rank, and where this rank sits in them."""

    ep_size: int
    world_size: int
    ep_rank: int
    ep_group: Any
    ep_ranks: tuple[int, ...]
    edp_group: Any
    edp_ranks: tuple[int, ...]

    @property
    def edp_size(self) -> int:
        """Copies of each expert (ranks in the expert-data-parallel group)."""
        return len(self.edp_ranks)


_BY_GROUP: weakref.WeakKeyDictionary[Any, dict[int, ExpertGroups]] = weakref.WeakKeyDictionary()
"""``data-parallel group (the world's default group for the whole world) -> {ep_size: ExpertGroups}``."""

_LATEST: weakref.WeakKeyDictionary[Any, dict[int, ExpertGroups]] = weakref.WeakKeyDictionary()
"""``world -> {ep_size: this rank's groups made last}``: what a script's later, group-less query gets."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def expert_rank(ep_size: int) -> int:
    """This rank's position in its expert-parallel group when the data-parallel group is the world.

    Before the process group exists, the launcher's ``RANK`` (what ``init_distributed`` will use), else 0.
    Under a grid the position comes from :func:`make_expert_groups` (``ExpertGroups.ep_rank``).
    """
    if dist.is_initialized():
        return dist.get_rank() % ep_size
    return (_env_int("RANK") or 0) % ep_size


def check_ep_size(ep_size: int, num_experts: int) -> None:
    """Refuse an ``ep_size`` that does not divide the experts or the world, naming the fix.

    Without a process group the world size is the launcher's ``WORLD_SIZE`` when set; otherwise the
    check waits for the groups (``initialize`` or the first forward), as DeepSpeed's does. The
    data-parallel group's size is checked when the groups are made.
    """
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"MoE(ep_size={ep_size!r}): expected a positive int.")
    if num_experts % ep_size:
        raise ValueError(f"MoE(num_experts={num_experts}, ep_size={ep_size}): ep_size must divide num_experts.")
    world = dist.get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE")
    if world is not None and world % ep_size:
        raise ValueError(f"MoE(ep_size={ep_size}): the world size {world} must be a multiple of ep_size.")


def _key(dp_group: Any) -> Any:
    return dist.group.WORLD if dp_group is None else dp_group


def _members(dp_group: Any) -> tuple[int, ...]:
    if dp_group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(dp_group)))


def _build(members: tuple[int, ...], ep_size: int, rank: int) -> ExpertGroups | None:
    """Make one data-parallel group's expert groups (collective: every rank of the world calls it alike)."""
    ep_group = edp_group = None
    ep_ranks: tuple[int, ...] = ()
    edp_ranks: tuple[int, ...] = ()
    for start in range(0, len(members), ep_size):
        ranks = members[start:start + ep_size]
        group = dist.new_group(list(ranks))
        if rank in ranks:
            ep_group, ep_ranks = group, ranks
    for j in range(ep_size):
        ranks = members[j::ep_size]
        group = dist.new_group(list(ranks))
        if rank in ranks:
            edp_group, edp_ranks = group, ranks
    if rank not in members:
        return None
    return ExpertGroups(ep_size, len(members), members.index(rank) % ep_size, ep_group, ep_ranks, edp_group,
                        edp_ranks)


def _refuse(ep_size: int, size: int, where: str) -> None:
    if size % ep_size:
        raise ConfigError(f"MoE(ep_size={ep_size}): {where} has {size} rank(s), which is not a multiple of ep_size; "
                         f"choose an ep_size that divides the data-parallel size.")


def make_expert_groups(ep_sizes: Iterable[int], dp_group: Any = None, everywhere: bool = False) -> dict[
        int, ExpertGroups]:
    """This rank's groups for each of ``ep_sizes`` inside the data-parallel group ``dp_group`` (``None``: the world).

    Collective over the world. With ``everywhere`` or a ``dp_group`` (ranks may need different
    ``ep_sizes`` or have different data-parallel groups — pipeline stages), every rank gathers every
    rank's data-parallel group and needed sizes, and all make the union of the groups in one order;
    over the whole world every rank must pass the same sizes.
    Groups already made for ``dp_group`` are reused. Without torch.distributed every rank is its
    own group (``None``).
    """
    sizes = sorted(set(ep_sizes))
    if not dist.is_initialized():
        for e in sizes:
            if e > 1:
                raise ValueError(f"MoE(ep_size={e}): expert parallelism needs torch.distributed; start it before the "
                                 f"layer's first forward (microspeed.initialize does, or "
                                 f"microspeed.init_distributed()).")
        return {e: ExpertGroups(e, 1, 0, None, (0,), None, (0,)) for e in sizes}
    rank = dist.get_rank()
    known = _BY_GROUP.setdefault(_key(dp_group), {})
    members = _members(dp_group)
    missing = tuple(e for e in sizes if e not in known)
    if everywhere or dp_group is not None:
        wanted: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(wanted, (members, missing))
        todo = sorted({(m, e) for m, es in wanted for e in es})
    else:
        todo = [(members, e) for e in missing]
    for m, e in todo:
        _refuse(e, len(m), f"the data-parallel group {list(m)}")
    for m, e in todo:
        made = _build(m, e, rank)
        if made is not None and m == members:
            known[e] = made
    out = {e: known[e] for e in sizes}
    _LATEST.setdefault(dist.group.WORLD, {}).update(out)
    return out


def get_expert_groups(ep_size: int, dp_group: Any = None) -> ExpertGroups:
    """The groups for ``ep_size`` inside ``dp_group``, made the first time (collective over the world).

    Without ``dp_group``: the groups an engine made last for ``ep_size`` in this world (a pipeline
    stage's, as DeepSpeed's ``groups._get_expert_parallel_group`` answers after ``initialize``), else
    those over the whole world.
    """
    if dp_group is None and dist.is_initialized():
        latest = _LATEST.get(dist.group.WORLD, {}).get(ep_size)
        if latest is not None:
            return latest
    return make_expert_groups((ep_size,), dp_group)[ep_size]
