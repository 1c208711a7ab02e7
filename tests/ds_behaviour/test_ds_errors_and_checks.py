"""Error types and checks DeepSpeed 0.19.8's users rely on, through microspeed and the ``deepspeed`` stand-in.

* ``deepspeed.DeepSpeedConfigError`` is what DeepSpeed's users catch for a bad ds_config (DeepSpeed's
  ``tests/unit/checkpoint/test_tag_validation.py``): it must catch microspeed's config errors.
* ``zero_optimization.ignore_unused_parameters: false`` with a parameter that got no gradient: DeepSpeed asserts in
  the window's ``step()`` (``tests/unit/runtime/zero/test_ignore_unused_parameters.py`` expects an
  ``AssertionError`` whose message names the key).
* fp16 on the CPU: microspeed trains it, so the accelerator says so (DeepSpeed's tests pick fp16 by asking it).
* Lightning's documented ZeRO-3 offload setup hands ``initialize()`` a client ``DeepSpeedCPUAdam``; DeepSpeed trains
  it, microspeed refused it with the message meant for 1-bit optimizers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import microspeed
from microspeed.compat import standin
from microspeed.compat.accelerator import Accelerator


def _run_standin(code: str, timeout: int = 200) -> dict:
    """Run ``code`` with the stand-in first on the path; it prints ``RESULT <json>``."""
    env = dict(os.environ, PYTHONPATH=str(standin.source_folder()) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


_CONFIG_ERROR = r"""
import json, torch, deepspeed, microspeed
from deepspeed.runtime.config import DeepSpeedConfigError
out = {"same": deepspeed.DeepSpeedConfigError is DeepSpeedConfigError}
model = torch.nn.Linear(4, 4)
bad = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
       "checkpoint": {"tag_validation": "foo"}}
try:
    deepspeed.initialize(config=bad, model=model, model_parameters=model.parameters())
    out["caught"] = None
except deepspeed.DeepSpeedConfigError as e:  # as DeepSpeed's test_checkpoint_unknown_tag_validation catches it
    out["caught"] = str(e)
try:  # DeepSpeed's own code paths (and users) raise it; microspeed's handlers catch it
    raise DeepSpeedConfigError("zero_optimization.stage: bad")
except microspeed.ConfigError as e:
    out["reverse"] = str(e)
print("RESULT " + json.dumps(out))
"""


def test_deepspeed_config_error_catches_microspeeds_config_errors():
    """``except deepspeed.DeepSpeedConfigError`` around ``initialize()`` with a bad key catches microspeed's error
    (was: a separate class nothing raised, so the error went through the handler)."""
    out = _run_standin(_CONFIG_ERROR)
    assert out["same"] is True
    assert out["caught"] is not None and "checkpoint.tag_validation" in out["caught"] and "foo" in out["caught"]
    assert out["reverse"] == "zero_optimization.stage: bad"


class _UnusedParametersModel(torch.nn.Module):
    """DeepSpeed's ``UnusedParametersModel``: a layer the loss never uses."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.used = torch.nn.Linear(hidden, hidden)
        self.unused = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).float().square().mean()


def _unused_engine(ignore: bool):
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "cpu_offload": True, "ignore_unused_parameters": ignore}}
    engine, *_ = microspeed.initialize(model=_UnusedParametersModel(), config=config)
    return engine


def test_ignore_unused_parameters_false_asserts_at_the_step_naming_key_and_parameter():
    """DeepSpeed's test: ``pytest.raises(AssertionError)`` with ``ignore_unused_parameters`` in ``args[0]``. The
    window's backward passes complete; its ``step()`` raises, naming the parameter, and applies nothing
    (was: a RuntimeError from the boundary's backward)."""
    engine = _unused_engine(False)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    x = torch.randn(2, 4, dtype=torch.bfloat16)  # the model's dtype, as DeepSpeed's random_dataloader gives
    engine.backward(engine(x))
    engine.step()  # not a boundary: nothing is checked yet
    engine.backward(engine(x))  # the boundary's backward reduces without raising
    with pytest.raises(AssertionError) as info:
        engine.step()
    message = info.value.args[0]
    assert "ignore_unused_parameters" in message and "unused.weight" in message and "unused.bias" in message
    assert isinstance(info.value, RuntimeError)  # microspeed's earlier type, for handlers written against it
    assert all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    engine = _unused_engine(True)
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    assert engine.global_steps == 1


