"""Recovery from a lost node: seconds from the kill to the first step on the survivor, and steps redone; and what
DeepSpeed does in the same situation.

Run (the DeepSpeed part needs DeepSpeed installed; ``--no-deepspeed`` skips it)::

    export TORCH_EXTENSIONS_DIR=$PWD/build/torch_extensions DS_ACCELERATOR=cpu
    python benchmarks/bench_recovery.py [--trials 5 --seed 0 --steps 14 --save-interval 2 --dir /tmp/bench_recovery]

**microspeed** (:mod:`microspeed.testing.elastic_job`, the job of ``tests/test_elastic_run_recovery.py`` with a
larger model): each trial is a fresh job of two local ``microspeed run --elastic 1:2`` agents (one rank each, one
c10d rendezvous; ``last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3``, ``--max_restarts 2``)
training an MLP (``--width`` 256, ``--layers`` 2 hidden layers, 131,841 parameters) with Adam under ZeRO-2,
global batch 64 (micro-batches of 16), ``--steps`` steps, a synchronous save every ``--save-interval`` steps and
``checkpoint.auto_resume_dir``, ``--pause`` s between steps. ``random.Random(seed + trial)`` draws the kill step
``k`` in ``[--kill-min, --kill-max]`` and a point in that step: once the rank to be killed has finished step
``k - 1``, the launcher waits a random fraction of the last step's period (compute + pause) and SIGKILLs rank 1's
agent and its processes (a node lost). Per trial, from each rank's records (``time.time()`` on one machine):

- **killed in**: the first step the survivor did not finish at world size 2 (a kill during the closing barrier of a
  save leaves that save complete, and its step counts as finished); **resumed at**: the step the restarted
  survivor starts from (its ``auto_resume_dir`` load); **redone** = killed in - resumed at.
- **fail**: kill -> the survivor's rank raises (its next collective fails).
- **restart**: that -> the new worker process starts (the agent sees the failure, re-rendezvous: the c10d round
  closes ``last_call_timeout`` after the survivor alone satisfies ``min_nodes``, then spawns the worker).
- **import**: the worker's first line -> ``microspeed.initialize()`` is called (python, torch, microspeed).
- **init+load**: ``initialize()`` (process group, engine, and the automatic resume from the checkpoint).
- **1st step**: the first step after the restart (world size 1, 4 accumulated micro-batches: the global batch kept).
- **to 1st step**: kill -> that step done (the sum of the above); **caught up**: kill -> the step it was killed in
  done again (the same when nothing is redone).
- **losses equal**: the survivor's losses after the restart against one process loaded by hand from the tag it
  resumed from (:func:`~microspeed.testing.elastic_job.reference_losses`): largest relative difference.

**DeepSpeed 0.19.8** (its launcher has no elastic agent, and its ``elasticity`` section was removed in 0.19): the
same model, config and batches trained with ZeRO-2 under ``torchrun`` on 2 ranks, saved after 4 steps, then 3
more steps (the uninterrupted reference). Then one process (world size 1, the survivor restarted by hand):

- ``deepspeed.initialize`` with an ``elasticity`` section: the error it raises;
- ``engine.load_checkpoint(dir)`` of the 2-rank ZeRO-2 checkpoint: the error it raises;
- ``load_checkpoint(dir, load_optimizer_states=False)`` (weights only; Adam's moments start from zero), then the
  3 steps: their losses against the uninterrupted run;
- its launcher with 0.16's elastic options (``deepspeed --elastic_training --min_elastic_nodes 1
  --max_elastic_nodes 2``) and whether the ``deepspeed.elasticity`` package exists;
- DeepSpeed's offline route: ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state`` (timed),
  then ``"checkpoint": {"load_universal": true}`` and ``load_checkpoint``, then the 3 steps, compared the same way.

Prints Markdown tables (the 1-minute load average before and after: the machine may be shared) and ``BENCH_JSON``
lines with every number.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from microspeed.testing.elastic_job import ElasticJob, JobSpec, make_model, reference_losses, run_step  # noqa: E402

DS_SAVED_STEPS = 4  # DeepSpeed: steps before the save
DS_MORE_STEPS = 3  # and after it (the uninterrupted reference; what the world-1 loads are compared with)
PHASES = ("fail", "restart", "import", "init+load", "1st step")


def _rel(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want, strict=True))


# ------------------------------------------------------------------------------------------------ microspeed


def trial(spec: JobSpec, folder: Path, rng: random.Random, kill_min: int, kill_max: int) -> dict[str, Any]:
    """One job, one node killed at a random point of a random step; the measured recovery."""
    kill_step = rng.randint(kill_min, kill_max)
    fraction = rng.random()
    shutil.rmtree(folder, ignore_errors=True)
    with ElasticJob(folder, spec) as job:
        job.start()
        job.wait_until(lambda: job.completed(0, 1) >= kill_step - 1 and job.records(0, 1)[-1]["world"] == 2)
        last = job.records(0, 1)
        period = last[-1]["t"] - last[-2]["t"] if len(last) > 1 else spec.pause
        time.sleep(fraction * period)
        killed_at, survivor = job.kill_node(rank=1)
        job.wait(survivor)
    before = [r for r in job.records(0, 0) if r["world"] == 2]
    failed = job.records(0, 0, "failed")
    after, started, initialized = list(job.resumed()), list(job.resumed("started")), list(job.resumed("initialized"))
    if not (failed and after and started and initialized) or [r["step"] for r in after] != list(
            range(after[0]["step"], spec.steps)):
        raise AssertionError(f"unexpected records: failed={failed} after={after} started={started}")
    started, initialized = started[0], initialized[0]
    start = after[0]["start"]
    # a kill in the closing barrier of a save leaves that save complete: its step counts as done
    killed_in = max(max((r["step"] for r in before), default=-1) + 1, start)
    ref = reference_losses(spec, str(job.ckpt), f"global_step{start}", start)
    caught_up = next(r for r in after if r["step"] == killed_in)
    return {
        "kill_step_drawn": kill_step, "kill_fraction": round(fraction, 3), "killed_in": killed_in,
        "resumed_at": start, "redone": killed_in - start, "resumed_from": after[0]["resumed_from"],
        "fail": failed[0]["t"] - killed_at, "restart": started["t"] - failed[0]["t"],
        "import": initialized["t0"] - started["t"], "init+load": initialized["t1"] - initialized["t0"],
        "1st step": after[0]["t"] - initialized["t1"], "to 1st step": after[0]["t"] - killed_at,
        "caught up": caught_up["t"] - killed_at, "world_after": after[0]["world"], "batch_after": after[0]["batch"],
        "losses_rel_diff": _rel([x for r in after for x in r["losses"]], [x for s in ref for x in s]),
        "error_seen": failed[0]["error"][:400],
    }


# ------------------------------------------------------------------------------------------------ DeepSpeed


def _ds_config(spec: JobSpec, universal: bool = False, elasticity: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": spec.batch, "train_micro_batch_size_per_gpu": spec.micro_rows, "steps_per_print": 10**6,
        "zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"lr": spec.lr, "torch_adam": True}}}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if elasticity:  # DeepSpeed 0.16's documented example section (the batch sizes of this job)
        cfg["elasticity"] = {"enabled": True, "max_train_batch_size": spec.batch,
                             "micro_batch_sizes": [spec.micro_rows], "min_gpus": 1, "max_gpus": 2, "min_time": 0,
                             "version": 0.1}
    return cfg


def _ds_engine(spec: JobSpec, **kw: Any) -> Any:
    import deepspeed

    model = make_model(spec)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(spec, **kw))[0]


def _ds_steps(engine: Any, spec: JobSpec, first: int) -> list[float]:
    """Steps ``first..first+DS_MORE_STEPS-1``; every micro-batch's loss in global order (all ranks)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for step in range(first, first + DS_MORE_STEPS):
        mine = run_step(engine, spec, step, rank, world)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        out += [every[m % world][m // world] for m in range(sum(map(len, every)))]
    return out


def _error(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"


def ds_save_worker(spec: JobSpec, folder: str) -> None:
    """Under torchrun, 2 ranks: train, save after DS_SAVED_STEPS steps, train on; rank 0 writes the losses after."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    engine = _ds_engine(spec)
    for step in range(DS_SAVED_STEPS):
        run_step(engine, spec, step, dist.get_rank(), dist.get_world_size())
    engine.save_checkpoint(folder)
    losses = _ds_steps(engine, spec, DS_SAVED_STEPS)
    if dist.get_rank() == 0:
        Path(folder, "uninterrupted.json").write_text(json.dumps({"world": dist.get_world_size(), "losses": losses}))


def ds_load_worker(spec: JobSpec, folder: str) -> None:
    """Under torchrun, 1 rank: the survivor restarted by hand; what each way of loading does."""
    import torch

    torch.set_num_threads(1)
    want = json.loads(Path(folder, "uninterrupted.json").read_text())["losses"]
    out: dict[str, Any] = {}
    try:
        _ds_engine(spec, elasticity=True)
        out["elasticity"] = "accepted"
    except Exception as exc:  # noqa: BLE001 - what DeepSpeed raises is the result
        out["elasticity"] = _error(exc)
    for name, kw, load in (("load_checkpoint", {}, {}),
                           ("load_checkpoint(load_optimizer_states=False)", {}, {"load_optimizer_states": False}),
                           ("load_universal", {"universal": True}, {})):
        if name == "load_universal" and not Path(folder, "latest_universal").exists():
            out[name] = {"error": "no universal checkpoint (the conversion failed)"}
            continue
        engine = _ds_engine(spec, **kw)
        t0 = time.perf_counter()
        try:
            engine.load_checkpoint(folder, **load)
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": _error(exc)}
            continue
        seconds, steps = time.perf_counter() - t0, engine.global_steps
        got = _ds_steps(engine, spec, DS_SAVED_STEPS)
        out[name] = {"load_s": seconds, "global_steps": steps, "losses_rel_diff": _rel(got, want)}
    Path(folder, "world1.json").write_text(json.dumps(out))


def deepspeed_situation(spec: JobSpec, folder: Path) -> dict[str, Any]:
    """Save with 2 ranks, convert, load with 1: DeepSpeed's behaviour, as a dict."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def torchrun(n: int, flag: str) -> None:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                __file__, flag, str(folder), "--spec", spec.to_json()]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{flag} failed ({done.returncode}): {done.stdout[-3000:]}{done.stderr[-3000:]}")

    torchrun(2, "--ds-save")
    tag = Path(folder, "latest").read_text().strip()
    t0 = time.perf_counter()
    conv = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(folder / tag), "--output_folder", str(folder / f"{tag}_universal"),
                           "--inject_missing_state"], env=env, capture_output=True, text=True, timeout=600)
    convert_s = time.perf_counter() - t0
    torchrun(1, "--ds-load")
    out = json.loads(Path(folder, "world1.json").read_text())
    out["ds_to_universal"] = {"returncode": conv.returncode, "seconds": convert_s,
                              "tail": (conv.stdout + conv.stderr)[-300:] if conv.returncode else ""}
    out["saved_after_steps"], out["tag"] = DS_SAVED_STEPS, tag
    launcher = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--elastic_training",
                               "--min_elastic_nodes", "1", "--max_elastic_nodes", "2", "train.py"], env=env,
                              capture_output=True, text=True, timeout=120)
    out["launcher_elastic"] = (launcher.stderr.strip().splitlines() or ["exit 0"])[-1]
    out["elasticity_package"] = importlib.util.find_spec("deepspeed.elasticity") is not None
    return out


