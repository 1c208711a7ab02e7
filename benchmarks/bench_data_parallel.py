"""Data-parallel step time and loss agreement: microspeed vs torch DDP vs DeepSpeed (vs FSDP2).

Launch with 2 ranks on CPU (gloo)::

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_data_parallel.py \
        [--steps N --warmup W --model demo|small]

One process group, several frameworks trained in the same processes on the same problem:

* the same GPT-style model (:mod:`microspeed.demo.model`), built once from ``--seed`` and deep-copied for
  each framework, so every framework starts from identical weights;
* the same data: a fixed list of global batches cut from the Python standard library's source
  (:func:`microspeed.demo.data.stdlib_corpus`); rank ``r`` trains on rows ``[r*m, (r+1)*m)`` of each
  global batch (``m`` = micro-batch per rank);
* the same optimizer: microspeed's ds_config ``{"type": "Adam"}`` resolves to ``torch.optim.AdamW`` with
  ``weight_decay=0`` and ``fused=True`` (:mod:`microspeed.builtin.optimizers`); DDP and FSDP2 build that
  optimizer directly, DeepSpeed gets ``"torch_adam": true, "fused": true`` so that it runs the same torch
  kernel (its own default, a JIT-compiled C++ ``FusedAdam``, takes minutes to build on 2 cores: opt in
  with ``--frameworks ...,deepspeed_fusedadam``). The script checks that the optimizers' hyperparameters
  and kernel choice agree and warns if not;
* the same ``gradient_clipping`` (``--clip``; DDP/FSDP2 call ``clip_grad_norm_`` when it is > 0).

Also available, not run by default: ``microspeed_smallbucket`` (microspeed with a 1 MiB
``data_parallel.reduce_bucket_size``, so that gradient all-reduces can overlap backward on a model this
small) and ``deepspeed_fusedadam`` (above). Entry-point plugins are not auto-loaded
(``MICROSPEED_DISABLE_PLUGIN_AUTOLOAD=1`` unless set): the core and built-ins are measured.

By default the frameworks are *interleaved*: step ``i`` of every framework runs before step ``i + 1`` of
any, so that slow drifts of a shared, noisy machine hit all of them alike (``--schedule sequential``
trains one framework after the other instead). Every step is timed with ``time.perf_counter`` around
forward + backward + optimizer step, after a ``dist.barrier()`` that aligns the ranks; a step's time is
the slowest rank's. The process CPU time of each step (``time.process_time``, averaged over ranks) is
recorded too: it counts work, not waiting, so it is much less disturbed by other load on the machine. The
first ``--warmup`` steps are not timed. Losses are recorded for every step and averaged over ranks
(outside the timed region).

Reported per framework: median/mean/min/p90 wall time per step, the median over DDP's, microspeed's
median over this framework's (``ratio_microspeed_over_X``) and the median of the per-step ratios
(``paired_ratio_...``, meaningful with the interleaved schedule), the CPU-time medians and ratio, and the
largest relative difference of the rank-averaged per-step losses from microspeed's.

Rank 0 prints a table and, last, one line ``BENCH_JSON {...}`` with every number.
"""

from __future__ import annotations

import os

# Before anything imports deepspeed (or torch): DeepSpeed picks its accelerator at import time, and two
# ranks share two cores, so each rank gets one thread.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Measure microspeed's core and built-in plugins only, not whatever plugin distributions happen to be installed
# (export MICROSPEED_DISABLE_PLUGIN_AUTOLOAD=0 to include them).
os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import core_fingerprint  # noqa: E402 - benchmarks/ is on sys.path when run as a script

import microspeed  # noqa: E402
from microspeed.demo.data import ByteSequenceDataset, stdlib_corpus  # noqa: E402
from microspeed.demo.model import GPT, GPTConfig  # noqa: E402

ALL_FRAMEWORKS = ("microspeed", "ddp", "deepspeed", "fsdp2", "deepspeed_fusedadam", "microspeed_smallbucket")
DEFAULT_FRAMEWORKS = ("microspeed", "ddp", "deepspeed", "fsdp2")
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Runner:
    """One framework under test: a step function ``(x, y) -> loss`` and what it recorded."""

    name: str
    step: StepFn
    info: str = ""
    setup_s: float = 0.0
    plugins: list[str] = field(default_factory=list)
    hyper: dict[str, Any] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    failed: str | None = None




