"""Asynchronous and periodic checkpoint saves (``checkpoint.async_save``, ``checkpoint.save_interval_steps``).

An asynchronous save returns once the tensors are copied to CPU memory; training continues while a
thread writes them; ``latest`` names the tag only after every rank finished, so a writer that fails or
a process that dies mid-save leaves ``latest`` on the previous complete save.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import microspeed
from microspeed import checkpoint
from microspeed.checkpoint import CheckpointError, CheckpointWarning, read_latest
from microspeed.checkpoint.storage import data_file
from microspeed.observe import watchdog
from microspeed.testing import DistributedTestError, run_distributed


def _engine(seed: int, gas: int = 1, **checkpoint):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    return microspeed.initialize(model=model, config=cfg)[0]


def _train(engine, first: int, steps: int) -> list[float]:
    losses = []
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _slow_writer(monkeypatch, delay: float) -> None:
    import microspeed.checkpoint.saving as saving

    real = saving.write_rank_file

    def slow(*args, **kwargs):
        time.sleep(delay)
        return real(*args, **kwargs)

    monkeypatch.setattr(saving, "write_rank_file", slow)


def test_async_save_snapshots_then_training_continues_and_loads_like_a_sync_save(tmp_path, monkeypatch):
    sync = _engine(0)
    asyn = _engine(0, async_save=True)
    assert _train(sync, 0, 2) == _train(asyn, 0, 2)
    sync.save_checkpoint(str(tmp_path / "sync"))
    _slow_writer(monkeypatch, 0.5)
    began = time.perf_counter()
    asyn.save_checkpoint(str(tmp_path / "async"))
    blocked = time.perf_counter() - began
    assert blocked < 0.5, blocked  # returned before the (slowed) write even started
    assert read_latest(str(tmp_path / "async")) is None  # not published while writing
    _train(asyn, 2, 3)  # the optimizer changes the parameters in place while the writer works
    asyn.wait_for_checkpoint()
    assert read_latest(str(tmp_path / "async")) == "global_step2"
    a, b = _engine(7), _engine(8)
    a.load_checkpoint(str(tmp_path / "sync"))
    b.load_checkpoint(str(tmp_path / "async"))
    for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
        assert torch.equal(p, q)  # the snapshot is of step 2, not of what training did afterwards
    assert _train(a, 2, 3) == _train(b, 2, 3) == _train(sync, 2, 3)


def test_a_failing_writer_never_publishes_and_the_error_names_the_file(tmp_path, monkeypatch):
    engine = _engine(0, writer={"decoupled": True})  # DeepSpeed's spelling of an asynchronous save
    _train(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path), tag="good")
    engine.wait_for_checkpoint()
    import microspeed.checkpoint.saving as saving

    def broken(tmp, rank, buffer, layout, rng=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saving, "write_rank_file", broken)
    _train(engine, 1, 1)
    engine.save_checkpoint(str(tmp_path), tag="bad")  # returns: the failure happens in the background
    _train(engine, 2, 1)
    with pytest.raises(CheckpointError, match="previous asynchronous save failed") as info:
        engine.save_checkpoint(str(tmp_path), tag="next")
    assert "No space left on device" in str(info.value) and "__0_0.distcp" in str(info.value)
    assert read_latest(str(tmp_path)) == "good" and not os.path.exists(tmp_path / "bad")
    monkeypatch.undo()
    engine.save_checkpoint(str(tmp_path), tag="again")  # the error was reported once; saving works again
    engine.wait_for_checkpoint()
    assert read_latest(str(tmp_path)) == "again"


_KILLED = textwrap.dedent("""
    import os, sys, time, torch, microspeed
    from microspeed.checkpoint import saving
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "checkpoint": {"async_save": True}}
    engine = microspeed.initialize(model=model, config=cfg)[0]
    engine.save_checkpoint(sys.argv[1], tag="good")
    engine.wait_for_checkpoint()
    real = saving.write_rank_file
    def dying(tmp, rank, buffer, layout, rng=None):
        real(tmp, rank, buffer, layout, rng)   # this rank's file is complete ...
        os._exit(9)                       # ... but the process dies before the save is published
    saving.write_rank_file = dying
    engine.save_checkpoint(sys.argv[1], tag="bad")
    time.sleep(30)
