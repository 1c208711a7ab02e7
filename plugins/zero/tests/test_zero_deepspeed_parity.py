"""microspeed ZeRO and DeepSpeed 0.19.8's ZeRO, same seed and batches on 2 ranks: the same training."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from microspeed.testing import run_distributed

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STAGES = (1, 2, 3)
STEPS = 4


def _model():
    torch.manual_seed(0)  # odd sizes: both pad parameters and partitions
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Tanh(),
                               torch.nn.Linear(3, 1))


def _config(stage):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}}}


def _run(lib, stage):
    import torch.distributed as dist

    rank = dist.get_rank()
    model = _model()
    if lib == "deepspeed":
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param
    else:
        import microspeed as deepspeed
        from microspeed.zero import safe_get_full_fp32_param
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 7, generator=g), torch.randn(4, 1, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / 2)
    weights = [safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    return losses, weights


def _body():
    return {(lib, s): _run(lib, s) for s in STAGES for lib in ("deepspeed", "microspeed")}


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed (pip install deepspeed==0.19.8)")
@pytest.mark.timeout(400)
def test_same_losses_and_weights_as_deepspeed():
    out = run_distributed(_body, world_size=2, timeout=380, env={"DS_ACCELERATOR": "cpu"})[0]
    for stage in STAGES:
        ds_losses, ds_w = out[("deepspeed", stage)]
        ms_losses, ms_w = out[("microspeed", stage)]
        for a, b in zip(ms_losses, ds_losses, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (stage, ms_losses, ds_losses)
        for a, b in zip(ms_w, ds_w, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
