"""Tensors of which a rank holds only pieces: flat ranges (ZeRO) and boxes (tensor parallel), and placements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _is_sharded(t: Any) -> bool:
    return type(t).__name__ == "ShardedTensor"


def flat_range_boxes(shape: tuple[int, ...] | list[int], start: int, end: int) -> list[tuple[list[int], list[int]]]:
    """Split the row-major flat range ``[start, end)`` of a tensor of ``shape`` into boxes.

    Returns ``[(offsets, sizes), ...]`` in flat order; each box is contiguous in the flat
    order, so its data is ``flat[a:a + prod(sizes)].view(sizes)``. At most ``2 * ndim - 1`` boxes.
    """
    shape = list(shape)
    if not shape:
        return [([], [])] if start < end else []
    boxes: list[tuple[list[int], list[int]]] = []

    def rec(prefix: list[int], dims: list[int], s: int, e: int) -> None:
        if s >= e:
            return
        inner = 1
        for d in dims[1:]:
            inner *= d
        i0, r0 = divmod(s, inner)
        i1, r1 = divmod(e, inner)
        if i0 == i1:
            rec(prefix + [i0], dims[1:], r0, r1)
            return
        if r0:
            rec(prefix + [i0], dims[1:], r0, inner)
            i0 += 1
        if i1 > i0:
            boxes.append((prefix + [i0] + [0] * (len(dims) - 1), [1] * len(prefix) + [i1 - i0] + dims[1:]))
        if r1:
            rec(prefix + [i1], dims[1:], 0, r1)

    rec([], shape, start, end)
    return boxes


def flat_shard(local: torch.Tensor, shape: tuple[int, ...] | list[int], ranges_by_rank: list[list[tuple[int, int]]],
               rank: int) -> Any:
    """A sharded tensor of global ``shape`` whose pieces are flat ranges of its row-major order.

    ``ranges_by_rank[q]`` lists the flat ranges rank ``q`` (global rank) holds, together covering
    the tensor exactly once; ``local`` is this ``rank``'s pieces concatenated (1-D, a view into
    the caller's storage: saving reads it, loading writes it in place). Checkpoints key it like
    the full tensor, so it reloads under any other partition, or as a plain tensor.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    shape = list(shape)
    device = local.device
    metas, shards = [], []
    for q, ranges in enumerate(ranges_by_rank):
        offset = 0
        for start, end in ranges:
            for offs, sizes in flat_range_boxes(shape, start, end):
                n = 1
                for x in sizes:
                    n *= x
                meta = ShardMetadata(list(offs), list(sizes), f"rank:{q}/{device}")
                metas.append(meta)
                if q == rank:
                    shards.append(Shard(local[offset:offset + n].view(sizes), meta))
                offset += n
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(metas, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


@dataclass(frozen=True)
class Placement:
    """Where this rank's piece of a parameter sits in the full tensor (see ``microspeed_checkpoint_placements``).

    ``shape``: the full tensor's; ``offsets``/``local``: this rank's box; ``pieces``: ``(global rank,
    offsets, sizes)`` of one complete copy that includes this rank's piece (its replica's ranks);
    ``write``: whether this rank's replica writes the tensor (exactly one replica should).
    """

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local: tuple[int, ...]
    pieces: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]
    write: bool = True


def box_shard(local: torch.Tensor, shape: tuple[int, ...] | list[int],
              pieces: Sequence[tuple[int, Sequence[int], Sequence[int]]], rank: int) -> Any:
    """A sharded tensor of global ``shape`` made of boxes ``(global rank, offsets, sizes)``; ``local`` is ``rank``'s.

    Like :func:`flat_shard`, but each piece is a rectangular box (a tensor-parallel split along any
    dimension). Saving reads ``local``; loading writes it in place.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    metas, shards = [], []
    for q, offsets, sizes in pieces:
        meta = ShardMetadata(list(offsets), list(sizes), f"rank:{q}/{local.device}")
        metas.append(meta)
        if q == rank:
            shards.append(Shard(local.view(list(sizes)), meta))
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(metas, torch.Size(list(shape)), props))


def placement_of(key: str, placements: dict[str, Placement]) -> Placement | None:
    """The placement of the parameter a checkpoint key belongs to (``model/``, ``master/``, ``optim/<fqn>/``)."""
    if not placements:
        return None
    head, _, rest = key.partition("/")
    if head in ("model", "master"):
        return placements.get(rest)
    if head == "optim":
        return placements.get(rest.rpartition("/")[0])
    return None


def apply_placements(tensors: dict[str, Any], placements: dict[str, Placement], rank: int) -> None:
    """Replace each placed piece in ``tensors`` by its sharded view; drop it where another replica writes it."""
    for key in list(tensors):
        where = placement_of(key, placements)
        t = tensors[key]
        if where is None or not isinstance(t, torch.Tensor) or tuple(t.shape) != where.local:
            continue
        if where.write:
            tensors[key] = box_shard(t.contiguous(), where.shape, where.pieces, rank)
        else:
            del tensors[key]


def collect_placements(engine: Any) -> dict[str, Placement]:
    """Every plugin's ``microspeed_checkpoint_placements`` answer, merged."""
    out: dict[str, Placement] = {}
    for part in engine.hook.microspeed_checkpoint_placements(engine=engine):
        out.update(part or {})
    return out
