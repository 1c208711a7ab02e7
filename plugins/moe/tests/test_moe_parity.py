"""Expert parallelism equals one process with the same experts (fp32, relative 1e-5), and checkpoints reshard."""

from __future__ import annotations

import pytest
import torch
from moe_models import Net, batch, config, reference_losses

from microspeed.testing import run_distributed

STEPS = 4


def _train(ep_size: int, steps: int, net_kwargs: dict, extra: dict, path: str | None = None,
           save_after: int | None = None, resume: bool = False) -> list[float]:
    import torch.distributed as dist

    import microspeed

    engine, *_ = microspeed.initialize(model=Net(ep_size=ep_size, **net_kwargs), config=config(extra))
    rank, world = dist.get_rank(), dist.get_world_size()
    start = 0
    if resume:
        engine.load_checkpoint(path)
        start = engine.global_steps
    losses = []
    for step in range(start, steps):
        loss = engine(batch(step, rank))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if save_after is not None and step + 1 == save_after:
            engine.save_checkpoint(path)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize(("world", "ep_size", "net_kwargs", "extra"), [
    (2, 2, {"k": 1}, {}),
    (2, 2, {"k": 2, "drop_tokens": False}, {"gradient_clipping": 0.3}),
    (4, 4, {"k": 2, "capacity_factor": 0.5}, {}),
    (4, 2, {"k": 1, "use_residual": True}, {"gradient_clipping": 0.3}),
    (2, 2, {"k": 1}, {"zero_optimization": {"stage": 1}}),
    (4, 2, {"k": 2, "drop_tokens": False}, {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.3}),
    (4, 1, {"k": 1}, {"zero_optimization": {"stage": 1, "reduce_bucket_size": 50}}),
], ids=["ep2-top1", "ep2-top2-nodrop-clip", "ep4-top2-drop", "ep2xedp2-residual-clip", "zero1-ep2",
        "zero2-ep2xedp2-clip", "zero1-ep1xedp4-small-buckets"])
def test_expert_parallel_losses_equal_one_process(world, ep_size, net_kwargs, extra):
    results = run_distributed(_train, world_size=world, args=(ep_size, STEPS, net_kwargs, extra), timeout=180)
    expected = reference_losses(world, STEPS, clip=extra.get("gradient_clipping", 0.0), **net_kwargs)
    for rank, losses in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.slow
def test_zero2_checkpoint_with_ep2_loads_with_ep4_and_zero1(tmp_path):
    kwargs = {"k": 2, "drop_tokens": False}
    expected = reference_losses(4, STEPS, **kwargs)
    path = str(tmp_path)
    run_distributed(_train, world_size=4, args=(2, 2, kwargs, {"zero_optimization": {"stage": 2}}, path, 2),
                    timeout=180)
    for losses in run_distributed(_train, world_size=4, timeout=180,
                                  args=(4, STEPS, kwargs, {"zero_optimization": {"stage": 1}}, path, None, True)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[2:]), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_checkpoint_saved_with_ep2_loads_with_ep1_and_ep4(tmp_path):
    kwargs = {"k": 2, "drop_tokens": False}
    expected = reference_losses(4, STEPS, **kwargs)
    path = str(tmp_path)
    # ep_size 2 on 4 ranks (two copies of each expert), then ep_size 1 and 4 on 4 ranks: the same data
    run_distributed(_train, world_size=4, args=(2, 2, kwargs, {}, path, 2), timeout=180)
    for ep in (1, 4):
        for losses in run_distributed(_train, world_size=4, args=(ep, STEPS, kwargs, {}, path, None, True),
                                      timeout=180):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[2:]), rtol=1e-5, atol=0)
