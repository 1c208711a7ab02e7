"""Sharded checkpoint tensors (:func:`microspeed.checkpoint.flat_shard`) reload under any other partition."""

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
