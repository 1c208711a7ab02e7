"""The DeepSpeed-compatible engine surface: initialize's results, counters, step, lr, grad norm, errors."""

from __future__ import annotations

import copy

import pytest
import torch

import microspeed
from microspeed import ConfigError
from microspeed.builtin.lamb import Lamb
from microspeed.builtin.lr_schedules import WarmupLR
from microspeed.builtin.optimizers import OPTIMIZER_NAMES


def _batch(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def _params(module):
    return [p.detach().clone() for p in module.parameters()]


def _changed(before, module):
    return [not torch.equal(b, p) for b, p in zip(before, module.parameters(), strict=True)]


def _train_step(engine, seed=0):
    x, y = _batch(engine.train_micro_batch_size_per_gpu(), seed)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss


# ------------------------------------------------------------------------------ initialize()


def test_initialize_returns_engine_optimizer_loader_scheduler(tiny_model, base_config):
    result = microspeed.initialize(model=tiny_model, config=base_config)
    assert isinstance(result, tuple) and len(result) == 4
    engine, optimizer, loader, scheduler = result
    assert isinstance(engine, microspeed.Engine) and isinstance(engine, microspeed.DeepSpeedEngine)
    assert isinstance(engine, torch.nn.Module)
    assert isinstance(optimizer, torch.optim.SGD) and engine.optimizer is optimizer
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert loader is None and scheduler is None and engine.lr_scheduler is None
    assert engine.train_batch_size() == 4
    assert engine.train_micro_batch_size_per_gpu() == 4
    assert engine.gradient_accumulation_steps() == 1

    cfg = {**base_config, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine, optimizer, _, scheduler = microspeed.initialize(model=copy.deepcopy(tiny_model), config=cfg)
    assert isinstance(scheduler, WarmupLR) and engine.lr_scheduler is scheduler
    assert scheduler.optimizer is optimizer


def test_optimizer_and_scheduler_as_objects(tiny_model):
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, optimizer, _, scheduler = microspeed.initialize(
        model=tiny_model, optimizer=opt, lr_scheduler=sched,
        config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    assert optimizer is opt and engine.optimizer is opt
    assert scheduler is sched and engine.lr_scheduler is sched
    assert engine.get_lr() == [0.2]
    _train_step(engine)
    assert engine.get_lr() == [0.2]  # not a boundary: the scheduler did not move
    _train_step(engine)
    assert engine.get_lr() == [pytest.approx(0.1)]
    assert sched.last_epoch == 1


def test_optimizer_and_scheduler_as_callables(tiny_model):
    seen = {}

    def make_optimizer(params):
        seen["params"] = list(params)
        return torch.optim.Adam(seen["params"], lr=0.01)

    def make_scheduler(optimizer):
        seen["optimizer"] = optimizer
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)

    engine, optimizer, _, scheduler = microspeed.initialize(
        model=tiny_model, optimizer=make_optimizer, lr_scheduler=make_scheduler,
        config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    assert isinstance(optimizer, torch.optim.Adam) and engine.optimizer is optimizer
    assert [id(p) for p in seen["params"]] == [id(p) for p in tiny_model.parameters()]
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and seen["optimizer"] is optimizer
    lrs = []
    for i in range(12):  # 4 optimizer steps
        _train_step(engine, seed=i)
        lrs.append(engine.get_lr()[0])
    # StepLR(step_size=2): the lr drops after the 2nd and 4th optimizer step (micro-steps 6 and 12)
    expected = [0.01] * 5 + [0.001] * 6 + [0.0001]
    assert lrs == pytest.approx(expected)
    assert scheduler.last_epoch == 4


def test_model_parameters_restricts_what_is_optimized(tiny_model, base_config):
    engine, optimizer, *_ = microspeed.initialize(model=tiny_model, config=base_config,
                                                  model_parameters=tiny_model.fc2.parameters())
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in
                                                                           tiny_model.fc2.parameters()}
    before = _params(tiny_model)
    _train_step(engine)
    assert _changed(before, tiny_model) == [False, False, True, True]  # fc1.weight, fc1.bias stay


def test_frozen_parameters_are_not_optimized_by_default(tiny_model, base_config):
    tiny_model.fc1.requires_grad_(False)
    engine, optimizer, *_ = microspeed.initialize(model=tiny_model, config=base_config)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 2
    before = _params(tiny_model)
    _train_step(engine)
    assert _changed(before, tiny_model) == [False, False, True, True]


# ------------------------------------------------------------------------------ module surface


def test_engine_is_callable_like_the_module_and_forwards_attributes(tiny_model, base_config):
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config)
    assert engine.module is tiny_model
    assert engine.fc1 is tiny_model.fc1 and engine.fc2.weight is tiny_model.fc2.weight
    x, y = _batch()
    torch.testing.assert_close(engine(x, y), tiny_model(x, y))
    torch.testing.assert_close(engine(x), tiny_model(x))
    torch.testing.assert_close(engine(x, y=y), tiny_model(x, y))
    with pytest.raises(AttributeError):
        engine.no_such_attribute  # noqa: B018


def test_train_and_eval_toggle_module_training(tiny_model, base_config):
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config)
    assert tiny_model.training
    assert engine.eval() is engine
    assert not engine.training and not tiny_model.training and not tiny_model.fc1.training
    assert engine.train() is engine
    assert engine.training and tiny_model.training and tiny_model.fc2.training
    engine.train(False)
    assert not tiny_model.training


