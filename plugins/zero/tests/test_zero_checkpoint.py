"""Checkpoints move across ZeRO stages and world sizes: save at stage 2 on 2 ranks, resume anywhere."""

from __future__ import annotations

import pytest
import torch

from microspeed.testing import run_distributed

GLOBAL = 8
BEFORE, AFTER = 2, 3


def _model():
    from microspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))


def _batches():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 64, (GLOBAL, 17), generator=gen) for _ in range(BEFORE + AFTER)]


def _engine(stage, precision=None, extra=None):
    import torch.distributed as dist

    import microspeed

    cfg = {"train_batch_size": GLOBAL, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
           "gradient_clipping": 1.0, "steps_per_print": 10_000,
           "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}),
                                 **(extra or {})}}
    if precision:
        cfg[precision] = {"enabled": True}
    engine, *_ = microspeed.initialize(model=_model(), config=cfg)
    return engine, dist.get_world_size(), dist.get_rank()


def _steps(engine, world, rank, batches):
    import torch.distributed as dist

    micro = GLOBAL // world
    out = []
    for x in batches:
        xb = x[rank * micro:(rank + 1) * micro]
        loss = engine(xb[:, :-1], xb[:, 1:])
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        out.append(t.item() / world)
    return out


def _save_one(path, precision):
    engine, world, rank = _engine(2, precision)
    batches = _batches()
    _steps(engine, world, rank, batches[:BEFORE])
    engine.save_checkpoint(path, tag="mid")
    return _steps(engine, world, rank, batches[BEFORE:])


def _save_body(fp32_path, bf16_path):
    return _save_one(fp32_path, None), _save_one(bf16_path, "bf16")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Stage 2 on 2 ranks, fp32 and bf16: checkpoints after 2 steps and the uninterrupted losses after them."""
    fp32, bf16 = str(tmp_path_factory.mktemp("fp32")), str(tmp_path_factory.mktemp("bf16"))
    losses = run_distributed(_save_body, world_size=2, args=(fp32, bf16), timeout=280)[0]
    return {"fp32": (fp32, losses[0]), "bf16": (bf16, losses[1])}


def _load_body(path, stage, precision, extra=None):
    engine, world, rank = _engine(stage, precision, extra)
    engine.load_checkpoint(path, tag="mid")
    assert engine.global_steps == BEFORE
    return _steps(engine, world, rank, _batches()[BEFORE:]), engine.get_lr()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_across_stages_and_world_sizes(saved):
    """Stage 2 / 2 ranks -> stage 3 / 4 ranks and stage 1 / 1 rank: the same losses as not stopping."""
    path, uninterrupted = saved["fp32"]
    for world, stage in ((4, 3), (1, 1)):
        resumed, lr = run_distributed(_load_body, world_size=world, args=(path, stage, None), timeout=200)[0]
        for a, b in zip(resumed, uninterrupted, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (world, stage, resumed, uninterrupted)
        assert lr == [pytest.approx(1e-2)], lr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bf16_resume_keeps_fp32_masters(saved):
    """bf16 stage 2 -> bf16 stage 3 on 2 ranks: fp32 masters come back exactly, so losses continue exactly."""
    path, uninterrupted = saved["bf16"]
    resumed, _ = run_distributed(_load_body, world_size=2, args=(path, 3, "bf16"), timeout=200)[0]
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (resumed, uninterrupted)
    from microspeed.checkpoint import get_fp32_state_dict

    full = get_fp32_state_dict(path, tag="mid")  # consolidates without a process group
    assert full["tok_emb.weight"].dtype == torch.float32 and full["tok_emb.weight"].shape == (64, 32)