def _mse_losses(engine, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    """Train ``steps`` steps on one batch (the loss in fp32); the losses."""
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_fp16_is_supported_on_the_cpu_as_microspeed_trains_it():
    """DeepSpeed's tests choose fp16 when ``is_fp16_supported()`` (and skip fp16 cases unless ``torch.half`` is in
    ``supported_dtypes()``); microspeed trains fp16 on the CPU, so its accelerator says yes (was: no, and those
    tests skipped). The claim holds: an fp16 engine on the CPU steps with finite, falling losses."""
    acc = Accelerator("cpu")
    assert acc.is_fp16_supported()
    assert acc.supported_dtypes() == [torch.float, torch.bfloat16, torch.half]  # DeepSpeed's CPU order
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, *_ = microspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "fp16": {"enabled": True, "initial_scale_power": 8}})
    losses = _mse_losses(engine, torch.randn(8, 8).half(), torch.randn(8, 1), steps=6)
    assert next(engine.module.parameters()).dtype == torch.half
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def _cpu_adam_losses(stage: int) -> list[float]:
    from microspeed.ops.cpu_optimizers import DeepSpeedCPUAdam

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-1, weight_decay=0.5, adamw_mode=False)
    engine, *_ = microspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}})
    return _mse_losses(engine, torch.randn(2, 4), torch.randn(2, 1), steps=3)


def test_client_deepspeed_cpu_adam_keeps_its_settings_under_zero():
    """DeepSpeed's ZeRO takes a client ``DeepSpeedCPUAdam`` without ``zero_allow_untested_optimizer`` (was: refused as
    not element-wise), and ZeRO's partition optimizer keeps ``adamw_mode=False`` (L2 decay; was: rebuilt with the
    constructor's default, decoupled decay, so the losses left stage 0's from the second step)."""
    assert _cpu_adam_losses(1) == _cpu_adam_losses(0)


class _SimpleOptimizer(torch.optim.Optimizer):
    """DeepSpeed's test ``SimpleOptimizer``: plain SGD written by hand (so ZeRO does not know it)."""

    def __init__(self, params, lr: float = 0.11072018) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def test_untested_optimizer_under_zero_is_an_assertion_error():
    """DeepSpeed's ``TestZeroAllowUntestedOptimizer``: ``zero_allow_untested_optimizer: false`` with an optimizer ZeRO
    does not know is ``pytest.raises(AssertionError)`` at ``initialize()`` (was: a ConfigError only, a ValueError);
    the message still names the key."""
    model = torch.nn.Linear(4, 4)
    with pytest.raises(AssertionError, match="zero_allow_untested_optimizer") as info:
        microspeed.initialize(model=model, optimizer=_SimpleOptimizer(model.parameters()), config={
            "train_batch_size": 4, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": False})
    assert isinstance(info.value, microspeed.ConfigError)


_LIGHTNING_OFFLOAD = r"""
import copy, json, torch, deepspeed
from deepspeed.ops.adam import DeepSpeedCPUAdam

# DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True).config (Lightning 2.6), plus the
# batch keys Lightning adds from the loader and the Trainer
LIGHTNING = {"zero_allow_untested_optimizer": True, "zero_optimization": {
    "stage": 3, "contiguous_gradients": True, "overlap_comm": True, "allgather_partitions": True,
    "reduce_scatter": True, "allgather_bucket_size": 200000000, "reduce_bucket_size": 200000000,
    "sub_group_size": 1000000000000,
    "offload_optimizer": {"device": "cpu", "nvme_path": "/local_nvme", "buffer_count": 4, "pin_memory": False},
    "offload_param": {"device": "cpu", "nvme_path": "/local_nvme", "buffer_count": 5, "buffer_size": 100000000,
                      "max_in_cpu": 1000000000, "pin_memory": False}},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                 "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False},
    "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True, "thread_count": 1},
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}


def train(config, make_optimizer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=config)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)

    def step():
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    return [step() for _ in range(4)], type(engine.optimizer).__name__, engine.zero_cpu_offload()


plain = copy.deepcopy(LIGHTNING)
del plain["zero_optimization"]["offload_optimizer"], plain["zero_optimization"]["offload_param"]
out = {"offload": train(LIGHTNING, lambda m: DeepSpeedCPUAdam(m.parameters(), lr=1e-2)),
       "plain": train(plain, lambda m: DeepSpeedCPUAdam(m.parameters(), lr=1e-2))}
try:  # a client optimizer DeepSpeed refuses with offload is still refused, for its own reason
    train(LIGHTNING, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    out["sgd"] = None
except deepspeed.DeepSpeedConfigError as e:
    out["sgd"] = str(e)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_lightning_zero3_offload_with_client_deepspeed_cpu_adam_trains():
    """Lightning's ZeRO-3 offload config with ``DeepSpeedCPUAdam`` from ``configure_optimizers`` trains, with the
    losses of the same run without offload (was: refused at ``initialize()`` as if it were a 1-bit optimizer). A
    client SGD is still refused under ``zero_force_ds_cpu_optimizer``, with DeepSpeed's reason, not the 1-bit one."""
    out = _run_standin(_LIGHTNING_OFFLOAD)
    (offload, kind, offloaded), (plain, _, plain_offloaded) = out["offload"], out["plain"]
    assert kind.startswith("ZeroOptimizer") and offloaded and not plain_offloaded
    assert offload == pytest.approx(plain, rel=1e-6) and offload[-1] < offload[0], (offload, plain)
    assert out["sgd"] is not None and "zero_force_ds_cpu_optimizer" in out["sgd"] and "SGD" in out["sgd"]
    assert "1-bit" not in out["sgd"] and "DeepSpeedCPUAdam" in out["sgd"]
