"""1-bit Adam, 0/1 Adam and 1-bit LAMB with MoE and ZeRO stages 1-3 (the three at once).

ZeRO lays experts out in segments of their replica group and reduces them over it (sum over the group divided by the
data-parallel size, as the MoE plugin reduces); after the warm-up that reduce-scatter is the 1-bit one with error
feedback, run per group with its own error buffers, and 1-bit LAMB sums an expert's whole-parameter norms over its
replica group. On 4 ranks with ``ep_size`` 2 every expert has two copies (a replica group of 2 inside the
data-parallel group of 4). Compared with one process running the same optimizer on the whole global batch with
``ep_size`` 1 (one rank: nothing compressed): the warm-up losses (and the loss after the last exact step) equal it to
rel 1e-5, the compressed ones stay within :data:`COMPRESSED_TOL` (the band of the 1-bit x ZeRO tests), and the two
copies of each expert are equal after training (stages 1 and 2 hold whole copies; stage 3 one shard of each).
The ZeRO-2 runs also save after a compressed step and resume in a fresh engine with the same losses (the sender
errors are checkpointed per rank and per group).

The losses of so few small steps hardly see the experts (zeroing every expert gradient after the warm-up moves them
by 2e-4), so the scaling and the group of the experts' compressed exchange are checked exactly on their own: with
gradients constant per rank (which 1-bit compression keeps exactly) the momenta after a compressed step hold the
group's sum over the data-parallel size (``test_compressed_expert_gradients_...``).
"""

from __future__ import annotations

from typing import Any

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
    """The expert parameters this rank holds, by global name (whole at stages 1 and 2)."""
    return {n: p.detach().clone() for n, p in engine.module.named_parameters() if "experts" in n}


SAVE_AFTER = 3
"""The ZeRO-2 runs save a checkpoint after this many steps (one compressed) and a fresh engine resumes from it."""


def _zero(stage: int | str, path: str) -> dict:
    """The ZeRO section of ``stage``: 1, 2, 3, or ``"nvme"`` (stage 2, optimizer state streamed from files)."""
    if stage != "nvme":
        return {"stage": stage}
    return {"stage": 2, "sub_group_size": 50, "offload_optimizer": {"device": "nvme", "nvme_path": f"{path}/nvme"}}


def _cases(cases: list[tuple[str, int | str]], path: str) -> list[dict]:
    """Train each (optimizer, ZeRO stage) on ``ep_size`` 2; at stage 2 also save and resume in a fresh engine."""
    import microspeed

    out = []
    for opt, stage in cases:
        cfg = config({"optimizer": {"type": opt, "params": OPTIMIZERS[opt]}, "zero_optimization": _zero(stage, path)})
        if stage == "nvme":  # step the 1-bit optimizer itself on the streamed state (not ZeRO's CPU Adam)
            cfg["zero_force_ds_cpu_optimizer"] = False
        engine, *_ = microspeed.initialize(model=Net(ep_size=EP), config=cfg)
        inner = engine.plugin_state("comm").optimizer
        losses, exact = _run(engine, 0, SAVE_AFTER)
        if stage == 2:
            engine.save_checkpoint(path, tag=opt)
        more, more_exact = _run(engine, SAVE_AFTER, STEPS)
        errors = inner.error_state().get("partition", {}).get("errors", {})
        result = {"losses": losses + more, "exact": exact + more_exact, "partitioned": inner.partitioned,
                  "experts": _experts(engine) if stage != 3 else {}, "resumed": None,
                  "group_errors": sorted(k for k, e in errors.items() if "@" in k and bool(e.abs().sum() > 0))}
        if stage == 2:
            fresh, *_ = microspeed.initialize(model=Net(ep_size=EP), config=cfg)
            fresh.load_checkpoint(path, tag=opt)
            result["resumed"] = _run(fresh, SAVE_AFTER, STEPS)[0]
        out.append(result)
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
        mine, other = per_rank[r]["experts"], per_rank[r + EP]["experts"]
        assert mine and list(mine) == list(other), name
        for key in mine:
            torch.testing.assert_close(mine[key], other[key], rtol=0, atol=0, msg=lambda m, k=key: f"{name} {k}: {m}")


def _train_and_check(cases: list[tuple[str, int | str]], path: str) -> None:
    results = run_distributed(_cases, world_size=WORLD, args=(cases, path), timeout=300)
    refs = {opt: _reference(opt) for opt in {opt for opt, _ in cases}}
    for i, (opt, stage) in enumerate(cases):
        name = f"{opt} zero-{stage}"  # zero-nvme: stage 2 with NVMe optimizer offload
        per_rank = [result[i] for result in results]
        gaps = _check(name, per_rank[0], refs[opt])
        print(name, "compressed rel", [f"{g:.2g}" for g in gaps])
        if stage != 3:
            _assert_copies_agree(name, per_rank)
        if stage == 2:  # the sender errors of the data-parallel and of each replica group's segments are restored
            for result in per_rank:
                assert result["resumed"] == result["losses"][SAVE_AFTER:], (name, result)


