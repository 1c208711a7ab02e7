"""ZeRO over the data axis of a pipeline: pp2 x dp2 with ZeRO-1, 2 and 3 against DeepSpeed's pp2 x dp2 ZeRO-1.

Usage (4 ranks, gloo on CPU, one torch thread per rank; about 2-4 minutes on 2 cores)::

    python benchmarks/pipeline_zero.py                        # speed and memory, all engines
    python benchmarks/pipeline_zero.py --quick                # smoke run
    python benchmarks/pipeline_zero.py --skip-deepspeed --json-out pz.json

DeepSpeed's ``PipelineEngine`` refuses ZeRO stages 2 and 3 ("ZeRO-2 and ZeRO-3 are incompatible with pipeline
parallelism"), so its pp2 x dp2 ZeRO-1 is the most it can run; microspeed runs all three stages on the same
layers. The model is the one of ``benchmarks/pipeline.py``: ``--depth`` blocks ``Linear(width, width) -> GELU``,
MSE loss against a random target, every layer a ``LayerSpec`` seeded with ``--seed + index`` (the same initial
weights in both frameworks), uniform partition over 2 stages; fp32, Adam (torch's fused AdamW, weight decay 0),
``--micro-batches`` micro-batches of ``--micro`` rows per data-parallel rank and batch.

**Speed.** One process group of 4 ranks holds every engine. Each step trains every engine on the same
micro-batches (each data-parallel rank its own), in an order that rotates every step, each ``train_batch`` after a
``dist.barrier()``; a batch's time is the slowest rank's. Reported: median batch time, the ratio to DeepSpeed's
ZeRO-1 (DeepSpeed's median / ours: above 1 is faster), the median of the per-step ratios, and the largest relative
difference of the per-step losses from microspeed's ZeRO-1 (every engine should train the same numbers).

**Gathers.** For ZeRO-3, per batch and rank (medians): the all-gathers of parameter segments, those that ran
synchronously (the segment was needed and neither prefetched nor kept from the pass before), and the most
elements gathered at once. The pipeline announces each pass and the next one, so ZeRO-3 keeps what the next
pass uses first and prefetches across passes, within ``stage3_max_live_parameters`` (``--stage3-max-live``).

**Memory.** Per rank, the model-state bytes microspeed's ZeRO accounts for (``microspeed.zero.memory_breakdown``:
parameters, gradient accumulators, fp32 masters and Adam state, counted by storage), against the accounting for
``P`` parameters of this stage and Adam in fp32 (4 bytes parameter, 4 gradient, 8 state):

    ZeRO-1: 4P + 4P + 8P/dp        ZeRO-2: 4P + 4P/dp + 8P/dp        ZeRO-3: (4P + 4P + 8P)/dp

so ZeRO-3's per-rank model state is ``16 * params / (pp * dp)`` when the stages are even. ZeRO-3 runs with
``stage3_param_persistence_threshold: 0`` so that every parameter is partitioned, as the accounting assumes
(DeepSpeed's default, 1e5 elements, keeps the small ones of ``--quick`` whole on every rank). The ratio measured /
accounted is printed per rank (the issue's bound: within 10 %).

Prints the tables and, last, ``BENCH_JSON {...}``. DeepSpeed runs with ``DS_ACCELERATOR=cpu`` and
``deepspeed.init_distributed(dist_backend="gloo")`` on the existing process group.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
os.environ.setdefault("MICROSPEED_PLUGINS", "pipeline,zero")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline import Block, optimizer_section, quiet_deepspeed  # noqa: E402

from microspeed.testing import run_distributed  # noqa: E402

STAGES = (1, 2, 3)
"""The ZeRO stages microspeed runs in the pipeline."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: small model, 3 timed steps")
    p.add_argument("--steps", type=int, default=None, help="timed batches per engine (default 20; --quick 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches per engine first")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per batch (gradient accumulation)")
    p.add_argument("--micro", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--width", type=int, default=None, help="block width (default 512; --quick 128)")
    p.add_argument("--depth", type=int, default=8, help="blocks in the model (split over 2 stages)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--stages", default="1,2,3", help="comma-separated microspeed ZeRO stages")
    p.add_argument("--stage3-max-live", type=float, default=None,
                   help="ZeRO-3's stage3_max_live_parameters (elements; default: ZeRO's, 1e9)")
    p.add_argument("--skip-deepspeed", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else 20)
    args.width = args.width or (128 if args.quick else 512)
    args.stage_list = [int(s) for s in args.stages.split(",") if s.strip()]
    if args.depth % 2 or any(s not in STAGES for s in args.stage_list):
        p.error("--depth must be even; --stages takes values among 1,2,3")
    return args


def _config(args: argparse.Namespace, stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.micro_batches,
            "optimizer": optimizer_section(args.lr), "steps_per_print": 10**9,
            "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}),
                                  **({"stage3_max_live_parameters": args.stage3_max_live}
                                     if stage == 3 and args.stage3_max_live else {})}}


