"""ZeRO's shared-memory exchange between the ranks of one host (:mod:`microspeed_zero.shm`).

Against gloo's own collectives on the same data: gathers (fp32 and bf16, sub-ranges, odd sizes) and
``all_to_all_single`` equal them exactly on 3 ranks, with slots shrunk to 4 KiB so that one operation takes many
rounds and writers wait for their peers' acknowledgements. Training at stage 3 (2 ranks) gives the same losses and
weights, bit for bit, through the exchange and through gloo (``MICROSPEED_ZERO_SHM=0``). A rank that issues a
different operation, or exits, makes its peer fail with a message naming it, not hang.
"""

from __future__ import annotations

import pytest
import torch

from microspeed.testing import run_distributed


def _exchange_body() -> list[str]:
    import torch.distributed as dist
    from microspeed_zero import shm

    shm.SLOT_BYTES = 4096
    rank, world = dist.get_rank(), dist.get_world_size()
    ex = shm.local_exchange(None, rank, world)
    assert ex is not None
    checked = []
    for dtype, size, lo, hi in ((torch.float32, 5000, 0, 5000), (torch.bfloat16, 3001, 17, 2999),
                                (torch.float32, 7, 0, 7)):
        torch.manual_seed(rank)
        local = torch.randn(size).to(dtype)
        flat = torch.zeros(world * size, dtype=dtype)
        flat[rank * size:(rank + 1) * size].copy_(local)
        works = [ex.gather(flat, lo, hi)]
        ref = [torch.zeros(size, dtype=dtype) for _ in range(world)]
        dist.all_gather(ref, local)
        works[0].wait()
        for q in range(world):
            expect = local if q == rank else torch.zeros(size, dtype=dtype)
            if q != rank:
                expect[lo:hi] = ref[q][lo:hi]
            assert torch.equal(flat[q * size:(q + 1) * size], expect), (dtype, size, q)
        checked.append(f"gather {dtype} {size}")
    for dtype, cols in ((torch.float32, 4000), (torch.bfloat16, 333)):
        torch.manual_seed(10 + rank)
        wire = torch.randn(world * cols).to(dtype)
        out, ref = torch.empty_like(wire), torch.empty_like(wire)
        work = ex.all_to_all(out, wire)
        dist.all_to_all_single(ref, wire)
        work.wait()
        assert torch.equal(out, ref), dtype
        checked.append(f"all_to_all {dtype} {cols}")
    # many operations in flight at once, waited in the end
    flats = [torch.full((world * 3000,), float(rank)) for _ in range(6)]
    works = [ex.gather(f, 0, 3000) for f in flats]
    for w, f in zip(works, flats, strict=True):
        w.wait()
        assert all(torch.equal(f[q * 3000:(q + 1) * 3000], torch.full((3000,), float(q))) for q in range(world))
    checked.append("in flight")
    return checked


@pytest.mark.timeout(240)
def test_gathers_and_all_to_alls_equal_gloo_over_many_rounds():
    results = run_distributed(_exchange_body, world_size=3, timeout=200)
    assert results[0] == results[1] == results[2]
    assert len(results[0]) == 6


def _mismatch_body() -> str:
    import torch.distributed as dist
    from microspeed_zero import shm

    rank, world = dist.get_rank(), dist.get_world_size()
    ex = shm.local_exchange(None, rank, world)
    size = 100 if rank == 0 else 200  # rank 1 gathers a different segment
    flat = torch.zeros(world * size)
    try:
        ex.gather(flat, 0, size).wait()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(240)
def test_ranks_issuing_different_operations_fail_naming_the_peer():
    results = run_distributed(_mismatch_body, world_size=2, timeout=200)
    assert "rank 1" in results[0] and "rank 0" in results[1], results
    assert all("different" in r and "MICROSPEED_ZERO_SHM=0" in r for r in results), results


def _exit_body() -> str:
    import torch.distributed as dist
    from microspeed_zero import shm

    rank, world = dist.get_rank(), dist.get_world_size()
    ex = shm.local_exchange(None, rank, world)
    dist.barrier()
    if rank == 1:
        return "left"
    import time

    time.sleep(1.0)  # rank 1 has exited: its pipes are closed
    try:
        ex.gather(torch.zeros(2 * 10), 0, 10).wait()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(240)
def test_a_peer_that_exited_is_named_not_waited_for():
    results = run_distributed(_exit_body, world_size=2, timeout=200, init_process_group=True)
    assert results[1] == "left"
    assert "rank 1" in results[0] and "exited" in results[0], results


