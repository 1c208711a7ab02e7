"""Expert-parallel process groups: which ranks split the experts, which hold copies of the same ones.

With ``W`` data-parallel ranks and ``ep_size = E`` (``E`` divides ``W``), as DeepSpeed lays them out:

* an **expert-parallel group** is ``E`` consecutive ranks ``[iE, …, iE + E − 1]``: together they hold
  every expert of a layer once (rank ``iE + j`` holds experts ``j·n … (j + 1)·n − 1``, ``n`` local
  experts each), and tokens are exchanged among them with ``all_to_all``;
* an **expert-data-parallel group** is the ``W / E`` ranks ``[j, j + E, j + 2E, …]`` holding the same
  experts: their expert gradients are summed over it.

Groups belong to the world they were made in: they are made once per ``ep_size`` and world (creating
groups is collective: every rank makes every group, in the same order) and kept with that world — the
default process group — never with the process, so a world started anew (``destroy_process_group`` and
``init_process_group`` again, as successive tests do) gets its own groups, and nothing of a finished
world is used again. Engines of one world share them, as they share torch's groups (DeepSpeed's
``groups._get_expert_parallel_group`` answers from the same place). As DeepSpeed's, a layer may be
built before the process group exists: its rank comes from the launcher's ``RANK`` variable (the one
``init_distributed`` will use) and its groups are made at ``initialize`` or its first forward.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


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


_BY_WORLD: weakref.WeakKeyDictionary[Any, dict[int, ExpertGroups]] = weakref.WeakKeyDictionary()
"""``world (the default process group) -> {ep_size: ExpertGroups}``: groups live as long as their world."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def expert_rank(ep_size: int) -> int:
    """This rank's position in its expert-parallel group (which experts it holds).

    Before the process group exists, the launcher's ``RANK`` (what ``init_distributed`` will use), else 0.
    """
    if dist.is_initialized():
        return dist.get_rank() % ep_size
    return (_env_int("RANK") or 0) % ep_size


def check_ep_size(ep_size: int, num_experts: int) -> None:
    """Refuse an ``ep_size`` that does not divide the experts or the world, naming the fix.

    Without a process group the world size is the launcher's ``WORLD_SIZE`` when set; otherwise the
    check waits for the groups (``initialize`` or the first forward), as DeepSpeed's does.
    """
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"MoE(ep_size={ep_size!r}): expected a positive int.")
    if num_experts % ep_size:
        raise ValueError(f"MoE(num_experts={num_experts}, ep_size={ep_size}): ep_size must divide num_experts.")
    world = dist.get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE")
    if world is not None and world % ep_size:
        raise ValueError(f"MoE(ep_size={ep_size}): the world size {world} must be a multiple of ep_size.")


def get_expert_groups(ep_size: int) -> ExpertGroups:
    """The groups for ``ep_size`` over the current world (collective the first time in a world, on every rank).

    Made once per world and ``ep_size`` and kept with the world (see the module docstring); without
    torch.distributed there is nothing to make and every rank is its own group (``None``).
    """
    known = _BY_WORLD.get(dist.group.WORLD) if dist.is_initialized() else None
    if known is not None and ep_size in known:
        return known[ep_size]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if ep_size > 1 and not dist.is_initialized():
        raise ValueError(f"MoE(ep_size={ep_size}): expert parallelism needs torch.distributed; start it before the "
                         f"layer's first forward (microspeed.initialize does, or microspeed.init_distributed()).")
    if world % ep_size:
        raise ValueError(f"MoE(ep_size={ep_size}): the world size {world} must be a multiple of ep_size.")
    ep_group = edp_group = None
    ep_ranks: tuple[int, ...] = (rank,)
    edp_ranks: tuple[int, ...] = (rank,)
    if dist.is_initialized():
        for start in range(0, world, ep_size):
            ranks = tuple(range(start, start + ep_size))
            group = dist.new_group(list(ranks))
            if rank in ranks:
                ep_group, ep_ranks = group, ranks
        for j in range(ep_size):
            ranks = tuple(range(j, world, ep_size))
            group = dist.new_group(list(ranks))
            if rank in ranks:
                edp_group, edp_ranks = group, ranks
    groups = ExpertGroups(ep_size, world, rank % ep_size, ep_group, ep_ranks, edp_group, edp_ranks)
    if dist.is_initialized():
        _BY_WORLD.setdefault(dist.group.WORLD, {})[ep_size] = groups
    return groups
