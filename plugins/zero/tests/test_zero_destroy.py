"""``engine.destroy()`` under ZeRO: the engine, its buffers and swap files go, as DeepSpeed's ``destroy`` lets them.

Accelerate's ``free_memory()`` (and so Trainer's ``find_executable_batch_size``, which builds the engine again
after an out-of-memory error) calls ``engine.destroy()`` and drops the engine. ZeRO puts hooks on the parameters,
on the modules and on every forward's activations; a parameter's hooks and attributes are held from outside
Python's collector, so before ``microspeed_destroy`` existed an engine dropped after ``destroy()`` stayed in memory
with its flat buffers, accumulators and optimizer state, at every stage. Checked here:

* at stages 1, 2 and 3 in memory and at stage 3 with parameters and optimizer on NVMe: after ``destroy()`` and
  ``del`` the engine is collected, and on NVMe the swap files are gone;
* at stages 1 and 2 the model keeps working afterwards (whole parameters, no hook left): its forward gives what
  the engine's gave before ``destroy()``;
* on 2 ranks (the shared-memory exchange in the reductions) the same, at stage 2.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

import microspeed
from microspeed.testing import run_distributed


class Net(torch.nn.Module):
    """Two linear layers; ``forward(x)`` is the output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _train_and_destroy(stage: int, nvme: str | None) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0}
    if nvme is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        zero["sub_group_size"] = 64
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    torch.manual_seed(0)
    with microspeed.zero.Init(enabled=stage == 3):
        model = Net()
    engine, *_ = microspeed.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(2, 8, generator=gen)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    x = torch.randn(2, 8, generator=gen)
    with torch.no_grad():
        before = engine(x)
    files_before = sum(len(fs) for _, _, fs in os.walk(nvme)) if nvme is not None else 0
    engine_ref, model_ref = weakref.ref(engine), weakref.ref(model)
    del loss
    engine.destroy()
    out = {"files_before": files_before,
           "files_after": sum(len(fs) for _, _, fs in os.walk(nvme)) if nvme is not None else 0}
    if stage < 3:  # whole parameters, no hook left: the model runs on its own
        with torch.no_grad():
            out["same_output"] = torch.equal(model(x), before)
    del engine, model
    gc.collect()
    out["engine_freed"], out["model_freed"] = engine_ref() is None, model_ref() is None
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_destroy_frees_the_engine_in_memory(stage: int):
    out = _train_and_destroy(stage, None)
    assert out["engine_freed"] and out["model_freed"], out
    if stage < 3:
        assert out["same_output"], out


@pytest.mark.timeout(120)
def test_destroy_frees_the_engine_and_removes_the_swap_files(tmp_path):
    out = _train_and_destroy(3, str(tmp_path))
    assert out["files_before"] > 0 and out["files_after"] == 0, out
    assert out["engine_freed"] and out["model_freed"], out


def _two_ranks() -> dict:
    return _train_and_destroy(2, None)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_destroy_frees_the_engine_on_two_ranks():
    for out in run_distributed(_two_ranks, world_size=2, timeout=200):
        assert out["engine_freed"] and out["model_freed"] and out["same_output"], out
