"""Hook order, plugin registration, disabling by config and environment, and ranks agreeing."""

from __future__ import annotations

import pytest
import torch

import microspeed
from microspeed import hookimpl
from microspeed.plugins import PluginManager


class Recorder:
    """Records the name of every step hook it sees."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @hookimpl
    def microspeed_before_forward(self, engine):
        self.calls.append("before_forward")

    @hookimpl
    def microspeed_after_forward(self, engine):
        self.calls.append("after_forward")

    @hookimpl
    def microspeed_before_backward(self, engine):
        self.calls.append("before_backward")

    @hookimpl
    def microspeed_scale_loss(self, loss):
        self.calls.append("scale_loss")

    @hookimpl
    def microspeed_after_backward(self, engine):
        self.calls.append("after_backward")

    @hookimpl(hookwrapper=True)
    def microspeed_reduce_gradients(self, engine):
        self.calls.append("reduce_gradients")
        yield

    @hookimpl
    def microspeed_before_step(self, engine):
        self.calls.append("before_step")

    @hookimpl(hookwrapper=True)
    def microspeed_optimizer_step(self, engine):
        self.calls.append("optimizer_step")
        yield

    @hookimpl(hookwrapper=True)
    def microspeed_clip_gradients(self, engine):
        self.calls.append("clip_gradients")
        yield

    @hookimpl
    def microspeed_after_step(self, engine, outcome):
        self.calls.append("after_step")

    @hookimpl
    def microspeed_after_global_step(self, engine):
        self.calls.append("after_global_step")


MICRO = ["before_forward", "after_forward", "before_backward", "scale_loss", "after_backward"]
BOUNDARY = ["reduce_gradients", "before_step", "optimizer_step", "clip_gradients", "after_step",
            "after_global_step"]


def _train(engine, steps):
    x, y = torch.randn(2, 8), torch.randn(2, 1)
    for _ in range(steps):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()


def test_hooks_fire_in_documented_order_with_accumulation(tiny_model):
    rec = Recorder()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = microspeed.initialize(model=tiny_model, config=cfg, plugins=[("recorder", rec)])
    _train(engine, 2)
    assert rec.calls == MICRO + MICRO + BOUNDARY
    assert engine.global_steps == 1 and engine.micro_steps == 2


def test_disable_by_config(tiny_model):
    rec = Recorder()
    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "plugins": {"disable": ["recorder"]}}
    engine, *_ = microspeed.initialize(model=tiny_model, config=cfg, plugins=[("recorder", rec)])
    _train(engine, 1)
    assert rec.calls == []
    assert "recorder" not in engine.plugins.names()


def _write_entry_point_plugin(tmp_path, monkeypatch):
    """Install a throw-away distribution with an entry point in group microspeed.plugins."""
    pkg = tmp_path / "site"
    (pkg / "ms_recorder_plugin.py").parent.mkdir(parents=True)
    (pkg / "ms_recorder_plugin.py").write_text(
        "import microspeed\n"
        "CALLS = []\n"
        "class Plugin:\n"
        "    @microspeed.hookimpl\n"
        "    def microspeed_before_step(self, engine):\n"
        "        CALLS.append(engine.global_steps)\n"
    )
    dist = pkg / "ms_recorder_plugin-1.2.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ms-recorder-plugin\nVersion: 1.2.3\n")
    (dist / "entry_points.txt").write_text("[microspeed.plugins]\nrecorder_ep = ms_recorder_plugin:Plugin\n")
    monkeypatch.syspath_prepend(str(pkg))
    import importlib

    importlib.invalidate_caches()


def test_entry_point_discovery_and_env_switches(tmp_path, monkeypatch, tiny_model, base_config):
    _write_entry_point_plugin(tmp_path, monkeypatch)
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config)
    assert "recorder_ep" in engine.plugins.names()
    assert engine.plugins.infos["recorder_ep"].version == "1.2.3"
    import ms_recorder_plugin

    _train(engine, 2)
    assert ms_recorder_plugin.CALLS == [0, 1]

    monkeypatch.setenv("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config)
    assert "recorder_ep" not in engine.plugins.names()

    monkeypatch.setenv("MICROSPEED_PLUGINS", "recorder_ep")
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config)
    assert "recorder_ep" in engine.plugins.names()

    monkeypatch.setenv("MICROSPEED_PLUGINS", "nope")
    with pytest.raises(microspeed.PluginError, match="MICROSPEED_PLUGINS names \\['nope'\\]"):
        microspeed.initialize(model=tiny_model, config=base_config)


def test_builtins_are_plugins_and_answer_defaults(monkeypatch):
    monkeypatch.setenv("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")  # built-ins only (zero would answer first)
    monkeypatch.delenv("MICROSPEED_PLUGINS", raising=False)
    pm = PluginManager()
    pm.load_all()
    assert {"data_parallel", "mixed_precision", "optimizers", "schedulers"} <= set(pm.names())
    assert pm.implementers("microspeed_optimizer_step")[0] == "mixed_precision"
    assert pm.implementers("microspeed_optimizer_step")[-1] == "optimizers"


def test_a_plugin_with_a_bad_hook_is_refused():
    class Bad:
        @hookimpl
        def microspeed_before_step(self, engine, not_an_argument):
            pass

    pm = PluginManager()
    with pytest.raises(microspeed.PluginError, match="does not fit the hook specs"):
        pm.register_plugin(Bad, "bad")


def test_conflicts_are_declared_and_refused(tiny_model, base_config):
    class Picky:
        @hookimpl
        def microspeed_conflicts(self, config):
            return [("gradient_clipping", "this plugin clips on its own")]

    cfg = {**base_config, "gradient_clipping": 1.0}
    with pytest.raises(microspeed.ConfigError, match="gradient_clipping: cannot be combined with the plugin 'picky'"):
        microspeed.initialize(model=tiny_model, config=cfg, plugins=[("picky", Picky)])


def test_exception_hook_sees_the_phase(tiny_model, base_config):
    seen = []

    class Watch:
        @hookimpl
        def microspeed_on_exception(self, exc, phase):
            seen.append((type(exc).__name__, phase))

    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config, plugins=[("watch", Watch)])
    with pytest.raises(RuntimeError):
        engine(torch.randn(2, 3))  # wrong width
    assert seen == [("RuntimeError", "forward")]
