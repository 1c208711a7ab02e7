"""Adam vs 1-bit Adam (and 0/1 Adam) on a slow network: step time of ranks in shaped network namespaces.

Usage (root, iproute2's ``ip`` and ``tc``; 2 ranks, gloo, CPU; the default run, 1 Gbit/s, Adam and
1-bit Adam, takes about 1.2 minutes on 2 cores under other load, ``--rate 100mbit`` about 5; each of
``zerooneadam`` adds 0.5 and 1.5)::

    python benchmarks/slow_network.py                              # 2 ranks, 1 Gbit/s, adam + onebitadam
    python benchmarks/slow_network.py --rate 1gbit,100mbit         # one table per rate
    python benchmarks/slow_network.py --optimizers adam,onebitadam,zerooneadam --world 4
    python benchmarks/slow_network.py --optimizers none            # only the raw all-reduce (shaping check)
    python benchmarks/slow_network.py --json-out slow.json         # also write every number as JSON
    python benchmarks/slow_network.py --cleanup                    # remove what a killed run left, then exit

What is measured, and how:

* **Network** (:mod:`netns`, next to this script): one Linux network namespace per rank, each joined by a
  veth pair to a bridge in the root namespace, addresses ``10.77.0.<rank+1>/24``. Both ends of every
  veth pair get an egress qdisc at ``--rate`` (a tc rate: ``1gbit``, ``100mbit``), so each direction of
  each rank's link is shaped on its own, like a full-duplex switch port: ``tbf`` with a burst of 1 ms at
  the rate (at least 96 KiB, one GSO packet of the veth) and ``--queue-ms`` (10) of queue, or ``netem
  rate`` (``--qdisc``; ``auto`` takes tbf, or netem when ``--delay-ms`` asks for a one-way rank-to-rank
  delay, and falls back to the other if the kernel lacks one). Every rank opens a TCP connection to
  every other one before anything runs. Names carry a random 6-hex id (``msnet<id>...``), so a crashed
  run cannot collide with the next; everything is deleted when the run ends, fails, is interrupted
  (Ctrl-C, SIGTERM, SIGHUP) or exits; ``--cleanup`` deletes the leftovers of a killed run (SIGKILL) by
  that prefix.
* **Ranks**: ``ip netns exec <ns> python slow_network.py --worker ...`` per rank, with ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK=0`` and ``LOCAL_WORLD_SIZE=1`` (each namespace is a host), ``MASTER_ADDR``
  (rank 0's address), ``MASTER_PORT`` (a fresh one per run), ``GLOO_SOCKET_IFNAME`` (the veth in the
  namespace), ``OMP_NUM_THREADS=1`` (and ``torch.set_num_threads(1)``),
  ``MICROSPEED_DISABLE_PLUGIN_AUTOLOAD=1`` and ``MICROSPEED_PLUGINS=comm`` (empty when the ``comm``
  plugin is not installed: Adam runs on the core alone, the 1-bit optimizers are reported as failed).
  Each run is one fresh process group; a rank that exits non-zero, or ``--timeout`` (per run), kills
  the others. The exit status is 1 if any run failed.
* **Raw all-reduce**: first, in the same namespaces, ``dist.all_reduce`` (gloo) of an fp32 tensor the
  size of the model, ``--allreduce-reps`` times after one untimed; its median time gives the algorithm
  bandwidth (bytes / time) and the bus bandwidth (times ``2(n-1)/n``, what each rank sends per byte of a
  ring all-reduce): about the shaped rate when shaping works (1 Gbit/s: 105 MB on 2 ranks ≈ 0.85 s).
* **Model**: a GELU MLP of ``--layers`` (4) square ``nn.Linear(--width, --width)`` (2560) layers,
  26.2M fp32 parameters (105 MB of gradients), MSE loss on random ``(--batch, --width)`` inputs (batch
  8 per rank) and targets ``tanh(x @ T)`` of a fixed random teacher ``T``: little compute, big
  gradients, so the all-reduce dominates. Built from ``--seed`` on every rank for every optimizer
  (identical start); rank ``r`` cycles through ``--batches`` (4) batches drawn from ``--seed + 1
  + r`` (a loss that goes down), the same sequence for every optimizer.
* **Engine**: ``microspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)``
  with ``train_micro_batch_size_per_gpu`` ``--batch``, ``gradient_accumulation_steps`` 1,
  ``steps_per_print`` 10**9 and the optimizer: ``adam`` = ``{"type": "Adam", "params": {"lr": LR}}``;
  ``onebitadam`` = ``{"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": W}}``; ``zerooneadam``
  = ``{"type": "ZeroOneAdam", "params": {"lr": LR, "var_freeze_step": W, "local_step_scaler":
  --local-step-scaler (2), "local_step_clipper": --local-step-clipper (4)}}``, so that local steps
  (synchronising every 1, 2, then 4 steps) start within the run. ``W`` is ``--freeze-step`` (5), ``LR``
  ``--lr``, 1e-5 for all: larger ones make the 1-bit optimizers diverge (NaN loss) within this short
  run (1e-3 already in the warm-up, 1e-4 and 3e-5 a few steps after the freeze) because they apply no
  bias correction (as DeepSpeed's): the variance they freeze after ``W`` steps is about ``1 - 0.999^W``
  (0.5% for 5) of its steady state, so their updates are many times Adam's. Real runs freeze after
  thousands of steps; the step times barely depend on the lr. A loss that is not finite is flagged.
* **Time**: ``--warmup`` untimed steps (default ``W + 2``: the 1-bit optimizers' full-precision warm-up
  and the switch are over), then ``--steps`` (10) timed ones, the same counts for every optimizer. Each
  step is ``loss = engine(x, y); engine.backward(loss); engine.step()`` timed with ``perf_counter`` on
  every rank (no barrier: the collectives keep the ranks in step); a step's time is the slowest rank's,
  and the table shows the median over the timed steps (and the mean: 0/1 Adam's median is a step
  without communication), ``x Adam`` = Adam's median / this one's (a speed-up above 1), ``x mean`` the
  same with the means (0/1 Adam's fair figure: it includes the synchronising steps), and the median
  process CPU time per step (rank mean: the compute, with gloo's own threads).
* **Bytes**: ``microspeed.comm.stats`` counted over the timed steps, divided by their number, mean over
  ranks: ``wire`` (bytes this rank sends with the op's bandwidth-optimal algorithm,
  ``stats.total_wire_bytes()``, when the core has it) and ``payload`` (the tensors handed to the
  collectives, ``stats.total_bytes()``), per op too in the JSON.

Each run also records the machine's 1-minute load average at its start and end: on a machine shared
with other work, a 1-bit step (little waiting on the wire, a few hundred ms of CPU) slows down with
the load much more than an Adam step (mostly waiting), so the speed-ups are lower bounds there.

The parent prints one table per rate and, last, one line ``BENCH_JSON {...}`` with every number (also
written to ``--json-out``). Ranks' logs go to a temporary directory, printed (tail) when a run fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

OPTIMIZERS = ("adam", "onebitadam", "zerooneadam")
ONE_BIT = ("onebitadam", "zerooneadam")
BASE_PORT = 29600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="See the module docstring (top of the file) for what is measured and how.")
    p.add_argument("--rate", default="1gbit",
                   help="tc rate of every link, comma-separated for one table each (e.g. 1gbit,100mbit)")
    p.add_argument("--world", type=int, default=2, help="ranks (one network namespace each)")
    p.add_argument("--optimizers", default="adam,onebitadam",
                   help=f"comma-separated, from {', '.join(OPTIMIZERS)}; 'none' runs only the raw all-reduce")
    p.add_argument("--steps", type=int, default=10, help="timed steps per optimizer")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default --freeze-step + 2)")
    p.add_argument("--freeze-step", type=int, default=5,
                   help="OneBitAdam freeze_step and ZeroOneAdam var_freeze_step (full-precision warm-up steps)")
    p.add_argument("--local-step-scaler", type=int, default=2, help="ZeroOneAdam local_step_scaler")
    p.add_argument("--local-step-clipper", type=int, default=4, help="ZeroOneAdam local_step_clipper")
    p.add_argument("--lr", type=float, default=1e-5,
                   help="every optimizer's lr (larger ones make the 1-bit optimizers diverge here: see the docstring)")
    p.add_argument("--width", type=int, default=2560, help="MLP width (square layers)")
    p.add_argument("--layers", type=int, default=4, help="MLP layers")
    p.add_argument("--batch", type=int, default=8, help="micro-batch per rank (train_micro_batch_size_per_gpu)")
    p.add_argument("--batches", type=int, default=4, help="distinct batches per rank, cycled")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--allreduce-reps", type=int, default=3, help="timed raw all-reduces (0: skip it)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way rank-to-rank delay (needs netem)")
    p.add_argument("--qdisc", choices=("auto", "tbf", "netem"), default="auto", help="shaping qdisc")
    p.add_argument("--burst", default=None, help="tbf burst (tc size, e.g. 125kb; default 1 ms at the rate)")
    p.add_argument("--queue-ms", type=float, default=10.0, help="queue before drops (tbf latency), ms")
    p.add_argument("--subnet", default="10.77.0", help="first three octets of the ranks' /24")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run (one optimizer at one rate)")
    p.add_argument("--json-out", default=None, help="also write the BENCH_JSON object to this file")
    p.add_argument("--keep-logs", action="store_true", help="keep the ranks' logs (their directory is printed)")
    p.add_argument("--cleanup", action="store_true",
                   help="delete namespaces and links left by earlier runs (prefix msnet), then exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = args.freeze_step + 2
    args.rate_list = [r.strip() for r in args.rate.split(",") if r.strip()]
    args.optimizer_list = [] if args.optimizers.strip() == "none" else [
        o.strip().lower() for o in args.optimizers.split(",") if o.strip()]
    bad = [o for o in args.optimizer_list if o not in OPTIMIZERS]
    if bad:
        p.error(f"unknown optimizers {bad}; choose from {', '.join(OPTIMIZERS)} (or 'none')")
    if args.world < 2:
        p.error("--world: at least 2 ranks")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps >= 1 and --warmup >= 0")
    return args


def n_params(width: int, layers: int) -> int:
    """Parameters of the benchmark's MLP."""
    return layers * (width * width + width)


