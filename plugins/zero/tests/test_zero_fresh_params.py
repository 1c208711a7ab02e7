"""Parameters hold their new values when ``step()`` returns (ZeRO-1/2 with ``overlap_comm``).

The all-gather of updated partitions is waited for lazily; any read of a parameter — an EMA
update from ``engine.module.named_parameters()``, ``p.data``, ``state_dict()`` — must see the new
values. Compared with ``overlap_comm: false`` (which waits inside ``step()``) on 2 ranks.
"""

from __future__ import annotations

import pytest
import torch

from microspeed.testing import run_distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _train(stage: int, overlap: bool) -> dict:
    import copy

    import torch.distributed as dist

    import microspeed

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10_000,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "overlap_comm": overlap, "reduce_bucket_size": 200,
                                 "allgather_bucket_size": 100}}
    engine, *_ = microspeed.initialize(model=_model(), config=cfg)
    ema = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    data_reads, saved = [], []
    for _ in range(4):
        x = torch.randn(4 * world, 8, generator=gen)[4 * rank:4 * rank + 4]
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        for n, p in engine.module.named_parameters():  # right after step: an EMA update
            ema[n].mul_(0.9).add_(p.detach(), alpha=0.1)
        data_reads.append([p.data.clone() for p in engine.module.parameters()])
        copied = copy.deepcopy(engine.module)  # an EMA model made by copying, right after a step
        assert all(type(p) is torch.nn.Parameter for p in copied.parameters())
        data_reads.append([p.detach() for p in copied.parameters()])
        saved.append({k: v.clone() for k, v in engine.module.state_dict().items()})
    return {"ema": ema, "data": data_reads, "state": saved}


def _body() -> dict:
    return {stage: (_train(stage, True), _train(stage, False)) for stage in (1, 2)}


@pytest.mark.slow
def test_parameters_fresh_after_step_two_ranks():
    results = run_distributed(_body, world_size=2)
    for res in results:
        for stage, (lazy, eager) in res.items():
            for n in eager["ema"]:
                assert torch.equal(lazy["ema"][n], eager["ema"][n]), (stage, n)
            for a, b in zip(lazy["data"], eager["data"], strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), stage
            for a, b in zip(lazy["state"], eager["state"], strict=True):
                assert all(torch.equal(a[k], b[k]) for k in b), stage