""")


def test_a_process_killed_mid_save_leaves_latest_on_the_previous_save(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, MICROSPEED_DISABLE_PLUGIN_AUTOLOAD="1"))
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert read_latest(str(tmp_path)) == "good"
    assert not os.path.exists(tmp_path / "bad") and any(n.startswith("bad.tmp-") for n in os.listdir(tmp_path))
    engine = _engine(3)
    path, _ = engine.load_checkpoint(str(tmp_path))
    assert path.endswith("good")


def test_interval_keys_are_checked():
    with pytest.raises(microspeed.ConfigError, match=r"checkpoint\.save_interval_steps: got 3 but no "
                                                     r"checkpoint\.save_dir"):
        _engine(0, save_interval_steps=3)
    with pytest.raises(microspeed.ConfigError, match=r"checkpoint\.save_interval_steps"):
        _engine(0, save_interval_steps=0, save_dir="/tmp/x")


def test_a_periodic_save_is_at_a_window_boundary_when_loaded_at_another_accumulation_count(tmp_path):
    """The periodic save runs in after_global_step: the micro-step that ended the window is counted by then."""
    run = str(tmp_path / "run")
    engine = _engine(0, gas=2, save_dir=run, save_interval_steps=2)
    _train(engine, 0, 8)  # 8 micro-steps: optimizer steps 1-4, saves at 2 and 4
    assert read_latest(run) == "global_step4"
    assert checkpoint.read_manifest(os.path.join(run, "global_step4"))["counters"]["micro_steps"] == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # no "inside an accumulation window" here
        other = _engine(1, gas=4)
        other.load_checkpoint(run)
    assert (other.global_steps, other.micro_steps) == (4, 16)
    _train(engine, 8, 1)  # one micro-step into the next window
    engine.save_checkpoint(str(tmp_path / "mid"))
    with pytest.warns(CheckpointWarning, match="inside a gradient-accumulation window"):
        _engine(1, gas=4).load_checkpoint(str(tmp_path / "mid"))


def _two_ranks(root: str) -> dict:
    """Interval saves every 2 steps, asynchronous; then rank 1's writer fails; then a resume."""
    rank = torch.distributed.get_rank()
    engine = _engine(0, async_save=True, save_dir=os.path.join(root, "run"), save_interval_steps=2)
    losses = _train(engine, 0, 5)  # saves at steps 2 and 4, in the background
    engine.wait_for_checkpoint()
    torch.distributed.barrier()
    tags = sorted(n for n in os.listdir(os.path.join(root, "run")) if n.startswith("global_step"))
    latest = read_latest(os.path.join(root, "run"))
    import microspeed.checkpoint.saving as saving

    real = saving.write_rank_file
    if rank == 1:
        def broken(tmp, r, buffer, layout, rng=None):
            saving.write_rank_file = real  # fails once
            raise OSError(5, "Input/output error")
        saving.write_rank_file = broken
    _train(engine, 5, 1)  # step 6 saves; rank 1's write fails in the background
    error = None
    try:
        _train(engine, 6, 2)  # step 8's save sees step 6's failure, on every rank
    except CheckpointError as exc:
        error = str(exc)
    latest_after = read_latest(os.path.join(root, "run"))
    resumed = _engine(5)
    resumed.load_checkpoint(os.path.join(root, "run"))
    fresh = _engine(0)
    ref = _train(fresh, 0, 4)
    return {"losses": losses, "tags": tags, "latest": latest, "error": error, "latest_after": latest_after,
            "resumed_step": resumed.global_steps, "resumed": _train(resumed, 4, 2), "ref": _train(fresh, 4, 2),
            "ref_first": ref}


@pytest.mark.slow
def test_interval_async_saves_on_two_ranks_and_a_rank_whose_writer_fails(tmp_path):
    out = run_distributed(_two_ranks, world_size=2, args=(str(tmp_path),), timeout=300)
    for r in out:
        assert r["tags"] == ["global_step2", "global_step4"] and r["latest"] == "global_step4"
        assert r["error"] is not None and "rank 1:" in r["error"] and "__1_0.distcp" in r["error"], r["error"]
        assert r["latest_after"] == "global_step4" and r["resumed_step"] == 4
        assert r["resumed"] == r["ref"]
    assert out[0]["losses"][:4] == out[0]["ref_first"]


def _rank_one_dies_while_writing(root: str) -> None:
    """Rank 1's process dies in the middle of its background write of tag "bad" (its writer ends the process)."""
    rank = torch.distributed.get_rank()
    engine = _engine(0, async_save=True)
    _train(engine, 0, 1)
    engine.save_checkpoint(root, tag="good")
    engine.wait_for_checkpoint()
    torch.distributed.barrier()  # "good" is published (rank 0's wait returned after latest was written)
    if rank == 1:
        import microspeed.checkpoint.saving as saving

        def dying(tmp, r, buffer, layout, rng=None):
            with open(os.path.join(tmp, data_file(r)), "wb") as f:
                f.write(b"half of a file")
            os._exit(9)  # a node lost mid-write: no exit handler runs, no failed marker is left

        saving.write_rank_file = dying
    _train(engine, 1, 1)
    began = time.monotonic()
    engine.save_checkpoint(root, tag="bad")  # returns; the writers work in the background
    if rank == 1:
        time.sleep(60)  # its writer ends the process
    error = None
    try:
        engine.wait_for_checkpoint()
    except CheckpointError as exc:
        error = str(exc)
    with open(os.path.join(root, "rank0.json"), "w") as f:
        json.dump({"error": error, "seconds": time.monotonic() - began, "latest": read_latest(root)}, f)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_dies_mid_save_ends_rank_0s_wait_and_nothing_is_published(tmp_path):
    with pytest.raises(DistributedTestError) as info:  # rank 1 died: the run fails; rank 0 wrote what it saw
        run_distributed(_rank_one_dies_while_writing, world_size=2, args=(str(tmp_path),), timeout=90,
                        grace_period=40, env={watchdog.ENV_VAR: "60"})
    failures = {f.rank: f for f in info.value.failures}
    assert list(failures) == [1] and failures[1].kind == "died" and failures[1].exitcode == 9, info.value
    seen = json.loads((tmp_path / "rank0.json").read_text())
    error = seen["error"]
    assert error is not None and "checkpoint 'bad' in " in error and "rank 1 died before finishing its checkpoint " \
        "files (rank 1: no heartbeat for " in error and "the save is not published. latest still names 'good'." \
        in error, error
    assert "__1_0.index" in error  # the file it did not write
    assert seen["seconds"] < 15.0  # the heartbeats' staleness (5 s here), not the 60 s timeout or 30 minutes
    assert seen["latest"] == "good" and read_latest(str(tmp_path)) == "good"
    assert not os.path.exists(tmp_path / "bad")
