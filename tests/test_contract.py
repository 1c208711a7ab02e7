"""The kernel contract: required hooks, checked hook names, roles, capabilities, chains through pluggy."""

from __future__ import annotations

import pytest
import torch

import microspeed
from microspeed import hookspecs
from microspeed.plugin_api import Capability, GradientPartitioning, LossScaling, NormRule, PluginError, Role
from microspeed.plugins import BUILTIN_PLUGINS, PluginManager, _load_object, essential_builtins

ESSENTIAL = essential_builtins()


def test_every_required_hook_has_a_builtin_default():
    answered = {h for hooks in ESSENTIAL.values() for h in hooks}
    for hook in hookspecs.REQUIRED:
        assert any(hasattr(_load_object(t), hook) for t in BUILTIN_PLUGINS.values()), hook
    assert {"gradient_accumulation", "data_parallel", "optimizers", "batch_loop", "dataloader",
            "schedulers", "gradient_clipping", "checkpointing"} <= set(ESSENTIAL)
    assert "microspeed_backward" in answered and "microspeed_make_topology" in answered


@pytest.mark.parametrize("builtin", sorted(ESSENTIAL))
def test_disabling_an_essential_builtin_is_refused_naming_hook_and_fix(builtin, tiny_model, base_config):
    cfg = {**base_config, "plugins": {"disable": [builtin]}}
    with pytest.raises(PluginError) as info:
        microspeed.initialize(model=tiny_model, config=cfg)
    msg = str(info.value)
    for hook in ESSENTIAL[builtin]:
        assert hook in msg
    assert f"{builtin!r} is essential and cannot be disabled" in msg and "plugins.disable" in msg
    assert "register a plugin that answers" in msg


class LazyBackward:
    """Implements ``microspeed_backward`` but never answers: the engine must not treat that as done."""

    @microspeed.hookimpl
    def microspeed_backward(self, engine, loss, retain_graph):
        return None


def test_an_unanswered_required_call_raises_naming_the_plugins_asked(tiny_model, base_config):
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config, plugins=[("lazy", LazyBackward())])
    engine.plugins.unregister(name="gradient_accumulation")  # as if a plugin had taken the default away
    loss = engine(torch.randn(4, 8), torch.randn(4, 1))
    with pytest.raises(PluginError) as info:
        engine.backward(loss)
    msg = str(info.value)
    assert "no plugin answered microspeed_backward, which is required (on every engine.backward()" in msg
    assert "asked: lazy" in msg and "'gradient_accumulation' does" in msg
    assert all(p.grad is None for p in engine.module.parameters())  # no silent no-op, nothing half-done


def test_a_required_hook_nobody_implements_is_refused_at_load():
    pm = PluginManager()  # nothing registered
    with pytest.raises(PluginError, match=r"no plugin answered microspeed_backward, which is required \(on every "
                                          r"engine.backward\(\); no plugin implements it\); register a plugin that "
                                          r"answers it \(the built-in 'gradient_accumulation' does\)"):
        pm.check_required()


class Misspelt:
    @microspeed.hookimpl
    def microspeed_after_stepp(self, engine):
        raise AssertionError("never called")


def test_a_misspelt_hook_is_refused_with_the_closest_name(tiny_model, base_config):
    with pytest.raises(PluginError) as info:
        microspeed.initialize(model=tiny_model, config=base_config, plugins=[("typo", Misspelt())])
    msg = str(info.value)
    assert "'typo'" in msg and "microspeed_after_stepp" in msg and "did you mean microspeed_after_step?" in msg


def test_unknown_hook_without_a_close_name_is_refused_too():
    class Odd:
        @microspeed.hookimpl
        def microspeed_teleport(self):
            return None

    pm = PluginManager()
    with pytest.raises(PluginError, match="microspeed_teleport"):
        pm.register_plugin(Odd, "odd")
    assert "odd" not in pm.names() and pm.get_plugin("odd") is None


class Claimer:
    def __init__(self, role):
        self.role = role

    @microspeed.hookimpl
    def microspeed_setup(self, engine):
        engine.claim(self.role, "claimer")


def test_claiming_an_unknown_role_is_an_error(tiny_model, base_config):
    with pytest.raises(PluginError, match="'parameters' is not a role; the roles are gradient_reduction"):
        microspeed.initialize(model=tiny_model, config=base_config, plugins=[("claimer", Claimer("parameters"))])
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config,
                                       plugins=[("claimer", Claimer(Role.OPTIMIZER_STEP))])
    assert engine.owner("optimizer_step") == "claimer" and engine.owner(Role.GRADIENT_REDUCTION) is None


