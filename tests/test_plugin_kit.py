"""The plugin-author kit: microspeed.testing's tiny engine, training helper, hook recorder and fixtures,
and ``microspeed plugins --hooks`` / ``config-keys`` as a plugin author sees them."""

from __future__ import annotations

import importlib
import pathlib
import re
import textwrap

import pytest
import torch

import microspeed
from microspeed import cli, hookimpl
from microspeed import testing as kit
from microspeed.config import Field, Section
from microspeed.plugins import PluginManager, all_hook_names
from microspeed.testing import (
    TINY_CONFIG,
    HookRecorder,
    TinyModel,
    run_distributed,
    tiny_batch,
    tiny_config,
    tiny_engine,
    train_steps,
)

pytest_plugins = ["pytester"]

# The kit's fixtures, made available to this module's tests (a plugin's conftest.py imports them, or
# names "microspeed.testing" in pytest_plugins).
ms_engine_factory = kit.ms_engine_factory
ms_engine = kit.ms_engine
hook_recorder = kit.hook_recorder

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRIAD = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _documented_order_block() -> str:
    """The step-hook order block of microspeed.hookspecs' docstring, whitespace normalised."""
    from microspeed import hookspecs

    block = hookspecs.__doc__.split("``engine.step()`` twice)::", 1)[1].split("(``*`` a chain)", 1)[0]
    return " ".join(block.split())


def _documented_step_order() -> list[str]:
    """The step-hook order the docstring of microspeed.hookspecs promises, as hook names."""
    block = _documented_order_block().replace("*", "").replace("(→", ",").replace(")", "")
    return [name.strip() for name in block.split(",") if name.strip()]


# ----------------------------------------------------------------------------- tiny_engine, train_steps


def test_tiny_config_puts_top_level_keys_over_the_defaults():
    assert tiny_config() == TINY_CONFIG and tiny_config() is not TINY_CONFIG
    cfg = tiny_config({"optimizer": {"type": "Adam"}, "gradient_clipping": 1.0})
    assert cfg["optimizer"] == {"type": "Adam"} and cfg["gradient_clipping"] == 1.0
    assert cfg["train_micro_batch_size_per_gpu"] == 2
    cfg = tiny_config({"train_batch_size": 8})  # any triad key replaces the whole default triad
    assert {k: cfg.get(k) for k in TRIAD} == {"train_batch_size": 8, "train_micro_batch_size_per_gpu": None,
                                              "gradient_accumulation_steps": None}
    TINY_CONFIG_BEFORE = dict(TINY_CONFIG)
    tiny_config({"optimizer": {"type": "SGD", "params": {"lr": 1.0}}})["optimizer"]["params"]["lr"] = 2.0
    assert TINY_CONFIG == TINY_CONFIG_BEFORE


