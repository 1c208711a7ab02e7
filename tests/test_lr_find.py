"""``microspeed lr-find``: the LR range test on a training script (``microspeed.cli.lr_find``)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from microspeed.cli import lr_find
from microspeed.cli.lr_find import ExponentialRangeTest, LRFinder, range_test_section, smooth, suggest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# A DeepSpeed-style script: full-batch regression with SGD; its own config has a WarmupLR scheduler that
# the range test must replace. With --report it appends "lr micro_batch" per optimizer step.
SCRIPT = textwrap.dedent("""
    import argparse

    import torch

    import microspeed as deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--report", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(8, 1, generator=g), torch.randn(16, 8, generator=g)
    for _ in range(args.steps):
        lr = engine.get_lr()[0]
        try:  # the range test's stop must get through a script's `except Exception`
            loss = torch.nn.functional.mse_loss(engine(x), x @ w)
            engine.backward(loss)
            engine.step()
        except Exception:
            raise SystemExit("an Exception handler caught the range test's stop")
        if args.report:
            with open(args.report, "a") as fh:
                fh.write(f"{lr} {engine.train_micro_batch_size_per_gpu()}\\n")
    print("script finished")
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _suggested(output: str) -> float:
    match = re.search(r"suggested lr: ([0-9.e+-]+)", output)
    assert match, output
    return float(match.group(1))


@pytest.mark.slow
def test_end_to_end_subprocess_writes_png_and_suggests(tmp_path, script):
    out = tmp_path / "plots" / "lr.png"
    proc = subprocess.run(
        [sys.executable, "-m", "microspeed.cli", "lr-find", "--min-lr", "1e-4", "--max-lr", "10", "--steps", "40",
         "--out", str(out), str(script), "--steps", "500"],
        capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR" and len(data) > 5000
    text = proc.stdout
    suggestion = _suggested(text)
    assert 1e-4 <= suggestion <= 10
    assert "steepest descent" in text and "minimum smoothed loss" in text
    assert "the config's scheduler 'WarmupLR' is replaced" in text
    # lr 10 makes SGD diverge on this problem: the run stops early, before 40 steps
    match = re.search(r"stopped early at step (\d+): diverged", text)
    assert match and int(match.group(1)) < 40, text
    assert "script finished" not in text
    assert "caught the range test's stop" not in proc.stderr


def test_linear_schedule_with_config_file_in_process(tmp_path, script, capsys):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
                                  "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}))
    report = tmp_path / "report.txt"
    result, notes = lr_find.run(str(script), ["--report", str(report), "--steps", "100"], config=str(config),
                                min_lr=1e-3, max_lr=0.1, steps=12, schedule="linear")
    assert result.stop_reason == "steps" and len(result.lrs) == 12
    rate = (0.1 / 1e-3 - 1) / 11
    assert result.lrs == pytest.approx([1e-3 * (1 + rate * i) for i in range(12)])
    assert result.lrs[-1] == pytest.approx(0.1)
    rows = [line.split() for line in report.read_text().splitlines()]
    assert [float(lr) for lr, _ in rows] == pytest.approx(result.lrs[:len(rows)])
    assert {mbs for _, mbs in rows} == {"4"}  # --config replaced the script's config (micro-batch 16)
    assert len(rows) == 11  # the 12th step ended the script inside engine.step()
    assert notes == []  # --config has no scheduler of its own
    assert 1e-3 <= result.suggestion <= 0.1
    assert all(math.isfinite(v) for v in result.losses)
    assert "script finished" not in capsys.readouterr().out


def test_exponential_schedule_and_section():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=123.0)
    sched = ExponentialRangeTest(opt, 1e-6, 1.0, 7)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(6):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([1e-6 * 10.0**i for i in range(7)])
    section = range_test_section(1e-3, 1e-1, 5)
    assert section["type"] == "LRRangeTest"
    assert section["params"]["lr_range_test_step_size"] == 1
    assert 1e-3 * (1 + section["params"]["lr_range_test_step_rate"] * 4) == pytest.approx(1e-1)


def test_smoothing_and_suggestion():
    assert smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # bias-corrected: no start-up dip
    assert smooth([1.0, 3.0], 0.0) == [1.0, 3.0]
    lrs = [1e-5 * 10 ** (i / 10) for i in range(61)]  # 1e-5 .. 10
    # loss falls fastest at lr 1e-2 (a logistic step in log10(lr)), is lowest near 0.3, then climbs
    losses = [1.0 + 2.0 / (1.0 + math.exp(3.0 * (math.log10(lr) + 2.0))) + max(0.0, math.log10(lr) + 0.5) ** 2
              for lr in lrs]
    suggestion, lr_at_min, min_loss, index = suggest(lrs, losses, 1e-5)
    assert suggestion == pytest.approx(1e-2, rel=0.3)
    assert index is not None and 0.1 < lr_at_min < 1.0
    assert min_loss == pytest.approx(min(losses))
    flat_up = suggest([1e-3, 1e-2, 1e-1, 1.0], [1.0, 1.1, 1.2, 1.3], 1e-3)
    assert flat_up[0] == 1e-3 and flat_up[3] is None  # never falls: a tenth of the minimum's lr, at least min
    assert suggest([1.0], [float("nan")]) == (None, None, None, None)


@pytest.mark.parametrize("args, message", [
    (["--min-lr", "1", "--max-lr", "0.1"], "--min-lr 1 must be smaller than --max-lr 0.1"),
    (["--min-lr", "0"], "--min-lr 0"),
    (["--steps", "1"], "--steps 1"),
    (["--smoothing", "1"], "--smoothing"),
    (["--diverge", "0.5"], "--diverge"),
    (["--config", "/nonexistent/ds.json"], "--config /nonexistent/ds.json: no such file"),
])
def test_bad_arguments(args, message, script, capsys):
    with pytest.raises(SystemExit) as exc:
        lr_find.main([*args, str(script)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_script_and_no_initialize(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        lr_find.main([str(tmp_path / "missing.py")])
    assert exc.value.code == 2
    assert "missing.py: no such file" in capsys.readouterr().err
    idle = tmp_path / "idle.py"
    idle.write_text("print('no training here')\n")
    with pytest.raises(RuntimeError, match="never called microspeed.initialize"):
        lr_find.run(str(idle), steps=5)


def test_finder_refuses_bad_settings():
    with pytest.raises(ValueError, match="--schedule"):
        LRFinder(1e-4, 1.0, 10, schedule="cosine")
    with pytest.raises(ValueError, match="--max-lr"):
        LRFinder(1e-4, float("inf"), 10)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_processes_under_torchrun(tmp_path, script):
    out = tmp_path / "lr2.png"
    proc = subprocess.run(
        [sys.executable, "-m", "microspeed.cli", "lr-find", "--nproc", "2", "--min-lr", "1e-3", "--max-lr", "1",
         "--steps", "8", "--out", str(out), str(script)],
        capture_output=True, text=True, timeout=170, env=_env(), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert proc.stdout.count("suggested lr:") == 1  # rank 0 only
    assert "lr-find: 8 steps" in proc.stdout
    assert 1e-3 <= _suggested(proc.stdout) <= 1
