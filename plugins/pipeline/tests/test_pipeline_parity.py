"""fp32 losses of pipeline (× data, × tensor) parallel training equal the single-process model's, step by step."""

from __future__ import annotations

import pytest
import torch
from pipeline_models import build_reference, micro_batches, mlp_specs, pipeline

from microspeed.testing import run_distributed

STEPS, MICRO, GAS = 4, 2, 4


def _config(extra=None):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "gradient_clipping": 0.5}
    cfg.update(extra or {})
    return cfg


def reference_losses(dp: int, specs=None, steps: int = STEPS) -> list[float]:
    """Single-process training over the same global batches (all data-parallel shards, all micro-batches)."""
    model = build_reference(specs or mlp_specs())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        batch = micro_batches(step, dp * GAS, MICRO)
        loss = torch.stack([torch.nn.functional.mse_loss(model(x), y) for x, y in batch]).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return losses


def _train_pipeline(stages: int, chunks: int = 1, schedule: str | None = None, steps: int = STEPS) -> list[float]:
    import microspeed

    model = pipeline(mlp_specs(), num_stages=stages, num_chunks=chunks, partition_method="uniform")
    engine, *_ = microspeed.initialize(model=model, config=_config({"pipeline": {"schedule": schedule}}))
    dp, d = engine.topology.data_parallel_size, engine.topology.data_parallel_rank
    losses = []
    for step in range(steps):
        mine = micro_batches(step, dp * GAS, MICRO)[d * GAS:(d + 1) * GAS]
        losses.append(engine.train_batch(iter(mine)).item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize(("world", "stages", "chunks"), [(2, 2, 1), (4, 4, 1), (4, 2, 1), (2, 2, 2)],
                         ids=["pp2", "pp4", "pp2xdp2", "pp2-interleaved2"])
def test_pipeline_losses_equal_single_process(world, stages, chunks):
    results = run_distributed(_train_pipeline, world_size=world, args=(stages, chunks), timeout=180)
    expected = reference_losses(world // stages)
    for rank, losses in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")


def _interleaved_odd_and_eval() -> dict:
    import microspeed

    model = pipeline(mlp_specs(), num_stages=2, num_chunks=2, partition_method="uniform")
    engine, *_ = microspeed.initialize(model=model, config=_config({"gradient_accumulation_steps": 3}))
    loss = engine.train_batch(iter(micro_batches(0, 3, MICRO))).item()  # 3 micro-batches on 2 stages
    return {"loss": loss, "eval": engine.eval_batch(iter(micro_batches(5, 3, MICRO))).item()}


@pytest.mark.slow
def test_interleaved_with_a_short_last_group_and_interleaved_eval():
    results = run_distributed(_interleaved_odd_and_eval, world_size=2, timeout=120)
    from pipeline_models import build_reference

    model = build_reference(mlp_specs())
    first = torch.stack([torch.nn.functional.mse_loss(model(x), y) for x, y in micro_batches(0, 3, MICRO)]).mean()
    for r in results:
        torch.testing.assert_close(r["loss"], first.item(), rtol=1e-6, atol=0)
        assert r["eval"] == results[0]["eval"]
