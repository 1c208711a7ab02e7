"""fp16 with DeepSpeed's dynamic loss scaling (overflow skips the step), bf16, fp32 accumulation."""

from __future__ import annotations

import pytest
import torch

import microspeed
from microspeed import hookimpl
from microspeed.testing import run_distributed


class InjectOverflow:
    """Puts an inf into one gradient at the chosen optimizer steps (after backward)."""

    def __init__(self, steps: set[int], rank: int | None = None) -> None:
        self.steps, self.rank = steps, rank

    @hookimpl
    def microspeed_after_backward(self, engine):
        if engine.global_steps in self.steps and (self.rank is None or engine.topology.rank == self.rank):
            p = next(engine.module.parameters())
            p.grad.view(-1)[0] = float("inf")


def _fp16_engine(model, overflow_steps, **fp16):
    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
           "fp16": {"enabled": True, "initial_scale_power": 8, **fp16}}
    return microspeed.initialize(model=model, config=cfg, plugins=[("inject", InjectOverflow(overflow_steps))])[0]


def _step(engine, x, y):
    engine.backward(engine(x, y))
    engine.step()


def test_fp16_overflow_skips_step_and_scale_follows_deepspeed(tiny_model):
    # hysteresis 2: the first overflow (step 2) keeps the scale, the second (step 3) halves it;
    # window 3: after the overflow at iteration 3, the scale doubles at cur_iter 3 + 1 + 3 = 7.
    engine = _fp16_engine(tiny_model, {2, 3}, loss_scale_window=3, hysteresis=2)
    x, y = torch.randn(4, 8).half(), torch.randn(4, 1).half()
    scales, applied = [], []
    for step in range(9):
        before = [p.detach().clone() for p in engine.module.parameters()]
        _step(engine, x, y)
        scales.append(engine.metrics["loss_scale"])
        applied.append(engine.was_step_applied())
        changed = any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters(), strict=True))
        assert changed == applied[-1], f"step {step}: weights changed={changed} but applied={applied[-1]}"
    assert applied == [True, True, False, False, True, True, True, True, True]
    # scale after each update: 2**8 from a fresh start grows on cur_iter == window (3): 512 at step 3
    # is prevented by the overflows; halving at the second overflow; doubling 3 clean steps later.
    assert scales == [256, 256, 256, 128, 128, 128, 128, 256, 256]
    assert engine.skipped_steps == 2 and engine.global_steps == 9
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    assert all(p.dtype == torch.float32 for g in engine.optimizer.param_groups for p in g["params"])


def test_fp16_scale_grows_after_clean_window(tiny_model):
    engine = _fp16_engine(tiny_model, set(), loss_scale_window=2)
    x, y = torch.randn(4, 8).half(), torch.randn(4, 1).half()
    scales = []
    for _ in range(5):
        _step(engine, x, y)
        scales.append(engine.metrics["loss_scale"])
    assert scales == [256, 256, 512, 512, 1024]  # grows on cur_iter 2 and 4 (DeepSpeed 0.19.8)


def test_fp16_static_scale_never_changes(tiny_model):
    engine = _fp16_engine(tiny_model, {1}, loss_scale=128.0)
    x, y = torch.randn(4, 8).half(), torch.randn(4, 1).half()
    for _ in range(3):
        _step(engine, x, y)
    assert engine.metrics["loss_scale"] == 128.0 and engine.skipped_steps == 1


def test_fp16_matches_fp32_when_no_overflow(tiny_model):
    """With masters in fp32 and a scale that is a power of two, fp16 tracks fp32 closely."""
    import copy

    fp32_model = copy.deepcopy(tiny_model)
    engine16 = _fp16_engine(tiny_model, set())
    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
    engine32, *_ = microspeed.initialize(model=fp32_model, config=cfg)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    for _ in range(3):
        _step(engine16, x.half(), y.half())
        _step(engine32, x, y)
    for p16, p32 in zip(engine16.module.parameters(), engine32.module.parameters(), strict=True):
        torch.testing.assert_close(p16.float(), p32, rtol=0, atol=2e-3)


def _overflow_on_one_rank():
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "fp16": {"enabled": True, "hysteresis": 1}}
    engine, *_ = microspeed.initialize(model=model, config=cfg,
                                       plugins=[("inject", InjectOverflow({0}, rank=1))])
    x = torch.randn(2, 4).half() * (dist.get_rank() + 1)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    return engine.was_step_applied(), engine.metrics["loss_scale"], engine.module.weight.detach().clone()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_overflow_on_one_rank_skips_on_all():
    (a0, s0, w0), (a1, s1, w1) = run_distributed(_overflow_on_one_rank, world_size=2, timeout=100)
    assert (a0, a1) == (False, False)
    assert s0 == s1 == 2.0**15
    torch.testing.assert_close(w0, w1)


def _demo_loss_curve(dtype_section, steps=30, **extra):
    from microspeed.demo.data import random_token_dataset
    from microspeed.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    data = random_token_dataset(64, GPTConfig.tiny().seq_len, vocab=16, seed=0)
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, **dtype_section, **extra}
    engine, _, loader, _ = microspeed.initialize(model=model, config=cfg, training_data=data)
    losses = []
    it = iter(microspeed.RepeatingLoader(loader))
    for _ in range(steps):
        loss = engine(next(it))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def test_bf16_trains_demo_model_to_falling_loss():
    engine, losses = _demo_loss_curve({"bf16": {"enabled": True}})
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_bf16_with_fp32_gradient_accumulation():
    engine, losses = _demo_loss_curve({"bf16": {"enabled": True}}, steps=20, gradient_accumulation_steps=2,
                                      data_types={"grad_accum_dtype": "fp32"})
    masters = [p for g in engine.optimizer.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4