# ------------------------------------------------------------------------------ counters & step


def test_counters_boundaries_and_accumulated_update(tiny_model):
    reference = copy.deepcopy(tiny_model)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = microspeed.initialize(model=tiny_model, config=cfg)
    assert engine.train_batch_size() == 6
    boundaries, updated = [], []
    for i in range(7):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        before = _params(tiny_model)
        _train_step(engine, seed=i)
        updated.append(any(_changed(before, tiny_model)))
        assert engine.micro_steps == i + 1
        assert engine.global_steps == (i + 1) // 3
        assert engine.global_samples == 6 * ((i + 1) // 3)
        assert engine.skipped_steps == 0
        if i == 2:
            after_first_step = _params(tiny_model)
    assert boundaries == [False, False, True, False, False, True, False]
    assert updated == boundaries  # step() only updates the weights at the boundary

    # The first optimizer step equals one SGD step on the mean loss of the three micro-batches.
    loss = sum(reference(*_batch(2, seed=i)) for i in range(3)) / 3
    loss.backward()
    for p, q in zip(after_first_step, reference.parameters(), strict=True):
        torch.testing.assert_close(p, q.detach() - 0.1 * q.grad, rtol=1e-6, atol=1e-7)


def test_zero_grad(tiny_model, base_config):
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config)
    engine.backward(engine(*_batch()))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in tiny_model.parameters())
    engine.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in tiny_model.parameters())
    engine.backward(engine(*_batch()))
    engine.zero_grad()
    assert all(p.grad is None for p in tiny_model.parameters())
    engine.backward(engine(*_batch()))
    engine.step()  # the boundary step clears the gradients too
    assert all(p.grad is None for p in tiny_model.parameters())


def test_get_lr_follows_warmup_lr_once_per_optimizer_step(tiny_model):
    lo, hi, warmup = 0.01, 0.1, 4
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": lo, "warmup_max_lr": hi,
                                                         "warmup_num_steps": warmup, "warmup_type": "linear"}}}
    engine, optimizer, _, scheduler = microspeed.initialize(model=tiny_model, config=cfg)

    def expected(optimizer_steps):  # DeepSpeed's WarmupLR: batch t = optimizer_steps - 1
        t = optimizer_steps - 1
        return lo if t < 0 else lo + (hi - lo) * min(t, warmup) / warmup

    assert engine.get_lr() == [pytest.approx(expected(0))]
    for micro in range(1, 15):
        lr_used = optimizer.param_groups[0]["lr"]
        before = _params(tiny_model)
        _train_step(engine, seed=micro)
        steps = micro // 2
        assert engine.global_steps == steps
        assert engine.get_lr() == [pytest.approx(expected(steps))], micro
        assert scheduler.last_batch_iteration == steps - 1
        if micro % 2 == 0:  # the step just taken used the lr set before it
            assert lr_used == pytest.approx(expected(steps - 1))
            assert any(_changed(before, tiny_model))
    assert engine.get_lr() == [pytest.approx(hi)]


