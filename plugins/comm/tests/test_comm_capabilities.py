"""The 1-bit optimizers ask for gradient partitioning by its type; a partitioner that does not take their compressed
exchange is refused naming the key its provider states."""

from __future__ import annotations

import pytest
import torch

import microspeed
from microspeed.plugin_api import Field, GradientPartitioning, Section


class Partitioner:
    """A third-party plugin that partitions gradients, turned on by ``partitioner.stage``."""

    @microspeed.hookimpl
    def microspeed_config_sections(self):
        return {"partitioner": Section({"stage": Field((int,), 0, "partition at this stage")})}

    @microspeed.hookimpl
    def microspeed_capabilities(self, config):
        stage = config["partitioner"]["stage"]
        if not stage:
            return None
        return [GradientPartitioning(stage=stage, keeps_replica_groups=True, config_key="partitioner.stage",
                                     disable_hint="set partitioner.stage to 0")]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def _config(**extra):
    return {"train_batch_size": 2, "steps_per_print": 10**6, **extra}


ONEBIT = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}


def test_any_partitioner_is_refused_naming_its_own_key_and_fix():
    with pytest.raises(microspeed.ConfigError, match=r"^partitioner\.stage: cannot be combined with OneBitAdam \(the "
                                                     r"plugin 'comm'\): .*partitioner\.stage=2 .*does not take the "
                                                     r"compressed gradient exchange .*set partitioner\.stage to 0 to "
                                                     r"use OneBitAdam"):
        microspeed.initialize(model=_mlp(), config=_config(optimizer=ONEBIT, partitioner={"stage": 2}),
                              plugins=[("partitioner", Partitioner())])


def test_a_client_onebit_optimizer_with_a_partitioner_is_refused_naming_its_key():
    from microspeed_comm import OneBitAdam

    model = _mlp()
    with pytest.raises(microspeed.ConfigError, match=r"^partitioner\.stage: cannot be combined with OneBitAdam"):
        microspeed.initialize(model=model, optimizer=OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2),
                              config=_config(partitioner={"stage": 1}), plugins=[("partitioner", Partitioner())])


def test_without_partitioning_the_onebit_optimizer_is_adopted():
    engine, *_ = microspeed.initialize(model=_mlp(), config=_config(optimizer=ONEBIT, partitioner={"stage": 0}),
                                       plugins=[("partitioner", Partitioner())])
    assert engine.capabilities.get(GradientPartitioning) is None
    assert type(engine.optimizer).__name__ == "OneBitAdam" and engine.plugin_state("comm").optimizer is not None


def test_zero_takes_the_compressed_exchange_instead_of_refusing():
    """ZeRO attaches its partition optimizer (training with it: test_onebit_zero.py)."""
    pytest.importorskip("microspeed_zero")
    engine, *_ = microspeed.initialize(model=_mlp(), config=_config(optimizer=ONEBIT, zero_optimization={"stage": 1}))
    assert engine.capabilities.get(GradientPartitioning).stage == 1
    assert engine.plugin_state("comm").partitioned and type(engine.optimizer).__name__ == "ZeroOptimizer"
