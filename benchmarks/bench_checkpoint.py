"""Checkpoint saves: time training is blocked, total write time, bytes per rank; microspeed vs DeepSpeed.

Run everything (world sizes 1, 2 and 4, each under torchrun, CPU/gloo)::

    export TORCH_EXTENSIONS_DIR=$PWD/build/torch_extensions DS_ACCELERATOR=cpu
    python benchmarks/bench_checkpoint.py [--model demo|gpt45m --world-sizes 1,2,4 --repeats 5 --dir /tmp/bench_ckpt]

or one world size by hand::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_checkpoint.py --worker

Models: ``demo`` is ``GPT(GPTConfig.demo())`` (484k parameters, tied embedding); ``gpt45m`` is a 44.6M-parameter
GPT (9 layers, width 640, byte vocabulary). fp32, Adam (``torch.optim.AdamW`` for both frameworks: DeepSpeed gets
``"torch_adam": true``), after 2 training steps so the optimizer state exists; one thread per rank. Frameworks
(one engine at a time, to bound memory): ``microspeed`` (a synchronous save), ``microspeed_async``
(``"checkpoint": {"async_save": true}``), DeepSpeed 0.19.8 ZeRO-0 (plain data parallelism) and ZeRO-2
(optimizer state and gradients sharded). Each does one untimed save and load first (imports, first-call costs,
buffers), then ``--repeats`` rounds of:

- **blocked**: the ``save_checkpoint()`` call, timed between two barriers on every rank; the slowest rank counts.
  For a synchronous save (DeepSpeed's, microspeed's without ``async_save``) that is the whole save.
- **write total**: from the start of ``save_checkpoint()`` until the files are complete and ``latest`` names
  the tag (``engine.wait_for_checkpoint()`` right after the save; the same as *blocked* for synchronous saves).
- **load**: ``load_checkpoint()`` of that tag.

A microspeed save is durable when it completes (each file ``fsync``-ed, ``latest`` replaced atomically);
DeepSpeed's ``torch.save`` does not ``fsync``. Bytes per rank are the files each rank wrote (microspeed
``__<rank>_0.distcp``, rank 0 also ``.metadata`` and the manifest; DeepSpeed ``mp_rank_00_*`` and its copied
``zero_to_fp32.py`` scripts on rank 0, ``zero_pp_rank_<r>_*`` on rank r). **Disk**: before the jobs, the
launcher writes as many bytes as the largest checkpoint to ``--dir`` in 4 MiB blocks and ``fsync``-s (``dd
conv=fsync``), three times, and again after the jobs; the better median is the sequential bandwidth the
write total is compared with ("vs disk"; DeepSpeed's writes end in the page cache, so theirs can exceed 100 %).
Reported: medians over ``--repeats``.

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

FRAMEWORKS = ("microspeed", "microspeed_async", "deepspeed_zero0", "deepspeed_zero2")
"""What is measured, in table order (the DeepSpeed rows are skipped when it is not installed)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help="run as one torchrun rank (else: launch torchrun jobs)")
    p.add_argument("--world-sizes", default="1,2,4", help="launcher: comma-separated world sizes")
    p.add_argument("--repeats", type=int, default=5, help="saves and loads per framework")
    p.add_argument("--dir", default="/tmp/bench_checkpoint", help="scratch folder for checkpoints")
    p.add_argument("--model", default="demo", choices=("demo", "gpt45m"), help="the model to checkpoint")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                   help="comma-separated subset of " + ",".join(FRAMEWORKS))
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------ worker