def test_global_grad_norm_and_clipping_match_manual(tiny_model):
    x, y = _batch()
    ref = copy.deepcopy(tiny_model)
    ref(x, y).backward()
    grads = [p.grad.clone() for p in ref.parameters()]
    norm = torch.nn.utils.get_total_norm(grads).item()
    assert norm > 0.05

    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    plain, *_ = microspeed.initialize(model=copy.deepcopy(tiny_model), config=cfg)
    assert plain.get_global_grad_norm() is None
    plain.backward(plain(x, y))
    plain.step()
    assert plain.get_global_grad_norm() == pytest.approx(norm, rel=1e-5)
    for p, w, g in zip(plain.module.parameters(), tiny_model.parameters(), grads, strict=True):
        torch.testing.assert_close(p, w - 0.1 * g, rtol=1e-6, atol=1e-7)

    max_norm = 0.05
    clipped, *_ = microspeed.initialize(model=copy.deepcopy(tiny_model), config={**cfg, "gradient_clipping": max_norm})
    clipped.backward(clipped(x, y))
    clipped.step()
    assert clipped.get_global_grad_norm() == pytest.approx(norm, rel=1e-5)  # reported before clipping
    coef = max_norm / (norm + 1e-6)
    for p, w, g in zip(clipped.module.parameters(), tiny_model.parameters(), grads, strict=True):
        torch.testing.assert_close(p, w - 0.1 * coef * g, rtol=1e-5, atol=1e-7)
    delta = [p.detach() - w for p, w in zip(clipped.module.parameters(), tiny_model.parameters(), strict=True)]
    assert torch.nn.utils.get_total_norm(delta).item() == pytest.approx(0.1 * max_norm, rel=1e-4)


def test_was_step_applied(tiny_model, base_config):
    engine, *_ = microspeed.initialize(model=tiny_model,
                                       config={**base_config, "train_batch_size": 4, "gradient_accumulation_steps": 2,
                                               "train_micro_batch_size_per_gpu": 2})
    assert engine.was_step_applied() is False
    _train_step(engine)
    assert engine.was_step_applied() is False  # no optimizer step yet
    _train_step(engine)
    assert engine.was_step_applied() is True


def test_backward_scale_wrt_gas(tiny_model):
    x, y = _batch(2)
    ref = copy.deepcopy(tiny_model)
    ref(x, y).backward()
    full = [p.grad.clone() for p in ref.parameters()]
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = microspeed.initialize(model=tiny_model, config=cfg)
    loss = engine(x, y)
    torch.testing.assert_close(engine.backward(loss), loss.detach() / 2)  # DeepSpeed returns the scaled loss
    for p, g in zip(tiny_model.parameters(), full, strict=True):
        torch.testing.assert_close(p.grad, g / 2)
    engine.zero_grad()
    loss = engine(x, y)
    assert engine.backward(loss, scale_wrt_gas=False) is loss
    for p, g in zip(tiny_model.parameters(), full, strict=True):
        torch.testing.assert_close(p.grad, g)


# ------------------------------------------------------------------------------ errors


def test_backward_of_non_scalar_is_type_error(tiny_model, base_config):
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config)
    x, _ = _batch()
    with pytest.raises(TypeError, match=r"scalar tensor.*shape \(4, 1\)"):
        engine.backward(engine(x))
    with pytest.raises(TypeError, match="scalar tensor"):
        engine.backward(1.0)