def test_tiny_engine_trains_and_train_steps_returns_one_loss_per_optimizer_step(ms_engine_factory):
    engine = ms_engine_factory({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    assert isinstance(engine, microspeed.Engine) and isinstance(engine.module, TinyModel)
    losses = train_steps(engine, 4)
    assert len(losses) == 4 and losses == sorted(losses, reverse=True)  # same batch: the loss falls
    assert (engine.global_steps, engine.micro_steps) == (4, 12)
    # until= ends the run early; a mid-window start still completes whole optimizer steps
    engine.backward(engine(*tiny_batch(engine)))
    engine.step()
    assert len(train_steps(engine, 10, until=lambda e: e.global_steps >= 6)) == 2
    assert (engine.global_steps, engine.micro_steps) == (6, 18)
    # the same seed gives the same weights and losses
    assert train_steps(tiny_engine(), 2) == train_steps(tiny_engine(), 2)


def test_train_steps_accepts_every_kind_of_batch(ms_engine_factory):
    x, y = tiny_batch(batch_size=2)
    dataset = torch.utils.data.TensorDataset(torch.randn(6, 8), torch.randn(6, 1))
    seen = []

    def by_step(micro_step):
        seen.append(micro_step)
        return (x, y)

    for batch in [(x, y), [x, y], {"x": x, "y": y}, by_step, iter([(x, y)] * 3),
                  torch.utils.data.DataLoader(dataset, batch_size=2)]:
        assert len(train_steps(ms_engine_factory(), 3, batch)) == 3
    assert seen == [0, 1, 2]
    engine = ms_engine_factory(training_data=dataset)  # no batch: the engine's training_dataloader
    assert len(train_steps(engine, 5)) == 5 and engine.training_dataloader.epoch >= 1

    def mse(outputs, batch):
        return torch.nn.functional.mse_loss(outputs, y)

    assert len(train_steps(ms_engine_factory(), 1, x, loss_fn=mse)) == 1  # the model returns predictions
    with pytest.raises(TypeError, match="not a scalar loss; pass loss_fn"):
        train_steps(ms_engine_factory(), 1, x)
    with pytest.raises(TypeError, match="train_steps\\(batch=...\\)"):
        train_steps(ms_engine_factory(), 1, 3.0)


def test_tiny_engine_passes_plugins_config_and_initialize_arguments():
    class Marker:
        @hookimpl
        def microspeed_setup(self, engine):
            engine.set_plugin_state(type(self).__name__, self)

    class Other(Marker):
        pass

    marker = Marker()
    engine = tiny_engine(plugins=[marker, ("named", Other)])  # a bare object, a (name, class) pair
    assert engine.plugins.names()[-2:] == ["marker", "named"]
    assert engine.plugin_state("Marker") is marker and isinstance(engine.plugin_state("Other"), Other)
    assert tiny_engine(plugins={"by_dict": Other()}).plugins.names()[-1] == "by_dict"

    engine = tiny_engine(optimizer=lambda params: torch.optim.SGD(params, lr=0.5))  # drops the SGD section
    assert engine.get_lr() == [0.5] and "optimizer" not in engine.config.raw
    engine = tiny_engine({"train_batch_size": 2, "steps_per_print": 1}, defaults=False)
    assert engine.optimizer is None and engine.config["steps_per_print"] == 1
    model = TinyModel(d=3)
    assert tiny_engine(model=model).module is model
    with pytest.raises(microspeed.ConfigError, match="gradient_clipping"):
        tiny_engine({"gradient_clipping": "big"})


# ----------------------------------------------------------------------------- HookRecorder


def test_hook_recorder_sees_the_documented_step_order(ms_engine_factory, hook_recorder):
    engine = ms_engine_factory({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
                               plugins=[hook_recorder])
    assert engine.plugins.names()[-1] == "hook_recorder"
    setup = hook_recorder.names()
    assert setup[:2] == ["plugins_loaded", "config_sections"]
    assert setup.index("make_topology") < setup.index("configure") < setup.index("conflicts") < setup.index("setup")
    assert setup.index("transform_model") < setup.index("after_model_ready") < setup.index("make_optimizer")
    assert setup.index("make_optimizer") < setup.index("wrap_optimizer")
    hook_recorder.clear()
    train_steps(engine, 1)
    documented = _documented_step_order()
    assert documented[:3] == ["before_forward", "after_forward", "before_backward"]
    assert hook_recorder.names() == [*documented, "after_global_step"]


def test_hook_recorder_records_arguments_and_answers_without_changing_anything(hook_recorder):
    plain = train_steps(tiny_engine(), 3)
    engine = tiny_engine(plugins=[hook_recorder])
    assert train_steps(engine, 3) == plain  # recording changes nothing
    steps = hook_recorder.of("optimizer_step")
    assert len(steps) == 3 and all(c.result.applied for c in steps)
    assert steps[-1].result.grad_norm == pytest.approx(engine.get_global_grad_norm())
    assert steps[0].kwargs == {"engine": engine}
    assert [c.result for c in hook_recorder.of("backward")] == [True] * 3
    scale = hook_recorder.of("scale_loss")[0]  # a chain: seen first, with the unscaled loss
    assert set(scale.kwargs) == {"engine", "loss"} and scale.result is None
    assert scale.kwargs["loss"].item() == pytest.approx(plain[0])
    assert hook_recorder.of("microspeed_after_step")[0].kwargs["outcome"] is steps[0].result

    only = HookRecorder(hooks=["before_step", "microspeed_after_step"])
    train_steps(tiny_engine(plugins=[only]), 2)
    assert only.names() == ["before_step", "after_step"] * 2
    assert only.names("after_step") == ["after_step"] * 2


def test_hook_recorder_implements_every_hook():
    pm = PluginManager()
    pm.register_plugin(HookRecorder(), "hook_recorder")
    assert pm.hooks_of("hook_recorder") == sorted(all_hook_names())
    for hook in all_hook_names():  # wrappers for firstresult hooks, tryfirst implementations otherwise
        (impl,) = [i for i in getattr(pm.hook, hook).get_hookimpls() if i.plugin_name == "hook_recorder"]
        firstresult = getattr(pm.hook, hook).spec.opts["firstresult"]
        assert (impl.wrapper, impl.tryfirst) == ((True, False) if firstresult else (False, True)), hook


def test_the_fixtures_work_through_pytest_plugins_and_through_imports(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the inner runs need no third-party plugin
    test_body = """
        from microspeed.testing import train_steps

        def test_kit(ms_engine_factory, ms_engine, hook_recorder):
            engine = ms_engine_factory({"gradient_clipping": 1.0}, plugins=[hook_recorder])
            assert len(train_steps(engine, 2)) == 2 and hook_recorder.names("before_step") == ["before_step"] * 2
            assert ms_engine.global_steps == 0
    """
    pytester.makeconftest('pytest_plugins = ["microspeed.testing"]')
    pytester.makepyfile(test_kit=textwrap.dedent(test_body))
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)

    nested = pytester.mkdir("plugin_repo").joinpath("tests", "deeper")
    nested.mkdir(parents=True)
    (pytester.path / "conftest.py").unlink()
    nested.joinpath("conftest.py").write_text(
        "from microspeed.testing import hook_recorder, ms_engine, ms_engine_factory  # noqa: F401\n")
    nested.joinpath("test_kit_nested.py").write_text(textwrap.dedent(test_body))
    pytester.runpytest_inprocess("-p", "no:cacheprovider", "plugin_repo").assert_outcomes(passed=1)


# ----------------------------------------------------------------------------- several processes


def _rank_body(steps: int) -> dict:
    """Runs on every rank (module level: spawned ranks import it by name)."""
    recorder = HookRecorder(hooks=["reduce_gradients", "after_global_step"])
    engine = tiny_engine({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, plugins=[recorder])
    losses = train_steps(engine, steps)
    weights = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    return {"losses": losses, "weights": weights, "hooks": recorder.names(), "rank": engine.topology.rank,
            "dp": engine.topology.data_parallel_size}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_engine_inside_run_distributed():
    rank0, rank1 = run_distributed(_rank_body, world_size=2, args=(3,))
    assert (rank0["rank"], rank1["rank"], rank0["dp"]) == (0, 1, 2)
    assert torch.equal(rank0["weights"], rank1["weights"])  # replicas stay identical
    assert rank0["losses"] != rank1["losses"]  # each rank trained on its own samples
    assert rank0["hooks"] == rank1["hooks"] == ["reduce_gradients", "after_global_step"] * 3


# ----------------------------------------------------------------------------- the CLI, for plugin authors


def _install_fake_plugin(tmp_path, monkeypatch):
    """A throw-away distribution with an entry point in the group microspeed.plugins."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "ms_kit_fake_plugin.py").write_text(textwrap.dedent("""
        import microspeed
        from microspeed.config import Field, Section

        class Plugin:
            @microspeed.hookimpl
            def microspeed_config_sections(self):
                return {"kit_fake": Section({"level": Field((int,), 3, "how much")})}

            @microspeed.hookimpl(tryfirst=True)
            def microspeed_optimizer_step(self, engine):
                return None

            @microspeed.hookimpl
            def microspeed_after_step(self, engine):
                pass
    """))
    dist = site / "ms_kit_fake_plugin-2.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ms-kit-fake-plugin\nVersion: 2.0.1\n")
    (dist / "entry_points.txt").write_text("[microspeed.plugins]\nkit_fake = ms_kit_fake_plugin:Plugin\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()


def _hook_lines(out: str) -> dict[str, list[str]]:
    lines = out.split("hooks (implementers in call order):\n", 1)[1].splitlines()
    table = {}
    for line in lines:
        hook, _, rest = line.strip().partition(" ")
        table[hook] = [] if rest.strip() == "(none)" else rest.strip().split(" -> ")
    return table


def test_plugins_hooks_shows_each_hooks_implementers_in_call_order(tmp_path, monkeypatch, capsys):
    _install_fake_plugin(tmp_path, monkeypatch)
    assert cli.main(["plugins", "--hooks"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hooks (implementers in call order):") and "registration order" not in out
    table = _hook_lines(out)
    pm = PluginManager()
    pm.load_all()
    assert list(table) == [h.removeprefix("microspeed_") for h in all_hook_names()]
    for hook in all_hook_names():
        assert table[hook.removeprefix("microspeed_")] == pm.implementers(hook), hook
    steppers = table["optimizer_step"]
    assert steppers.index("kit_fake") < steppers.index("mixed_precision")  # tryfirst: before mixed_precision
    assert table["optimizer_step"][-1] == "optimizers"  # trylast default answer
    after_step = table["after_step"]
    assert after_step.index("kit_fake") < after_step.index("logging")  # registered later, called earlier
    assert table["config_sections"][-1] == "config_core"  # first registered, called last

    cli.main(["plugins", "--hooks", "--disable", "kit_fake"])
    assert "kit_fake" not in capsys.readouterr().out
    cli.main(["plugins"])
    out = capsys.readouterr().out
    assert re.search(r"kit_fake\s+2\.0\.1\s+entry point ms_kit_fake_plugin:Plugin", out)
    assert "hooks (implementers in call order):" in out


def test_config_keys_lists_plugin_sections_unless_autoload_is_off(tmp_path, monkeypatch, capsys):
    _install_fake_plugin(tmp_path, monkeypatch)
    cli.main(["config-keys"])
    assert "| `kit_fake.level` | an integer | `3` | kit_fake | how much |" in capsys.readouterr().out
    monkeypatch.setenv("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("MICROSPEED_PLUGINS", raising=False)
    cli.main(["config-keys"])
    out = capsys.readouterr().out
    assert "kit_fake" not in out and "| `train_batch_size` |" in out
    assert Field and Section  # the names a plugin's schema is written with


# ----------------------------------------------------------------------------- the guide


def test_writing_plugins_guide_covers_every_hook_and_the_documented_order():
    guide = (ROOT / "docs" / "writing-plugins.md").read_text()
    for hook in all_hook_names():
        assert f"`{hook}`" in guide, f"docs/writing-plugins.md does not mention {hook}"
    assert _documented_order_block() in " ".join(guide.split())  # the step order, as hookspecs states it
    for name in ("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "MICROSPEED_PLUGINS", "plugins.disable",
                 "microspeed plugins --hooks", "set_plugin_state", "run_distributed", "ms_engine_factory",
                 "hook_recorder", "microspeed_conflicts", "firstresult", "Section", "Field"):
        assert name in guide, name
    assert "docs/writing-plugins.md" in (ROOT / "README.md").read_text()
