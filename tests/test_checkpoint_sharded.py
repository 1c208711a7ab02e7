"""Sharded checkpoint tensors (:func:`microspeed.checkpoint.flat_shard`, DTensors) reload under any other partition."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from microspeed.checkpoint import flat_range_boxes
from microspeed.testing import run_distributed


@pytest.mark.parametrize("shape", [(7,), (5, 7), (3, 4, 5), (2, 3, 2, 3)])
def test_boxes_cover_every_flat_range_exactly(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    for start, end in itertools.combinations(range(numel + 1), 2):
        flat = []
        for offs, sizes in flat_range_boxes(shape, start, end):
            box = index[tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))]
            flat.append(box.reshape(-1))
        assert torch.equal(torch.cat(flat), torch.arange(start, end)), (shape, start, end)
        assert len(flat) <= 2 * len(shape) - 1


def _ranges(numel, world):
    chunk = -(-numel // world)
    return [[(min(q * chunk, numel), min((q + 1) * chunk, numel))] if q * chunk < numel else [] for q in range(world)]


def _save_or_load(mode, path, shape):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from microspeed.checkpoint import flat_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    numel = math.prod(shape)
    full = torch.arange(numel, dtype=torch.float32)
    ranges = _ranges(numel, world)
    mine = ranges[rank]
    if mode == "save":
        local = torch.cat([full[s:e] for s, e in mine]) if mine else full[:0].clone()
        dcp.save({"x": flat_shard(local, shape, ranges, rank)}, storage_writer=dcp.FileSystemWriter(path))
        return True
    local = torch.zeros(sum(e - s for s, e in mine), dtype=torch.bfloat16)  # cast on read
    dcp.load({"x": flat_shard(local, shape, ranges, rank)}, storage_reader=dcp.FileSystemReader(path))
    expect = torch.cat([full[s:e] for s, e in mine]) if mine else full[:0]
    return torch.equal(local.float(), expect.bfloat16().float())


@pytest.mark.slow
def test_flat_shards_reload_under_other_world_sizes(tmp_path):
    """Saved by 4 ranks (rank 3 holds nothing), read back by 3 ranks (cast to bf16) and as one plain tensor."""
    import torch.distributed.checkpoint as dcp

    shape = (2, 3)
    assert run_distributed(_save_or_load, world_size=4, args=("save", str(tmp_path), shape), timeout=120) == [True] * 4
    assert run_distributed(_save_or_load, world_size=3, args=("load", str(tmp_path), shape), timeout=120) == [True] * 3
    plain = torch.zeros(shape)
    dcp.load({"x": plain}, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(plain.view(-1), torch.arange(6, dtype=torch.float32))


def _no_deprecated_torch(path, world_before):
    """Save flat-sharded and box-sharded tensors, then reload them under another partition and through
    :class:`microspeed.checkpoint.Reader`, with every FutureWarning and DeprecationWarning an error."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from microspeed.checkpoint import Placement, Reader, box_shard, flat_shard, read_tensor_index

    warnings.simplefilter("error", FutureWarning)
    warnings.simplefilter("error", DeprecationWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = (4, 3, 2)
    numel = math.prod(shape)
    full = torch.arange(numel, dtype=torch.float32)
    ranges = _ranges(numel, world)
    mine = ranges[rank]
    local = torch.cat([full[s:e] for s, e in mine]) if mine else full[:0].clone()
    if world == world_before:  # save, as microspeed.checkpoint.save hands tensors to DCP (detached)
        flat = flat_shard(local, shape, ranges, rank)
        rows = shape[0] // world
        box = box_shard(full.view(shape)[rank * rows:(rank + 1) * rows].clone(), shape,
                        [(q, (q * rows, 0, 0), (rows, *shape[1:])) for q in range(world)], rank)
        assert isinstance(flat, DTensor) and isinstance(box, DTensor)
        dcp.save({"model/flat": flat.detach(), "model/w": box.detach()}, storage_writer=dcp.FileSystemWriter(path))
        return True
    # load: flat pieces of another partition, and a box placement read by the Reader
    got = torch.zeros_like(local, dtype=torch.bfloat16)
    rows = shape[0] // world
    where = Placement(shape=shape, offsets=(rank * rows, 0, 0), local=(rows, *shape[1:]),
                      pieces=tuple((q, (q * rows, 0, 0), (rows, *shape[1:])) for q in range(world)))
    reader = Reader(path, read_tensor_index(path), placements={"w": where}, rank=rank)
    reader.into("model/flat", flat_shard(got, shape, ranges, rank), "flat")
    box_local = reader.fresh("model/w")  # this rank's box of the placed parameter "w"
    reader.run(no_dist=False)
    return (torch.equal(got.float(), (torch.cat([full[s:e] for s, e in mine]) if mine else full[:0]).bfloat16().float())
            and torch.equal(box_local, full.view(shape)[rank * rows:(rank + 1) * rows]))


@pytest.mark.slow
def test_sharded_checkpoints_use_no_deprecated_torch_api(tmp_path):
    """Sharded tensors are DTensors (no ShardedTensor): saving on 2 ranks and reading back on 4 warns nothing.

    A deprecated torch API called from our code would raise here even when torch attributes the warning
    to its own module (which the suite's ``error::FutureWarning:microspeed`` filter would not catch).
    """
    assert run_distributed(_no_deprecated_torch, world_size=2, args=(str(tmp_path), 2), timeout=120) == [True] * 2
    assert run_distributed(_no_deprecated_torch, world_size=4, args=(str(tmp_path), 2), timeout=120) == [True] * 4
