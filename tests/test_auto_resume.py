"""``checkpoint.auto_resume_dir``: ``initialize()`` ends by loading the newest complete checkpoint of a folder.

A restarted job (torchrun's elastic agent runs the same script again, maybe at another world size) continues
from the last periodic save: counters, weights, optimizer and scheduler state as a manual ``load_checkpoint``
would restore them; an empty folder starts fresh; a save that never completed is skipped.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import microspeed
from microspeed.checkpoint import read_latest
from microspeed.checkpoint.resume import find_resume_tag
from microspeed.testing import run_distributed

GLOBAL_BATCH, MICRO = 8, 2


def _config(zero_stage: int = 0, **checkpoint):
    cfg = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01}}}
    if zero_stage:
        cfg["zero_optimization"] = {"stage": zero_stage}
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    return cfg


def _engine(seed: int, config: dict):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return microspeed.initialize(model=model, config=config)[0]


def _train(engine, first: int, steps: int) -> list[float]:
    """``steps`` optimizer steps from step ``first``; step s's global batch is the same at any world size (each
    rank takes its share of the micro-batches). Returns rank 0's losses, one per micro-batch."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    losses = []
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
        for micro in range(rank, GLOBAL_BATCH // MICRO, world):
            sl = slice(micro * MICRO, (micro + 1) * MICRO)
            loss = torch.nn.functional.mse_loss(engine(x[sl]), y[sl])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def _save_run(save_dir: str, zero_stage: int, steps: int = 4) -> list[float]:
    """Train ``steps`` steps saving every 2 into ``save_dir``; the last save again with a client state."""
    engine = _engine(0, _config(zero_stage, save_dir=save_dir, save_interval_steps=2))
    losses = _train(engine, 0, steps)
    engine.save_checkpoint(save_dir, tag=f"global_step{steps}", client_state={"epoch": 3, "note": "hello"})
    return losses


def _resumed_and_manual(save_dir: str, zero_stage: int = 0, tag: str | None = None):
    """A fresh engine resumed through ``auto_resume_dir`` and one restored by hand (``load_checkpoint``)."""
    auto = _engine(11, _config(zero_stage, auto_resume_dir=save_dir))
    manual = _engine(12, _config(zero_stage))
    manual.load_checkpoint(save_dir, tag=tag)
    return auto, manual


def test_resumes_from_the_newest_save_like_a_manual_load(tmp_path, capsys):
    save_dir = str(tmp_path / "ckpt")
    _save_run(save_dir, zero_stage=0)
    assert read_latest(save_dir) == "global_step4" and os.path.isdir(os.path.join(save_dir, "global_step2"))
    capsys.readouterr()
    auto, manual = _resumed_and_manual(save_dir)
    err = capsys.readouterr().err
    assert "checkpoint.auto_resume_dir: resumed from" in err and "(tag global_step4) at global step 4" in err
    assert auto.global_steps == manual.global_steps == 4 and auto.global_samples == 4 * GLOBAL_BATCH
    assert auto.resumed_from == os.path.join(save_dir, "global_step4")
    assert auto.resumed_client_state == {"epoch": 3, "note": "hello"}
    assert auto.get_lr() == manual.get_lr() and auto.get_lr() != _engine(0, _config()).get_lr()
    assert _train(auto, 4, 3) == _train(manual, 4, 3)


def test_an_empty_or_missing_folder_starts_fresh(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "missing"):
        engine = _engine(0, _config(auto_resume_dir=str(folder)))
        err = capsys.readouterr().err
        assert f"checkpoint.auto_resume_dir: no complete checkpoint in {folder}; starting fresh" in err
        assert engine.global_steps == 0 and engine.resumed_from is None and engine.resumed_client_state is None
        assert _train(engine, 0, 2) == _train(_engine(0, _config()), 0, 2)
    assert _engine(0, _config()).resumed_from is None  # the key unset: nothing loaded, the names still answer


def test_an_incomplete_newest_save_is_skipped(tmp_path, capsys):
    save_dir = str(tmp_path / "ckpt")
    _save_run(save_dir, zero_stage=0)
    # `latest` names a folder without its manifest (what rank 0 writes last), and a killed save left a .tmp- folder
    os.remove(os.path.join(save_dir, "global_step4", "manifest.msgpack"))
    shutil.copytree(os.path.join(save_dir, "global_step2"), os.path.join(save_dir, "global_step6.tmp-dead"))
    os.remove(os.path.join(save_dir, "global_step6.tmp-dead", "manifest.msgpack"))
    assert find_resume_tag(save_dir)[0] == "global_step2"
    capsys.readouterr()
    auto, manual = _resumed_and_manual(save_dir, tag="global_step2")
    err = capsys.readouterr().err
    assert "names 'global_step4', which is incomplete" in err and "(tag global_step2) at global step 2" in err
    assert auto.global_steps == 2 and auto.resumed_client_state == {}
    assert _train(auto, 2, 2) == _train(manual, 2, 2)
    # without `latest` at all: the complete folder written last
    os.remove(os.path.join(save_dir, "latest"))
    shutil.rmtree(os.path.join(save_dir, "global_step4"))
    assert find_resume_tag(save_dir) == ("global_step2", [])


def _save_on_two_ranks(save_dir: str) -> list[float]:
    return _save_run(save_dir, zero_stage=2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_zero2_on_two_ranks_resumes_on_one_with_the_same_global_batch(tmp_path):
    """Saved by 2 ranks under ZeRO-2 (periodic saves), resumed by a fresh ``initialize()`` on 1 rank."""
    save_dir = str(tmp_path / "ckpt")
    run_distributed(_save_on_two_ranks, world_size=2, args=(save_dir,), timeout=200)
    assert read_latest(save_dir) == "global_step4"
    auto, manual = _resumed_and_manual(save_dir, zero_stage=2)
    assert auto.global_steps == 4 and auto.train_batch_size() == GLOBAL_BATCH
    assert auto.gradient_accumulation_steps() == GLOBAL_BATCH // MICRO  # 1 rank: 4 micro-batches of 2
    assert auto.resumed_client_state == {"epoch": 3, "note": "hello"}
    ref = _engine(0, _config(2))  # a fresh start differs: the resume did load something
    assert _train(auto, 4, 2) == _train(manual, 4, 2) != _train(ref, 4, 2)
