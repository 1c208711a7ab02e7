"""Data parallel on 2 and 4 ranks reproduces single-process training on the global batch."""

from __future__ import annotations

import pytest
import torch

import microspeed
from microspeed.testing import run_distributed

STEPS = 5
GLOBAL_BATCH = 8


def _model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


def _batches(steps, global_batch):
    g = torch.Generator().manual_seed(99)
    return [(torch.randn(global_batch, 6, generator=g), torch.randn(global_batch, 1, generator=g))
            for _ in range(steps)]


def _config(micro, gas, extra=None):
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0,
           "steps_per_print": 1000}
    cfg.update(extra or {})
    return cfg


def _train(world, rank, gas, extra=None):
    """Each rank trains on its slice of every global batch; returns mean losses and final weights."""
    micro = GLOBAL_BATCH // world // gas
    engine, *_ = microspeed.initialize(model=_model(), config=_config(micro, gas, extra))
    losses = []
    for x, y in _batches(STEPS, GLOBAL_BATCH):
        step_loss = torch.zeros(())
        for m in range(gas):
            lo = (rank * gas + m) * micro
            loss = torch.nn.functional.mse_loss(engine(x[lo:lo + micro]), y[lo:lo + micro])
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach() / gas
        microspeed.comm.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
    return losses, [p.detach().clone() for p in engine.module.parameters()], engine.get_global_grad_norm()


def _rank_body(world, cases):
    """Run every ``(gas, extra)`` case in one process group (spawning ranks is the slow part)."""
    import torch.distributed as dist

    return [_train(world, dist.get_rank(), gas, extra) for gas, extra in cases]


CASES = {
    2: [(1, None),
        (1, {"data_parallel": {"reduce_bucket_size": 100, "overlap_comm": True}}),
        (1, {"data_parallel": {"reduce_bucket_size": 100, "overlap_comm": False}}),
        (1, {"prescale_gradients": True}),
        (2, None)],
    4: [(1, None),
        (1, {"gradient_predivide_factor": 2.0, "data_parallel": {"reduce_bucket_size": 500}})],
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_matches_single_process(world):
    """Losses per step (rel. diff <= 1e-5), final weights and grad norm equal the 1-process run's.

    Cases: one bucket, many small buckets with and without overlap, prescaling, a predivide
    factor, and gradient accumulation across ranks.
    """
    ref_losses, ref_params, ref_norm = _train(1, 0, 1)
    per_rank = run_distributed(_rank_body, world_size=world, args=(world, CASES[world]), timeout=200)
    for rank_results in per_rank:
        for (gas, extra), (losses, params, norm) in zip(CASES[world], rank_results, strict=True):
            for a, b in zip(losses, ref_losses, strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (gas, extra, losses, ref_losses)
            for p, q in zip(params, ref_params, strict=True):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            assert norm == pytest.approx(ref_norm, rel=1e-5)


def test_accumulation_4x2_equals_1x8():
    ref_losses, ref_params, _ = _train(1, 0, 1)
    losses, params, _ = _train(1, 0, 4)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _no_sync_body():
    """Inside no_sync the gradients stay local; the boundary backward reduces them."""
    import torch.distributed as dist

    engine, *_ = microspeed.initialize(model=_model(), config=_config(2, 2))
    rank = dist.get_rank()
    x = torch.full((2, 6), float(rank + 1))
    with engine.no_sync():
        engine.backward(engine(x).sum())
        with pytest.raises(RuntimeError, match="inside engine.no_sync"):
            engine.step()
    local = engine.module[0].bias.grad.clone()
    engine.micro_steps += 1  # the step() refused above did not count the micro-step
    engine.backward(engine(x).sum())
    return local, engine.module[0].bias.grad.clone()


@pytest.mark.timeout(120)
def test_no_sync_skips_reduction():
    (l0, r0), (l1, r1) = run_distributed(_no_sync_body, world_size=2, timeout=100)
    assert not torch.allclose(l0, l1)  # different inputs, no reduction inside no_sync
    torch.testing.assert_close(r0, r1)  # the boundary reduced both micro-steps' gradients


def _broadcast_body():
    import torch.distributed as dist

    torch.manual_seed(dist.get_rank())  # different initial weights on each rank
    model = torch.nn.Linear(3, 3)
    engine, *_ = microspeed.initialize(model=model, config=_config(1, 1))
    return engine.module.weight.detach().clone()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_initial_weights_are_broadcast_from_rank0():
    w0, w1 = run_distributed(_broadcast_body, world_size=2, timeout=100)
    torch.testing.assert_close(w0, w1)
