"""The contract by which ZeRO's NVMe swapper steps optimizers other than Adam (``ElementwiseState``), in one process.

A toy optimizer that declares its element-wise state (one tensor starting at 0, one at 1) streams through
sub-groups of 7 elements (cutting every parameter apart) and gives the same parameters as the same optimizer
stepping the CPU partition; its scalar state stays in memory between steps, its tensors do not, and the pieces
it was handed are forgotten; its partition's state dict loads into a fresh NVMe engine, which continues
alike. An optimizer declaring nothing (torch's SGD) is refused naming the protocol.
The 1-bit optimizers on two ranks: ``plugins/comm/tests/test_nvme_onebit.py``.
"""

from __future__ import annotations

import pytest
import torch

import microspeed
from microspeed.plugin_api import ElementwiseState

pytest.importorskip("microspeed_zero")

STEPS = 4


class DampedMomentum(torch.optim.Optimizer):
    """SGD with momentum whose step is damped per element (``scale`` starts at 1): element-wise, declared."""

    forgotten = 0

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    def elementwise_state(self) -> dict[str, float]:
        """``buf`` (momentum, from 0) and ``scale`` (damping, from 1)."""
        return {"buf": 0.0, "scale": 1.0}

    def forget(self, params: list[torch.Tensor]) -> None:
        """Count the pieces handed back (nothing is cached)."""
        DampedMomentum.forgotten += len(params)

    @torch.no_grad()
    def step(self, closure=None):
        """``buf = momentum * buf + g; scale *= 0.9; p -= lr * scale * buf`` for parameters with a gradient."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "buf" not in st:
                    st["buf"], st["scale"] = torch.zeros_like(p), torch.ones_like(p)
                st.setdefault("step", torch.tensor(0.0))
                st["step"] += 1  # in place, as torch's optimizers count
                st["buf"].mul_(group["momentum"]).add_(p.grad)
                st["scale"].mul_(0.9)
                p.sub_(st["scale"] * st["buf"], alpha=group["lr"])


def _engine(offload: dict, optimizer_cls=DampedMomentum):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    cfg = {"train_batch_size": 4, "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
           "zero_force_ds_cpu_optimizer": False,
           "zero_optimization": {"stage": 1, "offload_optimizer": offload, "sub_group_size": 7}}
    engine, *_ = microspeed.initialize(model=model, optimizer=optimizer_cls(model.parameters(), lr=0.05),
                                       config=cfg)
    return engine


def _steps(engine, n: int) -> list[float]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, generator=g)
    y = torch.randn(4, 1, generator=g)
    losses = []
    for _ in range(n):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _train(offload: dict, optimizer_cls=DampedMomentum):
    engine = _engine(offload, optimizer_cls)
    losses = _steps(engine, STEPS)
    return engine, losses, [p.detach().clone() for p in engine.module.parameters()]


def test_a_declared_elementwise_optimizer_streams_from_nvme_with_the_results_of_cpu_offload(tmp_path):
    assert isinstance(DampedMomentum([torch.zeros(1)]), ElementwiseState)
    _, cpu_losses, cpu_params = _train({"device": "cpu"})
    DampedMomentum.forgotten = 0
    engine, losses, params = _train({"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2})
    assert losses == pytest.approx(cpu_losses, rel=1e-6) and losses[-1] < losses[0]
    for a, b in zip(params, cpu_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    rt = engine.plugin_state("zero")
    sw = rt.swapper
    pieces = sum(len(sg.pieces) for sg in sw.subgroups)
    assert sw.tensor_names == ("master", "buf", "scale") and len(sw.subgroups) >= 4
    assert DampedMomentum.forgotten == STEPS * pieces  # every piece handed over is handed back
    states = list(rt.optimizer.inner.state.values())
    assert states and all(set(st) == {"step"} and int(st["step"]) == STEPS for st in states)  # scalars stay
    with sw.resident():  # the streamed tensors, as checkpoints read them: scale = 0.9 ** steps everywhere
        scales = torch.cat([st["scale"] for st in rt.optimizer.run_states()])
        torch.testing.assert_close(scales, torch.full_like(scales, 0.9 ** STEPS))
    assert all(set(st) == {"step"} and int(st["step"]) == STEPS for st in rt.optimizer.inner.state.values())
    saved = engine.optimizer.state_dict()  # this rank's partition (the Lightning path): read through resident()
    again = _engine({"device": "nvme", "nvme_path": str(tmp_path / "again"), "buffer_count": 2})
    again.optimizer.load_state_dict(saved)  # written to the new files through resident(writeback=True)
    assert all(int(st["step"]) == STEPS for st in again.plugin_state("zero").optimizer.inner.state.values())
    assert _steps(again, 2) == _steps(engine, 2)


def test_an_optimizer_that_declares_no_elementwise_state_is_refused_on_nvme_naming_the_protocol(tmp_path):
    with pytest.raises(microspeed.ConfigError, match=r"offload_optimizer\.device='nvme' with the optimizer SGD: .*"
                                                     r"ElementwiseState.*use optimizer\.type 'Adam'/'AdamW'"):
        _train({"device": "nvme", "nvme_path": str(tmp_path)}, optimizer_cls=torch.optim.SGD)
