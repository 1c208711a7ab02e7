"""DeepSpeed's engine surface that clients call: accumulation boundary, accessors, no_sync, backward, RNG on load."""

from __future__ import annotations

import copy

import pytest
import torch

import microspeed
from microspeed.errors import EngineUsageError

GAS = 4


def _config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, **extra}


def _batches(n):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(2, 8, generator=gen), torch.randn(2, 1, generator=gen)) for _ in range(n)]


def _counting(engine):
    calls = []
    step = engine.optimizer.step
    engine.optimizer.step = lambda *a, **k: (calls.append(1), step(*a, **k))[1]
    return calls


def test_set_gradient_accumulation_boundary_drives_steps_as_accelerate_does(tiny_model):
    """Accelerate sets the boundary before each backward and calls step() only at it; same run as plain GAS."""
    data = _batches(3 * GAS)
    plain, *_ = microspeed.initialize(model=copy.deepcopy(tiny_model), config=_config())
    driven, *_ = microspeed.initialize(model=copy.deepcopy(tiny_model), config=_config())
    plain_steps, driven_steps = _counting(plain), _counting(driven)
    plain_losses, driven_losses = [], []
    for x, y in data:
        loss = plain(x, y)
        plain_losses.append(plain.backward(loss).item())
        plain.step()
    for i, (x, y) in enumerate(data):
        sync = (i + 1) % GAS == 0
        driven.set_gradient_accumulation_boundary(is_boundary=sync)  # DeepSpeedEngineWrapper.backward
        assert driven.is_gradient_accumulation_boundary() is sync
        loss = driven(x, y)
        driven_losses.append(driven.backward(loss).item())
        if sync:
            driven.step()
    assert len(plain_steps) == len(driven_steps) == 3 and driven.global_steps == 3
    assert driven_losses == plain_losses
    for p, q in zip(plain.module.parameters(), driven.module.parameters(), strict=True):
        assert torch.equal(p, q)


def test_boundary_set_false_never_steps(tiny_model):
    engine, *_ = microspeed.initialize(model=tiny_model, config=_config())
    calls = _counting(engine)
    engine.set_gradient_accumulation_boundary(False)
    for x, y in _batches(2 * GAS):
        engine.backward(engine(x, y))
        engine.step()
    assert calls == [] and engine.global_steps == 0 and engine.micro_steps == 2 * GAS
    engine.set_gradient_accumulation_boundary(True)
    engine.step()
    assert calls == [1] and engine.global_steps == 1


def test_boundary_is_passed_to_an_optimizer_that_tracks_it(tiny_model):
    seen = []

    class Tracking(torch.optim.SGD):
        def set_gradient_accumulation_boundary(self, is_boundary):
            seen.append(is_boundary)

    engine, *_ = microspeed.initialize(model=tiny_model, optimizer=Tracking(tiny_model.parameters(), lr=0.1),
                                       config={"train_batch_size": 2})
    engine.set_gradient_accumulation_boundary(False)
    engine.set_gradient_accumulation_boundary(True)
    assert seen == [False, True]


def test_accessors_answer_as_deepspeed_does(tiny_model, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    engine, optimizer, _, scheduler = microspeed.initialize(
        model=tiny_model, config=_config(gradient_clipping=1.5, steps_per_print=7, bf16={"enabled": True},
                                         scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}}))
    assert (engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size,
            engine.mp_world_size) == (0, 0, 1, 1, 1)
    assert engine.zero_optimization_stage() == 0 and engine.zero_optimization() is False
    assert engine.zero_gather_16bit_weights_on_model_save() is False and engine.zero_offload_optimizer() is False
    assert engine.zero_offload_param() is False and engine.zero_cpu_offload() is False
    assert engine.fp16_enabled() is False and engine.bfloat16_enabled() is True
    assert engine.communication_data_type is torch.bfloat16
    assert engine.gradient_accumulation_steps() == GAS and engine.train_micro_batch_size_per_gpu() == 2
    assert engine.train_batch_size() == 2 * GAS and engine.get_batch_info() == (2 * GAS, 2, GAS)
    assert engine.steps_per_print() == 7 and engine.gradient_clipping() == 1.5
    assert engine.optimizer_name() == "SGD" and engine.scheduler_name() == "WarmupLR"
    assert engine.optimizer is optimizer and engine.lr_scheduler is scheduler and engine.module is tiny_model
    assert engine.global_steps == 0 and engine.get_global_grad_norm() is None
    with pytest.raises(ValueError, match="requires ZeRO-3"):
        engine._zero3_consolidated_16bit_state_dict()
    with pytest.raises(ValueError, match="only applicable to cases where weights are partitioned"):
        engine._consolidated_16bit_state_dict()


def test_fp16_accessors(tiny_model):
    engine, *_ = microspeed.initialize(model=tiny_model, config=_config(fp16={"enabled": True,
                                                                             "initial_scale_power": 8}))
    assert engine.fp16_enabled() is True and engine.bfloat16_enabled() is False
    assert engine.dynamic_loss_scale() is True and engine.loss_scale() == 0.0
    assert engine.initial_dynamic_scale() == 256.0 and engine.communication_data_type is torch.float16
    static, *_ = microspeed.initialize(model=copy.deepcopy(tiny_model),
                                       config=_config(fp16={"enabled": True, "loss_scale": 128}))
    assert static.dynamic_loss_scale() is False and static.loss_scale() == 128.0


