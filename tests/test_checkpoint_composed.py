"""Checkpoint pieces that two plugins split in turn: ZeRO's flat ranges of tensor-parallel boxes.

One plugin (tensor parallel) places a rank's box in the full tensor (:class:`Placement`); another (ZeRO)
splits that box into flat ranges over the data axis (:func:`flat_shard`). The core composes the two
(:func:`place_pieces`) on save and on load, so tensors written under tp × dp with any split read back
whole, and into any other tp × dp split — without either plugin knowing the other.
"""

from __future__ import annotations

import torch

from microspeed.checkpoint import Placement, flat_shard, place_pieces
from microspeed.testing import run_distributed

FULL = (6, 4)


def _full(seed: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).view(FULL) * (seed + 1) + 0.5


def _box(tp: int, t: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rows = FULL[0] // tp
    return (t * rows, 0), (rows, FULL[1])


def _placement(tp: int, t: int, d: int, tp_ranks: list[int], duplicate: bool = False) -> Placement:
    offsets, local = _box(tp, t)
    pieces = tuple((q, _box(tp, i)[0], local) for i, q in enumerate(tp_ranks))
    return Placement(shape=FULL, offsets=offsets, local=local, pieces=pieces, write=d == 0, duplicate=duplicate)


def _ranges(numel: int, cuts: list[int], dp_ranks: list[int], world: int) -> list[list[tuple[int, int]]]:
    """Flat ranges of a tensor of ``numel`` elements cut at ``cuts``, rank ``dp_ranks[i]`` holding range i."""
    bounds = [0, *cuts, numel]
    out: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for i, q in enumerate(dp_ranks):
        out[q] = [(bounds[i], bounds[i + 1])]
    return out


def _job(path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from microspeed.checkpoint import apply_placements, read_tensor_index
    from microspeed.checkpoint.reader import Reader

    rank, world = dist.get_rank(), dist.get_world_size()
    # save: tp2 x dp2, global rank = 2 * d + t
    t, d = rank % 2, rank // 2
    tp_ranks, dp_ranks = [2 * d, 2 * d + 1], [t, t + 2]
    offsets, local = _box(2, t)
    tensors, placements = {}, {}
    # "zero": a tensor-parallel box that ZeRO splits over the data axis (uneven cut, rows not whole)
    box = _full(0)[offsets[0]:offsets[0] + local[0]].reshape(-1)
    rng = _ranges(box.numel(), [5], dp_ranks, world)[rank][0]
    tensors["optim/w/exp_avg"] = flat_shard(box[rng[0]:rng[1]].clone(), local, _ranges(12, [5], dp_ranks, world),
                                            rank)
    placements["w"] = _placement(2, t, d, tp_ranks)
    # "plain": a tensor-parallel box kept whole on each replica (one replica writes it)
    tensors["model/v"] = _full(1)[offsets[0]:offsets[0] + local[0]].clone()
    placements["v"] = _placement(2, t, d, tp_ranks)
    # "replicated": the same full tensor on both tensor ranks, split by ZeRO; tensor rank 1's copy is a duplicate
    whole = _full(2).reshape(-1)
    rng = _ranges(24, [13], dp_ranks, world)[rank][0]
    tensors["model/n"] = flat_shard(whole[rng[0]:rng[1]].clone(), FULL, _ranges(24, [13], dp_ranks, world), rank)
    if t == 1:
        placements["n"] = Placement(shape=FULL, offsets=(0, 0), local=FULL, pieces=((rank, (0, 0), FULL),),
                                    duplicate=True)
    apply_placements(tensors, placements, rank)
    kept = sorted(tensors)
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path))
    dist.barrier()
    index = read_tensor_index(path)
    chunks = {k: sorted((list(c.offsets), list(c.sizes)) for c in index.state_dict_metadata[k].chunks)
              for k in ("optim/w/exp_avg", "model/v", "model/n")}

    # load 1: tp4 x dp1 boxes (rows 0-1, 2-3, 4-5: across the saved tp boundary)
    reader = Reader(path, index, {}, {"w": _placement(4, rank, 0, [0, 1, 2, 3])}, rank)
    got_box = torch.zeros(_box(4, rank)[1])
    reader.into("optim/w/exp_avg", got_box, "w")
    # load 2: tp1 x dp4: ZeRO flat ranges of the whole tensor, no tensor parallelism
    cuts = [3, 10, 17]
    r4 = _ranges(24, cuts, [0, 1, 2, 3], world)
    a, b = r4[rank][0]
    got_flat = torch.zeros(b - a)
    reader.into("model/v", flat_shard(got_flat, FULL, r4, rank), "v")
    # load 3: tp2 x dp2 with the roles swapped (global rank = 2 * t + d) and another ZeRO cut, composed
    t2, d2 = rank // 2, rank % 2
    tp2, dp2 = [d2, d2 + 2], [2 * t2, 2 * t2 + 1]
    off2, loc2 = _box(2, t2)
    r2 = _ranges(12, [7], dp2, world)
    a2, b2 = r2[rank][0]
    got_composed = torch.zeros(b2 - a2)
    reader2 = Reader(path, index, {}, {"n": _placement(2, t2, d2, tp2)}, rank)
    reader2.into("model/n", flat_shard(got_composed, loc2, r2, rank), "n")
    reader.run(no_dist=False)
    reader2.run(no_dist=False)
    want_composed = _full(2)[off2[0]:off2[0] + loc2[0]].reshape(-1)[a2:b2]
    whole_back = {}
    if rank == 0:
        full_reader = Reader(path, index)
        whole_back = {k: full_reader.fresh(k) for k in ("optim/w/exp_avg", "model/v", "model/n")}
        full_reader.run(no_dist=True)
    off4, loc4 = _box(4, rank)
    return {"kept": kept, "chunks": chunks,
            "box_ok": torch.equal(got_box, _full(0)[off4[0]:off4[0] + loc4[0]]),
            "flat_ok": torch.equal(got_flat, _full(1).reshape(-1)[a:b]),
            "composed_ok": torch.equal(got_composed, want_composed),
            "whole_ok": {k: torch.equal(v, _full(i)) for i, (k, v) in enumerate(whole_back.items())}}


