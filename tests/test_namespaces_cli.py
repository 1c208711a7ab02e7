"""DeepSpeed's namespaces resolved to plugins, add_config_arguments, and the ``microspeed`` command."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import microspeed
import microspeed.cli
from microspeed.testing import free_port

MISSING = [  # (how DeepSpeed scripts reach it, module to import, name imported from it, distribution)
    ("fakeplugin", "microspeed.fakeplugin.layer", "Thing", "microspeed-fakeplugin"),
    ("ops.fakekernels", "microspeed.ops.fakekernels", "Kernel", "microspeed-fakekernels"),  # a nested alias
]


FAKE = ("fakeplugin", "microspeed_fakeplugin", "microspeed-fakeplugin")
"""An alias for a plugin package that no distribution provides (tests write it into a temp folder)."""


def _plugin_modules():
    return [name for name in sys.modules
            if name == FAKE[1] or name.startswith((FAKE[1] + ".", f"microspeed.{FAKE[0]}"))]


@pytest.fixture
def no_fake_modules(monkeypatch):
    """Register the fake alias; forget its modules before and after the test."""
    from microspeed import namespaces

    monkeypatch.setitem(namespaces.ALIASES, FAKE[0], (FAKE[1], FAKE[2]))
    monkeypatch.setitem(namespaces.ALIASES, "ops.fakekernels", ("microspeed_fakekernels", "microspeed-fakekernels"))

    def clear():
        for name in _plugin_modules():
            del sys.modules[name]
        microspeed.__dict__.pop(FAKE[0], None)  # the import system sets it on the parent package

    clear()
    yield
    clear()


def _ds_attribute(ds, dotted):
    obj = ds
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("alias, module, name, dist", MISSING, ids=[m[0] for m in MISSING])
def test_missing_plugin_namespace_names_the_distribution(alias, module, name, dist, no_fake_modules):
    import microspeed as deepspeed

    assert issubclass(microspeed.MissingPluginError, ImportError)
    with pytest.raises(microspeed.MissingPluginError, match=rf"microspeed\.{alias}.*'{dist}'.*pip install"):
        _ds_attribute(deepspeed, alias)
    with pytest.raises(microspeed.MissingPluginError, match=f"'{dist}'"):
        exec(f"from {module} import {name}", {})
    with pytest.raises(ImportError, match=f"'{dist}'"):  # what `try: import ... except ImportError` sees
        importlib.import_module(module)
    assert module not in sys.modules  # a failed import leaves nothing half-imported behind


def test_unknown_attribute_of_microspeed_is_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        microspeed.nothing_here  # noqa: B018
    assert not hasattr(microspeed.ops, "nothing_here")


def _write_fake_plugin(root):
    pkg = root / FAKE[1]
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""A fake plugin."""\nVERSION = "9.9"\n')
    (pkg / "sharded_moe.py").write_text(textwrap.dedent("""
        def top1gating(logits):
            return _argmax(logits)


        def _argmax(logits):
            return logits.argmax(-1)
        """))
    return pkg


def test_installed_plugin_is_reached_through_the_alias(tmp_path, monkeypatch, no_fake_modules):
    _write_fake_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import microspeed as deepspeed
    from microspeed.fakeplugin.sharded_moe import top1gating

    assert "microspeed_fakeplugin.sharded_moe" in sys.modules  # the alias imported the plugin's module
    real = importlib.import_module("microspeed_fakeplugin.sharded_moe")
    assert top1gating is real.top1gating
    assert deepspeed.fakeplugin.sharded_moe.top1gating is real.top1gating
    assert deepspeed.fakeplugin.VERSION == "9.9"
    assert top1gating(torch.tensor([[0.1, 0.9]])).tolist() == [1]


def test_alias_module_missing_attribute_is_attribute_error(tmp_path, monkeypatch, no_fake_modules):
    _write_fake_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import microspeed.fakeplugin

    assert not hasattr(microspeed.fakeplugin, "no_such_name")
    assert getattr(microspeed.fakeplugin, "no_such_name", None) is None
    namespace: dict = {}
    exec("from microspeed.fakeplugin import *", namespace)  # the fake plugin has no __all__
    assert namespace["VERSION"] == "9.9"


def test_alias_is_the_plugin_module_itself(tmp_path, monkeypatch, no_fake_modules):
    _write_fake_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import microspeed.fakeplugin.sharded_moe as via_alias

    real = importlib.import_module("microspeed_fakeplugin.sharded_moe")

    # What namespaces.AliasFinder promises: "import microspeed.<alias>[.sub] returns the plugin's own module".
    monkeypatch.setattr(via_alias, "_argmax", lambda logits: "patched")  # as a DeepSpeed test would patch it
    assert real.top1gating(torch.zeros(1, 2)) == "patched"
    assert via_alias is real and sys.modules["microspeed.fakeplugin"] is sys.modules["microspeed_fakeplugin"]


