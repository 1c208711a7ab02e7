"""Checkpoint save / load time and bytes written per rank: microspeed (DCP) vs DeepSpeed, same model.

Run everything (world sizes 1, 2 and 4, each under torchrun, CPU/gloo)::

    python benchmarks/bench_checkpoint.py [--world-sizes 1,2,4 --repeats 5 --dir /tmp/bench_ckpt]

or one world size by hand::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_checkpoint.py --worker

The model is the demo GPT (``GPT(GPTConfig.demo())``, 484k parameters, tied embedding), fp32, Adam
(``torch.optim.AdamW`` for both: DeepSpeed gets ``"torch_adam": true``), after 2 training steps so the
optimizer state exists; one thread per rank; one untimed save and load per framework first (imports,
first-call costs). In each torchrun job, the frameworks run in the same processes, interleaved:
repeat ``i`` saves and loads microspeed, then DeepSpeed ZeRO-0 (the same plain data parallelism), then
DeepSpeed ZeRO-1 (optimizer state sharded over ranks). A save or load is timed on every rank between two
barriers; its time is the slowest rank's. A save includes what each framework does to be durable:
microspeed's DCP writer fsyncs its files and publishes ``latest`` atomically; DeepSpeed's ``torch.save``
does not fsync. Bytes per rank are the files each rank wrote (DCP ``__<rank>_*.distcp``, rank 0 also
``.metadata`` and the manifest; DeepSpeed ``mp_rank_00_*`` and its copied ``zero_to_fp32.py`` scripts on
rank 0, ``zero_pp_rank_<r>_*`` on rank r). Reported: medians over ``--repeats``.

The launcher prints a Markdown table (and ``BENCH_JSON`` lines with every number).
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed
os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")  # the core and built-ins only

import argparse  # noqa: E402
import glob  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

FRAMEWORKS = ("microspeed", "deepspeed_zero0", "deepspeed_zero1")
"""What is measured, in table order (the DeepSpeed rows are skipped when it is not installed)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help="run as one torchrun rank (else: launch torchrun jobs)")
    p.add_argument("--world-sizes", default="1,2,4", help="launcher: comma-separated world sizes")
    p.add_argument("--repeats", type=int, default=5, help="saves and loads per framework")
    p.add_argument("--dir", default="/tmp/bench_checkpoint", help="scratch folder for checkpoints")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                   help="comma-separated subset of " + ",".join(FRAMEWORKS))
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------ worker


def _batch(step: int, rank: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 256, (4, seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _microspeed(model: torch.nn.Module) -> Any:
    import microspeed

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    return microspeed.initialize(model=model, config=cfg)[0]


def _deepspeed(model: torch.nn.Module, stage: int) -> Any:
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "zero_optimization": {"stage": stage},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "fused": True}}}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _bytes_per_rank(tag_dir: str, framework: str, world: int) -> list[int]:
    out = [0] * world
    for path in glob.glob(os.path.join(tag_dir, "**", "*"), recursive=True) + glob.glob(os.path.join(tag_dir, ".*")):
        if not os.path.isfile(path):
            continue
        name, size = os.path.basename(path), os.path.getsize(path)
        if framework == "microspeed":
            rank = int(name.split("_")[2]) if name.startswith("__") and name.endswith(".distcp") else 0
        else:
            rank = int(name.split("_")[3]) if "zero_pp_rank_" in name else 0
        out[rank] += size
    if framework != "microspeed":  # DeepSpeed copies its recovery scripts next to the tag, from rank 0
        out[0] += sum(os.path.getsize(p) for p in glob.glob(os.path.join(os.path.dirname(tag_dir), "*.py")))
    return out


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def worker(opts: argparse.Namespace) -> None:
    """One rank: build each framework's engine, train 2 steps, then save/load ``--repeats`` times."""
    from microspeed import comm
    from microspeed.demo.model import GPT, GPTConfig

    comm.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # as many ranks as cores (or more): one thread each keeps copies from contending
    frameworks = [f for f in opts.frameworks.split(",") if f]
    if importlib.util.find_spec("deepspeed") is None:
        frameworks = [f for f in frameworks if not f.startswith("deepspeed")]
    config = GPTConfig.demo()
    engines = {}
    for name in frameworks:
        torch.manual_seed(0)
        model = GPT(config)
        engine = _microspeed(model) if name == "microspeed" else _deepspeed(model, int(name[-1]))
        for step in range(2):
            x, y = _batch(step, rank, config.seq_len)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        engines[name] = engine
    root = os.path.join(opts.dir, f"w{world}")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    for name, engine in engines.items():  # warm-up (imports, first-call costs), not timed
        engine.save_checkpoint(os.path.join(root, "warmup", name), tag="w")
        engine.load_checkpoint(os.path.join(root, "warmup", name), tag="w")
    results: dict[str, dict[str, list]] = {n: {"save": [], "load": [], "bytes": []} for n in frameworks}
    for i in range(opts.repeats):
        for name, engine in engines.items():
            save_dir, tag = os.path.join(root, name), f"r{i}"
            results[name]["save"].append(_timed(lambda e=engine, d=save_dir, t=tag: e.save_checkpoint(d, tag=t)))
            results[name]["load"].append(_timed(lambda e=engine, d=save_dir, t=tag: e.load_checkpoint(d, tag=t)))
            dist.barrier()
            if rank == 0:
                results[name]["bytes"].append(_bytes_per_rank(os.path.join(save_dir, tag), name, world))
                shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
            dist.barrier()
    if rank == 0:
        params = sum(p.numel() for p in GPT(config).parameters())
        for name, r in results.items():
            row = {"framework": name, "world_size": world, "repeats": opts.repeats, "params": params,
                   "save_s": statistics.median(r["save"]), "load_s": statistics.median(r["load"]),
                   "bytes_per_rank": r["bytes"][-1], "save_all": r["save"], "load_all": r["load"]}
            print("BENCH_JSON " + json.dumps(row), flush=True)
    dist.barrier()


# ---------------------------------------------------------------------------------- launcher


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| world | framework | save (median s) | load (median s) | bytes written per rank (KiB) | total (KiB) |",
             "|---:|---|---:|---:|---|---:|"]
    for r in sorted(rows, key=lambda r: (r["world_size"], FRAMEWORKS.index(r["framework"]))):
        per_rank = " / ".join(f"{b / 1024:,.0f}" for b in r["bytes_per_rank"])
        lines.append(f"| {r['world_size']} | {r['framework']} | {r['save_s']:.3f} | {r['load_s']:.3f} | {per_rank} | "
                     f"{sum(r['bytes_per_rank']) / 1024:,.0f} |")
    return "\n".join(lines)


def launcher(opts: argparse.Namespace) -> int:
    """Run one torchrun job per world size and print the table."""
    rows = []
    for world in [int(w) for w in opts.world_sizes.split(",")]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               os.path.abspath(__file__), "--worker", "--repeats", str(opts.repeats), "--dir", opts.dir,
               "--frameworks", opts.frameworks]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        found = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
                 if line.startswith("BENCH_JSON")]
        if proc.returncode or not found:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode or 1
        for row in found:
            print("BENCH_JSON " + json.dumps(row))
        rows += found
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"python {platform.python_version()}\n")
    print(_markdown(rows))
    return 0


if __name__ == "__main__":
    args = parse_args()
    if args.worker:
        worker(args)
    else:
        sys.exit(launcher(args))