def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="timed steps per framework (default: 30 demo, 100 small)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before the timed ones")
    p.add_argument("--model", choices=("demo", "small"), default="demo",
                   help="demo: GPTConfig.demo() (484k params, 128-byte sequences); small: GPTConfig.tiny()")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step over all ranks")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping for every framework (0 = off)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--frameworks", default=",".join(DEFAULT_FRAMEWORKS),
                   help=f"comma-separated subset of {','.join(ALL_FRAMEWORKS)}")
    p.add_argument("--schedule", choices=("interleaved", "sequential"), default="interleaved",
                   help="interleaved: step i of every framework, then step i+1; sequential: one after another")
    p.add_argument("--small-bucket", type=int, default=262_144,
                   help="data_parallel.reduce_bucket_size (elements) of the opt-in 'microspeed_smallbucket' "
                        "variant (default: 1 MiB of fp32, DDP's first bucket)")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file (rank 0)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 30 if args.model == "demo" else 100
    unknown = set(args.frameworks.split(",")) - set(ALL_FRAMEWORKS)
    if unknown:
        p.error(f"unknown frameworks {sorted(unknown)}; choose from {ALL_FRAMEWORKS}")
    return args


def log0(*parts: Any) -> None:
    """Print on rank 0 only (flushed, so it interleaves sensibly with torchrun's output)."""
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def model_config(name: str) -> GPTConfig:
    """The GPT configuration behind ``--model``."""
    return GPTConfig.demo() if name == "demo" else GPTConfig.tiny()


