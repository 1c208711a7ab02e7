"""How parameters are laid out in partitions: flat segments split evenly across ranks.

A :class:`Segment` is an ordered list of parameters flattened into one buffer, padded to a
multiple of the data-parallel size ``N`` and split into ``N`` equal, contiguous slices: rank
``r`` owns elements ``[r*S, (r+1)*S)``. Every collective ZeRO runs is on one segment, so it is
balanced across ranks and needs no copies: the all-gather of updated parameters writes straight
into the segment's flat buffer (of which the parameters are views), and the gradient reduction
of a segment hands each rank exactly its slice.

Stages 1 and 2 cut segments from the parameters in backward order, at most
``reduce_bucket_size`` elements each, so a segment is a reduction bucket that becomes ready as
backward proceeds. Stage 3 makes one segment per module (its own parameters), the unit gathered
before the module runs and released after.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(eq=False)
class Segment:
    """Parameters flattened into one padded buffer, one equal slice per rank.

    ``offsets[i]`` is where ``params[i]`` starts in the flat buffer; ``groups[i]`` is its
    optimizer param group (``None``: not optimized); ``names[i]`` its FQN. ``group`` is the process group
    the segment is split over (``world`` ranks, this one at ``rank``): the data-parallel group, or the
    :class:`~microspeed.builtin.data_parallel.ReplicaGroup` of parameters held by only some ranks.
    """

    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    groups: list[int | None]
    world: int
    rank: int
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    shard_size: int = 0
    persistent: bool = False
    group: Any = None

    def __post_init__(self) -> None:
        self.shapes = [tuple(p.ds_shape) if getattr(p, "ds_shape", None) is not None else tuple(p.shape)
                       for p in self.params]
        self.numels = [int(torch.Size(s).numel()) for s in self.shapes]
        self.offsets, total = [], 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        self.shard_size = max(1, -(-total // self.world))
        self.dtype = self.params[0].dtype
        self.trainable = sum(1 for p in self.params if p.requires_grad)

    @property
    def padded(self) -> int:
        """Elements of the flat buffer: ``shard_size * world``."""
        return self.shard_size * self.world

    def global_rank(self, q: int) -> int:
        """The global rank of position ``q`` in the segment's group."""
        return dist.get_global_rank(self.group, q) if self.group is not None else q

    def slice_of(self, rank: int) -> tuple[int, int]:
        """Flat range ``[start, end)`` rank ``rank`` owns (may reach into the padding)."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def real_len(self, rank: int) -> int:
        """How many of rank ``rank``'s elements are real (not padding)."""
        start, end = self.slice_of(rank)
        return max(0, min(end, self.numel) - start)

    def param_range(self, i: int, rank: int) -> tuple[int, int] | None:
        """The flat range of ``params[i]`` (in its own flattened order) that ``rank`` owns, or ``None``."""
        start, end = self.slice_of(rank)
        off, n = self.offsets[i], self.numels[i]
        a, b = max(start, off), min(end, off + n)
        return (a - off, b - off) if a < b else None

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``[(param index, start within the param, start within rank's slice), ...]`` with lengths implied."""
        out = []
        start, _ = self.slice_of(rank)
        for i in range(len(self.params)):
            rng = self.param_range(i, rank)
            if rng is not None:
                out.append((i, rng[0], self.offsets[i] + rng[0] - start))
        return out

    def runs(self, rank: int) -> list[tuple[int, int, int]]:
        """Maximal ``(group, start, end)`` runs of rank ``rank``'s slice whose parameters share a param group."""
        runs: list[tuple[int, int, int]] = []
        for i, a, s in self.pieces(rank):
            g = self.groups[i]
            if g is None:
                continue
            length = self.param_range(i, rank)[1] - a
            if runs and runs[-1][0] == g and runs[-1][2] == s:
                runs[-1] = (g, runs[-1][1], s + length)
            else:
                runs.append((g, s, s + length))
        return runs

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view (its shape) into the flat buffer ``flat``."""
        return [flat[o:o + n].view(shape) for n, shape, o in zip(self.numels, self.shapes, self.offsets, strict=True)]


def cut_segments(params: Iterable[tuple[str, torch.nn.Parameter, int | None]], world: int, rank: int,
                 max_numel: int, start_index: int = 0, group: Any = None) -> list[Segment]:
    """Cut ``(name, param, group)`` triples, in order, into segments of at most ``max_numel`` elements.

    A segment holds one dtype and whole parameters (a parameter larger than ``max_numel`` gets
    its own segment). ``group`` is the process group of ``world`` ranks the segments are split over.
    """
    segments: list[Segment] = []
    batch: list[tuple[str, torch.nn.Parameter, int | None]] = []
    size = 0

    def close() -> None:
        nonlocal batch, size
        if batch:
            segments.append(Segment(start_index + len(segments), [p for _, p, _ in batch], [n for n, _, _ in batch],
                                    [g for _, _, g in batch], world, rank, group=group))
        batch, size = [], 0

    for name, p, g in params:
        if batch and (size + p.numel() > max_numel or batch[0][1].dtype != p.dtype):
            close()
        batch.append((name, p, g))
        size += p.numel()
    close()
    return segments