def _layers(spec: Any, args: argparse.Namespace) -> list[Any]:
    return [spec(Block, args.width) for _ in range(args.depth)]


def build_microspeed(args: argparse.Namespace, stage: int) -> tuple[Any, Any]:
    """A microspeed pp2 engine (data axis = world / 2) with ZeRO ``stage``; ``(engine, module)``."""
    from microspeed_pipeline.module import LayerSpec, PipelineModule

    import microspeed

    module = PipelineModule(_layers(LayerSpec, args), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True,
                            base_seed=args.seed, partition_method="uniform")
    module.params_this_stage = sum(p.numel() for p in module.parameters())  # before ZeRO-3 partitions them
    engine, *_ = microspeed.initialize(model=module, config=_config(args, stage))
    return engine, module


def build_deepspeed(args: argparse.Namespace, deepspeed: Any) -> tuple[Any, Any]:
    """DeepSpeed's pp2 engine with ZeRO-1 over the same layers; ``(engine, module)``."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    with contextlib.redirect_stdout(io.StringIO()):
        module = PipelineModule(_layers(LayerSpec, args), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True,
                                base_seed=args.seed, partition_method="uniform")
        config = {**_config(args, 1),
                  "train_batch_size": args.micro * args.micro_batches * (dist.get_world_size() // 2)}
        engine, *_ = deepspeed.initialize(model=module, config=config,
                                          model_parameters=[q for q in module.parameters() if q.requires_grad])
    return engine, module


def make_batch(args: argparse.Namespace, step: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's micro-batches of ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step * 101 + dp_rank)
    return [(torch.randn(args.micro, args.width, generator=g), torch.randn(args.micro, args.width, generator=g))
            for _ in range(args.micro_batches)]


def accounted(stage: int, params: int, dp: int) -> int:
    """Model-state bytes per rank for ``params`` fp32 parameters with Adam under ZeRO ``stage`` (see the docstring)."""
    if stage == 1:
        return 4 * params + 4 * params + 8 * params // dp
    if stage == 2:
        return 4 * params + (4 * params + 8 * params) // dp
    return 16 * params // dp


def bench_rank(args: argparse.Namespace) -> dict[str, Any] | None:
    """One rank: build the engines, alternate their batches, account their memory."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import microspeed_zero

    rank = dist.get_rank()
    engines: dict[str, Any] = {}
    errors: dict[str, str] = {}
    memory: dict[str, Any] = {}
    for stage in args.stage_list:
        name = f"microspeed pp2 dp2 ZeRO-{stage}"
        try:
            engine, module = build_microspeed(args, stage)
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"
            continue
        engines[name] = engine
        params = module.params_this_stage
        dp = engine.topology.data_parallel_size
        memory[name] = {"stage": stage, "params_this_stage": params, "dp": dp,
                        "breakdown": microspeed_zero.memory_breakdown(engine)}
    dp_rank = next(iter(engines.values())).topology.data_parallel_rank if engines else rank % 2
    if not args.skip_deepspeed:
        try:
            deepspeed = quiet_deepspeed()
            with contextlib.redirect_stdout(io.StringIO()):
                deepspeed.init_distributed(dist_backend="gloo")
            engines["DeepSpeed pp2 dp2 ZeRO-1"] = build_deepspeed(args, deepspeed)[0]
            torch.set_num_threads(1)
        except Exception as err:
            errors["DeepSpeed pp2 dp2 ZeRO-1"] = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    gathers: dict[str, list[dict[str, int]]] = {}  # ZeRO-3: all-gathers, synchronous ones, peak gathered elements
    parts = {n: e.plugin_state("zero").stage3 for n, e in engines.items() if n in memory and memory[n]["stage"] == 3}
    for step in range(args.warmup + args.steps):
        data = make_batch(args, step, dp_rank)
        order = names[step % len(names):] + names[:step % len(names)]
        for name in order:
            if name in parts:
                parts[name].stats.update(gathers=0, sync=0, peak_live=0)
            dist.barrier()
            t0 = time.perf_counter()
            loss = float(engines[name].train_batch(iter(data)).item())
            elapsed = time.perf_counter() - t0
            losses[name].append(loss)
            if step >= args.warmup:
                times[name].append(elapsed)
                if name in parts:
                    gathers.setdefault(name, []).append(dict(parts[name].stats))
    for name, entry in memory.items():  # after training: optimizer state exists
        entry["breakdown"] = microspeed_zero.memory_breakdown(engines[name])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"times": times, "losses": losses, "memory": memory, "gathers": gathers})
    if rank != 0:
        return None
    per_step = {n: [max(g["times"][n][i] for g in gathered) for i in range(args.steps)] for n in names}
    return {"names": names, "times": per_step, "losses": gathered[0]["losses"], "errors": errors,
            "memory": [g["memory"] for g in gathered], "gathers": [g["gathers"] for g in gathered]}


