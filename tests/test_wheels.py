"""The distributions install the way software is installed: built as wheels, installed non-editable, no checkout.

The core, every plugin under ``plugins/`` and the ``deepspeed`` stand-in are built as wheels (from a copy of their
sources, so the checkout gets no ``build/`` or ``*.egg-info``), installed into a fresh virtual environment (no
system site-packages) with the pinned CPU torch and their dependencies resolved by pip, and run from an empty
folder, with no checkout on ``sys.path``:

* a 2-rank ZeRO-2 job with ``microspeed run --nproc-per-node 2`` trains (3 steps, finite falling losses, exit 0)
  -- before, the core wheel lacked ``microspeed.elasticity`` (a hand-written package list) and every
  ``initialize()`` failed;
* ``microspeed deepspeed-path`` prints the stand-in folder the core wheel carries, and ``microspeed run
  --as-deepspeed`` makes ``import deepspeed`` the stand-in, whose version (what transformers, accelerate and
  Lightning check) reads ``0.19.8+microspeed`` -- before, that folder was the checkout's ``compat/deepspeed/src``;
* ``microspeed demo``'s default config is in the wheel;
* the stand-in's own wheel, installed, makes ``import deepspeed`` the stand-in everywhere.

One virtual environment serves every step; slow (a minute or more: most of it is unpacking and first importing
torch). The quick test checks that the package lists of every distribution cover every folder of Python sources.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU build pip finds in its find-links (pinned: a looser pin downloads CUDA builds)
CORE_FILES = ("core", "compat", "examples", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md")
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".pytest_cache", "runs")
SKIP_PLUGIN = shutil.ignore_patterns("tests", "__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".pytest_cache")

TRAIN = """
import json, os, sys

import torch

import microspeed

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
engine, *_ = microspeed.initialize(model=model, config=config)
gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
x = torch.randn(4, 8, generator=gen)
y = x.sum(1, keepdim=True)
losses = []
for _ in range(3):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
result = {"rank": int(os.environ["RANK"]), "world": torch.distributed.get_world_size(), "losses": losses,
          "stage": engine.zero_optimization_stage(), "microspeed": microspeed.__file__, "path": sys.path}
with open(os.path.join(sys.argv[1], f"rank{result['rank']}.json"), "w") as fh:  # the ranks share stdout
    json.dump(result, fh)
engine.destroy()
"""

AS_DEEPSPEED = """
import importlib.metadata, json, os

import deepspeed
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # a pydantic model, as in DeepSpeed

import microspeed
from microspeed.compat import standin

print("RESULT", json.dumps({"file": deepspeed.__file__, "standin": standin.is_standin_file(deepspeed.__file__),
                            "version": importlib.metadata.version("deepspeed"), "attr": deepspeed.__version__,
                            "microspeed": deepspeed.microspeed_version == microspeed.__version__,
                            "zero": DeepSpeedZeroConfig(stage=2).stage}), flush=True)
"""

CHECKS = """
import importlib.metadata, json, os

import deepspeed

from microspeed.demo.train import DEFAULT_CONFIG
from microspeed.compat import standin

print("RESULT", json.dumps({"file": deepspeed.__file__, "standin": standin.is_standin_file(deepspeed.__file__),
                            "version": importlib.metadata.version("deepspeed"),
                            "demo_config": os.path.isfile(DEFAULT_CONFIG)}), flush=True)
"""


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(map(str, argv))} exited {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def _results(stdout: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def _sources(dest: Path) -> tuple[Path, list[Path], Path]:
    """Copies of the core's, each plugin's and the stand-in's sources (the build writes beside its sources)."""
    core = dest / "microspeed"
    core.mkdir(parents=True)
    for name in CORE_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, core / name, ignore=SKIP)
        else:
            shutil.copy2(src, core / name)
    plugins = []
    for folder in sorted((REPO / "plugins").iterdir()):
        if (folder / "pyproject.toml").is_file():
            plugins.append(dest / folder.name)
            shutil.copytree(folder, plugins[-1], ignore=SKIP_PLUGIN)
    return core, plugins, core / "compat" / "deepspeed"


def _source_folders(root: Path, name: str) -> set[str]:
    """``name`` and ``name.<sub>`` for every folder under ``root`` holding Python sources (tests excluded)."""
    return {".".join((name, *folder.relative_to(root).parts)) for folder in [root, *root.rglob("*")]
            if folder.is_dir() and "__pycache__" not in folder.parts and "tests" not in folder.parts
            and any(folder.glob("*.py"))}


