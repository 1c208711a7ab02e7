"""Pipeline parallelism: measured bubble of 1F1B, GPipe and interleaved 1F1B, and throughput against DeepSpeed.

Usage (gloo on CPU, one torch thread per rank; the default run takes about 3-5 minutes on 2 cores)::

    python benchmarks/pipeline.py                          # bubble at pp2 and pp4, then throughput vs DeepSpeed
    python benchmarks/pipeline.py --quick                  # smoke run, under a minute
    python benchmarks/pipeline.py --stages 2 --micro-batch-list 1,2,4,8,16 --steps 30
    python benchmarks/pipeline.py --skip-bubble --micro-batches 8 --steps 40   # throughput only
    python benchmarks/pipeline.py --json-out pipeline.json

The model is ``--depth`` identical blocks ``Linear(width, width) -> GELU`` (default 16 blocks of 512, micro-batch
64 rows: a stage's forward of 8 blocks takes about 5 ms on one core, its backward about 10 ms) and an MSE loss
against a random target; every layer is a ``LayerSpec``, seeded with ``--seed + layer index``
(``seed_layers=True``), split uniformly. fp32, ``Adam`` (torch's fused ``AdamW``, weight decay 0: the same
``{"type": "Adam", "params": {"lr": ..., "weight_decay": 0, "torch_adam": true, "fused": true}}`` for both
frameworks), no gradient clipping.

**1. Bubble** (``--stages``, default ``2,4``; each stage count in its own fresh ranks via
:func:`microspeed.testing.run_distributed`). For every schedule (``1f1b``, ``gpipe``, and ``interleaved`` with
``num_chunks=--chunks``, 2) and every number of micro-batches ``m`` in ``--micro-batch-list`` one microspeed
engine is built; then ``--warmup`` + ``--steps`` rounds each run one ``train_batch`` of every engine in turn
(interleaved, so machine load hits all of them alike), each after a ``dist.barrier()``. Per batch and rank the
runtime reports ``timings["compute"]`` (forward + backward seconds) and ``timings["batch"]``; the benchmark also
times ``engine.step()`` (the optimizer) and each rank's forwards and backwards separately, and logs every send
and receive (by wrapping the runtime's ``_forward``, ``_backward``, ``_send_*``, ``_recv_*`` and the engine's
``step`` on the instance; the runtime's own ``compute`` figure is what the bubble uses). With ``T`` the slowest
rank's batch time without its optimizer step:

    measured bubble = 1 - sum over stages of compute / (stages * T)       (median over the timed batches)

and ``incl. step`` the same with the whole ``timings["batch"]``. Printed next to it: the ideal
``(p - 1) / (v * m + p - 1)`` (:func:`ideal_bubble_fraction`; ``v = 1`` for 1F1B and GPipe); :func:`simulate`'s
bubble with its default costs (forward 1, backward 2, free sends: ``sim 1:2``); :func:`simulate` fed the measured
costs (median per-micro-batch forward and backward of a whole stage) and, as the cost of every send, the
one-way latency of an activation-sized ``send``/``recv`` measured by ping-pong between stages 0 and 1
(``sim lat``), or the mean in-pipeline message delay (``sim p2p``). The in-pipeline delay of a message is the end of
its ``recv`` minus the later of its ``isend`` and the ``recv``'s start (one clock: ``time.perf_counter`` is
``CLOCK_MONOTONIC`` on Linux), from logs of every send and receive. Also printed: the coefficient of variation of
one pass's time (``cv F/B``), how long a ``recv`` takes outside the pipeline for a message ``isend`` before it was
posted, with the sender idle or computing (:func:`p2p_late_recv`), and ``desched``, the share of the forward and
backward wall time the ranks were not on a core (``1 - time.thread_time() / wall``).

``pp4`` runs 4 ranks on however many cores the machine has: on 2 cores they are time-sliced (oversubscribed), so
a "busy" second there includes time the rank waited for a core, and the figures describe the machine more than
the schedule.

**2. Throughput against DeepSpeed** (2 ranks, pp2, ``--micro-batches`` per batch). The same layer list, as
``deepspeed.pipe.LayerSpec`` in ``deepspeed.pipe.PipelineModule``, same seed, same partition (uniform), same
micro-batch size, gradient accumulation and optimizer, ``engine.train_batch`` in both. One process group holds
three engines: microspeed 1F1B, microspeed interleaved (``num_chunks=--chunks``) and DeepSpeed. Each step trains
every engine on the same micro-batches, in an order that rotates every step, each ``train_batch`` after a
``dist.barrier()``; its time is the slowest rank's. Reported: median batch time, samples/s, the ratio to
DeepSpeed (microspeed / DeepSpeed in samples/s: above 1 is faster), and the largest relative difference of the
per-step losses from DeepSpeed's (the initial weights are compared first and copied from DeepSpeed's module when
they differ). If DeepSpeed cannot be imported or built, its error is printed and microspeed alone is timed.

Prints the tables and, last, one line ``BENCH_JSON {...}``. Entry-point plugins are not auto-loaded
(``MICROSPEED_DISABLE_PLUGIN_AUTOLOAD=1``, ``MICROSPEED_PLUGINS=pipeline`` unless set). DeepSpeed runs with
``DS_ACCELERATOR=cpu`` and ``deepspeed.init_distributed(dist_backend="gloo")`` on the existing process group; a
stale ``~/.cache/torch_extensions/py311_cpu/*/lock`` left by a killed build makes its first import hang: delete it.
"""