class Partitioner:
    """States a capability; with ``twice`` a second plugin states the same kind."""

    @microspeed.hookimpl
    def microspeed_capabilities(self, config):
        return [GradientPartitioning(stage=2, keeps_replica_groups=True, config_key="partitioner.stage",
                                     disable_hint="drop the partitioner")]


class Asker:
    def __init__(self):
        self.seen = None

    @microspeed.hookimpl
    def microspeed_conflicts(self, config, capabilities):
        self.seen = capabilities.get(GradientPartitioning)
        return None


def test_capabilities_are_typed_unique_and_reach_conflicts_and_the_engine(tiny_model, base_config):
    asker = Asker()
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config,
                                       plugins=[("partitioner", Partitioner()), ("asker", asker)])
    assert asker.seen is not None and asker.seen.stage == 2
    assert engine.capabilities.provider(GradientPartitioning) == "partitioner"
    scaling = engine.capabilities.get(LossScaling)  # the built-in mixed precision states it
    assert scaling is not None and scaling.scaler is None and engine.capabilities.provider(LossScaling) == \
        "mixed_precision"
    with pytest.raises(PluginError, match="'again' and 'partitioner' both provide GradientPartitioning"):
        microspeed.initialize(model=tiny_model, config=base_config,
                              plugins=[("partitioner", Partitioner()), ("again", Partitioner())])


def test_a_capability_must_be_a_capability():
    from microspeed.capabilities import Capabilities

    with pytest.raises(PluginError, match="not a microspeed.plugin_api.Capability"):
        Capabilities().provide({"stage": 2}, "dicty")

    class Mine(Capability):
        pass

    caps = Capabilities()
    caps.provide(Mine(), "me")
    assert isinstance(caps.get(Mine), Mine) and caps.get(LossScaling) is None


class Doubler:
    """A chain implementation and a wrapper around the whole chain."""

    def __init__(self):
        self.wrapper_saw = None

    @microspeed.hookimpl(tryfirst=True)
    def microspeed_scale_loss(self, loss):
        return loss * 2

    @microspeed.hookimpl(wrapper=True)
    def microspeed_transform_model(self, model):
        result = yield
        self.wrapper_saw = result
        return torch.nn.Sequential(result) if isinstance(result, torch.nn.Linear) else result


def test_chains_are_pluggy_calls_wrappers_see_and_may_replace_the_final_value():
    doubler = Doubler()
    model = torch.nn.Linear(3, 1)
    engine, *_ = microspeed.initialize(model=model, config={"train_batch_size": 1, "optimizer": {
        "type": "SGD", "params": {"lr": 0.0}}}, plugins=[("doubler", doubler)])
    assert doubler.wrapper_saw is model and isinstance(engine.module, torch.nn.Sequential)
    loss = engine.module(torch.ones(1, 3)).sum()
    scaled = engine.hook.microspeed_scale_loss(engine=engine, loss=loss)
    assert torch.equal(scaled, loss * 2)  # doubler first, then the built-ins passed it on unchanged


def test_norm_rules_combine_skip_wins_and_groups_add_up():
    from microspeed.gradients import combine_rules

    g1, g2 = object(), object()
    merged = combine_rules([{"a": NormRule(groups=(g1,)), "b": NormRule(groups=(g1,))},
                            {"a": NormRule(groups=(g2, g1)), "b": NormRule(skip=True)}, None])
    assert merged["a"].groups == (g1, g2) and not merged["a"].skip
    assert merged["b"].skip
    with pytest.raises(TypeError, match="not a microspeed.plugin_api.NormRule"):
        combine_rules([{"a": (True,)}])


class SkipFirstLayer:
    @microspeed.hookimpl
    def microspeed_grad_norm_rules(self, engine):
        return {"fc1.weight": NormRule(skip=True)}


def test_grad_norm_applies_the_rules(tiny_model):
    cfg = {"train_batch_size": 4, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, *_ = microspeed.initialize(model=tiny_model, config=cfg, plugins=[("skipper", SkipFirstLayer())])
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    engine.backward(engine(x, y))
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
    engine.step()
    expected = torch.sqrt(sum(g.float().square().sum() for n, g in grads.items() if n != "fc1.weight"))
    assert engine.get_global_grad_norm() == pytest.approx(float(expected), rel=1e-6)
    everything = torch.sqrt(sum(g.float().square().sum() for g in grads.values()))
    assert engine.get_global_grad_norm() < float(everything)