def summarize(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Speed rows (ratios to DeepSpeed) and memory rows (measured / accounted per rank)."""
    names, times = result["names"], result["times"]
    ds = "DeepSpeed pp2 dp2 ZeRO-1" if "DeepSpeed pp2 dp2 ZeRO-1" in names else None
    ref_losses = result["losses"][names[0]] if names else []
    speed = []
    for n in names:
        row: dict[str, Any] = {"engine": n, "batch_ms": 1e3 * statistics.median(times[n])}
        if ds is not None:
            row["x_deepspeed"] = statistics.median(times[ds]) / statistics.median(times[n])
            row["x_deepspeed_paired"] = statistics.median(r / x for r, x in zip(times[ds], times[n], strict=True))
        row["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(result["losses"][n], ref_losses,
                                                                           strict=True))
        speed.append(row)
    memory = []
    for rank, per in enumerate(result["memory"]):
        for n, entry in per.items():
            b = entry["breakdown"]
            measured = b["parameters"] + b["gradients"] + b["optimizer_states"]
            acc = accounted(entry["stage"], entry["params_this_stage"], entry["dp"])
            memory.append({"engine": n, "rank": rank, "params_this_stage": entry["params_this_stage"],
                           "measured_bytes": measured, "accounted_bytes": acc, "ratio": measured / acc, **b})
    gathers = []
    for rank, per in enumerate(result.get("gathers", [])):
        for n, batches in per.items():
            gathers.append({"engine": n, "rank": rank, **{k: statistics.median(b[k] for b in batches)
                                                          for k in ("gathers", "sync", "peak_live")}})
    return {"speed": speed, "memory": memory, "gathers": gathers}


def print_tables(summary: dict[str, Any], result: dict[str, Any], args: argparse.Namespace) -> None:
    """The speed and memory tables."""
    print(f"\n== pp2 x dp2 (4 ranks), {args.depth} blocks of width {args.width}, {args.micro_batches} micro-batches "
          f"of {args.micro} rows per data-parallel rank, medians of {args.steps} batches ==")
    print(f"{'engine':<28}{'batch ms':>10}{'x DS ZeRO-1':>13}{'paired':>9}{'max rel loss diff':>19}")
    for r in summary["speed"]:
        xds = f"{r['x_deepspeed']:.3f}" if "x_deepspeed" in r else "-"
        xdp = f"{r['x_deepspeed_paired']:.3f}" if "x_deepspeed_paired" in r else "-"
        print(f"{r['engine']:<28}{r['batch_ms']:>10.1f}{xds:>13}{xdp:>9}{r['max_rel_loss_diff']:>19.2e}")
    print(f"\n{'engine':<28}{'rank':>5}{'params':>10}{'params B':>11}{'grads B':>11}{'states B':>11}"
          f"{'measured':>11}{'accounted':>11}{'ratio':>7}")
    for r in summary["memory"]:
        print(f"{r['engine']:<28}{r['rank']:>5}{r['params_this_stage']:>10}{r['parameters']:>11}{r['gradients']:>11}"
              f"{r['optimizer_states']:>11}{r['measured_bytes']:>11}{r['accounted_bytes']:>11}{r['ratio']:>7.3f}")
    if summary["gathers"]:
        print(f"\n{'ZeRO-3 per batch (median)':<28}{'rank':>5}{'all-gathers':>13}{'synchronous':>13}"
              f"{'peak gathered':>15}")
        for r in summary["gathers"]:
            print(f"{r['engine']:<28}{r['rank']:>5}{r['gathers']:>13.0f}{r['sync']:>13.0f}{r['peak_live']:>15.0f}")
    for n, e in result["errors"].items():
        print(f"\n{n} could not run: {e}")


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; print the tables and ``BENCH_JSON``."""
    args = parse_args(argv)
    started = time.time()
    out: dict[str, Any] = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                       "torch": torch.__version__, "loadavg_start": os.getloadavg()}}
    result = run_distributed(bench_rank, world_size=4, args=(args,), timeout=args.timeout)[0]
    summary = summarize(result, args)
    print_tables(summary, result, args)
    out.update(summary, errors=result["errors"])
    out["machine"]["loadavg_end"] = os.getloadavg()
    out["wall_s"] = time.time() - started
    print(f"\nwall {out['wall_s']:.0f} s; load average {out['machine']['loadavg_start'][0]:.2f} at start, "
          f"{out['machine']['loadavg_end'][0]:.2f} at end")
    line = json.dumps(out, default=str)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print("BENCH_JSON " + line)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
