"""The progress line every ``steps_per_print`` steps: its fields, fp16's loss scale, the time breakdown."""

from __future__ import annotations

import pytest
import torch

import microspeed


def _train(model, config, steps=4, half_inputs=False):
    engine, *_ = microspeed.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(0)
    losses, norms = [], []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)
        if half_inputs:
            x, y = x.half(), y.half()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.micro_steps % engine.gradient_accumulation_steps() == 0:  # an optimizer step was taken
            norms.append(engine.get_global_grad_norm())
    return engine, losses, norms


def _train_lines(err):
    """The ``train`` lines on stderr, each as ``{key: value}``."""
    out = []
    for line in err.splitlines():
        if "train" not in line.split():
            continue
        out.append(dict(tok.split("=", 1) for tok in line.split() if "=" in tok))
    return out


def _config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, **extra}


def test_a_line_every_steps_per_print(tiny_model, capfd):
    engine, losses, norms = _train(tiny_model, _config(gradient_accumulation_steps=2))
    captured = capfd.readouterr()
    lines = _train_lines(captured.err)
    assert _train_lines(captured.out) == []  # the log goes to stderr
    assert [ln["step"] for ln in lines] == ["2", "4"]
    for ln in lines:
        for key in ("loss", "lr", "grad_norm", "samples_per_s", "rank", "skipped"):
            assert key in ln, (key, ln)
        assert float(ln["lr"]) == pytest.approx(0.05)
        assert float(ln["samples_per_s"]) > 0
        assert ln["rank"] == "0" and ln["skipped"] == "0"
        assert "loss_scale" not in ln and "forward_ms" not in ln
    # loss: the mean over the window's micro-steps (4 steps x 2 micro-steps = 8 losses, 4 per line)
    assert float(lines[0]["loss"]) == pytest.approx(sum(losses[:4]) / 4, abs=1e-5)
    assert float(lines[1]["loss"]) == pytest.approx(sum(losses[4:]) / 4, abs=1e-5)
    assert float(lines[1]["grad_norm"]) == pytest.approx(engine.get_global_grad_norm(), abs=1e-4)
    assert norms[1] == pytest.approx(float(lines[0]["grad_norm"]), abs=1e-4)


def test_no_line_before_steps_per_print(tiny_model, capfd):
    _train(tiny_model, _config(steps_per_print=5))
    assert _train_lines(capfd.readouterr().err) == []


def test_fp16_line_has_the_loss_scale(tiny_model, capfd):
    engine, *_ = _train(tiny_model, _config(fp16={"enabled": True, "initial_scale_power": 10}), half_inputs=True)
    lines = _train_lines(capfd.readouterr().err)
    assert len(lines) == 2
    assert all(float(ln["loss_scale"]) == 1024.0 for ln in lines)
    assert engine.metrics["loss_scale"] == 1024.0


def test_wall_clock_breakdown(tiny_model, capfd):
    _train(tiny_model, _config(wall_clock_breakdown=True))
    lines = _train_lines(capfd.readouterr().err)
    assert len(lines) == 2
    for ln in lines:
        for key in ("forward_ms", "backward_ms", "step_ms"):
            assert float(ln[key]) > 0, (key, ln)
        assert "step" in ln and "loss" in ln
