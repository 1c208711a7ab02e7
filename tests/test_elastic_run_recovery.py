"""A node of an elastic job dies and the job continues on the survivors from the last checkpoint.

Two torchrun agents on this machine (``microspeed run --elastic 1:2``, one rank each: two "nodes" on one c10d
rendezvous) train a tiny model under ZeRO-2, saving every 2 steps, with ``checkpoint.auto_resume_dir``. The test
kills the second agent and its rank (SIGKILL: a node lost). The first agent's rank fails in its next collective,
the agent restarts it at world size 1, and ``initialize()`` resumes from the last complete save with the same
global batch (4 micro-batches of 2 on one rank instead of 2 on each of two). Its losses after the restart equal
those of a one-process run resumed from that checkpoint by hand.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import microspeed

STEPS = 8

_SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    import microspeed

    out, ckpt, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 2},
           "checkpoint": {"save_dir": ckpt, "save_interval_steps": 2, "auto_resume_dir": ckpt}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine = microspeed.initialize(model=model, config=cfg)[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log = open(os.path.join(out, f"attempt{attempt}_rank{rank}.jsonl"), "a")
    start = engine.global_steps
    while engine.global_steps < steps:
        step = engine.global_steps
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        losses = []
        for micro in range(rank, 4, world):
            loss = torch.nn.functional.mse_loss(engine(x[2 * micro:2 * micro + 2]), y[2 * micro:2 * micro + 2])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        log.write(json.dumps({"step": step, "losses": losses, "world": world, "start": start,
                              "resumed_from": engine.resumed_from, "batch": engine.train_batch_size(),
                              "t": time.time()}) + "\\n")
        log.flush()
        time.sleep(0.5)  # time for the test to kill a node between steps
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its ranks in their own sessions: a process group kill misses
    them)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _records(folder, attempt: int, rank: int) -> list[dict]:
    path = folder / f"attempt{attempt}_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _reference(ckpt: str, tag: str, first: int) -> list[list[float]]:
    """One process, ZeRO-2, loaded by hand from ``tag``: the losses of steps ``first..STEPS-1``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine = microspeed.initialize(model=model, config={
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 2}})[0]
    engine.load_checkpoint(ckpt, tag=tag)
    out = []
    for step in range(first, STEPS):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        losses = []
        for micro in range(4):
            loss = torch.nn.functional.mse_loss(engine(x[2 * micro:2 * micro + 2]), y[2 * micro:2 * micro + 2])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out.append(losses)
    return out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_lost_node_the_job_continues_on_the_survivor_from_the_last_checkpoint(tmp_path):
    (tmp_path / "train.py").write_text(_SCRIPT)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MICROSPEED_JOB_ID": f"recovery-{port}"}
    argv = [sys.executable, "-m", "microspeed.cli", "run", "--elastic", "1:2", "--max_restarts", "2",
            "--master-port", str(port), "--rdzv-conf",
            "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
            "--log-dir", str(tmp_path / "logs"), "train.py", str(out), str(ckpt), str(STEPS)]
    agents = []
    try:
        agents.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True))
        deadline = time.monotonic() + 120
        while not _listening(port) and time.monotonic() < deadline and agents[0].poll() is None:
            time.sleep(0.2)  # the first agent hosts the rendezvous store; the second joins it as a client
        agents.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True))
        # wait for a step after the first periodic save (step 2) on two ranks
        while time.monotonic() < deadline and not any(r["step"] >= 3 and r["world"] == 2
                                                      for r in _records(out, 0, 1)):
            assert all(a.poll() is None for a in agents), [a.communicate()[0][-3000:] for a in agents]
            time.sleep(0.2)
        records = _records(out, 0, 1)
        assert records and records[-1]["world"] == 2, [a.communicate(timeout=5)[0][-3000:] for a in agents]
        killed_at = time.time()
        doomed = agents[1]
        for pid in [*_descendants(doomed.pid), doomed.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log, _ = agents[0].communicate(timeout=300)
        assert agents[0].returncode == 0, log[-4000:]
    finally:
        for a in agents:
            if a.poll() is None:
                for pid in [*_descendants(a.pid), a.pid]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                a.wait()
    before = _records(out, 0, 0)
    after = [r for attempt in range(1, 3) for r in _records(out, attempt, 0)]
    assert after, log[-4000:]
    resumed = after[0]
    lost_at = max(r["step"] for r in before) + 1
    assert all(r["world"] == 1 and r["batch"] == 8 for r in after)  # the global batch kept on one rank
    assert resumed["start"] in (2, 4, 6) and resumed["start"] <= lost_at and resumed["resumed_from"].endswith(
        f"global_step{resumed['start']}")
    assert [r["step"] for r in after] == list(range(resumed["start"], STEPS))
    ref = _reference(str(ckpt), f"global_step{resumed['start']}", resumed["start"])
    got = [loss for r in after for loss in r["losses"]]
    assert got == pytest.approx([loss for losses in ref for loss in losses], rel=1e-6, abs=1e-7)
    print(f"node lost after step {lost_at - 1}; resumed at step {resumed['start']} "
          f"({lost_at - resumed['start']} step(s) redone), first new step "
          f"{resumed['t'] - killed_at:.1f} s after the kill")
