"""Tied embedding/head across stages, and checkpoints that load under another number of stages."""

from __future__ import annotations

import pytest
import torch
from pipeline_models import build_reference, lm_loss, micro_batches, mlp_specs, pipeline, tied_specs, token_batches
from test_pipeline_parity import GAS, MICRO, _config, reference_losses

from microspeed.testing import run_distributed


def _reference_tied(steps: int) -> list[float]:
    model = build_reference(tied_specs())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    assert model[0].module.weight is model[-1].module.weight  # one weight, by construction
    out = []
    for step in range(steps):
        loss = torch.stack([lm_loss(model(x), y) for x, y in token_batches(step, GAS, MICRO)]).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        out.append(loss.item())
    return out


def _train_tied(steps: int) -> dict:
    import torch.distributed as dist

    import microspeed

    model = pipeline(tied_specs(), num_stages=2, loss_fn=lm_loss, partition_method="uniform")
    engine, *_ = microspeed.initialize(model=model, config=_config())
    losses = [engine.train_batch(iter(token_batches(step, GAS, MICRO))).item() for step in range(steps)]
    weight = model.tied_modules["embed"].weight.detach().clone()
    copies = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, weight)
    return {"losses": losses, "copies_equal": all(torch.equal(c, copies[0]) for c in copies),
            "names": sorted(n for n, _ in model.named_parameters())}


def test_tied_embedding_and_head_across_stages_train_as_one_weight():
    results = run_distributed(_train_tied, world_size=2, args=(4,), timeout=120)
    expected = _reference_tied(4)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        assert r["copies_equal"]  # the two stages' copies stay identical
    assert "tied_modules.embed.weight" in results[0]["names"] and "tied_modules.embed.weight" in results[1]["names"]


def _save_or_resume(stages: int, path: str, save_after: int | None, resume: bool, steps: int) -> list[float]:
    import microspeed

    model = pipeline(mlp_specs(), num_stages=stages, partition_method="uniform")
    engine, *_ = microspeed.initialize(model=model, config=_config())
    start = 0
    if resume:
        engine.load_checkpoint(path)
        start = engine.global_steps
    losses = []
    for step in range(start, steps):
        losses.append(engine.train_batch(iter(micro_batches(step, GAS, MICRO))).item())
        if save_after is not None and step + 1 == save_after:
            engine.save_checkpoint(path)
    return losses


@pytest.mark.slow
def test_checkpoint_saved_with_two_stages_loads_into_one_and_four(tmp_path):
    expected = reference_losses(1, steps=4)
    saved = run_distributed(_save_or_resume, world_size=2, args=(2, str(tmp_path), 2, False, 2), timeout=120)
    torch.testing.assert_close(torch.tensor(saved[0]), torch.tensor(expected[:2]), rtol=1e-5, atol=0)
    for world in (1, 4):
        resumed = run_distributed(_save_or_resume, world_size=world, args=(world, str(tmp_path), None, True, 4),
                                  timeout=120)
        for losses in resumed:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[2:]), rtol=1e-5, atol=0)
