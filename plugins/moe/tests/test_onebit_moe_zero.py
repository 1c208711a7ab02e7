"""1-bit Adam, 0/1 Adam and 1-bit LAMB with MoE and ZeRO stages 1-3 (the three at once).

ZeRO lays experts out in segments of their replica group and reduces them over it (sum over the group divided by the
data-parallel size, as the MoE plugin reduces); after the warm-up that reduce-scatter is the 1-bit one with error
feedback, run per group with its own error buffers, and 1-bit LAMB sums an expert's whole-parameter norms over its
replica group. On 4 ranks with ``ep_size`` 2 every expert has two copies (a replica group of 2 inside the
data-parallel group of 4). Compared with one process running the same optimizer on the whole global batch with
``ep_size`` 1 (one rank: nothing compressed): the warm-up losses (and the loss after the last exact step) equal it to
rel 1e-5, the compressed ones stay within :data:`COMPRESSED_TOL` (the band of the 1-bit x ZeRO tests), and the two
copies of each expert are equal after training (stages 1 and 2 hold whole copies; stage 3 one shard of each).
"""

from __future__ import annotations

import pytest
import torch
from moe_models import Net, batch, config

from microspeed.testing import run_distributed

pytest.importorskip("microspeed_zero")
pytest.importorskip("microspeed_comm")

WORLD, EP, STEPS = 4, 2, 5
COMPRESSED_TOL = 3e-2
"""Largest relative loss difference from the uncompressed run on the compressed steps (as ``test_onebit_zero``)."""

OPTIMIZERS = {
    "OneBitAdam": {"lr": 1e-3, "freeze_step": 2, "betas": [0.9, 0.99]},
    "ZeroOneAdam": {"lr": 1e-3, "var_freeze_step": 2, "var_update_scaler": 1, "local_step_clipper": 1,
                    "betas": [0.9, 0.99]},
    "OneBitLamb": {"lr": 1e-2, "freeze_step": 2},
}