from __future__ import annotations

import os

# Before anything imports torch (or deepspeed); the ranks inherit these.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
os.environ.setdefault("MICROSPEED_PLUGINS", "pipeline")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from microspeed.testing import run_distributed  # noqa: E402

SCHEDULES = ("1f1b", "gpipe", "interleaved")
"""The microspeed schedules whose bubble is measured, in the order they are printed."""


class Block(nn.Module):
    """One layer of the benchmark model: ``Linear(width, width)`` then GELU (identical cost everywhere)."""

    def __init__(self, width: int) -> None:
        """One ``Linear(width, width)``."""
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(fc(x))``."""
        return nn.functional.gelu(self.fc(x))


# ------------------------------------------------------------------------------------------ options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: --steps 5 --warmup 2 --micro-batch-list 2,8 --stages 2 (under a minute)")
    p.add_argument("--steps", type=int, default=None, help="timed batches per engine (default 30; --quick 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed batches per engine first (default 3)")
    p.add_argument("--stages", default=None, help="comma-separated pipeline sizes for the bubble (default 2,4)")
    p.add_argument("--micro-batch-list", default=None,
                   help="comma-separated micro-batches per batch for the bubble (default 1,2,4,8,16)")
    p.add_argument("--micro-batches", type=int, default=8,
                   help="micro-batches per batch (gradient accumulation) for the DeepSpeed comparison")
    p.add_argument("--chunks", type=int, default=2, help="model chunks per rank of the interleaved schedule")
    p.add_argument("--micro", type=int, default=64, help="rows per micro-batch")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=16, help="blocks in the model")
    p.add_argument("--sender-busy-ms", type=float, default=5.0,
                   help="how long the sender computes after its isend when the late-recv cost is measured")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--skip-bubble", action="store_true", help="only the DeepSpeed comparison")
    p.add_argument("--skip-deepspeed", action="store_true", help="only the bubble")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per group of ranks, start-up included")
    p.add_argument("--json-out", default=None, help="also write the BENCH_JSON object to this file")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 5 if args.quick else 30
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3
    if args.stages is None:
        args.stages = "2" if args.quick else "2,4"
    if args.micro_batch_list is None:
        args.micro_batch_list = "2,8" if args.quick else "1,2,4,8,16"
    try:
        args.stage_list = [int(s) for s in args.stages.split(",") if s.strip()]
        args.m_list = [int(s) for s in args.micro_batch_list.split(",") if s.strip()]
    except ValueError:
        p.error("--stages and --micro-batch-list take comma-separated integers")
    for p_ in args.stage_list:
        if p_ < 2 or args.depth % (p_ * args.chunks):
            p.error(f"--stages {p_}: needs >= 2 stages and --depth ({args.depth}) divisible by stages * --chunks")
    if min(args.m_list + [args.micro_batches, args.steps]) < 1 or args.warmup < 0:
        p.error("micro-batch counts and --steps must be >= 1, --warmup >= 0")
    return args


# ------------------------------------------------------------------------------------------ building blocks


def optimizer_section(lr: float) -> dict[str, Any]:
    """The optimizer of both frameworks: torch's fused AdamW, weight decay 0 (ds_config ``optimizer``)."""
    return {"type": "Adam", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True, "fused": True}}


def base_config(args: argparse.Namespace, micro_batches: int) -> dict[str, Any]:
    """The ds_config keys both frameworks get (DeepSpeed also gets ``train_batch_size``)."""
    return {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": micro_batches,
            "optimizer": optimizer_section(args.lr), "steps_per_print": 10**9}