def _which_body() -> bool:
    import torch.distributed as dist
    from microspeed_zero import shm

    return shm.local_exchange(None, dist.get_rank(), dist.get_world_size()) is not None


@pytest.mark.timeout(240)
def test_the_environment_can_keep_gloo():
    assert run_distributed(_which_body, world_size=2, timeout=200) == [True, True]
    assert run_distributed(_which_body, world_size=2, timeout=200, env={"MICROSPEED_ZERO_SHM": "0"}) == [False, False]


def _train_body(stage: int, gas: int) -> tuple[list[float], list[torch.Tensor], tuple[int, int], int]:
    import torch.distributed as dist
    from microspeed_zero import shm

    import microspeed
    from microspeed.models import GPT, GPTConfig
    from microspeed.plugin_api import comm
    from microspeed.zero import GatheredParameters

    shm.SLOT_BYTES = 1 << 14  # several rounds per segment
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0},
           "steps_per_print": 10_000}
    engine, *_ = microspeed.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(4 * gas):
        x = torch.randint(0, 64, (2 * world, 17), generator=gen)[2 * rank:2 * rank + 2]
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    with GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    rounds = sum(ex.rounds for ex in shm._exchanges.values() if ex is not None)
    pool = engine.plugin_state("zero").reducer.pool.free
    pooled = sum(b.numel() * b.element_size() for bufs in pool.values() for b in bufs)
    return losses, weights, (rounds, comm.stats.calls.get("all_to_all_single", 0)), pooled


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("stage", "world", "gas"), [  # stages 1, 2 on 3 ranks in the full suite only
    pytest.param(1, 3, 2, marks=pytest.mark.slow), pytest.param(2, 3, 1, marks=pytest.mark.slow), (3, 2, 1)])
def test_training_is_bit_identical_through_the_exchange_and_through_gloo(stage: int, world: int, gas: int):
    """The exchange sums each reduction into the rank's slice as it receives it (no receive buffer): the same
    arithmetic in the same order as summing gloo's all-to-all rows, so losses and weights are bit-identical at every
    stage (stage 1 sums into its accumulator, whose own row the wire is; stage 2 in column chunks; 3 ranks put a
    rank's own row in the middle of the order); the reducer's pool holds less (stage 1: nothing)."""
    shared = run_distributed(_train_body, world_size=world, args=(stage, gas), timeout=300)
    gloo = run_distributed(_train_body, world_size=world, args=(stage, gas), timeout=300,
                           env={"MICROSPEED_ZERO_SHM": "0"})
    for a, b in zip(shared, gloo, strict=True):
        assert a[0] == b[0]
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
        assert a[3] < b[3] and (a[3] == 0 if stage == 1 else True), (a[3], b[3])
    # through the exchange (rounds run) and through gloo (none), the reductions counted as the same collective
    (rounds, reductions), (gloo_rounds, gloo_reductions) = shared[0][2], gloo[0][2]
    assert rounds > 0 and gloo_rounds == 0 and reductions == gloo_reductions > 0, (shared[0][2], gloo[0][2])


def _unavailable_body(bad_rank: int) -> tuple[bool, list[str], bool]:
    import os

    import torch.distributed as dist
    from microspeed_zero import collectives, shm

    rank, world = dist.get_rank(), dist.get_world_size()
    before = set(os.listdir("/dev/shm"))
    if rank == bad_rank:
        shm.SHM_DIR = "/proc"  # a directory where nothing can be made
    ex = shm.local_exchange(None, rank, world)
    dist.barrier()  # every rank done cleaning up
    left = sorted(n for n in set(os.listdir("/dev/shm")) - before if n.startswith("microspeed-zero"))
    flat = torch.zeros(world * 4)
    flat[rank * 4:(rank + 1) * 4] = rank + 1.0
    collectives.gather_slices(flat, flat[rank * 4:(rank + 1) * 4], rank, world, None, False)  # over gloo, then
    return ex is None, left, torch.equal(flat, torch.arange(1.0, world + 1).repeat_interleave(4))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_rank_that_cannot_set_it_up_leaves_every_rank_on_gloo(bad_rank: int):
    """Rank 0 cannot make the slots' file, or rank 1 its pipes: every rank gets no exchange (agreed, not a hang),
    nothing is left in /dev/shm, and the gathers run over gloo."""
    assert run_distributed(_unavailable_body, world_size=2, args=(bad_rank,), timeout=200) == [(True, [], True)] * 2
