"""The ``csv_monitor`` and ``tensorboard`` sections (DeepSpeed's layout, rank 0 only) and ``microspeed plot``."""

from __future__ import annotations

import csv
import importlib.util
import os
import sys

import pytest
import torch

import microspeed
from microspeed import cli
from microspeed.builtin.monitor import csv_file_name
from microspeed.testing import run_distributed

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_tensorboard = pytest.mark.skipif(not HAS_TENSORBOARD, reason="pip install tensorboard to test it")
needs_matplotlib = pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib not installed (pip install matplotlib)")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _config(out_dir=None, *, csv_on=True, tb_on=False, **extra):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 10}},
        **extra,
    }
    if out_dir is not None:
        config["csv_monitor"] = {"enabled": csv_on, "output_path": str(out_dir), "job_name": "job"}
        config["tensorboard"] = {"enabled": tb_on, "output_path": str(out_dir), "job_name": "tb"}
    return config


def _train(model, config, steps=3, half=False):
    """Train ``steps`` optimizer steps; return the engine and per-step records of the engine's numbers."""
    engine, *_ = microspeed.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(0)
    records, losses = [], []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)
        if half:
            x, y = x.half(), y.half()
        loss = engine(x, y)
        engine.backward(loss)
        losses.append(loss.item())
        engine.step()
        if engine.micro_steps % engine.gradient_accumulation_steps() == 0:
            records.append({"samples": engine.global_samples, "lr": engine.get_lr()[0],
                            "grad_norm": engine.get_global_grad_norm(), "loss": sum(losses) / len(losses),
                            "loss_scale": engine.metrics.get("loss_scale")})
            losses = []
    return engine, records


def _read(path):
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    return rows[0], [(int(r[0]), float(r[1])) for r in rows[1:]]


def test_csv_files_hold_the_engine_numbers(tiny_model, tmp_path):
    engine, records = _train(tiny_model, _config(tmp_path), steps=3)
    job = tmp_path / "job"
    assert sorted(os.listdir(job)) == sorted(csv_file_name(f"Train/Samples/{n}") for n in
                                            ("train_loss", "lr", "grad_norm", "samples_per_sec"))
    assert csv_file_name("Train/Samples/lr") == "Train_Samples_lr.csv"
    samples = [r["samples"] for r in records]
    assert samples == [4, 8, 12]  # x = global samples (train_batch_size 4 per step)
    # read while the engine is alive: every step is flushed
    for name, key in (("lr", "lr"), ("train_loss", "loss"), ("grad_norm", "grad_norm")):
        header, rows = _read(job / f"Train_Samples_{name}.csv")
        assert header == ["step", name]
        assert [s for s, _ in rows] == samples
        assert [v for _, v in rows] == pytest.approx([r[key] for r in records], rel=1e-6), name
    lrs = [v for _, v in _read(job / "Train_Samples_lr.csv")[1]]
    assert len(set(lrs)) == 3  # the warm-up moves the lr every step: the column follows it
    _, sps = _read(job / "Train_Samples_samples_per_sec.csv")
    assert all(v > 0 for _, v in sps)
    plugin = engine.plugins.get_plugin("monitor")
    files = list(plugin.csv.files.values())
    plugin.close()
    assert all(fh.closed for fh in files) and not plugin.writing
    plugin.close()  # idempotent


def test_fp16_loss_scale_and_breakdown(tiny_model, tmp_path):
    config = _config(tmp_path, fp16={"enabled": True, "initial_scale_power": 10}, wall_clock_breakdown=True)
    _, records = _train(tiny_model, config, steps=2, half=True)
    job = tmp_path / "job"
    header, rows = _read(job / "Train_Samples_loss_scale.csv")
    assert header == ["step", "loss_scale"]
    assert rows == [(4, 1024.0), (8, 1024.0)] == [(r["samples"], r["loss_scale"]) for r in records]
    for phase in ("forward", "backward", "step"):
        _, rows = _read(job / f"Train_Samples_elapsed_time_ms_{phase}.csv")
        assert len(rows) == 2 and all(v >= 0 for _, v in rows)


def test_appends_to_an_existing_run_without_a_second_header(tiny_model, tmp_path):
    _train(tiny_model, _config(tmp_path), steps=1)
    _train(tiny_model, _config(tmp_path), steps=1)  # a second run into the same job folder appends
    lines = (tmp_path / "job" / "Train_Samples_lr.csv").read_text().splitlines()
    assert lines[0] == "step,lr" and lines.count("step,lr") == 1 and len(lines) == 3