def test_unknown_attribute_names_engine_plugins_and_model(tiny_model):
    engine, *_ = microspeed.initialize(model=tiny_model, config=_config())
    with pytest.raises(AttributeError, match=r"'Engine' object has no attribute 'no_such_thing' \(neither the "
                                             r"engine, its plugins nor the wrapped model TinyNet define it\)"):
        engine.no_such_thing  # noqa: B018
    assert engine.fc1 is tiny_model.fc1  # the model's own attributes still come through


def test_nested_no_sync_and_step_inside_raise_as_deepspeed(tiny_model):
    engine, *_ = microspeed.initialize(model=tiny_model, config=_config())
    with engine.no_sync():
        with pytest.raises(AssertionError, match="no_sync context manager reentry is unsupported"):
            with engine.no_sync():
                pass
        with pytest.raises(EngineUsageError, match="illegal to call Engine.step"):
            engine.step()
    x, y = _batches(1)[0]
    engine.backward(engine(x, y))  # the outer block ended cleanly: reduction is back on
    assert engine._inside_no_sync is False


def test_destroy_releases_the_optimizer(tiny_model):
    engine, *_ = microspeed.initialize(model=tiny_model, config=_config())
    engine.destroy()
    assert engine.optimizer is None and engine.lr_scheduler is None


class _HookOnActivations:
    """A plugin that does what ZeRO-3 does: a hook on every forward's output, its closure holding the engine."""

    def __init__(self) -> None:
        self.destroyed = 0

    @microspeed.hookimpl
    def microspeed_setup(self, engine) -> None:
        engine.set_plugin_state("activations", self)
        self.engine = engine

    @microspeed.hookimpl
    def microspeed_after_forward(self, engine, ctx) -> None:
        if isinstance(ctx.outputs, torch.Tensor) and ctx.outputs.requires_grad:
            ctx.outputs.register_hook(lambda g: g if engine.global_steps >= 0 else None)

    @microspeed.hookimpl
    def microspeed_destroy(self, engine) -> None:
        self.destroyed += 1
        self.engine = None


def test_destroy_tells_every_plugin_once_and_lets_the_engine_go():
    """DeepSpeed's ``destroy()`` (Accelerate's ``free_memory`` calls it): every plugin hears ``microspeed_destroy``
    once (a second call does nothing), the plugins' states go, and so does the last micro-step's loss, whose graph
    holds hooks that reach the engine from outside Python's collector: once dropped, engine and model are freed."""
    import gc
    import weakref

    plugin = _HookOnActivations()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, *_ = microspeed.initialize(model=net, config=_config(gradient_accumulation_steps=1),
                                       plugins=[("activations", plugin)])
    x, y = _batches(1)[0]
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    del loss
    gone, model = weakref.ref(engine), weakref.ref(net)
    engine.destroy()
    engine.destroy()
    assert plugin.destroyed == 1 and engine.plugin_state("activations") is None
    del engine, net
    gc.collect()
    assert gone() is None and model() is None


def test_load_checkpoint_leaves_rng_alone_unless_asked(tiny_model, tmp_path):
    """DeepSpeed's load_checkpoint does not touch random-number state; load_rng_state=True restores it."""
    engine, *_ = microspeed.initialize(model=tiny_model, config=_config())
    torch.manual_seed(11)
    engine.save_checkpoint(str(tmp_path), tag="t")
    after_save = torch.rand(3)
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    engine.load_checkpoint(str(tmp_path), tag="t")
    assert torch.equal(torch.rand(3), expected)  # untouched by the load
    engine.load_checkpoint(str(tmp_path), tag="t", load_rng_state=True)
    assert torch.equal(torch.rand(3), after_save)  # the saved stream continues


def test_save_16bit_model_excludes_frozen_parameters(tiny_model, tmp_path):
    tiny_model.fc1.weight.requires_grad_(False)
    engine, *_ = microspeed.initialize(model=tiny_model, config=_config())
    assert engine.save_16bit_model(str(tmp_path), "m.bin", exclude_frozen_parameters=True)
    saved = torch.load(tmp_path / "m.bin")
    assert set(saved) == {"fc1.bias", "fc2.weight", "fc2.bias"}
    torch.testing.assert_close(saved["fc2.weight"], tiny_model.fc2.weight)


def test_initialize_takes_deepspeeds_arguments_in_deepspeeds_order(tiny_model):
    import inspect

    names = list(inspect.signature(microspeed.initialize).parameters)
    assert names[:13] == ["args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                          "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
                          "config_params"]  # deepspeed.initialize's order in 0.19.8
    with pytest.raises(microspeed.ConfigError, match=r"mesh_param=.*not supported"):
        microspeed.initialize(model=tiny_model, config=_config(), mesh_param=(2, 1))


def test_get_mom_and_batch_setters_follow_deepspeed(tiny_model):
    engine, *_ = microspeed.initialize(model=tiny_model, config=_config())
    assert engine.get_mom() == [0.9]  # SGD: momentum
    adam, *_ = microspeed.initialize(model=copy.deepcopy(tiny_model), config={
        "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1, "betas": [0.8, 0.9]}}})
    assert [tuple(b) for b in adam.get_mom()] == [(0.8, 0.9)]
    engine.set_train_batch_size(12)  # micro-batch 2 stays, accumulation becomes 6
    assert (engine.train_batch_size(), engine.gradient_accumulation_steps()) == (12, 6)
    with pytest.raises(ValueError, match="divisible by micro-batch data parallelism"):
        engine.set_train_batch_size(7)
    engine.set_train_micro_batch_size(4)  # accumulation stays 6
    assert engine.get_batch_info() == (24, 4, 6)
    calls = _counting(engine)
    for x, y in _batches(6):
        engine.backward(engine(x, y))
        engine.step()
    assert calls == [1]  # one optimizer step per 6 micro-steps