def optimizer_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The ds_config ``optimizer`` section of ``name``."""
    if name == "adam":
        return {"type": "Adam", "params": {"lr": args.lr}}
    if name == "onebitadam":
        return {"type": "OneBitAdam", "params": {"lr": args.lr, "freeze_step": args.freeze_step}}
    return {"type": "ZeroOneAdam", "params": {"lr": args.lr, "var_freeze_step": args.freeze_step,
                                              "local_step_scaler": args.local_step_scaler,
                                              "local_step_clipper": args.local_step_clipper}}


# --------------------------------------------------------------------------------------------------
# Worker (one rank, inside its namespace)
# --------------------------------------------------------------------------------------------------

def _stats_snapshot() -> tuple[dict[str, int], dict[str, int] | None]:
    from microspeed.comm import stats
    wire = dict(stats.wire) if hasattr(stats, "total_wire_bytes") else None
    return dict(stats.bytes), wire


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def worker(spec: dict[str, Any], out_path: str) -> None:
    """Run one rank of ``spec["task"]`` (``allreduce`` or ``train``) and write its numbers to ``out_path``."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=spec["timeout"])
    result: dict[str, Any] = {"rank": rank, "world": world}
    if spec["task"] == "allreduce":
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
        t = torch.ones(spec["numel"], dtype=torch.float32)
        times = []
        for _ in range(spec["reps"] + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        result.update(times_s=times[1:], nbytes=t.numel() * t.element_size(), check=float(t[0]))
    else:
        import microspeed  # after OMP_NUM_THREADS; initialize() starts the process group (env://)

        torch.manual_seed(spec["seed"])
        model = WideMLP(spec["width"], spec["layers"])
        cfg = {"train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
               "steps_per_print": 10**9, "optimizer": spec["optimizer"]}
        engine, *_ = microspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        # A fixed random teacher (the same on every rank), so that the loss has something to go down to.
        teacher = torch.randn(spec["width"], spec["width"], generator=torch.Generator().manual_seed(spec["seed"] + 7))
        teacher /= spec["width"] ** 0.5
        gen = torch.Generator().manual_seed(spec["seed"] + 1 + rank)
        xs = [torch.randn(spec["batch"], spec["width"], generator=gen) for _ in range(spec["batches"])]
        pool = [(x, torch.tanh(x @ teacher)) for x in xs]
        batches = [pool[i % len(pool)] for i in range(spec["warmup"] + spec["steps"])]
        step_s, cpu_s, losses = [], [], []
        before = _stats_snapshot()
        for i, (x, y) in enumerate(batches):
            if i == spec["warmup"]:
                before = _stats_snapshot()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            step_s.append(time.perf_counter() - t0)
            cpu_s.append(time.process_time() - c0)
            losses.append(float(loss.detach()))
        after = _stats_snapshot()
        result.update(step_s=step_s, cpu_s=cpu_s, losses=losses, payload_bytes=_delta(after[0], before[0]),
                      wire_bytes=_delta(after[1], before[1]) if after[1] is not None and before[1] is not None
                      else None, optimizer_class=type(getattr(engine, "optimizer", None)).__name__,
                      params=sum(p.numel() for p in model.parameters()))
        dist.barrier()
    Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


class WideMLP(torch.nn.Module):
    """``layers`` square linear layers with GELU between them; ``forward(x, y)`` returns the MSE loss."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.nn.functional.gelu(x)
        return torch.nn.functional.mse_loss(x, y)


# --------------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------------

def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (``ip netns exec`` execs, so it carries over)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGTERM then SIGKILL each rank's process group (each rank is its own session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3.0
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.05)


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def launch(net: Any, tag: str, spec: dict[str, Any], args: argparse.Namespace, port: int,
           plugins: str, logdir: Path) -> tuple[list[dict[str, Any]] | None, str | None, float]:
    """Run ``spec`` on every rank of ``net``; ``(per-rank results, None, wall s)`` or ``(None, error, wall s)``.

    The results' first entry gets ``loadavg_1m``: the machine's 1-minute load average at start and end.
    """
    load0 = os.getloadavg()[0]
    procs: list[subprocess.Popen] = []
    logs = []
    t0 = time.monotonic()
    try:
        for r in range(args.world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR=net.addr(0), MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=net.ifname(r),
                       OMP_NUM_THREADS="1", MICROSPEED_DISABLE_PLUGIN_AUTOLOAD="1", MICROSPEED_PLUGINS=plugins,
                       PYTHONUNBUFFERED="1")
            log = logdir / f"{tag}.rank{r}.log"
            logs.append(log)
            argv = net.exec_argv(r, [sys.executable, os.path.abspath(__file__), "--worker", "--worker-spec",
                                     json.dumps(spec), "--worker-out", str(logdir / f"{tag}.rank{r}.json")])
            with open(log, "w") as fh:
                procs.append(subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True,
                                              preexec_fn=_die_with_parent))
        error = None
        while error is None:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                break
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                r, c = bad[0]
                tail = _tail(logs[r])
                last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "")
                error = f"rank {r} exited {c}: {last[:300]}\nkilled the others. rank {r}'s log ({logs[r]}):\n{tail}"
            elif time.monotonic() - t0 > args.timeout:
                error = (f"timed out after {args.timeout:.0f} s; killed every rank. rank 0's log:\n{_tail(logs[0])}")
            else:
                time.sleep(0.2)
    finally:
        _kill(procs)
    wall = time.monotonic() - t0
    if error:
        return None, error, wall
    ranks = [json.loads((logdir / f"{tag}.rank{r}.json").read_text()) for r in range(args.world)]
    ranks[0]["loadavg_1m"] = [load0, os.getloadavg()[0]]
    return ranks, None, wall


def summarize_train(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per-step slowest rank, medians over the timed steps, bytes per timed step (mean over ranks)."""
    steps = len(ranks[0]["step_s"]) - warmup
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    timed = step_s[warmup:]
    cpu = [statistics.mean(r["cpu_s"][i] for r in ranks) for i in range(warmup, len(step_s))]

    def per_step(key: str) -> dict[str, float] | None:
        if any(r.get(key) is None for r in ranks):
            return None
        ops = sorted({op for r in ranks for op in r[key]})
        return {op: statistics.mean(r[key].get(op, 0) for r in ranks) / steps for op in ops}

    wire, payload = per_step("wire_bytes"), per_step("payload_bytes")
    losses = [statistics.mean(r["losses"][i] for r in ranks) for i in range(len(step_s))]
    return {"median_step_s": statistics.median(timed), "mean_step_s": statistics.mean(timed),
            "min_step_s": min(timed), "max_step_s": max(timed), "median_cpu_s": statistics.median(cpu),
            "warmup_median_step_s": statistics.median(step_s[:warmup]) if warmup else None,
            "wire_bytes_per_step": sum(wire.values()) if wire is not None else None,
            "payload_bytes_per_step": sum(payload.values()) if payload is not None else None,
            "wire_bytes_per_step_by_op": wire, "payload_bytes_per_step_by_op": payload,
            "step_s": step_s, "losses": losses, "first_loss": losses[0], "last_loss": losses[-1],
            "diverged": not all(math.isfinite(x) for x in losses),
            "optimizer_class": ranks[0]["optimizer_class"], "params": ranks[0]["params"],
            "loadavg_1m": ranks[0].get("loadavg_1m")}


def summarize_allreduce(ranks: list[dict[str, Any]], world: int, rate_bps: float) -> dict[str, Any]:
    """Median (slowest rank) time of the raw all-reduce, its algorithm and bus bandwidth, the shaped ideal."""
    times = [max(r["times_s"][i] for r in ranks) for i in range(len(ranks[0]["times_s"]))]
    nbytes = ranks[0]["nbytes"]
    med = statistics.median(times)
    factor = 2 * (world - 1) / world
    return {"nbytes": nbytes, "times_s": times, "median_s": med, "algbw_gbps": nbytes * 8 / med / 1e9,
            "busbw_gbps": nbytes * 8 * factor / med / 1e9, "ideal_s": nbytes * 8 * factor / rate_bps,
            "check": ranks[0]["check"], "loadavg_1m": ranks[0].get("loadavg_1m")}


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def print_table(rate: str, res: dict[str, Any], optimizers: list[str]) -> None:
    """One rate's table."""
    net = res["network"]
    print(f"\n== {rate}: {net['ranks']} ranks, {net['qdisc_args']}"
          + (f", one-way delay {net['delay_ms']:g} ms" if net["delay_ms"] else "") + " ==")
    ar = res.get("allreduce")
    if ar and "failed" not in ar:
        print(f"raw all_reduce {ar['nbytes'] / 1e6:.1f} MB: median {ar['median_s']:.3f} s (shaped ideal "
              f"{ar['ideal_s']:.3f} s), algbw {ar['algbw_gbps']:.3f} Gbit/s, busbw {ar['busbw_gbps']:.3f} Gbit/s")
    elif ar:
        print(f"raw all_reduce FAILED: {ar['failed'].splitlines()[0]}")
    if not optimizers:
        return
    print(f"{'optimizer':<13}{'median s':>10}{'mean s':>9}{'x Adam':>8}{'x mean':>8}{'cpu s':>8}{'wire MB/step':>14}"
          f"{'payload MB/step':>17}{'loss first->last':>20}")
    base = res["optimizers"].get("adam", {}).get("median_step_s")
    base_mean = res["optimizers"].get("adam", {}).get("mean_step_s")
    for name in optimizers:
        r = res["optimizers"].get(name)
        if r is None:
            print(f"{name:<13}  not run")
            continue
        if "failed" in r:
            print(f"{name:<13}  FAILED: {r['failed'].splitlines()[0]}")
            continue
        ratio = f"{base / r['median_step_s']:.2f}" if base else "-"
        ratio_mean = f"{base_mean / r['mean_step_s']:.2f}" if base_mean else "-"
        print(f"{name:<13}{r['median_step_s']:>10.3f}{r['mean_step_s']:>9.3f}{ratio:>8}{ratio_mean:>8}"
              f"{r['median_cpu_s']:>8.3f}"
              f"{_mb(r['wire_bytes_per_step']):>14}{_mb(r['payload_bytes_per_step']):>17}"
              f"{r['first_loss']:>11.4f}->{r['last_loss']:.4f}" + ("  DIVERGED" if r["diverged"] else ""))


def sources_fingerprint(module: str) -> str | None:
    """A short hash of an installed package's ``*.py`` files (``None`` if it does not import)."""
    import hashlib
    import importlib

    try:
        root = Path(importlib.import_module(module).__file__).parent
    except Exception:
        return None
    h = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def comm_plugin_installed() -> bool:
    """Whether an entry point ``comm`` in group ``microspeed.plugins`` exists (the 1-bit optimizers)."""
    return any(ep.name == "comm" for ep in metadata.entry_points(group="microspeed.plugins"))


def run_rate(rate: str, args: argparse.Namespace, plugins: str, logdir: Path, port: list[int],
             res: dict[str, Any]) -> None:
    """Build the network for ``rate``, run the raw all-reduce and every optimizer in it into ``res``, tear it down."""
    from netns import SlowNetwork

    res["optimizers"] = {}
    with SlowNetwork(args.world, rate=rate, delay_ms=args.delay_ms, qdisc=args.qdisc, burst=args.burst,
                     queue_ms=args.queue_ms, subnet=args.subnet) as net:
        res["network"] = net.describe()
        numel = n_params(args.width, args.layers)
        if args.allreduce_reps > 0:
            spec = {"task": "allreduce", "numel": numel, "reps": args.allreduce_reps, "timeout": args.timeout}
            port[0] += 1
            ranks, err, wall = launch(net, f"{net.id}.allreduce", spec, args, port[0], plugins, logdir)
            res["allreduce"] = ({"failed": err, "wall_s": wall} if err else
                                {**summarize_allreduce(ranks, args.world, net.rate_bps), "wall_s": wall})
            if err:
                print(f"  raw all_reduce FAILED after {wall:.0f} s:\n{err}", flush=True)
            else:
                a = res["allreduce"]
                print(f"  raw all_reduce {a['nbytes'] / 1e6:.1f} MB: median {a['median_s']:.3f} s, busbw "
                      f"{a['busbw_gbps']:.3f} Gbit/s (ideal {a['ideal_s']:.3f} s) ({wall:.0f} s)", flush=True)
        for name in args.optimizer_list:
            if name in ONE_BIT and "comm" not in plugins.split(","):
                res["optimizers"][name] = {"failed": "the comm plugin (microspeed_comm) is not installed: "
                                                     "pip install -e plugins/comm"}
                print(f"  {name}: skipped, the comm plugin is not installed", flush=True)
                continue
            spec = {"task": "train", "optimizer": optimizer_config(name, args), "width": args.width,
                    "layers": args.layers, "batch": args.batch, "batches": args.batches, "seed": args.seed,
                    "warmup": args.warmup,
                    "steps": args.steps, "timeout": args.timeout}
            print(f"  running {name} ({args.warmup} warm-up + {args.steps} timed steps) ...", flush=True)
            port[0] += 1
            ranks, err, wall = launch(net, f"{net.id}.{name}", spec, args, port[0], plugins, logdir)
            if err:
                res["optimizers"][name] = {"failed": err, "wall_s": wall, "config": spec["optimizer"]}
                print(f"  {name} FAILED after {wall:.0f} s:\n{err}", flush=True)
                continue
            r = res["optimizers"][name] = {**summarize_train(ranks, args.warmup), "wall_s": wall,
                                           "config": spec["optimizer"]}
            print(f"  {name}: median {r['median_step_s']:.3f} s/step (warm-up median "
                  f"{r['warmup_median_step_s'] or 0:.3f} s), wire {_mb(r['wire_bytes_per_step'])} MB/step, "
                  f"loss {r['first_loss']:.4f}->{r['last_loss']:.4f} ({wall:.0f} s, load avg "
                  f"{' -> '.join(f'{x:.1f}' for x in r['loadavg_1m'])})", flush=True)
    adam = res["optimizers"].get("adam", {})
    for r in res["optimizers"].values():
        if "median_step_s" in adam and "median_step_s" in r:
            r["speedup_vs_adam"] = adam["median_step_s"] / r["median_step_s"]
            r["speedup_vs_adam_mean"] = adam["mean_step_s"] / r["mean_step_s"]


def main(argv: list[str] | None = None) -> int:
    """Parent: every rate, every optimizer; the tables and ``BENCH_JSON``. Worker: one rank."""
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker_spec), args.worker_out)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from netns import cleanup_leftovers

    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("needs root and iproute2's ip and tc", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup_leftovers()
        print(f"removed {len(removed)}: {', '.join(removed)}" if removed else "nothing to clean up")
        return 0
    # SIGINT raises KeyboardInterrupt (even where a shell started us ignoring it); SIGTERM and SIGHUP
    # become SystemExit: every finally runs, the ranks are killed and the network is torn down.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    from common import core_fingerprint

    plugins = "comm" if comm_plugin_installed() else ""
    numel = n_params(args.width, args.layers)
    print(f"slow_network benchmark: MLP {args.layers} x {args.width}^2 ({numel:,} params, {numel * 4 / 1e6:.1f} MB "
          f"fp32), {args.world} ranks x batch {args.batch}, lr {args.lr}, {args.warmup} warm-up + {args.steps} "
          f"timed steps, freeze_step {args.freeze_step}; rates {', '.join(args.rate_list)}; torch {torch.__version__}, "
          f"Python {platform.python_version()}, {os.cpu_count()} CPUs, gloo, 1 thread/rank; comm plugin "
          f"{'installed' if plugins else 'NOT installed'}", flush=True)
    logdir = Path(tempfile.mkdtemp(prefix="slow_network_"))
    port = [BASE_PORT]  # a fresh port per run (fresh namespaces per rate)
    results: dict[str, Any] = {}
    t0 = time.monotonic()
    interrupted = 0
    try:
        for rate in args.rate_list:
            print(f"rate {rate}:", flush=True)
            results[rate] = {"optimizers": {}}
            try:
                run_rate(rate, args, plugins, logdir, port, results[rate])
            except (RuntimeError, OSError, ValueError) as exc:  # set-up of the network
                results[rate]["failed"] = f"network set-up: {exc}"
                print(f"  FAILED: network set-up: {exc}", flush=True)
    except (KeyboardInterrupt, SystemExit) as exc:  # the network is down already; report what finished
        interrupted = 130 if isinstance(exc, KeyboardInterrupt) else int(exc.code or 1)
        if results:
            results[list(results)[-1]]["failed"] = "interrupted"
        print(f"\ninterrupted ({type(exc).__name__}); the results so far:", flush=True)
    finally:
        if args.keep_logs:
            print(f"ranks' logs kept in {logdir}")
        elif not any("failed" in r or any("failed" in o for o in r["optimizers"].values())
                     for r in results.values()):
            shutil.rmtree(logdir, ignore_errors=True)
        else:
            print(f"ranks' logs in {logdir}")
    for rate, res in results.items():
        if "network" in res:
            print_table(rate, res, args.optimizer_list)
    failed = [f"{rate}" for rate, r in results.items() if "failed" in r]
    failed += [f"{rate}/allreduce" for rate, r in results.items() if "failed" in r.get("allreduce", {})]
    failed += [f"{rate}/{n}" for rate, r in results.items() for n, o in r["optimizers"].items() if "failed" in o]
    meta = {"benchmark": "slow_network", "world": args.world, "width": args.width, "layers": args.layers,
            "params": numel, "batch": args.batch, "batches": args.batches, "lr": args.lr, "warmup": args.warmup,
            "steps": args.steps,
            "freeze_step": args.freeze_step, "local_step_scaler": args.local_step_scaler,
            "local_step_clipper": args.local_step_clipper, "delay_ms": args.delay_ms, "seed": args.seed,
            "comm_plugin": bool(plugins), "microspeed_comm": sources_fingerprint("microspeed_comm"),
            "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "microspeed_core": core_fingerprint(), "wall_s": time.monotonic() - t0,
            "argv": sys.argv[1:], "failed": failed}
    line = json.dumps({**meta, "rates": results})
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(f"\nmicrospeed core {meta['microspeed_core']}, microspeed_comm {meta['microspeed_comm']}, "
          f"total {meta['wall_s']:.0f} s")
    print("BENCH_JSON " + line, flush=True)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return interrupted or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
