"""DeepSpeed 0.19.8's ZeRO module paths and ``unwrap_model_for_generation``, through the stand-in.

DeepSpeed's tests and libraries import ``deepspeed.runtime.zero.stage3``, ``stage_1_and_2``,
``parameter_offload`` and ``partition_parameters``: the names microspeed has must be microspeed's own
objects there (so ``isinstance`` checks by clients hold), the rest must fail to import saying so.
TRL's RLHF trainers generate under ZeRO-3 inside ``unwrap_model_for_generation``: the whole model is
gathered once for the block (not once per module per token) and partitioned again after it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import microspeed
from microspeed.compat import standin
from microspeed.testing import distributed

_IMPORTS = r"""
import json
import microspeed.zero as mz
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3, unwrap_model_for_generation as u3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.zero.partition_parameters import GatheredParameters, Init, ZeroParamStatus
from deepspeed.runtime.zero import unwrap_model_for_generation, GatheredParameters as G2
import deepspeed.runtime.zero.parameter_offload as po
out = {"same": [DeepSpeedZeroOptimizer_Stage3 is mz.ZeroOptimizerStage3, DeepSpeedZeroOptimizer is mz.ZeroOptimizer,
                u3 is mz.unwrap_model_for_generation, unwrap_model_for_generation is mz.unwrap_model_for_generation,
                GatheredParameters is mz.GatheredParameters, G2 is mz.GatheredParameters, Init is mz.Init,
                ZeroParamStatus is mz.ZeroParamStatus]}
import importlib
errors, reasons, probes = {}, {}, {}
for module, name in [("stage3", "estimate_zero3_model_states_mem_needs_all_live"), ("stage_1_and_2", "IPGBucket"),
                     ("parameter_offload", "ZeROOrderedDict"), ("partition_parameters", "zero3_linear_wrap"),
                     ("stage3", "NoSuchName"), ("", "TiledLinear")]:
    path = f"deepspeed.runtime.zero.{module}".rstrip(".")
    try:
        exec(f"from {path} import {name}")
        errors[name] = None
    except ImportError as e:
        errors[name] = str(e)
    mod = importlib.import_module(path)
    probes[name] = hasattr(mod, name)
    try:
        getattr(mod, name)
    except AttributeError as e:
        reasons[name] = str(e)
out.update(errors=errors, reasons=reasons, probes=probes)
print("RESULT " + json.dumps(out))
"""


def test_zero_module_paths_give_microspeeds_objects_and_absent_names_fail_plainly():
    """Each provided name is microspeed's object (no stub); an absent one is an ImportError naming it, ``hasattr``
    is ``False`` and the attribute's error says why."""
    env = dict(os.environ, PYTHONPATH=str(standin.source_folder()) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["same"] == [True] * 8
    for name, error in out["errors"].items():  # Python's ImportError, naming the name
        assert error is not None and name in error, (name, error)
        assert out["probes"][name] is False  # hasattr answers (libraries probe versions with it)
    assert "estimate_memory" in out["reasons"]["estimate_zero3_model_states_mem_needs_all_live"]  # what to use
    assert "ZeROOrderedDict" in out["reasons"]["ZeROOrderedDict"] and "NoSuchName" in out["reasons"]["NoSuchName"]
    assert "not offered" in out["reasons"]["TiledLinear"]


class _TinyLM(torch.nn.Module):
    """A causal LM small enough to generate with on 2 CPU ranks: embedding, two blocks, a head."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).cumsum(dim=1)  # causal: position t sees tokens <= t
        for block in self.blocks:
            h = torch.tanh(block(h)) + h
        return self.head(h)


def _greedy(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    ids = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0].tolist()


@pytest.mark.slow
@distributed(world_size=2)
def test_unwrap_model_for_generation_gathers_once_per_block_not_per_token():
    torch.manual_seed(0)
    model = _TinyLM()
    reference = copy.deepcopy(model)
    config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = microspeed.initialize(model=model, config=config)
    stats = engine.plugin_state("zero").stage3.stats
    params = list(model.parameters())
    assert all(p.numel() == 0 for p in params)  # partitioned
    prompt = torch.tensor([[1, 2, 3]])
    expected = _greedy(reference, prompt, new_tokens=6)

    before = stats["gathers"]
    with microspeed.zero.unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine  # DeepSpeed yields what it was given
        assert [tuple(p.shape) for p in params] == [tuple(p.shape) for p in reference.parameters()]
        gathered = stats["gathers"] - before
        assert gathered == len(engine.plugin_state("zero").segments)  # each segment once
        assert _greedy(model, prompt, new_tokens=6) == expected
        assert stats["gathers"] - before == gathered  # no gather per layer per token
        assert not engine.optimizer.forward_hooks  # generation runs without ZeRO-3's hooks
    assert all(p.numel() == 0 for p in params)  # partitioned again
    assert engine.optimizer.forward_hooks

    # training goes on after the block (its hooks are back), and generation without the block agrees
    loss = engine(torch.tensor([[1, 2, 3, 4]]))[:, -1].logsumexp(-1).mean()
    engine.backward(loss)
    engine.step()
    assert all(p.numel() == 0 for p in params)
    before = stats["gathers"]
    _greedy(model, prompt, new_tokens=3)
    assert stats["gathers"] - before >= 3  # without the block: gathered again for every token