@pytest.mark.slow
def test_onebit_and_zero_one_adam_with_moe_and_zero_1_2_3(tmp_path):
    """At ZeRO-2 a run resumed after a compressed step continues with the uninterrupted run's losses."""
    _train_and_check([(opt, stage) for opt in ("OneBitAdam", "ZeroOneAdam") for stage in (1, 2, 3)], str(tmp_path))


@pytest.mark.slow
def test_onebit_lamb_with_moe_and_zero_1_2_3(tmp_path):
    """An expert's trust ratio comes from its norms summed over its replica group only (not the other experts'),
    also when ZeRO's NVMe streamer steps the partition in pieces; the ZeRO-2 run resumes exactly too."""
    _train_and_check([("OneBitLamb", stage) for stage in (1, 2, 3, "nvme")], str(tmp_path))


# ---------------------------------------------- exact: constant gradients (1-bit compression keeps them exactly)

N = 256
"""Values per parameter: whole blocks of the compressed layout on 4 ranks (dense) and on 2 (the expert's group)."""


class _Constant(torch.nn.Module):
    """A dense parameter and one held by a replica group (an expert), each gradient ``c`` in every element."""

    def __init__(self, group, ranks) -> None:
        super().__init__()
        from microspeed.plugin_api import ReplicaGroup

        self.dense = torch.nn.Parameter(torch.zeros(N))
        self.expert = torch.nn.Parameter(torch.zeros(N))
        self.expert.allreduce = False
        self.expert.replica_group = ReplicaGroup(group, ranks)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.dense * c).sum() + (self.expert * c).sum()


def _momenta(cases: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Per (optimizer, stage): the warm-up's steps with gradient 1 everywhere (exact), then one with ``rank + 1``
    (compressed); the momentum values of this rank's dense and expert slices."""
    import torch.distributed as dist

    import microspeed

    rank = dist.get_rank()
    groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 2), (1, 3))}
    mine = (0, 2) if rank % 2 == 0 else (1, 3)
    out = []
    for opt, stage in cases:
        params = {"lr": 1e-3, "betas": [0.5, 0.9]}
        params.update({"freeze_step": 1} if opt != "ZeroOneAdam" else
                      {"var_freeze_step": 1, "var_update_scaler": 1, "local_step_clipper": 1})
        cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
               "optimizer": {"type": opt, "params": params}}
        engine, *_ = microspeed.initialize(model=_Constant(groups[mine], mine), config=cfg)
        inner = engine.plugin_state("comm").optimizer
        exact = 0
        while inner.full_precision_gradients_next() and exact < 4:  # the warm-up: gradient 1, averaged exactly
            engine.backward(engine(torch.tensor(1.0)))
            engine.step()
            exact += 1
        compressed = not inner.full_precision_gradients_next()
        engine.backward(engine(torch.tensor(float(rank + 1))))  # compressed: rank + 1
        engine.step()
        values: dict[str, Any] = {"dense": [], "expert": [], "exact": exact, "compressed": compressed}
        for group in inner.param_groups:
            for view in group["params"]:
                if view.numel():
                    key = "expert" if getattr(view, "replica_group", None) is not None else "dense"
                    values[key] += inner.state[view]["exp_avg"].tolist()
        out.append(values)
    return out


@pytest.mark.slow
def test_compressed_expert_gradients_are_summed_over_their_replica_group_divided_by_the_world():
    """Exact (constant gradients compress without loss): after the first compressed step an expert's momentum
    holds the sum of its replica group's gradients over the data-parallel size, the dense one the average over
    every rank, at every stage and for each optimizer (summed over the whole group, or scaled otherwise, the
    expert's would differ)."""
    cases = [(opt, stage) for opt in OPTIMIZERS for stage in (1, 2, 3)]
    b1 = 0.5
    for rank, per_case in enumerate(run_distributed(_momenta, world_size=WORLD, args=(cases,), timeout=300)):
        group = (0, 2) if rank % 2 == 0 else (1, 3)
        for (opt, stage), values in zip(cases, per_case, strict=True):
            assert values["compressed"] and 1 <= values["exact"] < 4, (opt, stage, values["exact"])
            warm = 1 - b1 ** values["exact"]  # the momentum after the warm-up's lerps towards gradient g1
            expected = {"dense": b1 * warm * 1.0 + (1 - b1) * sum(q + 1 for q in range(WORLD)) / WORLD,
                        "expert": b1 * warm * len(group) / WORLD + (1 - b1) * sum(q + 1 for q in group) / WORLD}
            for key, want in expected.items():
                assert values[key], (opt, stage, key)
                torch.testing.assert_close(torch.tensor(values[key]), torch.full((len(values[key]),), want),
                                           rtol=1e-6, atol=0, msg=lambda m, k=key, o=opt, s=stage: f"{o} z{s} {k}: {m}")
