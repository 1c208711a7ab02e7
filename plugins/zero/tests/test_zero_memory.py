"""The engine's accounting of parameter, gradient and optimizer-state bytes per rank is the ideal partition."""

from __future__ import annotations

import pytest
import torch

from microspeed.testing import run_distributed


def _model():
    from microspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64))


def _accounting_body():
    import torch.distributed as dist

    import microspeed
    from microspeed.zero import estimate_memory, memory_breakdown

    world = dist.get_world_size()
    out = []
    for precision in (None, "bf16"):
        for stage in (1, 2, 3):
            cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                   "steps_per_print": 10_000,
                   "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000}}
            if precision:
                cfg[precision] = {"enabled": True}
            model = _model()
            ideal = estimate_memory(model, world, stage, precision=precision or "fp32", optimizer="adam")
            engine, *_ = microspeed.initialize(model=model, config=cfg)
            x = torch.randint(0, 256, (2, 33))
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            engine.step()  # optimizer state exists after the first step
            got = memory_breakdown(engine)
            out.append((precision or "fp32", stage, got,
                        {"parameters": ideal.params.total, "gradients": ideal.gradients.total,
                         "optimizer_states": ideal.optimizer_states.total}))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_partitioned_bytes_within_10_percent_of_ideal(world):
    """fp32 and bf16 Adam at stages 1-3: each of params/grads/optimizer state within 10 % of the ideal.

    Ideal (Ψ parameters, N ranks): bf16 — stage 1: 2Ψ + 2Ψ + 12Ψ/N, stage 2: 2Ψ + 14Ψ/N, stage 3: 16Ψ/N;
    fp32 — stage 1: 4Ψ + 4Ψ + 8Ψ/N, stage 2: 4Ψ + 12Ψ/N, stage 3: 16Ψ/N.
    """
    for precision, stage, got, ideal in run_distributed(_accounting_body, world_size=world, timeout=280)[0]:
        for key, want in ideal.items():
            assert abs(got[key] - want) <= 0.10 * want, (precision, stage, key, got, ideal)
        total, want_total = sum(got[k] for k in ideal), sum(ideal.values())
        assert abs(total - want_total) <= 0.10 * want_total