def test_add_config_arguments(tmp_path, tiny_model, base_config):
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    assert microspeed.add_config_arguments(parser) is parser
    defaults = parser.parse_args([])
    assert defaults.deepspeed is False and defaults.deepspeed_config is None
    config_file = tmp_path / "ds_config.json"
    config_file.write_text(json.dumps({**base_config, "train_batch_size": 8}))
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(config_file), "--local_rank", "0"])
    assert args.deepspeed is True and args.deepspeed_config == str(config_file)
    engine, *_ = microspeed.initialize(args=args, model=tiny_model)  # config from args.deepspeed_config
    assert engine.train_batch_size() == 8


# ------------------------------------------------------------------------------ the command


def test_cli_plugins_lists_builtins_versions_and_call_order(capsys, monkeypatch):
    monkeypatch.setenv("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")  # the built-ins only, whatever else is installed
    monkeypatch.delenv("MICROSPEED_PLUGINS", raising=False)
    assert microspeed.cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in ("config_core", "data_parallel", "gradient_accumulation", "gradient_clipping", "optimizers",
                 "schedulers", "mixed_precision", "dataloader", "logging"):
        row = next((ln for ln in lines if ln.split()[:1] == [name]), None)
        assert row is not None, f"plugin {name} not listed:\n{out}"
        assert row.split()[1] == microspeed.__version__ and "builtin" in row
    hooks = {ln.split()[0]: ln.split(None, 1)[1] for ln in lines[lines.index("hooks (implementers in call order):")
                                                                 + 1:] if ln.strip()}
    assert hooks["optimizer_step"] == "mixed_precision -> optimizers"
    # gradient_clipping first: it ties a non-finite loss to the gradients (the step's one non-finite check)
    assert hooks["scale_loss"] == "gradient_clipping -> mixed_precision -> gradient_accumulation"
    assert hooks["clip_gradients"] == "gradient_clipping"
    assert hooks["conflicts"] == "(none)"
    mp_hooks = lines[lines.index(next(ln for ln in lines if ln.split()[:1] == ["mixed_precision"])) + 1]
    assert "optimizer_step" in mp_hooks and "wrap_optimizer" in mp_hooks


def test_installed_zero_namespace_resolves_to_the_plugin():
    import microspeed as deepspeed
    from microspeed.zero import GatheredParameters, Init

    assert deepspeed.zero.Init is Init and Init.__module__ == "microspeed_zero.init"
    assert GatheredParameters.__module__ == "microspeed_zero.init"


def test_cli_plugins_disable(capsys):
    assert microspeed.cli.main(["plugins", "--disable", "mixed_precision", "--disable", "zero"]) == 0
    out = capsys.readouterr().out
    assert "mixed_precision" not in out
    assert any(ln.split() == ["optimizer_step", "optimizers"] for ln in out.splitlines())


def test_cli_without_a_command_prints_usage_and_returns_2(capsys):
    assert microspeed.cli.main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: microspeed") and "plugins" in out and "run" in out


def test_cli_unknown_command_names_the_closest_and_returns_2(capsys):
    assert microspeed.cli.main(["no-such-command"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: microspeed") and "unknown command 'no-such-command'" in err


def test_cli_help_returns_0(capsys):
    assert microspeed.cli.main(["--help"]) == 0
    assert "usage: microspeed" in capsys.readouterr().out


SCRIPT = """
import os, sys
import torch
import microspeed

out = sys.argv[1]
rank = int(os.environ["RANK"])
torch.manual_seed(rank)  # different initial weights per rank: initialize() broadcasts rank 0's
model = torch.nn.Linear(4, 1)
engine, *_ = microspeed.initialize(model=model, config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "steps_per_print": 1000})
g = torch.Generator().manual_seed(100 + rank)  # different data per rank: gradients are averaged
for _ in range(2):
    x, y = torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
torch.save({"world": torch.distributed.get_world_size(), "steps": engine.global_steps,
            "batch": engine.train_batch_size(), "weights": [p.detach() for p in model.parameters()]},
           os.path.join(out, f"rank{rank}.pt"))
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_cli_run_trains_on_two_processes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "microspeed.cli", "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for res in results:
        assert res["world"] == 2 and res["steps"] == 2 and res["batch"] == 4
    for a, b in zip(results[0]["weights"], results[1]["weights"], strict=True):
        assert torch.equal(a, b)