def test_every_folder_of_sources_is_packaged():
    """The core's discovered packages and each plugin's ``packages.find`` cover every folder of Python sources --
    a folder missing from a hand-written list (``microspeed.elasticity`` once) or without an ``__init__.py``
    (which discovery skips) would be left out of the wheel."""
    spec = importlib.util.spec_from_file_location("microspeed_setup", REPO / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)
    assert set(setup_py.core_packages()) == _source_folders(REPO / "core", "microspeed")
    projects = [p for p in sorted((REPO / "plugins").iterdir()) if (p / "pyproject.toml").is_file()]
    for project in [*projects, REPO / "compat" / "deepspeed"]:
        config = tomllib.loads((project / "pyproject.toml").read_text())["tool"]["setuptools"]
        find = config["packages"]["find"]
        where = project / find.get("where", ["."])[0]
        found = set(find_packages(str(where), include=find["include"]))
        name = find["include"][0].rstrip("*")
        assert found == _source_folders(where / name, name), project


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheels_install_into_a_fresh_venv_and_train_from_an_empty_folder(tmp_path):
    timings: dict[str, float] = {}
    start = time.perf_counter()
    core, plugins, standin_src = _sources(tmp_path / "src")
    wheels = tmp_path / "wheels"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MICROSPEED_DEEPSPEED_PATH")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
          str(core), *map(str, plugins), str(standin_src)], tmp_path, env)
    built = sorted(p.name for p in wheels.glob("*.whl"))
    assert len(built) == 2 + len(plugins), built
    timings["build"] = time.perf_counter() - start

    start = time.perf_counter()
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python, cli = str(venv / "bin" / "python"), str(venv / "bin" / "microspeed")
    standin_wheel = next(wheels.glob("deepspeed-*.whl"))
    others = [str(w) if not w.name.startswith("microspeed-") else f"{w}[standin]"  # what the stand-in imports
              for w in sorted(wheels.glob("*.whl")) if w != standin_wheel]
    _run([python, "-m", "pip", "install", "-q", "--no-compile", TORCH, *others], tmp_path, env, timeout=600)
    timings["install"] = time.perf_counter() - start

    start = time.perf_counter()
    work = tmp_path / "empty"
    work.mkdir()
    (tmp_path / "train.py").write_text(TRAIN)
    _run([cli, "run", "--nproc-per-node", "2", str(tmp_path / "train.py"), str(tmp_path)], work, env)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["world"] == 2 and r["stage"] == 2, r
        assert str(venv) in r["microspeed"] and not any(p.startswith(str(REPO)) for p in r["path"]), r
        losses = r["losses"]
        assert len(losses) == 3 and all(abs(v) < float("inf") for v in losses), losses
        assert losses[2] < losses[1] < losses[0], losses
    timings["train"] = time.perf_counter() - start

    start = time.perf_counter()
    path = _run([cli, "deepspeed-path"], work, env).stdout.strip()
    assert path.startswith(str(venv)) and os.path.isfile(os.path.join(path, "deepspeed", "__init__.py")), path
    assert os.path.isdir(os.path.join(path, "deepspeed-0.19.8+microspeed.dist-info")), os.listdir(path)
    (tmp_path / "script.py").write_text(AS_DEEPSPEED)
    proc = _run([cli, "run", "--as-deepspeed", "--nproc-per-node", "1", str(tmp_path / "script.py")], work, env)
    (r,) = _results(proc.stdout)
    assert r["standin"] and r["file"].startswith(path) and r["microspeed"] and r["zero"] == 2, r
    assert r["version"] == r["attr"] == "0.19.8+microspeed", r

    # the stand-in's own wheel: `import deepspeed` is the stand-in everywhere
    _run([python, "-m", "pip", "install", "-q", "--no-compile", str(standin_wheel)], tmp_path, env)
    (tmp_path / "checks.py").write_text(CHECKS)
    (r,) = _results(_run([python, str(tmp_path / "checks.py")], work, env).stdout)
    assert r["standin"] and r["version"] == "0.19.8+microspeed" and r["demo_config"], r
    timings["deepspeed"] = time.perf_counter() - start
    print("wheel test timings (s):", {k: round(v, 1) for k, v in timings.items()})