def _batch(step: int, rank: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 256, (4, seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _config(name: str) -> Any:
    from microspeed.models import GPTConfig

    if name == "demo":
        return GPTConfig.demo()
    return GPTConfig(vocab_size=256, seq_len=128, n_layer=9, n_head=10, d_model=640)


def _microspeed(model: torch.nn.Module, asynchronous: bool) -> Any:
    import microspeed

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "checkpoint": {"async_save": asynchronous}}
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
        if framework.startswith("microspeed"):
            rank = int(name.split("_")[2]) if name.startswith("__") and name.endswith(".distcp") else 0
        else:
            rank = int(name.split("_")[3]) if "zero_pp_rank_" in name else 0
        out[rank] += size
    if not framework.startswith("microspeed"):  # DeepSpeed copies its recovery scripts next to the tag, from rank 0
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
    """One rank: for each framework, build the engine, train 2 steps, then save/load ``--repeats`` times."""
    from microspeed import comm
    from microspeed.models import GPT

    comm.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # as many ranks as cores (or more): one thread each keeps copies from contending
    frameworks = [f for f in opts.frameworks.split(",") if f]
    if importlib.util.find_spec("deepspeed") is None:
        frameworks = [f for f in frameworks if not f.startswith("deepspeed")]
    config = _config(opts.model)
    root = os.path.join(opts.dir, f"w{world}")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    params = sum(p.numel() for p in GPT(config).parameters())
    for name in frameworks:
        torch.manual_seed(0)
        model = GPT(config)
        if name.startswith("microspeed"):
            engine = _microspeed(model, name.endswith("async"))
        else:
            engine = _deepspeed(model, int(name[-1]))
        for step in range(2):
            x, y = _batch(step, rank, config.seq_len)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        wait = engine.wait_for_checkpoint if name.startswith("microspeed") else (lambda: None)
        warm = os.path.join(root, "warmup", name)
        engine.save_checkpoint(warm, tag="w")
        wait()
        engine.load_checkpoint(warm, tag="w")
        r: dict[str, list] = {"blocked": [], "total": [], "load": [], "bytes": []}
        save_dir = os.path.join(root, name)
        for i in range(opts.repeats):
            tag = f"r{i}"
            dist.barrier()
            start = time.perf_counter()
            engine.save_checkpoint(save_dir, tag=tag)
            blocked = time.perf_counter() - start
            wait()
            total = time.perf_counter() - start
            times = torch.tensor([blocked, total], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            dist.barrier()
            r["blocked"].append(float(times[0]))
            r["total"].append(float(times[1]))
            r["load"].append(_timed(lambda e=engine, d=save_dir, t=tag: e.load_checkpoint(d, tag=t)))
            dist.barrier()
            if rank == 0:
                r["bytes"].append(_bytes_per_rank(os.path.join(save_dir, tag), name, world))
                shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
            dist.barrier()
        if rank == 0:
            row = {"framework": name, "model": opts.model, "world_size": world, "repeats": opts.repeats,
                   "params": params, "blocked_s": statistics.median(r["blocked"]),
                   "total_s": statistics.median(r["total"]), "load_s": statistics.median(r["load"]),
                   "bytes_per_rank": r["bytes"][-1], "blocked_all": r["blocked"], "total_all": r["total"],
                   "load_all": r["load"]}
            print("BENCH_JSON " + json.dumps(row), flush=True)
        del engine, model
        dist.barrier()


def disk_bandwidth(folder: str, nbytes: int, repeats: int = 3) -> float:
    """Sequential write bandwidth of ``folder``'s disk, bytes/s: ``nbytes`` in 4 MiB blocks, then fsync (median)."""
    os.makedirs(folder, exist_ok=True)
    block = os.urandom(4 << 20)
    speeds = []
    for _ in range(repeats):
        path = os.path.join(folder, "dd.bin")
        start = time.perf_counter()
        with open(path, "wb") as fh:
            written = 0
            while written < nbytes:
                written += fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        speeds.append(written / (time.perf_counter() - start))
        os.remove(path)
    return statistics.median(speeds)


# ---------------------------------------------------------------------------------- launcher


def _markdown(rows: list[dict[str, Any]], disk: float) -> str:
    lines = ["| model | world | framework | blocked (s) | write total (s) | write MB/s | vs disk | load (s) | "
             "bytes per rank (MiB) | total (MiB) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["world_size"], FRAMEWORKS.index(r["framework"]))):
        per_rank = " / ".join(f"{b / 2**20:,.1f}" for b in r["bytes_per_rank"])
        total = sum(r["bytes_per_rank"])
        speed = total / r["total_s"]
        lines.append(f"| {r['model']} | {r['world_size']} | {r['framework']} | {r['blocked_s']:.3f} | "
                     f"{r['total_s']:.3f} | {speed / 1e6:,.0f} | {speed / disk:.0%} | {r['load_s']:.3f} | "
                     f"{per_rank} | {total / 2**20:,.1f} |")
    return "\n".join(lines)


def launcher(opts: argparse.Namespace) -> int:
    """Run one torchrun job per world size and print the table."""
    rows = []
    config = _config(opts.model)
    from microspeed.models import GPT

    nbytes = 3 * 4 * sum(p.numel() for p in GPT(config).parameters())  # weights and two Adam moments, fp32
    disk_before = disk_bandwidth(opts.dir, nbytes)
    for world in [int(w) for w in opts.world_sizes.split(",")]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               os.path.abspath(__file__), "--worker", "--repeats", str(opts.repeats), "--dir", opts.dir,
               "--frameworks", opts.frameworks, "--model", opts.model]
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
    disk_after = disk_bandwidth(opts.dir, nbytes)
    disk = max(disk_before, disk_after)  # the better of the two: the stricter reference
    disk_row = {"disk_bytes_per_s": disk, "disk_before": disk_before, "disk_after": disk_after,
                "disk_test_bytes": nbytes}
    print(f"BENCH_JSON {json.dumps(disk_row)}")
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"python {platform.python_version()}\n")
    print(f"disk: {disk / 1e6:,.0f} MB/s sequential write with fsync ({nbytes / 2**20:,.0f} MiB, 4 MiB blocks; "
          f"{disk_before / 1e6:,.0f} before the jobs, {disk_after / 1e6:,.0f} after)\n")
    print(_markdown(rows, disk))
    return 0


if __name__ == "__main__":
    args = parse_args()
    if args.worker:
        worker(args)
    else:
        sys.exit(launcher(args))
