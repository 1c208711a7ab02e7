"""Two machines, either may die: the elastic job continues on the survivor, grows back, survives a cut link.

Two network namespaces ("machines", 2 ranks each) run one elastic job launched over ssh (``microspeed run
--hostfile --elastic 1:2``), ZeRO-2, saving every 2 steps with ``checkpoint.auto_resume_dir``, 8 samples a step
(1 micro-batch of 2 per rank on 4 ranks, 2 on 2 ranks). The launcher hosts the rendezvous, so no machine is
special. The test, at random steps:

1. kills every process of machine 0 (its sshd too: the machine is gone; it held ranks 0-1 and the workers'
   store). The survivors' collective fails naming the lost ranks (from the peer's address: the store is gone
   too), their agent restarts them at world 2 and they resume from the newest complete save with the global
   batch kept;
2. brings machine 0 back (its sshd again). The launcher's probe finds it, starts its node again, and the job
   grows back to 4 ranks at that restart point, resuming from the newest save;
3. cuts machine 1's link. Nothing resets the survivors' connections: their watchdog (``timeout_s`` 10) ends the
   hung collective with a report naming the silent ranks, and the job continues at world 2 on machine 0.

Each generation's per-rank losses equal an uninterrupted run of its world size resumed from the same checkpoint by
hand on this machine (``microspeed run --nproc-per-node W``, fp32). Printed: steps lost and seconds from each fault
to the first new step.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from microspeed.testing import free_port
from microspeed.testing.netns import SlowNetwork, cleanup_leftovers
from microspeed.testing.sshd import SshCluster, sshd_unavailable

PREFIX = "msrc"
SUBNET = "10.81.0"
IFNAME = "msr0"
WATCHDOG_S = 10

SCRIPT = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
import microspeed

out, ckpt, mode = sys.argv[1], sys.argv[2], sys.argv[3]
torch.set_num_threads(1)


def config(resume):
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 2},
           "watchdog": {"timeout_s": @WATCHDOG@}}
    if resume:
        cfg["checkpoint"] = {"save_dir": ckpt, "save_interval_steps": 2, "auto_resume_dir": ckpt}
    return cfg


def engine_for(resume):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return microspeed.initialize(model=model, config=config(resume))[0]


def step(engine, rank, world):
    g = torch.Generator().manual_seed(1000 + engine.global_steps)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    losses = []
    for micro in range(rank, 4, world):
        loss = torch.nn.functional.mse_loss(engine(x[2 * micro:2 * micro + 2]), y[2 * micro:2 * micro + 2])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def limit():
    try:
        return int(open(os.path.join(out, "limit")).read())
    except (OSError, ValueError):
        return 10**6


if mode == "train":
    engine = engine_for(True)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(gen, 0)
    log = open(os.path.join(out, f"gen{gen.item():.6f}_rank{rank}.jsonl"), "a")
    start = engine.global_steps
    while engine.global_steps < limit():
        s = engine.global_steps
        losses = step(engine, rank, world)
        log.write(json.dumps({"step": s, "losses": losses, "world": world, "start": start,
                              "resumed_from": engine.resumed_from, "machine": os.stat("/proc/self/ns/net").st_ino,
                              "t": time.time()}) + "\n")
        log.flush()
        time.sleep(0.25)
else:  # reference: every segment [tag, first, last] of this world size, resumed by hand, uninterrupted
    segments = json.loads(open(sys.argv[4]).read())
    results = []
    for tag, first, last in segments:
        engine = engine_for(False)
        rank, world = dist.get_rank(), dist.get_world_size()
        engine.load_checkpoint(ckpt, tag=tag)
        assert engine.global_steps == first, (engine.global_steps, first)
        results.append([step(engine, rank, world) for _ in range(first, last + 1)])
    with open(os.path.join(out, f"ref_world{world}_rank{rank}.json"), "w") as f:
        json.dump(results, f)
""".replace("@WATCHDOG@", str(WATCHDOG_S))