def global_batches(n: int, global_batch: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed global batches ``(x, y)`` of shape ``(global_batch, seq_len)`` from the stdlib corpus.

    Consecutive non-overlapping samples; wraps around if the corpus is shorter than needed. The same on
    every rank of one Python installation.
    """
    need = n * global_batch * seq_len + 1
    data = ByteSequenceDataset(stdlib_corpus(max_bytes=min(need, 8_000_000)), seq_len)
    out, k = [], 0
    for _ in range(n):
        xs, ys = [], []
        for _ in range(global_batch):
            x, y = data[k % len(data)]
            xs.append(x)
            ys.append(y)
            k += 1
        out.append((torch.stack(xs), torch.stack(ys)))
    return out


def optimizer_params(lr: float) -> dict[str, Any]:
    """The ds_config ``optimizer.params`` every framework's config starts from."""
    return {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def torch_adamw(params: Any, lr: float) -> torch.optim.AdamW:
    """What microspeed's ``{"type": "Adam"}`` resolves to on CPU: AdamW, decay 0, torch's fused kernel."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)


_COMPARED_DEFAULTS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "fused", "foreach", "maximize")


def optimizer_signature(opt: Any) -> tuple[str, dict[str, Any]]:
    """Class name and the update-relevant defaults of a torch optimizer (unwrapping DeepSpeed's)."""
    inner = getattr(opt, "optimizer", opt) if not isinstance(opt, torch.optim.Optimizer) else opt
    defaults = dict(getattr(inner, "defaults", {}))
    if isinstance(defaults.get("betas"), list):
        defaults["betas"] = tuple(defaults["betas"])
    return type(inner).__name__, {k: defaults.get(k) for k in _COMPARED_DEFAULTS}


def optimizer_mismatches(runners: list[Runner]) -> list[str]:
    """Hyperparameters on which a framework's optimizer differs from microspeed's (empty: all agree).

    The kernel choice (``fused``/``foreach``) is compared too, except for ``deepspeed_fusedadam``,
    which runs DeepSpeed's own kernel on purpose.
    """
    ref = next((r.hyper for r in runners if r.name == "microspeed" and r.failed is None), None)
    if ref is None:
        return []
    out = []
    for r in runners:
        if r.failed is not None or r.name == "microspeed":
            continue
        keys = ("lr", "betas", "eps", "weight_decay")
        if r.name != "deepspeed_fusedadam":
            keys += ("amsgrad", "fused", "foreach", "maximize")
        out += [f"{r.name}.{k}={r.hyper.get(k)!r} (microspeed: {ref.get(k)!r})"
                for k in keys if r.hyper.get(k) != ref.get(k)]
    return out


# ------------------------------------------------------------------------------------- frameworks


def make_microspeed(model: torch.nn.Module, args: argparse.Namespace, micro: int,
                    bucket: int | None = None) -> Runner:
    """microspeed data parallel: fp32, ds_config Adam, bucketed all-reduce overlapped with backward.

    ``bucket`` sets ``data_parallel.reduce_bucket_size``; ``None`` keeps microspeed's default.
    """
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": optimizer_params(args.lr)},
        "gradient_clipping": args.clip,
        "steps_per_print": 10**9,
    }
    if bucket is not None:
        config["data_parallel"] = {"reduce_bucket_size": bucket}
    engine, optimizer, _, _ = microspeed.initialize(model=model, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step on this rank's micro-batch; returns the loss."""
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    name, defaults = optimizer_signature(optimizer)
    return Runner("microspeed" if bucket is None else "microspeed_smallbucket", step,
                  info=f"{name} {defaults}" + ("" if bucket is None else f", reduce_bucket_size={bucket}"),
                  plugins=engine.plugins.names(), hyper=defaults)


def plain_torch_step(model: torch.nn.Module, opt: torch.optim.Optimizer, clip: float):
    """The hand-written torch training step used for DDP and FSDP2: zero, forward, backward, clip, step."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step on this rank's micro-batch; returns the loss."""
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        return loss

    return step


def make_ddp(model: torch.nn.Module, args: argparse.Namespace) -> Runner:
    """torch DistributedDataParallel (C++ reducer, 25 MB buckets) with the same AdamW and clipping."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    opt = torch_adamw(ddp.parameters(), args.lr)
    step = plain_torch_step(ddp, opt, args.clip)
    name, defaults = optimizer_signature(opt)
    return Runner("ddp", step, info=f"{name} {defaults}", hyper=defaults)


def make_deepspeed(model: torch.nn.Module, args: argparse.Namespace, micro: int, torch_adam: bool) -> Runner:
    """DeepSpeed ZeRO stage 0, fp32; ``torch_adam`` selects torch's fused AdamW over DeepSpeed's FusedAdam."""
    import deepspeed

    params = optimizer_params(args.lr)
    if torch_adam:
        params.update(torch_adam=True, fused=True)
    config = {
        "train_batch_size": micro * dist.get_world_size(),
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": params},
        "zero_optimization": {"stage": 0},
        "gradient_clipping": args.clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step on this rank's micro-batch; returns the loss."""
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    name, defaults = optimizer_signature(optimizer)
    return Runner("deepspeed" if torch_adam else "deepspeed_fusedadam", step,
                  info=f"deepspeed {deepspeed.__version__}, {name} {defaults}", hyper=defaults)


def make_fsdp2(model: torch.nn.Module, args: argparse.Namespace) -> Runner:
    """FSDP2 (``fully_shard`` per block and at the root) on a CPU device mesh, same AdamW and clipping."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        opt = torch_adamw(model.parameters(), args.lr)
        kernel = "fused"
    except (RuntimeError, ValueError, TypeError):  # fused kernel refused for DTensor parameters
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        kernel = "default"
    step = plain_torch_step(model, opt, args.clip)
    name, defaults = optimizer_signature(opt)
    return Runner("fsdp2", step, info=f"{name} ({kernel} kernel) {defaults}", hyper=defaults)


def build_runner(name: str, base: torch.nn.Module, args: argparse.Namespace, micro: int) -> Runner:
    """Build framework ``name`` on a deep copy of ``base``; a failure is recorded, not raised.

    All ranks must agree on success: if any rank failed, every rank drops the framework (otherwise
    the next collective would hang).
    """
    model = copy.deepcopy(base)
    runner: Runner | None = None
    error = None
    try:
        if name == "microspeed":
            runner = make_microspeed(model, args, micro)
        elif name == "microspeed_smallbucket":
            runner = make_microspeed(model, args, micro, bucket=args.small_bucket)
        elif name == "ddp":
            runner = make_ddp(model, args)
        elif name == "deepspeed":
            runner = make_deepspeed(model, args, micro, torch_adam=True)
        elif name == "deepspeed_fusedadam":
            runner = make_deepspeed(model, args, micro, torch_adam=False)
        elif name == "fsdp2":
            runner = make_fsdp2(model, args)
    except Exception as exc:  # report and continue without this framework
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        if os.environ.get("BENCH_DEBUG"):
            traceback.print_exc()
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        return Runner(name, step=lambda x, y: x, failed=first)
    assert runner is not None
    return runner


# ------------------------------------------------------------------------------------------ running


def timed_step(runner: Runner, x: torch.Tensor, y: torch.Tensor, record_time: bool) -> None:
    """Barrier, then one timed training step; keeps the loss (detached) and, if asked, the times.

    Two clocks: wall time (``perf_counter``), the headline; and this process's CPU time (all its threads,
    ``process_time``), the work done, which does not grow while the rank waits for a core or for the other
    rank, and so is far less sensitive to other load on a shared machine.
    """
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    loss = runner.step(x, y)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    runner.losses.append(loss.detach().float().reshape(()))
    if record_time:
        runner.times.append(dt)
        runner.cpu_times.append(dc)


def run_all(runners: list[Runner], batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int,
            schedule: str, micro: int) -> None:
    """Train every runner on ``batches`` (this rank's slice), interleaved or one after another."""
    rank = dist.get_rank()
    lo, hi = rank * micro, (rank + 1) * micro
    active = [r for r in runners if r.failed is None]
    if schedule == "interleaved":
        for i, (x, y) in enumerate(batches):
            for r in active:
                timed_step(r, x[lo:hi], y[lo:hi], i >= warmup)
    else:
        for r in active:
            for i, (x, y) in enumerate(batches):
                timed_step(r, x[lo:hi], y[lo:hi], i >= warmup)


def summarize(runners: list[Runner]) -> dict[str, Any]:
    """Gather times (slowest rank per step) and rank-averaged losses; medians, ratios, loss agreement.

    ``ratio_microspeed_over_X`` is microspeed's median step time over X's; ``loss_max_rel_diff_vs_X`` the
    largest relative difference between microspeed's and X's rank-averaged loss over all steps (warm-up
    included). Each framework's entry also has ``over_ddp``, its median over DDP's.
    """
    world = dist.get_world_size()
    out: dict[str, Any] = {}
    for r in runners:
        if r.failed is not None:
            out[r.name] = {"failed": r.failed}
            continue
        times = torch.tensor(r.times, dtype=torch.float64)
        gathered = [torch.zeros_like(times) for _ in range(world)]
        dist.all_gather(gathered, times)
        per_step = torch.stack(gathered).max(dim=0).values.tolist()
        losses = torch.stack(r.losses).double()
        dist.all_reduce(losses)
        losses = (losses / world).tolist()
        cpu = torch.tensor(r.cpu_times, dtype=torch.float64)
        dist.all_reduce(cpu)
        cpu_per_rank = (cpu / world).tolist()
        out[r.name] = {
            "median_step_s": statistics.median(per_step),
            "mean_step_s": statistics.fmean(per_step),
            "min_step_s": min(per_step),
            "p90_step_s": sorted(per_step)[int(0.9 * (len(per_step) - 1))],
            "rank_median_step_s": [statistics.median(g.tolist()) for g in gathered],
            "median_cpu_s": statistics.median(cpu_per_rank),
            "setup_s": r.setup_s,
            "losses": losses,
            "step_ms": [round(t * 1e3, 2) for t in per_step],
            "optimizer": r.info,
        }
    ok = [r.name for r in runners if r.failed is None]
    if "ddp" in out and "median_step_s" in out["ddp"]:
        for name in ok:
            out[name]["over_ddp"] = out[name]["median_step_s"] / out["ddp"]["median_step_s"]
    ms = out.get("microspeed", {})
    for other in ok:
        if other == "microspeed" or "median_step_s" not in ms:
            continue
        o = out[other]
        out[f"ratio_microspeed_over_{other}"] = ms["median_step_s"] / o["median_step_s"]
        out[f"cpu_ratio_microspeed_over_{other}"] = ms["median_cpu_s"] / o["median_cpu_s"]
        # With the interleaved schedule step i of both ran back to back: the median of per-step ratios is
        # less sensitive to the machine's slow drifts than the ratio of medians.
        out[f"paired_ratio_microspeed_over_{other}"] = statistics.median(
            a / b for a, b in zip(ms["step_ms"], o["step_ms"], strict=True))
        rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ms["losses"], o["losses"], strict=True)]
        out[f"loss_max_rel_diff_vs_{other}"] = max(rel)
    return out


def print_table(result: dict[str, Any], names: list[str]) -> None:
    """Rank 0: one row per framework (times in ms), then each one's optimizer."""
    log0(f"\n{'':<24}{'---------- wall ms per step ----------':^44}{'-- CPU ms/rank --':^26}")
    log0(f"{'framework':<24}{'median':>9}{'mean':>9}{'min':>9}{'p90':>9}{'x DDP':>8}{'ms/this':>9}"
         f"{'median':>9}{'ms/this':>9}{'loss[0]':>9}{'loss[-1]':>9}  max rel loss diff vs microspeed")
    for name in names:
        row = result[name]
        if "failed" in row:
            log0(f"{name:<24}  skipped: {row['failed']}")
            continue
        ratio = result.get(f"ratio_microspeed_over_{name}")
        diff = result.get(f"loss_max_rel_diff_vs_{name}")
        cpu_ratio = result.get(f"cpu_ratio_microspeed_over_{name}")
        over = row.get("over_ddp")
        log0(f"{name:<24}{row['median_step_s'] * 1e3:>9.2f}{row['mean_step_s'] * 1e3:>9.2f}"
             f"{row['min_step_s'] * 1e3:>9.2f}{row['p90_step_s'] * 1e3:>9.2f}"
             f"{'' if over is None else f'{over:8.3f}':>8}{'' if ratio is None else f'{ratio:9.3f}':>9}"
             f"{row['median_cpu_s'] * 1e3:>9.2f}{'' if cpu_ratio is None else f'{cpu_ratio:9.3f}':>9}"
             f"{row['losses'][0]:>9.4f}{row['losses'][-1]:>9.4f}  {'' if diff is None else f'{diff:.2e}'}")
    log0("")
    for name in names:
        if "optimizer" in result[name]:
            log0(f"  {name}: set up in {result[name]['setup_s']:.1f} s; {result[name]['optimizer']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return (and on rank 0 print) the result dict."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    microspeed.init_distributed()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by the world size {world}")
    micro = args.global_batch // world

    cfg = model_config(args.model)
    torch.manual_seed(args.seed)
    base = GPT(cfg)
    batches = global_batches(args.warmup + args.steps, args.global_batch, cfg.seq_len)
    names = [n for n in args.frameworks.split(",") if n]
    load_before = os.getloadavg()[0]
    log0(f"bench_data_parallel: model={args.model} ({base.num_parameters():,} params), world={world}, "
         f"global batch {args.global_batch} x {cfg.seq_len} tokens (micro {micro}/rank), "
         f"{args.warmup} warm-up + {args.steps} timed steps, clip={args.clip}, schedule={args.schedule}, "
         f"torch {torch.__version__}, {dist.get_backend()}, threads/rank={torch.get_num_threads()}, "
         f"load avg {load_before:.2f}")

    # The first torch optimizer built in a process imports torch._dynamo (seconds); pay it here so that
    # no framework's set-up time is charged for it.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    runners = []
    for name in names:
        t0 = time.perf_counter()
        quiet = io.StringIO()
        silence = rank != 0 or name.startswith("deepspeed")  # DeepSpeed prints its whole config
        with contextlib.redirect_stdout(quiet) if silence else contextlib.nullcontext():
            runner = build_runner(name, base, args, micro)
        runner.setup_s = time.perf_counter() - t0
        runners.append(runner)
        if runner.failed:
            log0(f"  {name}: SKIPPED ({runner.failed})")
        dist.barrier()

    t0 = time.perf_counter()
    run_all(runners, batches, args.warmup, args.schedule, micro)
    train_s = time.perf_counter() - t0
    result = summarize(runners)
    plugin_names = next((r.plugins for r in runners if r.plugins), [])
    mismatches = optimizer_mismatches(runners)
    meta = {
        "benchmark": "data_parallel", "model": args.model, "params": base.num_parameters(), "world": world,
        "global_batch": args.global_batch, "seq_len": cfg.seq_len, "steps": args.steps, "warmup": args.warmup,
        "clip": args.clip, "schedule": args.schedule, "torch": torch.__version__, "backend": dist.get_backend(),
        "python": platform.python_version(), "cpus": os.cpu_count(), "train_wall_s": train_s,
        "loadavg_1m": [load_before, os.getloadavg()[0]], "microspeed_core": core_fingerprint(),
        "microspeed_plugins": plugin_names, "optimizer_mismatches": mismatches,
    }
    if rank == 0:
        print_table(result, names)
        log0("")
        for other in names:
            if f"ratio_microspeed_over_{other}" in result:
                log0(f"  microspeed / {other:<24} median step time {result[f'ratio_microspeed_over_{other}']:.3f}x"
                     f" (median per-step ratio {result[f'paired_ratio_microspeed_over_{other}']:.3f}x,"
                     f" CPU time {result[f'cpu_ratio_microspeed_over_{other}']:.3f}x);"
                     f" losses agree to {result[f'loss_max_rel_diff_vs_{other}']:.2e} (max rel diff)")
        log0(f"  training took {train_s:.1f} s; load avg {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
        log0(f"  microspeed core {meta['microspeed_core']}, plugins: {', '.join(plugin_names)}")
        log0("  optimizers: same hyperparameters and kernel as microspeed's" if not mismatches else
             f"  WARNING: optimizers differ from microspeed's: {'; '.join(mismatches)}")
        line = json.dumps({**meta, **result})
        if args.json_out:
            with open(args.json_out, "w") as f:
                f.write(line + "\n")
        print("BENCH_JSON " + line, flush=True)
    dist.barrier()
    return result


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