# ------------------------------------------------------------------------------------------------ report


def _fmt(x: float) -> str:
    return f"{x:.2f}"


def _side_by_side(rows: list[dict[str, Any]], ds: dict[str, Any]) -> None:
    """One table: microspeed's measured recovery beside what DeepSpeed does when a node of a ZeRO-2 job is lost."""
    med, top = (lambda c: statistics.median(r[c] for r in rows)), (lambda c: max(r[c] for r in rows))
    weights, universal = ds["load_checkpoint(load_optimizer_states=False)"], ds["load_universal"]
    conv = ds["ds_to_universal"]
    print(f"\n| after a node is lost (ZeRO-2, 2 ranks -> 1) | microspeed | DeepSpeed "
          f"{__import__('deepspeed').__version__} |\n|---|---|---|")
    print(f"| who restarts the survivor | its elastic agent (`microspeed run --elastic 1:2`), at once | nobody: "
          f"`deepspeed --elastic_training ...`: `{ds['launcher_elastic']}`; `deepspeed.elasticity` "
          f"{'exists' if ds['elasticity_package'] else 'does not exist'}; an `elasticity` config section: "
          f"`{ds['elasticity'].split(': ', 1)[0].rsplit('.', 1)[-1]}` |")
    print(f"| resume the 2-rank ZeRO-2 checkpoint at world size 1 | automatic (`checkpoint.auto_resume_dir`); "
          f"losses equal a hand-loaded run (largest relative difference {top('losses_rel_diff'):.1e}) | "
          f"`load_checkpoint`: `{ds['load_checkpoint'].get('error', 'loads').split(': ', 1)[0].rsplit('.', 1)[-1]}`"
          f" (world size 2 vs 1) |")
    print(f"| kill -> first step on the survivor | median {med('to 1st step'):.1f} s, max {top('to 1st step'):.1f}"
          f" s (steps redone: median {med('redone'):g}, max {top('redone'):g}) | when someone restarts it; then "
          f"either weights only (`load_optimizer_states=False`: Adam's moments lost, next losses "
          f"{weights.get('losses_rel_diff', float('nan')):.1e} off) or the offline `ds_to_universal "
          f"--inject_missing_state` ({conv['seconds']:.1f} s) and `load_universal` (next losses "
          f"{universal.get('losses_rel_diff', float('nan')):.1e} off) |")