def _records(out: Path) -> dict[str, dict[int, list[dict]]]:
    """``{generation: {rank: [record per step]}}`` (a generation: one start of the worker group)."""
    gens: dict[str, dict[int, list[dict]]] = {}
    for path in out.glob("gen*_rank*.jsonl"):
        gen, rank = path.stem[3:].rsplit("_rank", 1)
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if lines:
            gens.setdefault(gen, {})[int(rank)] = lines
    return dict(sorted(gens.items(), key=lambda kv: float(kv[0])))


def _latest(out: Path) -> tuple[str, dict[int, list[dict]]] | None:
    gens = _records(out)
    return next(reversed(gens.items())) if gens else None


def _wait(launcher: subprocess.Popen, what: str, until, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if launcher.poll() is not None:
            pytest.fail(f"the launcher ended ({launcher.returncode}) while waiting for {what}:\n"
                        f"{log.read_text()[-6000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f} s:\n{log.read_text()[-6000:]}")
        time.sleep(0.2)


def _at_world(out: Path, world: int, min_step: int = -1, after: float = 0.0) -> bool:
    """The newest generation runs at ``world``, started after ``after`` and reached ``min_step`` on every rank."""
    latest = _latest(out)
    if latest is None or float(latest[0]) < after:
        return False
    ranks = latest[1]
    return (len(ranks) == world and all(r[-1]["world"] == world for r in ranks.values())
            and min(r[-1]["step"] for r in ranks.values()) >= min_step)


def _run_reference(tmp_path: Path, world: int, segments: list[list]) -> list:
    seg_file = tmp_path / f"segments{world}.json"
    seg_file.write_text(json.dumps(segments))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "microspeed.cli", "run", "--nproc-per-node", str(world),
                          "--master-port", str(free_port()), "train.py", str(tmp_path / "out"),
                          str(tmp_path / "ckpt"), "reference", str(seg_file)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads((tmp_path / "out" / f"ref_world{world}_rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_machine_dies_comes_back_and_loses_its_link(tmp_path):
    reason = sshd_unavailable()
    if reason:
        pytest.skip(f"two-machine recovery test: {reason}")
    cleanup_leftovers(PREFIX)
    rng = random.Random(int(os.environ.get("MICROSPEED_TEST_SEED", time.time_ns() % 10**6)))
    (tmp_path / "home").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "train.py").write_text(SCRIPT)
    out, log = tmp_path / "out", tmp_path / "launcher.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path / "home")}
    events: dict[str, float] = {}
    with SlowNetwork(2, rate=None, subnet=SUBNET, prefix=PREFIX, host_addr=True, inner_ifname=IFNAME) as net, \
            SshCluster(net, str(tmp_path / "ssh")) as ssh:
        (tmp_path / "hostfile").write_text(f"{net.addr(0)} slots=2\n{net.addr(1)} slots=2\n")
        (tmp_path / ".microspeed_env").write_text(f"GLOO_SOCKET_IFNAME={IFNAME}\nOMP_NUM_THREADS=1\n")
        argv = [sys.executable, "-m", "microspeed.cli", "run", "--hostfile", "hostfile", "--launcher", "ssh",
                "--launcher_args", f"-F {ssh.client_config}", "--master_port", str(free_port()),
                "--elastic", "1:2", "--max_restarts", "6", "--rdzv-conf",
                "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
                "train.py", str(out), str(tmp_path / "ckpt"), "train"]
        with open(log, "w") as log_file:
            launcher = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        try:
            # 1. four ranks train; machine 1 dies at a random step (after the first save)
            kill_step = rng.randint(3, 7)
            _wait(launcher, f"step {kill_step} on 4 ranks", lambda: _at_world(out, 4, kill_step), 240, log)
            events["kill"] = time.time()
            net.kill_machine(0)
            _wait(launcher, "the survivors' restart at world 2", lambda: _at_world(out, 2, after=events["kill"]),
                  120, log)
            # 2. it comes back: the launcher starts its node again, the job grows to 4 ranks
            ssh.restart(0)
            events["back"] = time.time()
            _wait(launcher, "the job at 4 ranks again", lambda: _at_world(out, 4, after=events["back"]), 120, log)
            grown = float(_latest(out)[0])
            # 3. its link is cut at a random later step
            cut_step = max(r[0]["step"] for r in _latest(out)[1].values()) + rng.randint(2, 5)
            _wait(launcher, f"step {cut_step} after growing back", lambda: _at_world(out, 4, cut_step), 120, log)
            events["cut"] = time.time()
            net.set_link(1, up=False)
            _wait(launcher, "the survivors' restart after the cut",
                  lambda: _at_world(out, 2, after=events["cut"]), 180, log)
            net.kill_machine(1)  # its hung processes (a machine that comes back reboots); it stays away
            net.set_link(1, up=True)
            last = max(r[-1]["step"] for r in _latest(out)[1].values())
            (out / "limit").write_text(str(last + 3))
            launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    text = log.read_text()
    assert launcher.returncode == 0, text[-6000:]

    gens = _records(out)
    first_t = {g: min(r[0]["t"] for r in ranks.values()) for g, ranks in gens.items()}
    order = list(gens)
    worlds = [next(iter(gens[g].values()))[0]["world"] for g in order]
    # generations: 4 ranks, 2 (after the kill), 4 (grown back), 2 (after the cut); a restart can repeat a world
    # (e.g. a rank that failed at the same moment), but the sequence of distinct worlds is this one
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [4, 2, 4, 2], worlds
    assert float(order[-1]) > events["cut"] and grown > events["back"]

    assert "rendezvous hosted here (elastic: any node may be lost)" in text, text[-3000:]
    machine = {rank: records[0]["machine"] for rank, records in gens[order[0]].items()}
    assert machine[0] == machine[1] != machine[2] == machine[3]
    assert {r[0]["machine"] for r in gens[order[1]].values()} == {machine[2]}  # machine 1's ranks went on
    assert {r[0]["machine"] for r in gens[order[-1]].values()} == {machine[0]}  # after the cut: machine 0's
    print("\n".join(line for line in text.splitlines() if "lost" in line or "stragglers" in line))
    # after the kill the survivors' connection error names the lost ranks (machine 0 also served the workers' store:
    # they are named from the peer's address); after the cut the watchdog names the silent ranks
    assert f"ranks 0-1 (at {net.addr(0)}, the failed connection's peer) are lost" in text, text[-6000:]
    assert "stragglers: ranks 2-3" in text, text[-6000:]

    # every resumed generation equals an uninterrupted run of its world size from the same checkpoint
    segments: dict[int, list] = {2: [], 4: []}
    resumed = []
    for g, w in zip(order, worlds, strict=True):
        ranks = gens[g]
        rec0 = ranks[0][0]
        if rec0["resumed_from"] is None:
            assert rec0["start"] == 0 and g == order[0]
            continue
        steps = [r["step"] for r in ranks[0]]
        assert steps == list(range(rec0["start"], rec0["start"] + len(steps)))
        common = min(len(r) for r in ranks.values())
        tag = os.path.basename(rec0["resumed_from"])
        assert tag == f"global_step{rec0['start']}"
        segments[w].append([tag, rec0["start"], rec0["start"] + common - 1])
        resumed.append((g, w, common))
    refs = {w: _run_reference(tmp_path, w, segs) for w, segs in segments.items() if segs}
    index = {2: 0, 4: 0}
    for g, w, common in resumed:
        for rank, records in gens[g].items():
            got = [loss for r in records[:common] for loss in r["losses"]]
            want = [loss for losses in refs[w][rank][index[w]] for loss in losses]
            assert got == pytest.approx(want, rel=1e-6, abs=1e-7), (g, w, rank)
        index[w] += 1
    assert all(len(set(loss for r in ranks[0] for loss in r["losses"])) > 1 for ranks in gens.values())

    # the report: steps lost and time to the first new step after each fault
    def after(event: str) -> tuple[str, float]:
        g = next(g for g in order if first_t[g] > events[event])
        return g, first_t[g] - events[event]

    for event in ("kill", "back", "cut"):
        g, seconds = after(event)
        before = max(r["step"] for gg in order if first_t[gg] < events[event] for r in gens[gg][0])
        start = gens[g][0][0]["start"]
        print(f"{event}: last step before {before}, resumed at step {start} on {worlds[order.index(g)]} ranks "
              f"({before + 1 - start} step(s) redone), first new step {seconds:.1f} s after it")