def test_step_without_optimizer_is_config_error(tiny_model):
    engine, optimizer, _, _ = microspeed.initialize(model=tiny_model, config={"train_batch_size": 4})
    assert optimizer is None and engine.get_lr() == []
    engine.backward(engine(*_batch()))
    with pytest.raises(ConfigError, match="no optimizer"):
        engine.step()


def test_initialize_without_a_module_is_config_error(base_config):
    with pytest.raises(ConfigError, match="torch.nn.Module is required"):
        microspeed.initialize(model=None, config=base_config)
    with pytest.raises(ConfigError, match="expected a torch.nn.Module, got str"):
        microspeed.initialize(model="model", config=base_config)
    with pytest.raises(ConfigError, match="expected a torch.nn.Module, got function"):
        microspeed.initialize(model=lambda x: x, config=base_config)


def test_config_params_is_the_older_name(tiny_model, base_config):
    engine, optimizer, *_ = microspeed.initialize(model=tiny_model,
                                                  config_params={**base_config, "train_batch_size": 8})
    assert engine.train_batch_size() == 8 and isinstance(optimizer, torch.optim.SGD)
    with pytest.raises(ConfigError, match="not both"):
        microspeed.initialize(model=tiny_model, config=base_config, config_params=base_config)


_OPTIMIZER_PARAMS = {
    "RMSprop": {"lr": 0.01, "alpha": 0.9, "momentum": 0.5, "centered": True},
    "SGD": {"lr": 0.01, "momentum": 0.9, "nesterov": True},
    "Lamb": {"lr": 0.01, "weight_decay": 0.01},
    "Adagrad": {"lr": 0.01, "lr_decay": 0.001},
}


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_optimizer_name_builds_and_steps(name):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=name != "Muon")  # Muon only takes 2-d parameters
    params = _OPTIMIZER_PARAMS.get(name, {"lr": 0.01})
    cfg = {"train_batch_size": 4, "optimizer": {"type": name, "params": params}}
    engine, optimizer, *_ = microspeed.initialize(model=model, config=cfg)
    expected_cls = Lamb if name == "Lamb" else getattr(torch.optim, name)
    if name == "Adam":  # DeepSpeed's Adam defaults to adam_w_mode=True, i.e. AdamW
        expected_cls = torch.optim.AdamW
    assert type(optimizer) is expected_cls
    for key, value in params.items():
        assert optimizer.param_groups[0][key] == value
    if name in ("LBFGS", "SparseAdam"):  # need a closure / sparse gradients: built, not stepped here
        return
    before = _params(model)
    x = torch.randn(4, 8)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    assert any(_changed(before, model)), name


def test_optimizer_name_is_case_insensitive(tiny_model):
    cfg = {"train_batch_size": 4, "optimizer": {"type": "rmsprop", "params": {"lr": 0.01}}}
    _, optimizer, *_ = microspeed.initialize(model=tiny_model, config=cfg)
    assert type(optimizer) is torch.optim.RMSprop


def test_optimizer_param_typo_names_the_key(tiny_model):
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lrr": 0.01}}}
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lrr.*did you mean 'lr'"):
        microspeed.initialize(model=tiny_model, config=cfg)


def test_roles_claim_release_and_conflict(tiny_model, base_config):
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config)
    assert engine.owner("gradient_reduction") is None
    engine.claim("gradient_reduction", "a")
    engine.claim("gradient_reduction", "a")  # idempotent for the holder
    with pytest.raises(ConfigError, match="'a' and 'b' both take over 'gradient_reduction'"):
        engine.claim("gradient_reduction", "b")
    engine.release("gradient_reduction", "b")  # not the holder: nothing happens
    assert engine.owner("gradient_reduction") == "a"
    engine.release("gradient_reduction", "a")  # handed back to the built-in default
    assert engine.owner("gradient_reduction") is None
    engine.claim("gradient_reduction", "b")
    assert engine.owner("gradient_reduction") == "b"