def test_zero_pieces_of_tensor_parallel_boxes_save_once_and_load_under_any_split(tmp_path):
    results = run_distributed(_job, world_size=4, args=(str(tmp_path / "ck"),), timeout=120)
    r0 = results[0]
    assert r0["whole_ok"] == {"optim/w/exp_avg": True, "model/v": True, "model/n": True}
    # the composed tensor: each of the 4 ranks wrote its flat range of its box, moved to the box's rows
    assert r0["chunks"]["optim/w/exp_avg"] == sorted([
        ([0, 0], [1, 4]), ([1, 0], [1, 1]),   # rank 0: flat [0, 5) of rows 0-2
        ([1, 1], [1, 3]), ([2, 0], [1, 4]),   # rank 2: flat [5, 12) of rows 0-2
        ([3, 0], [1, 4]), ([4, 0], [1, 1]),   # rank 1: flat [0, 5) of rows 3-5
        ([4, 1], [1, 3]), ([5, 0], [1, 4])])  # rank 3: flat [5, 12) of rows 3-5
    assert r0["chunks"]["model/v"] == [([0, 0], [3, 4]), ([3, 0], [3, 4])]  # data replica 0 writes the boxes
    assert r0["chunks"]["model/n"] == [([0, 0], [3, 4]), ([3, 0], [1, 1]), ([3, 1], [1, 3]), ([4, 0], [2, 4])]
    assert [r["kept"] for r in results] == [["model/n", "model/v", "optim/w/exp_avg"],
                                            ["model/v", "optim/w/exp_avg"],  # tensor rank 1: n is a duplicate
                                            ["model/n", "optim/w/exp_avg"],  # data replica 1: v is written by 0
                                            ["optim/w/exp_avg"]]
    for rank, r in enumerate(results):
        assert r["box_ok"] and r["flat_ok"] and r["composed_ok"], (rank, r)


def test_place_pieces_moves_each_piece_by_the_box_offset():
    local = torch.arange(12.0)
    sharded = flat_shard(local[5:12], (3, 4), [[(0, 5)], [(5, 12)]], 1)
    where = Placement(shape=(6, 4), offsets=(3, 0), local=(3, 4), pieces=())
    moved = place_pieces(sharded, where, 1)
    chunks = [(list(c.offsets), list(c.sizes)) for c in moved._local_tensor.__create_chunk_list__()]
    assert tuple(moved.shape) == (6, 4)
    assert chunks == [([4, 1], [1, 3]), ([5, 0], [1, 4])]
    assert moved._local_tensor._pieces[1].data_ptr() == local[8:].data_ptr()  # views, not copies