def test_disabled_writes_nothing(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine, _ = _train(tiny_model, _config(), steps=2)  # sections absent (DeepSpeed's default: off)
    engine2, _ = _train(tiny_model, _config(tmp_path / "out", csv_on=False, tb_on=False), steps=2)
    assert os.listdir(tmp_path) == []
    assert not engine.plugins.get_plugin("monitor").writing and not engine2.plugins.get_plugin("monitor").writing


def test_config_is_strict(tiny_model):
    engine, *_ = microspeed.initialize(model=tiny_model, config={**_config(), "wandb": {"enabled": True}})
    assert [n.split(":")[0] for n in engine.config.notices] == ["wandb"]  # DeepSpeed's key: a notice, no typo
    with pytest.raises(microspeed.ConfigError, match=r"wandb\.projekt: unknown key\. Did you mean 'project'"):
        microspeed.initialize(model=tiny_model, config={**_config(), "wandb": {"projekt": "x"}})
    with pytest.raises(microspeed.ConfigError, match="csv_monitor.jobname"):
        microspeed.initialize(model=tiny_model, config={**_config(), "csv_monitor": {"jobname": "x"}})
    with pytest.raises(microspeed.ConfigError, match="csv_monitor.job_name"):
        microspeed.initialize(model=tiny_model, config={**_config(), "csv_monitor": {"job_name": ""}})


def test_tensorboard_missing_is_a_config_error(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(microspeed.ConfigError, match=r"tensorboard\.enabled.*pip install tensorboard"):
        microspeed.initialize(model=tiny_model, config=_config(tmp_path, csv_on=False, tb_on=True))
    assert not (tmp_path / "tb").exists()


@needs_tensorboard
def test_tensorboard_event_file(tiny_model, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine, records = _train(tiny_model, _config(tmp_path, csv_on=False, tb_on=True), steps=3)
    engine.plugins.get_plugin("monitor").close()
    assert not (tmp_path / "job").exists()
    files = os.listdir(tmp_path / "tb")
    assert len(files) == 1 and files[0].startswith("events.out.tfevents.")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/grad_norm",
            "Train/Samples/samples_per_sec"} <= tags
    lr = acc.Scalars("Train/Samples/lr")
    assert [e.step for e in lr] == [r["samples"] for r in records]
    assert [e.value for e in lr] == pytest.approx([r["lr"] for r in records], rel=1e-6)


class _Net(torch.nn.Module):
    """A linear layer returning the MSE loss (module level: each spawned rank imports it)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)


def _two_rank_run(out_dir):
    """Runs on each rank: both sections on, same config; report whether this rank writes."""
    torch.manual_seed(0)
    engine, records = _train(_Net(), _config(out_dir, tb_on=HAS_TENSORBOARD), steps=2)
    plugin = engine.plugins.get_plugin("monitor")
    writing = plugin.writing
    plugin.close()
    return writing, [r["samples"] for r in records]


@pytest.mark.slow
def test_only_rank_0_writes(tmp_path):
    results = run_distributed(_two_rank_run, world_size=2, args=(str(tmp_path),), timeout=120)
    assert [w for w, _ in results] == [True, False]
    samples = results[0][1]
    assert samples == [8, 16]  # 2 ranks x 2 micro-batch x 2 accumulation steps per step
    header, rows = _read(tmp_path / "job" / "Train_Samples_lr.csv")
    assert [s for s, _ in rows] == samples  # one row per step, not one per rank
    if HAS_TENSORBOARD:
        assert len(os.listdir(tmp_path / "tb")) == 1


@needs_matplotlib
def test_plot_writes_a_png(tiny_model, tmp_path, capsys):
    _train(tiny_model, _config(tmp_path / "run", fp16={"enabled": True}), steps=3, half=True)
    out = tmp_path / "curves.png"
    assert cli.main(["plot", str(tmp_path / "run"), "-o", str(out)]) == 0  # the parent: the job folder is found
    assert out.read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "train_loss" in printed and "lr" in printed and "loss_scale" in printed
    out2 = tmp_path / "sub" / "job.png"
    assert cli.main(["plot", str(tmp_path / "run" / "job"), "-o", str(out2)]) == 0
    assert out2.read_bytes()[:8] == PNG_MAGIC


@needs_matplotlib
def test_plot_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 1
    assert "no .csv files" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path / "missing"), "-o", str(tmp_path / "x.png")]) == 1
    assert "no such folder" in capsys.readouterr().err
    (empty / "other.csv").write_text("step,throughput\n1,2.0\n")
    assert cli.main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 1
    assert "no train_loss or lr" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