def _run(engine, start: int, steps: int) -> tuple[list[float], list[bool]]:
    """Train steps ``start..steps-1``: per-step losses averaged over ranks, and whether each step was exact."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    stepper = engine.plugin_state("comm").optimizer
    losses, exact = [], []
    for step in range(start, steps):
        exact.append(stepper.full_precision_gradients_next())
        loss = engine(batch(step, rank))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses, exact


def _experts(engine) -> dict[str, torch.Tensor]:
    """The expert parameters this rank holds (whole: stages 1 and 2)."""
    return {n: p.detach().clone() for n, p in engine.module.named_parameters() if "experts" in n}


def _cases(cases: list[tuple[str, int]]) -> list[dict]:
    """Train each (optimizer, ZeRO stage) on ``ep_size`` 2."""
    import microspeed

    out = []
    for opt, stage in cases:
        cfg = config({"optimizer": {"type": opt, "params": OPTIMIZERS[opt]}, "zero_optimization": {"stage": stage}})
        engine, *_ = microspeed.initialize(model=Net(ep_size=EP), config=cfg)
        inner = engine.plugin_state("comm").optimizer
        losses, exact = _run(engine, 0, STEPS)
        errors = inner.error_state().get("partition", {}).get("errors", {})
        out.append({"losses": losses, "exact": exact, "partitioned": inner.partitioned,
                    "experts": _experts(engine) if stage < 3 else {},
                    "group_errors": sorted(k for k, e in errors.items() if "@" in k and bool(e.abs().sum() > 0))})
    return out


def _reference(opt: str) -> list[float]:
    """One process, ``ep_size`` 1, the same optimizer on every rank's micro-batch (no group: nothing compressed)."""
    import microspeed_comm

    net = Net(ep_size=1)
    optimizer = getattr(microspeed_comm, opt)(net.parameters(), **OPTIMIZERS[opt])
    out = []
    for step in range(STEPS):
        loss = torch.stack([net(batch(step, r)) for r in range(WORLD)]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        out.append(loss.item())
    return out


def _check(name: str, run: dict, ref: list[float]) -> list[float]:
    """Warm-up at rel 1e-5, compressed steps within the band; returns the compressed steps' relative gaps."""
    losses, exact = run["losses"], run["exact"]
    assert run["partitioned"], f"{name}: the 1-bit optimizer was not attached to ZeRO's partitions"
    assert run["group_errors"], f"{name}: no expert segment was reduced compressed over its replica group"
    warm = exact.index(False) + 1  # losses 0..warm-1 follow exact steps only
    assert 2 <= warm < STEPS, (name, exact)
    for i in range(warm):
        assert losses[i] == pytest.approx(ref[i], rel=1e-5), (name, i, losses, ref)
    gaps = [abs(a - b) / b for a, b in zip(losses[warm:], ref[warm:], strict=True)]
    assert 0 < max(gaps) < COMPRESSED_TOL, (name, gaps, losses, ref)
    return gaps


def _assert_copies_agree(name: str, per_rank: list[dict]) -> None:
    """Ranks r and r + EP hold copies of the same experts (replica group (r, r + EP)): equal values."""
    for r in range(EP):
        mine, other = per_rank[r], per_rank[r + EP]
        assert mine.keys() == other.keys() and mine, name
        for key in mine:
            torch.testing.assert_close(mine[key], other[key], rtol=0, atol=0, msg=lambda m, k=key: f"{name} {k}: {m}")


def _train_and_check(cases: list[tuple[str, int]]) -> None:
    results = run_distributed(_cases, world_size=WORLD, args=(cases,), timeout=300)
    refs = {opt: _reference(opt) for opt in {opt for opt, _ in cases}}
    for i, (opt, stage) in enumerate(cases):
        name = f"{opt} zero-{stage}"
        gaps = _check(name, results[0][i], refs[opt])
        print(name, "compressed rel", [f"{g:.2g}" for g in gaps])
        if stage < 3:
            _assert_copies_agree(name, [per_rank[i]["experts"] for per_rank in results])


@pytest.mark.slow
def test_onebit_and_zero_one_adam_with_moe_and_zero_1_2_3():
    _train_and_check([(opt, stage) for opt in ("OneBitAdam", "ZeroOneAdam") for stage in (1, 2, 3)])


@pytest.mark.slow
def test_onebit_lamb_with_moe_and_zero_1_2_3():
    """An expert's trust ratio comes from its norms summed over its replica group only (not the other experts')."""
    _train_and_check([("OneBitLamb", stage) for stage in (1, 2, 3)])


def _resume(path: str) -> dict[str, tuple[list[float], list[float]]]:
    """ZeRO-2: train 3 steps (one compressed), save, train 2; a fresh engine loads and trains the same 2."""
    import microspeed

    out = {}
    for opt in ("OneBitAdam", "OneBitLamb"):
        cfg = config({"optimizer": {"type": opt, "params": OPTIMIZERS[opt]}, "zero_optimization": {"stage": 2}})
        first, *_ = microspeed.initialize(model=Net(ep_size=EP), config=cfg)
        _run(first, 0, 3)
        first.save_checkpoint(path, tag=opt)
        after, _ = _run(first, 3, STEPS)
        second, *_ = microspeed.initialize(model=Net(ep_size=EP), config=cfg)
        second.load_checkpoint(path, tag=opt)
        out[opt] = (after, _run(second, 3, STEPS)[0])
    return out


@pytest.mark.slow
def test_a_resumed_run_continues_exactly(tmp_path):
    """The sender errors of the data-parallel and of each replica group's segments are checkpointed per rank: the
    compressed steps after the load equal the uninterrupted run's."""
    for rank_result in run_distributed(_resume, world_size=WORLD, args=(str(tmp_path),), timeout=300):
        for opt, (after, resumed) in rank_result.items():
            assert resumed == after, (opt, after, resumed)