def main() -> None:
    """Parse the options; a worker mode (``--ds-save``/``--ds-load``) or the whole benchmark."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--kill-min", type=int, default=3)
    p.add_argument("--kill-max", type=int, default=9)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pause", type=float, default=0.2, help="seconds between steps")
    p.add_argument("--dir", default="/tmp/bench_recovery")
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--ds-save", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--ds-load", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ds_save or args.ds_load:
        spec = JobSpec.from_json(args.spec)
        (ds_save_worker if args.ds_save else ds_load_worker)(spec, args.ds_save or args.ds_load)
        return
    if args.kill_max >= args.steps - 1 or not args.save_interval <= args.kill_min <= args.kill_max:
        p.error(f"--kill-min/--kill-max: got {args.kill_min}..{args.kill_max}; the kill steps must be an interval "
                f"from --save-interval ({args.save_interval}, so that a save exists) to below --steps - 1 "
                f"({args.steps - 1})")
    spec = JobSpec(inputs=args.width, hidden=args.width, layers=args.layers, micro_rows=16, steps=args.steps,
                   save_interval=args.save_interval, lr=1e-3, pause=args.pause)
    root = Path(args.dir)
    load_before = os.getloadavg()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}; 1-min load average before: {load_before[0]:.2f}")
    rows = []
    for k in range(args.trials):
        row = trial(spec, root / f"trial{k}", random.Random(args.seed + k), args.kill_min, args.kill_max)
        rows.append(row)
        print("BENCH_JSON " + json.dumps({"trial": k, **row}), flush=True)
    ds = None
    if not args.no_deepspeed and importlib.util.find_spec("deepspeed") is not None:
        ds = deepspeed_situation(spec, root / "deepspeed")
        print("BENCH_JSON " + json.dumps({"deepspeed": ds}), flush=True)
    load_after = os.getloadavg()

    cols = ("killed in", "resumed at", "redone", *PHASES, "to 1st step", "caught up")
    print(f"\nmicrospeed: {args.trials} kills, {args.steps} steps, a save every {args.save_interval}, MLP width "
          f"{args.width} x {args.layers}, ZeRO-2, 2 agents -> 1 (seconds)\n")
    print("| trial | " + " | ".join(cols) + " | world, batch after | losses vs hand-loaded |")
    print("|---:|" + "---:|" * len(cols) + "---|---:|")
    for k, r in enumerate(rows):
        cells = [str(r["killed_in"]), str(r["resumed_at"]), str(r["redone"]), *(_fmt(r[c]) for c in cols[3:])]
        print(f"| {k} | " + " | ".join(cells) + f" | {r['world_after']}, {r['batch_after']} | "
              f"{r['losses_rel_diff']:.1e} |")
    for name, fn in (("median", statistics.median), ("max", max)):
        cells = [fn([r[c] for r in rows]) for c in ("redone", *PHASES, "to 1st step", "caught up")]
        print(f"| **{name}** | | | {cells[0]:g} | " + " | ".join(_fmt(c) for c in cells[1:]) + " | | |")
    print(f"\nthe survivor's error: {rows[0]['error_seen']}")
    if ds is not None:
        print(f"\nDeepSpeed {__import__('deepspeed').__version__}: ZeRO-2 saved by 2 ranks after "
              f"{ds['saved_after_steps']} steps ({ds['tag']}), loaded by 1 rank\n")
        print("| what | result |\n|---|---|")
        print(f"| `elasticity` section in the config | {ds['elasticity']} |")
        for name in ("load_checkpoint", "load_checkpoint(load_optimizer_states=False)", "load_universal"):
            r = ds[name]
            text = r["error"] if "error" in r else (
                f"loads ({r['load_s']:.2f} s, global_steps {r['global_steps']}); the next {DS_MORE_STEPS} steps' "
                f"losses vs the uninterrupted 2-rank run: {r['losses_rel_diff']:.1e} relative")
            print(f"| `{name}` | {text} |")
        conv = ds["ds_to_universal"]
        print(f"| `ds_to_universal --inject_missing_state` (offline, before `load_universal`) | "
              f"{'exit 0' if conv['returncode'] == 0 else 'exit ' + str(conv['returncode']) + ': ' + conv['tail']}, "
              f"{conv['seconds']:.2f} s |")
        _side_by_side(rows, ds)
    print(f"\n1-min load average: {load_before[0]:.2f} before, {load_after[0]:.2f} after")


if __name__ == "__main__":
    main()