def make_batch(args: argparse.Namespace, step: int, micro_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``micro_batches`` ``(x, y)`` micro-batches of training step ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    return [(torch.randn(args.micro, args.width, generator=g), torch.randn(args.micro, args.width, generator=g))
            for _ in range(micro_batches)]


def build_microspeed(args: argparse.Namespace, stages: int, schedule: str, micro_batches: int) -> tuple[Any, Any]:
    """A microspeed pipeline engine of the benchmark model; ``(engine, module)``."""
    from microspeed_pipeline.module import LayerSpec, PipelineModule

    import microspeed

    chunks = args.chunks if schedule == "interleaved" else 1
    module = PipelineModule([LayerSpec(Block, args.width) for _ in range(args.depth)], num_stages=stages,
                            num_chunks=chunks, loss_fn=nn.MSELoss(), seed_layers=True, base_seed=args.seed,
                            partition_method="uniform")
    config = {**base_config(args, micro_batches), "pipeline": {"schedule": schedule}}
    engine, *_ = microspeed.initialize(model=module, config=config)
    return engine, module


def instrument(engine: Any) -> dict[str, Any]:
    """Time the runtime's passes, receives and sends and the engine's optimizer step (wrapping them on the instance).

    Returns the accumulator: seconds ``fwd``, ``bwd`` (wall; and the sums of squares of each pass's time,
    ``fwd_sq``, ``bwd_sq``) and ``cpu`` (the thread's CPU time in those passes,
    ``time.thread_time``: below their wall time when the rank waited for a core), ``step``, ``recv`` (in receives),
    the counts ``n_fwd``, ``n_bwd``, and the message logs ``sends`` (``(dst stage, kind, chunk at dst, micro-batch,
    time the isend returned)``) and ``recvs`` (``(src stage, kind, chunk, micro-batch, start, end)``), on
    ``time.perf_counter``'s clock (``CLOCK_MONOTONIC`` on Linux: one clock for every process of the host). :func:`reset`
    clears it per batch. The wrappers add a few clock reads per call; the runtime's ``timings["compute"]`` includes
    them.
    """
    runtime = engine.plugin_state("pipeline")
    acc: dict[str, Any] = {}
    reset(acc)
    forward, backward, step = runtime._forward, runtime._backward, engine.step

    def timed_forward(mb: int, chunk: int) -> None:
        """The runtime's forward, timed."""
        c0, t0 = time.thread_time(), time.perf_counter()
        forward(mb, chunk)
        dt = time.perf_counter() - t0
        acc["fwd"] += dt
        acc["fwd_sq"] += dt * dt
        acc["cpu"] += time.thread_time() - c0
        acc["n_fwd"] += 1

    def timed_backward(mb: int, chunk: int) -> None:
        """The runtime's backward, timed."""
        c0, t0 = time.thread_time(), time.perf_counter()
        backward(mb, chunk)
        dt = time.perf_counter() - t0
        acc["bwd"] += dt
        acc["bwd_sq"] += dt * dt
        acc["cpu"] += time.thread_time() - c0
        acc["n_bwd"] += 1

    def timed_step(*a: Any, **kw: Any) -> Any:
        """The engine's optimizer step, timed."""
        t0 = time.perf_counter()
        out = step(*a, **kw)
        acc["step"] += time.perf_counter() - t0
        return out

    def logged_recv(method: Any, kind: str) -> Any:
        """``method`` (a receive of the runtime), timed and logged."""

        def recv(ins: Any) -> None:
            """The runtime's receive, timed."""
            t0 = time.perf_counter()
            method(ins)
            t1 = time.perf_counter()
            acc["recv"] += t1 - t0
            acc["recvs"].append((ins.peer, kind, ins.chunk, ins.micro_batch, t0, t1))

        return recv

    def logged_send(method: Any, kind: str) -> Any:
        """``method`` (a send of the runtime), logged when its ``isend`` returns."""

        def send(ins: Any) -> None:
            """The runtime's send, logged."""
            method(ins)
            acc["sends"].append((ins.peer, kind, ins.peer_chunk, ins.micro_batch, time.perf_counter()))

        return send

    runtime._forward, runtime._backward, engine.step = timed_forward, timed_backward, timed_step
    runtime._recv_activation = logged_recv(runtime._recv_activation, "act")
    runtime._recv_grad = logged_recv(runtime._recv_grad, "grad")
    runtime._send_activation = logged_send(runtime._send_activation, "act")
    runtime._send_grad = logged_send(runtime._send_grad, "grad")
    return acc


def reset(acc: dict[str, Any]) -> None:
    """Clear an :func:`instrument` accumulator."""
    acc.update(fwd=0.0, bwd=0.0, fwd_sq=0.0, bwd_sq=0.0, cpu=0.0, step=0.0, recv=0.0, n_fwd=0, n_bwd=0, sends=[],
               recvs=[])


def message_delays(per_stage: list[Any]) -> list[float]:
    """Seconds each message of one batch took beyond the later of its ``isend`` and the start of its ``recv``.

    ``per_stage[s]`` is stage ``s``'s batch row; sends and receives are matched on (source, destination, kind,
    chunk at the destination, micro-batch).
    """
    sent = {}
    for src, row in enumerate(per_stage):
        for dst, kind, chunk, mb, t in row[9]:
            sent[(src, dst, kind, chunk, mb)] = t
    delays = []
    for dst, row in enumerate(per_stage):
        for src, kind, chunk, mb, t0, t1 in row[10]:
            t_send = sent.get((src, dst, kind, chunk, mb))
            if t_send is not None:
                delays.append(max(0.0, t1 - max(t0, t_send)))
    return delays


def p2p_latency(numel: int, iters: int = 60) -> float:
    """One-way seconds of a ``send``/``recv`` of ``numel`` fp32 values between ranks 0 and 1 (median ping-pong / 2)."""
    rank = dist.get_rank()
    buf = torch.randn(numel)
    times = []
    dist.barrier()
    for i in range(iters + 10):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=1)
            dist.recv(buf, src=1)
        elif rank == 1:
            dist.recv(buf, src=0)
            dist.send(buf, dst=0)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    lat = torch.tensor([statistics.median(times) / 2 if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(lat, src=0)
    return float(lat.item())


def p2p_late_recv(numel: int, width: int, sender_busy_s: float, iters: int = 40) -> float:
    """Median seconds rank 1 spends in ``recv`` of ``numel`` fp32 values that rank 0 ``isend`` earlier.

    Rank 0 ``isend``s, then multiplies ``width``-wide matrices for ``sender_busy_s`` (as a stage computing its
    next pass does; 0: it waits for the send at once); rank 1 computes for ``sender_busy_s / 2`` first, so its
    ``recv`` is posted after the send, the usual case in a pipeline. gloo's TCP transport sends a buffer only once
    both sides have posted (a rendezvous: the receiver's "ready" must be answered by the sender's transport
    thread), so this is the cost of a message that has, in the schedule's terms, already arrived.
    """
    rank = dist.get_rank()
    buf = torch.randn(numel)
    a, w = torch.randn(64, width), torch.randn(width, width)

    def compute(seconds: float) -> None:
        """Matrix products for ``seconds``."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            torch.mm(a, w)

    waits = []
    for i in range(iters + 5):
        dist.barrier()
        if rank == 0:
            work = dist.isend(buf, dst=1)
            compute(sender_busy_s)
            work.wait()
        elif rank == 1:
            compute(sender_busy_s / 2 if sender_busy_s else 0.002)
            t0 = time.perf_counter()
            dist.recv(buf, src=0)
            if i >= 5:
                waits.append(time.perf_counter() - t0)
    out = torch.tensor([statistics.median(waits) if rank == 1 else 0.0], dtype=torch.float64)
    dist.broadcast(out, src=1)
    return float(out.item())


def gather_rows(rows: list[Any]) -> list[list[Any]]:
    """Every rank's ``rows``, indexed by rank (on every rank)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, rows)
    return out


def quiet_deepspeed() -> Any:
    """Import DeepSpeed without its banner; set its loggers to warnings; return the module."""
    with contextlib.redirect_stdout(io.StringIO()):
        import deepspeed
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    with contextlib.suppress(Exception):
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
    return deepspeed


# ------------------------------------------------------------------------------------------ 1. bubble


def bubble_rank(args: argparse.Namespace, stages: int) -> dict[str, Any] | None:
    """One rank of the bubble measurement at ``stages`` stages; rank 0 returns every rank's per-batch rows."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank = dist.get_rank()
    latency = p2p_latency(args.micro * args.width)
    latency_small = p2p_latency(1)
    late_idle = p2p_late_recv(args.micro * args.width, args.width, 0.0)
    late_busy = p2p_late_recv(args.micro * args.width, args.width, args.sender_busy_ms / 1e3)
    engines = []
    for schedule in SCHEDULES:
        for m in args.m_list:
            engine, _module = build_microspeed(args, stages, schedule, m)
            engines.append({"schedule": schedule, "m": m, "engine": engine, "acc": instrument(engine),
                            "data": make_batch(args, 0, m), "rows": []})
    for step in range(args.warmup + args.steps):
        for e in engines:
            reset(e["acc"])
            dist.barrier()
            e["engine"].train_batch(iter(e["data"])).item()
            if step >= args.warmup:
                t = e["engine"].plugin_state("pipeline").timings
                a = e["acc"]
                e["rows"].append([t["compute"], t["batch"], a["step"], a["fwd"], a["bwd"], a["n_fwd"], a["n_bwd"],
                                  a["cpu"], a["recv"], a["sends"], a["recvs"], a["fwd_sq"], a["bwd_sq"]])
    gathered = [gather_rows(e["rows"]) for e in engines]
    if rank != 0:
        return None
    configs = [{"schedule": e["schedule"], "m": e["m"], "per_rank": g} for e, g in zip(engines, gathered, strict=True)]
    return {"stages": stages, "latency": latency, "latency_small": latency_small, "late_idle": late_idle,
            "late_busy": late_busy, "host_cpus": os.cpu_count(), "configs": configs}


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; 0.0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def predicted(stages: int, schedule: str, m: int, chunks: int, fwd: float = 1.0, bwd: float = 2.0,
              send: float = 0.0) -> float:
    """:func:`simulate`'s bubble of ``schedule`` (every stage's program) with the given costs."""
    from microspeed_pipeline.schedule import GPipeSchedule, InterleavedTrainSchedule, TrainSchedule, simulate

    if schedule == "interleaved":
        progs = [InterleavedTrainSchedule(m, stages, s, chunks) for s in range(stages)]
    elif schedule == "gpipe":
        progs = [GPipeSchedule(m, stages, s) for s in range(stages)]
    else:
        progs = [TrainSchedule(m, stages, s) for s in range(stages)]
    return simulate(progs, forward_time=fwd, backward_time=bwd, send_time=send).bubble_fraction


def summarize_bubble(result: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per (schedule, m): medians of the measured bubble, the ideal and the two :func:`simulate` predictions."""
    from microspeed_pipeline.schedule import ideal_bubble_fraction

    p, lat = result["stages"], result["latency"]
    rows = []
    for cfg in result["configs"]:
        per_rank, m, schedule = cfg["per_rank"], cfg["m"], cfg["schedule"]
        v = args.chunks if schedule == "interleaved" else 1
        n = len(per_rank[0])
        bub_ex, bub_in, walls, fwd_mb, bwd_mb, steps, desched, recv, t_pipe, busy_sum, delays = ([] for _ in range(11))
        for i in range(n):
            r = [per_rank[s][i] for s in range(p)]
            busy = sum(x[0] for x in r)
            t_ex = max(x[1] - x[2] for x in r)
            t_in = max(x[1] for x in r)
            bub_ex.append(1 - busy / (p * t_ex))
            t_pipe.append(t_ex)
            busy_sum.append(busy)
            bub_in.append(1 - busy / (p * t_in))
            walls.append(t_in)
            steps.append(max(x[2] for x in r))
            desched.append(1 - sum(x[7] for x in r) / sum(x[3] + x[4] for x in r))
            recv.append(statistics.mean(x[8] for x in r))
            delays += message_delays(r)
            # a whole stage's forward (backward) of one micro-batch, averaged over stages
            fwd_mb.append(statistics.mean(x[3] / x[5] * v for x in r))
            bwd_mb.append(statistics.mean(x[4] / x[6] * v for x in r))
        f, b = statistics.median(fwd_mb), statistics.median(bwd_mb)
        busy_share = [statistics.median(per_rank[s][i][0] for i in range(n)) for s in range(p)]
        sim_lat = predicted(p, schedule, m, args.chunks, f, b, lat)
        delay = statistics.mean(delays) if delays else 0.0
        # spread of one pass's time (one chunk's forward or backward), pooled over stages and batches
        n_f = sum(per_rank[s][i][5] for s in range(p) for i in range(n))
        n_b = sum(per_rank[s][i][6] for s in range(p) for i in range(n))
        mean_f = sum(per_rank[s][i][3] for s in range(p) for i in range(n)) / n_f
        mean_b = sum(per_rank[s][i][4] for s in range(p) for i in range(n)) / n_b
        sd_f = max(0.0, sum(per_rank[s][i][11] for s in range(p) for i in range(n)) / n_f - mean_f ** 2) ** 0.5
        sd_b = max(0.0, sum(per_rank[s][i][12] for s in range(p) for i in range(n)) / n_b - mean_b ** 2) ** 0.5
        # idle time beyond simulate's (with latency), over every stage, per message sent (2 per virtual-stage boundary
        # and micro-batch: the activation and its gradient)
        t_sim = statistics.median(busy_sum) / (p * (1 - sim_lat))
        messages = 2 * m * (p * v - 1)
        rows.append({
            "stages": p, "schedule": schedule, "chunks": v, "m": m,
            "ideal": ideal_bubble_fraction(p, m, v),
            "simulate_1_2": predicted(p, schedule, m, args.chunks),
            "simulate_fb": predicted(p, schedule, m, args.chunks, f, b),
            "simulate_measured": sim_lat,
            "simulate_p2p": predicted(p, schedule, m, args.chunks, f, b, delay),
            "p2p_delay_ms": 1e3 * delay, "p2p_delay_median_ms": 1e3 * quantile(delays, 0.5),
            "p2p_delay_p90_ms": 1e3 * quantile(delays, 0.9),
            "pass_cv_fwd": sd_f / mean_f, "pass_cv_bwd": sd_b / mean_b,
            "measured": statistics.median(bub_ex), "measured_incl_step": statistics.median(bub_in),
            "measured_min": min(bub_ex), "measured_max": max(bub_ex),
            "batch_ms": 1e3 * statistics.median(walls), "step_ms": 1e3 * statistics.median(steps),
            "fwd_ms": 1e3 * f, "bwd_ms": 1e3 * b, "busy_ms_per_stage": [1e3 * x for x in busy_share],
            "samples_per_s": m * args.micro / statistics.median(walls), "batches": n,
            "descheduled": statistics.median(desched), "recv_ms_per_stage": 1e3 * statistics.median(recv),
            "messages": messages, "excess_ms_per_message": 1e3 * p * (statistics.median(t_pipe) - t_sim) / messages,
        })
    return rows


def print_bubble(rows: list[dict[str, Any]], result: dict[str, Any], args: argparse.Namespace) -> None:
    """The bubble table of one stage count."""
    p = result["stages"]
    over = p > (result["host_cpus"] or p)
    print(f"\n== bubble, pp{p} ({p} ranks on {result['host_cpus']} CPUs{', OVERSUBSCRIBED' if over else ''}), "
          f"{args.depth} x Linear({args.width}) blocks, micro-batch {args.micro}, medians of {rows[0]['batches']} "
          f"batches ==")
    print(f"p2p of one activation ({args.micro}x{args.width} fp32), rank 0 -> 1, outside the pipeline: one-way "
          f"latency (ping-pong / 2) {1e3 * result['latency']:.3f} ms ({1e3 * result['latency_small']:.3f} ms for 4 "
          f"bytes); a recv posted after the isend takes {1e3 * result['late_idle']:.3f} ms when the sender waits, "
          f"{1e3 * result['late_busy']:.3f} ms when it computes ({args.sender_busy_ms:g} ms) after its isend")
    print("columns: ideal = (p-1)/(v*m+p-1); sim 1:2 = simulate(forward 1, backward 2, free sends) (the measured "
          "forward and backward with free sends give the same here); sim lat = simulate(measured forward, backward, "
          "ping-pong latency per send); sim p2p = simulate(measured forward, backward, the mean in-pipeline "
          "message delay per send); measured = 1 - sum(compute) / (p * slowest batch time less its optimizer step), "
          "median (range) over batches; incl.step = the same over the whole batch; F, B = a whole stage's forward, "
          "backward of one micro-batch; cv F/B = coefficient of variation of one pass's time; p2p ms = mean (p90) "
          "in-pipeline message delay: end of the recv minus the later of the isend and the recv's start; "
          "desched = share of forward+backward wall time spent off a core")
    head = (f"{'schedule':<16}{'m':>3}{'ideal':>7}{'sim 1:2':>8}{'sim lat':>8}{'sim p2p':>8}{'measured':>9}"
            f"{'(range)':>15}{'incl.step':>10}{'batch ms':>9}{'step ms':>8}{'F ms':>6}{'B ms':>6}"
            f"{'samples/s':>10}{'cv F/B':>11}{'p2p ms (p90)':>14}{'desched':>8}")
    print(head)
    for r in rows:
        name = r["schedule"] + (f" v={r['chunks']}" if r["chunks"] > 1 else "")
        rng = f"[{r['measured_min']:.3f},{r['measured_max']:.3f}]"
        p2p = f"{r['p2p_delay_ms']:.2f} ({r['p2p_delay_p90_ms']:.1f})"
        cv = f"{r['pass_cv_fwd']:.2f}/{r['pass_cv_bwd']:.2f}"
        print(f"{name:<16}{r['m']:>3}{r['ideal']:>7.3f}{r['simulate_1_2']:>8.3f}{r['simulate_measured']:>8.3f}"
              f"{r['simulate_p2p']:>8.3f}{r['measured']:>9.3f}{rng:>15}{r['measured_incl_step']:>10.3f}"
              f"{r['batch_ms']:>9.1f}{r['step_ms']:>8.1f}{r['fwd_ms']:>6.2f}{r['bwd_ms']:>6.2f}"
              f"{r['samples_per_s']:>10.0f}{cv:>11}{p2p:>14}{r['descheduled']:>8.1%}")
    by = {(r["schedule"], r["m"]): r for r in rows}
    pairs = [(m, by[("1f1b", m)]["measured"], by[("interleaved", m)]["measured"]) for m in args.m_list
             if ("1f1b", m) in by and ("interleaved", m) in by]
    if pairs:
        print("interleaved vs 1f1b measured bubble: " + ", ".join(f"m={m}: {i:.3f} vs {o:.3f}" for m, o, i in pairs))


# ------------------------------------------------------------------------------------------ 2. vs DeepSpeed


class _Skipped(Exception):
    """``--skip-deepspeed``: DeepSpeed is not built."""


def build_deepspeed(args: argparse.Namespace, deepspeed: Any) -> tuple[Any, Any]:
    """A DeepSpeed pipeline engine of the same layers; ``(engine, module)``."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its partition and whole config
        module = PipelineModule([LayerSpec(Block, args.width) for _ in range(args.depth)], num_stages=2,
                                loss_fn=nn.MSELoss(), seed_layers=True, base_seed=args.seed,
                                partition_method="uniform")
        config = {**base_config(args, args.micro_batches),
                  "train_batch_size": args.micro * args.micro_batches * (dist.get_world_size() // 2)}
        engine, *_ = deepspeed.initialize(model=module, config=config,
                                          model_parameters=[q for q in module.parameters() if q.requires_grad])
    return engine, module


def compare_rank(args: argparse.Namespace) -> dict[str, Any] | None:
    """One rank of the throughput comparison (pp2): microspeed 1F1B, microspeed interleaved, DeepSpeed."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank = dist.get_rank()
    m = args.micro_batches
    engines: dict[str, Any] = {}
    info: dict[str, Any] = {}
    ms_1f1b, ms_module = build_microspeed(args, 2, "1f1b", m)
    engines["microspeed 1f1b"] = ms_1f1b
    engines[f"microspeed interleaved v={args.chunks}"] = build_microspeed(args, 2, "interleaved", m)[0]
    ds_error = None
    try:
        if args.skip_deepspeed:
            raise _Skipped
        deepspeed = quiet_deepspeed()
        with contextlib.redirect_stdout(io.StringIO()):
            deepspeed.init_distributed(dist_backend="gloo")
        ds_engine, ds_module = build_deepspeed(args, deepspeed)
        torch.set_num_threads(1)
        engines["deepspeed 1f1b"] = ds_engine
        info["deepspeed_optimizer"] = type(ds_engine.optimizer).__name__
        # Same initial weights? (same layer names on the same stage: both partitions are uniform over 2 stages)
        ms_sd, ds_sd = ms_module.state_dict(), ds_module.state_dict()
        common = sorted(set(ms_sd) & set(ds_sd))
        diff = max((float((ms_sd[k] - ds_sd[k]).abs().max()) for k in common), default=float("nan"))
        info["init_max_abs_diff"] = diff
        info["init_tensors_compared"] = len(common)
        if diff != 0.0:  # copy DeepSpeed's weights into the 1F1B module so the losses are comparable
            ms_module.load_state_dict({k: ds_sd[k] for k in common}, strict=False)
            info["init_copied"] = True
    except _Skipped:
        pass
    except Exception as err:  # report what failed, go on with microspeed alone
        ds_error = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=6)}"
    info["optimizer"] = {name: type(getattr(e, "optimizer", None)).__name__ for name, e in engines.items()}
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for step in range(args.warmup + args.steps):
        data = make_batch(args, step, m)
        order = names[step % len(names):] + names[:step % len(names)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            loss = engines[name].train_batch(iter(data))
            value = float(loss.item())
            elapsed = time.perf_counter() - t0
            losses[name].append(value)
            if step >= args.warmup:
                times[name].append(elapsed)
    gathered = gather_rows([times, losses])
    if rank != 0:
        return None
    per_step = {n: [max(g[0][n][i] for g in gathered) for i in range(args.steps)] for n in names}
    return {"names": names, "times": per_step, "losses": gathered[-1][1], "deepspeed_error": ds_error, "info": info,
            "ranks_loss_equal": all(g[1] == gathered[0][1] for g in gathered)}


def summarize_compare(result: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per engine: median batch time, samples/s, ratio to DeepSpeed, per-step ratio medians, loss agreement."""
    samples = args.micro * args.micro_batches
    ds = "deepspeed 1f1b" if "deepspeed 1f1b" in result["names"] else None
    rows = []
    for n in result["names"]:
        t = result["times"][n]
        row: dict[str, Any] = {"engine": n, "batch_ms": 1e3 * statistics.median(t),
                               "samples_per_s": samples / statistics.median(t), "steps": len(t)}
        if ds is not None:
            ref = result["times"][ds]
            row["x_deepspeed"] = statistics.median(ref) / statistics.median(t)
            row["x_deepspeed_paired"] = statistics.median(r / x for r, x in zip(ref, t, strict=True))
            a, b = result["losses"][n], result["losses"][ds]
            row["max_rel_loss_diff"] = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
        rows.append(row)
    return rows


def print_compare(rows: list[dict[str, Any]], result: dict[str, Any], args: argparse.Namespace) -> None:
    """The throughput table."""
    print(f"\n== throughput, pp2 on 2 ranks, {args.micro_batches} micro-batches of {args.micro} rows, "
          f"medians of {rows[0]['steps']} batches (engines alternate every batch) ==")
    print(f"{'engine':<28}{'batch ms':>10}{'samples/s':>11}{'x DS':>8}{'x DS paired':>13}{'max rel loss diff':>19}")
    for r in rows:
        xds = f"{r['x_deepspeed']:.3f}" if "x_deepspeed" in r else "-"
        xdp = f"{r['x_deepspeed_paired']:.3f}" if "x_deepspeed_paired" in r else "-"
        dl = f"{r['max_rel_loss_diff']:.2e}" if "max_rel_loss_diff" in r else "-"
        print(f"{r['engine']:<28}{r['batch_ms']:>10.1f}{r['samples_per_s']:>11.0f}{xds:>8}{xdp:>13}{dl:>19}")
    first = {n: [round(x, 6) for x in result["losses"][n][:4]] for n in result["names"]}
    print(f"first losses: {first}")
    print(f"info: {result['info']}; losses identical on both ranks: {result['ranks_loss_equal']}")
    if result["deepspeed_error"]:
        print(f"DeepSpeed failed:\n{result['deepspeed_error']}")


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    """Run the bubble measurement(s), then the DeepSpeed comparison; print tables and ``BENCH_JSON``."""
    args = parse_args(argv)
    started = time.time()
    out: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "loadavg_start": os.getloadavg()},
        "model": {"depth": args.depth, "width": args.width, "micro": args.micro, "chunks": args.chunks},
        "bubble": [], "throughput": None,
    }
    failed = False
    if not args.skip_bubble:
        for p in args.stage_list:
            try:
                result = run_distributed(bubble_rank, world_size=p, args=(args, p), timeout=args.timeout)[0]
            except Exception as err:  # report it and go on with the other measurements
                print(f"\npp{p} bubble failed: {err}")
                failed = True
                continue
            rows = summarize_bubble(result, args)
            print_bubble(rows, result, args)
            out["bubble"].append({"stages": p, "rows": rows, **{f"{k}_s": result[k] for k in (
                "latency", "latency_small", "late_idle", "late_busy")}})
    try:
        result = run_distributed(compare_rank, world_size=2, args=(args,), timeout=args.timeout)[0]
        rows = summarize_compare(result, args)
        print_compare(rows, result, args)
        out["throughput"] = {"rows": rows, "deepspeed_error": result["deepspeed_error"], "info": result["info"],
                             "first_losses": {n: v[:4] for n, v in result["losses"].items()}}
        failed = failed or bool(result["deepspeed_error"])
    except Exception as err:  # report it
        print(f"\nthroughput comparison failed: {err}")
        failed = True
    out["machine"]["loadavg_end"] = os.getloadavg()
    out["wall_s"] = time.time() - started
    print(f"\nwall {out['wall_s']:.0f} s; load average {out['machine']['loadavg_start'][0]:.2f} at start, "
          f"{out['machine']['loadavg_end'][0]:.2f} at end")
    line = json.dumps(out, default=str)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print("BENCH_JSON " + line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
