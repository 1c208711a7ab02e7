"""Stage 3's forward, backward and step, alone or beside a DDP model stepped in the same ranks, phase by phase.

Usage::

    python benchmarks/zero3_phase_probe.py --beside ddp --steps 14 [--model demo] [--world 2]

Builds ``benchmarks/zero.py``'s model twice per rank: a ZeRO-3 engine (``zero.py``'s config) and, with ``--beside
ddp``, a torch ``DistributedDataParallel`` copy that takes one step before each of the engine's (as ``zero.py
--schedule interleaved`` alternates them); ``--beside none`` steps the engine alone. Prints, per rank and phase, the
median wall time, process CPU and system CPU, minor page faults and context switches of the engine's steps after the
first two. This is how stage 3's interleaved outliers were traced to its backward refaulting its gradients (see
BENCHMARKS.md, "Stage 3 beside DDP"); ``MICROSPEED_ZERO_SHM=0`` in the environment compares gloo's transport.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import zero as Z  # noqa: E402

from microspeed.testing import run_distributed  # noqa: E402

PHASES = ("forward", "backward", "step")


def _usage() -> list[float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return [time.perf_counter(), r.ru_utime + r.ru_stime, r.ru_stime, r.ru_minflt, r.ru_nvcsw + r.ru_nivcsw]


def rank_body(beside: str, steps: int, model: str) -> list[list[list[float]]]:
    """One rank: build the engine (and the DDP model), step them, return each step's per-phase usage deltas."""
    import microspeed

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    args = Z.parse_args(["--model", model, "--world", str(world)])
    batches = Z.make_batches(steps, args.micro * world, Z.model_config(args.small).seq_len)
    other: Any = None
    if beside == "ddp":
        torch.manual_seed(args.seed)
        other, _ = Z.build_engine("ddp", Z.build_model(args), args)
    torch.manual_seed(args.seed)
    engine, *_ = microspeed.initialize(model=Z.build_model(args),
                                       config=Z.ds_config(3, args.reduce_bucket, args, world, deepspeed=False))
    lo, hi = rank * args.micro, (rank + 1) * args.micro
    rows = []
    for x, y in batches:
        if other is not None:
            dist.barrier()
            other(x[lo:hi], y[lo:hi])
        dist.barrier()
        a = _usage()
        loss = engine(x[lo:hi], y[lo:hi])
        b = _usage()
        engine.backward(loss)
        c = _usage()
        engine.step()
        d = _usage()
        rows.append([[q - p for p, q in zip(u, v, strict=True)] for u, v in ((a, b), (b, c), (c, d))])
    dist.barrier()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the probe and print its table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--beside", choices=("none", "ddp"), default="ddp")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--model", choices=("demo", "mha", "mlp"), default="demo")
    p.add_argument("--world", type=int, default=2)
    opts = p.parse_args(argv)
    ranks = run_distributed(rank_body, world_size=opts.world, args=(opts.beside, opts.steps, opts.model), timeout=900)
    print(f"stage 3 beside {opts.beside}, {opts.model}, {opts.world} ranks, {opts.steps} steps (first 2 dropped), "
          f"shared-memory exchange {'off' if os.environ.get('MICROSPEED_ZERO_SHM') == '0' else 'on'}")
    print("rank phase     wall ms  max ms   CPU ms   sys ms   faults  switches")
    for r, rows in enumerate(ranks):
        rows = rows[2:]
        for i, name in enumerate(PHASES):
            col = [row[i] for row in rows]

            def med(k: int, col: list[list[float]] = col) -> float:
                return statistics.median(v[k] for v in col)

            print(f"{r:4d} {name:8s} {1e3 * med(0):8.0f} {1e3 * max(v[0] for v in col):7.0f} {1e3 * med(1):8.0f} "
                  f"{1e3 * med(2):8.0f} {med(3):8.0f} {med(4):9.0f}")
        print(f"     backward ms by step: {[round(1e3 * row[1][0]) for row in rows]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
