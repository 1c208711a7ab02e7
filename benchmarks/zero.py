"""ZeRO stages 1–3: microspeed vs DeepSpeed 0.19.8 vs torch DDP and FSDP2, step time and peak memory.

Usage (2 ranks, gloo, CPU; the default run takes about 5.5 minutes on 2 idle cores, 13-25 under other load)::

    python benchmarks/zero.py                       # every default engine, full-size model
    python benchmarks/zero.py --small               # quick smoke run on a tiny model (a few minutes)
    python benchmarks/zero.py --engines ddp,microspeed_z2,deepspeed_z2 --steps 20 --warmup 3
    python benchmarks/zero.py --json-out zero.json  # also write every number as JSON
    python benchmarks/zero.py --repeats 3           # the engine list 3 times, round robin (a shared machine)
    python benchmarks/zero.py --from-runs a.json.runs b.json.runs   # pool saved runs, run nothing
    python benchmarks/zero.py --model mha --schedule interleaved --engines ddp,microspeed_z1,deepspeed_z1

What is measured, and how:

* **Model** (``--model``): ``demo`` (default), :class:`microspeed.demo.model.GPT` with
  ``GPTConfig(vocab_size=32000, d_model=512, n_layer=4, n_head=8, seq_len=64, tie_weights=False)`` (about 45M
  parameters; ``--small``: 256/64/2/4/32, about 0.1M); ``mha``, :class:`microspeed.models.torch_blocks.TorchBlocksGPT`
  (torch's ``nn.TransformerEncoderLayer`` blocks, so ``nn.MultiheadAttention``) with the same sizes (45.4M;
  ``--small``: 256/64/2/4/32); ``mlp``, :class:`microspeed.models.torch_blocks.WideMLP`, 4 layers of width 2048
  over a 256-token vocabulary, sequence 64 (17.8M; ``--small``: width 128); fp32
  (``--bf16``: bf16 with fp32 masters for microspeed and DeepSpeed, ``torch.autocast`` for
  DDP and FSDP2's ``MixedPrecisionPolicy``: not bit-comparable, and bf16 matmuls are slow on CPU).
* **Engines** (``--engines``, comma-separated): ``ddp`` (``DistributedDataParallel``), ``fsdp2``
  (``fully_shard`` per block and at the root), ``microspeed_z{1,2,3}`` and ``deepspeed_z{1,2,3}`` with
  ``"zero_optimization": {"stage": s, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e8,
  "overlap_comm": true}``, and ``microspeed_z{1,2,3}_rb5e8`` / ``deepspeed_z{1,2,3}_rb5e8``, the same
  with the default ``reduce_bucket_size`` 5e8 (the ``deepspeed_*_rb5e8`` ones are not run by default).
* **Same problem for all**: every rank builds the model from ``--seed``; the batches are a fixed list of
  global batches cut from the Python standard library's source (:func:`common.make_batches`), rank ``r``
  training on rows ``[r*m, (r+1)*m)`` (``m`` = ``--micro``, 2). The optimizer is ``torch.optim.AdamW``
  (lr ``--lr`` 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0, torch's fused CPU kernel) everywhere:
  microspeed's ``{"type": "AdamW"}`` resolves to it, DeepSpeed gets ``"torch_adam": true, "fused": true``;
  FSDP2 falls back to the foreach kernel if the fused one refuses DTensors. ``gradient_clipping``
  ``--clip`` (1.0) for every engine.
* **Fresh processes per engine**: each engine runs in its own 2-rank process group
  (:func:`microspeed.testing.run_distributed`: fresh processes, ``OMP_NUM_THREADS=1``,
  ``torch.set_num_threads(1)``), so its memory figures are its own. The framework is imported, and the
  first torch optimizer built (it imports ``torch._dynamo``), before the model is built.
* **Time**: ``--warmup`` untimed steps, then ``--steps`` timed ones. Each step starts after a
  ``dist.barrier()``; its time is the slowest rank's ``perf_counter`` around forward + backward +
  optimizer step; the median over the timed steps is reported, with the split into forward / backward /
  step (medians of each phase, rank 0; asynchronous communication lands in whichever phase waits for it)
  and the process CPU time per step (mean over ranks). With ``--repeats N`` the whole engine list runs N
  times, round robin (fresh processes each time), and the medians pool every repeat's steps; the ratio to
  DDP of each repeat's median is printed too (on a machine shared with other work, load swings between
  engines run minutes apart otherwise decide the ratios).
* **Interleaved** (``--schedule interleaved``): one 2-rank job builds every engine's model (each from
  ``--seed``) in the same processes and runs step ``i`` of every engine, in an order rotated by one each step,
  before step ``i + 1`` of any (as ``bench_data_parallel.py`` does), so drift of a shared machine hits all
  engines alike; ``paired x DDP`` is the median over steps of the engine's step time over DDP's in the same
  step. Peak RSS cannot be told apart in one process, so each engine then also runs alone in fresh processes
  for ``--memory-steps`` steps (after one warm-up) for its memory figures; ``--memory-steps 0`` skips that.
* **Memory**: peak RSS is ``VmHWM`` from ``/proc/self/status`` at the end, the maximum over ranks
  (it includes the interpreter, torch, the framework's imports — DeepSpeed's add about 20 MiB — and the
  model as built, before the engine takes it over);
  ``growth`` is ``VmRSS`` at the end minus ``VmRSS`` right after the model was built (what the engine
  added and kept), ``peak growth`` is ``VmHWM`` at the end minus that same baseline; max over ranks.
  For microspeed, ``microspeed_zero.memory_breakdown(engine)`` (bytes of parameters, gradients and
  optimizer states per rank) is printed too.
* **Agreement**: the loss of every step (warm-up included) is averaged over the ranks; each engine's
  largest relative difference from DDP's over all steps is printed (fp32: all should agree closely).

Ratios printed per engine: median step time and peak RSS over DDP's (``x DDP``), and for microspeed over
DeepSpeed's at the same stage and bucket size (``x DS``). The parent prints two tables and, last,
one line ``BENCH_JSON {...}`` with every number. The exit status is 1 if any engine failed.

Entry-point plugins are not auto-loaded (``MICROSPEED_DISABLE_PLUGIN_AUTOLOAD=1``,
``MICROSPEED_PLUGINS=zero`` unless set): the core, its built-ins and the ``zero`` plugin are measured.
DeepSpeed runs with ``DS_ACCELERATOR=cpu``; a stale ``~/.cache/torch_extensions/py311_cpu/*/lock`` left
by a killed build makes its first import hang: delete it. (Another Python installation rebuilding the
same extension in that cache can also hold DeepSpeed's set-up for minutes; that is set-up time, not step time.)
"""

from __future__ import annotations

import os

# Before anything imports torch (or deepspeed); the ranks inherit these.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
os.environ.setdefault("MICROSPEED_PLUGINS", "zero")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import core_fingerprint, make_batches  # noqa: E402 - benchmarks/ is on sys.path as a script

from microspeed.demo.model import GPT, GPTConfig  # noqa: E402
from microspeed.models.torch_blocks import TorchBlocksGPT, WideMLP  # noqa: E402
from microspeed.testing import DistributedTestError, run_distributed  # noqa: E402

MODELS = ("demo", "mha", "mlp")
ENGINE_RE = re.compile(r"^(ddp|fsdp2|(microspeed|deepspeed)_z([123])(_rb5e8)?)$")
DEFAULT_ENGINES = (
    "ddp", "fsdp2",
    "microspeed_z1", "microspeed_z2", "microspeed_z3",
    "deepspeed_z1", "deepspeed_z2", "deepspeed_z3",
    "microspeed_z1_rb5e8", "microspeed_z2_rb5e8", "microspeed_z3_rb5e8",
)
StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[float]]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help="comma-separated: ddp, fsdp2, microspeed_z{1,2,3}[_rb5e8], deepspeed_z{1,2,3}[_rb5e8]")
    p.add_argument("--steps", type=int, default=None, help="timed steps per engine (default 10; --small 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--small", action="store_true", help="tiny model (smoke run)")
    p.add_argument("--model", choices=MODELS, default="demo", help="model shape (see the module docstring)")
    p.add_argument("--schedule", choices=("sequential", "interleaved"), default="sequential",
                   help="one job per engine, or every engine in one job, step by step in rotating order")
    p.add_argument("--memory-steps", type=int, default=2,
                   help="--schedule interleaved: steps of each engine's own memory run (0: no memory runs)")
    p.add_argument("--bf16", action="store_true", help="bf16 instead of fp32 (see the module docstring)")
    p.add_argument("--micro", type=int, default=2, help="micro-batch per rank")
    p.add_argument("--world", type=int, default=2, help="ranks per engine")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping for every engine (0 = off)")
    p.add_argument("--reduce-bucket", type=float, default=5e6, help="reduce_bucket_size of the ZeRO engines")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=1,
                   help="run the engine list this many times, round robin; medians pool every repeat's steps")
    p.add_argument("--from-runs", nargs="+", default=[], metavar="FILE",
                   help="run nothing: report the runs saved in these --json-out FILE.runs files (pooled per engine)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine, start-up included")
    p.add_argument("--json-out", default=None,
                   help="also write the JSON result to this file (and the raw runs so far to FILE.runs as they end)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 30 if args.small else 10
    args.engine_list = [e for e in args.engines.split(",") if e]
    bad = [e for e in args.engine_list if not ENGINE_RE.match(e)]
    if bad:
        p.error(f"unknown engines {bad}; choose from ddp, fsdp2, microspeed_z1..3[_rb5e8], deepspeed_z1..3[_rb5e8]")
    return args


def model_config(small: bool) -> GPTConfig:
    """The GPT sizes of the benchmark (about 45M parameters), or tiny ones for ``--small``."""
    if small:
        return GPTConfig(vocab_size=256, d_model=64, n_layer=2, n_head=4, seq_len=32, tie_weights=False)
    return GPTConfig(vocab_size=32000, d_model=512, n_layer=4, n_head=8, seq_len=64, tie_weights=False)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A fresh ``--model`` from the global RNG (seed it first)."""
    cfg = model_config(args.small)
    if args.model == "mha":
        return TorchBlocksGPT(cfg.vocab_size, cfg.d_model, cfg.n_layer, cfg.n_head, cfg.seq_len)
    if args.model == "mlp":
        return WideMLP(256, 128 if args.small else 2048, 4)
    return GPT(cfg)


def model_description(args: argparse.Namespace) -> str:
    """The model's name and sizes, for the report."""
    cfg = model_config(args.small)
    if args.model == "mha":
        return (f"TorchBlocksGPT(nn.TransformerEncoderLayer; vocab {cfg.vocab_size}, d_model {cfg.d_model}, "
                f"{cfg.n_layer} layers, {cfg.n_head} heads, seq {cfg.seq_len})")
    if args.model == "mlp":
        return f"WideMLP(vocab 256, 4 layers of width {128 if args.small else 2048}, seq {cfg.seq_len})"
    return f"GPT {cfg}"


def proc_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process in bytes (``/proc/self/status``)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def sources_fingerprint(package: str) -> str:
    """A short hash of an installed package's ``*.py`` sources ("" if it is not importable)."""
    try:
        module = __import__(package)
    except ImportError:
        return ""
    root = Path(module.__file__).parent
    h = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


# ---------------------------------------------------------------------------------------- engines


def optimizer_params(lr: float) -> dict[str, Any]:
    """The ds_config ``optimizer.params`` shared by microspeed and DeepSpeed."""
    return {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def zero_section(stage: int, reduce_bucket: float) -> dict[str, Any]:
    """The ``zero_optimization`` section given to both microspeed and DeepSpeed."""
    return {"stage": stage, "reduce_bucket_size": reduce_bucket, "allgather_bucket_size": 5e8, "overlap_comm": True}


def ds_config(stage: int, reduce_bucket: float, args: argparse.Namespace, world: int, deepspeed: bool) -> dict:
    """The ds_config of a microspeed or DeepSpeed ZeRO engine."""
    params = optimizer_params(args.lr)
    if deepspeed:
        params.update(torch_adam=True, fused=True)  # torch's fused AdamW, as microspeed and DDP run
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": zero_section(stage, reduce_bucket),
        "gradient_clipping": args.clip,
        "steps_per_print": 10**9,
    }
    if deepspeed:
        config.update(train_batch_size=args.micro * world, wall_clock_breakdown=False)
    if args.bf16:
        config["bf16"] = {"enabled": True}
    return config


def engine_step(engine: Any) -> StepFn:
    """The step of a DeepSpeed-style engine: ``loss = engine(x, y)``, ``engine.backward``, ``engine.step``."""

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        t0 = time.perf_counter()
        loss = engine(x, y)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        return loss, [t1 - t0, t2 - t1, t3 - t2]

    return step


def torch_step(model: torch.nn.Module, opt: torch.optim.Optimizer, clip: float, bf16_autocast: bool) -> StepFn:
    """The hand-written torch step of DDP and FSDP2: zero, forward, backward, clip, step."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16_autocast else contextlib.nullcontext():
            loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        t3 = time.perf_counter()
        return loss, [t1 - t0, t2 - t1, t3 - t2]

    return step


def torch_adamw(params: Any, lr: float, fused: bool = True) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with the benchmark's hyper-parameters."""
    kernel = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **kernel)


def import_framework(name: str) -> None:
    """Import what engine ``name`` needs, before the memory baseline is taken."""
    if name.startswith("deepspeed"):
        with contextlib.redirect_stdout(io.StringIO()):
            import deepspeed  # noqa: F401
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    elif name.startswith("microspeed"):
        import microspeed_zero  # noqa: F401

        import microspeed  # noqa: F401
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    else:
        from torch.nn.parallel import DistributedDataParallel  # noqa: F401
    # The first torch optimizer built in a process imports torch._dynamo (seconds, tens of MiB).
    torch_adamw([torch.nn.Parameter(torch.zeros(1))], 1e-3)


def build_engine(name: str, model: torch.nn.Module, args: argparse.Namespace) -> tuple[StepFn, dict[str, Any]]:
    """Wrap ``model`` in engine ``name``; return its step function and facts about it."""
    world = dist.get_world_size()
    info: dict[str, Any] = {}
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        return torch_step(ddp, torch_adamw(ddp.parameters(), args.lr), args.clip, args.bf16), info
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16
              else MixedPrecisionPolicy())
        for block in getattr(model, "blocks", None) or model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        try:
            opt, info["kernel"] = torch_adamw(model.parameters(), args.lr), "fused"
        except (RuntimeError, ValueError, TypeError):  # fused kernel refused for DTensor parameters
            opt, info["kernel"] = torch_adamw(model.parameters(), args.lr, fused=False), "foreach"
        return torch_step(model, opt, args.clip, False), info
    m = ENGINE_RE.match(name)
    assert m is not None
    framework, stage = m.group(2), int(m.group(3))
    bucket = 5e8 if m.group(4) else args.reduce_bucket
    if framework == "microspeed":
        import microspeed_zero

        import microspeed

        config = ds_config(stage, bucket, args, world, deepspeed=False)
        engine, optimizer, _, _ = microspeed.initialize(model=model, config=config)
        info["plugins"] = engine.plugins.names()
        info["breakdown_fn"] = lambda: microspeed_zero.memory_breakdown(engine)
    else:
        import deepspeed

        config = ds_config(stage, bucket, args, world, deepspeed=True)
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its whole config
            engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config,
                                                           model_parameters=model.parameters())
    inner = getattr(optimizer, "inner", None) or getattr(optimizer, "optimizer", None) or optimizer
    info["optimizer"] = f"{type(optimizer).__name__} over {type(inner).__name__}"
    info["zero_optimization"] = config["zero_optimization"]
    return engine_step(engine), info


# ------------------------------------------------------------------------------------- rank body


def rank_main(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One rank of engine ``name``: build, train ``warmup + steps`` steps, return times, losses, memory."""
    torch.set_num_threads(1)
    # torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor (used by the ZeRO engines) per call.
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    t_start = time.perf_counter()
    import_framework(name)
    cfg = model_config(args.small)
    batches = make_batches(args.warmup + args.steps, args.micro * world, cfg.seq_len)
    torch.manual_seed(args.seed)
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    mem_built = proc_status()
    t_built = time.perf_counter()
    step, info = build_engine(name, model, args)
    breakdown_fn = info.pop("breakdown_fn", None)
    del model
    mem_init = proc_status()
    t_init = time.perf_counter()
    lo, hi = rank * args.micro, (rank + 1) * args.micro
    times, cpu, phases, losses = [], [], [], []
    for i, (x, y) in enumerate(batches):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        loss, phase = step(x[lo:hi], y[lo:hi])
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        losses.append(float(loss.detach().float()))
        if i >= args.warmup:
            times.append(dt)
            cpu.append(dc)
            phases.append(phase)
    dist.barrier()
    mem_end = proc_status()
    return {
        "rank": rank, "params": n_params, "times": times, "cpu": cpu, "phases": phases, "losses": losses,
        "rss_built": mem_built["VmRSS"], "rss_init": mem_init["VmRSS"], "rss_end": mem_end["VmRSS"],
        "hwm_built": mem_built["VmHWM"], "hwm_end": mem_end["VmHWM"],
        "setup_s": t_init - t_built, "start_s": t_built - t_start,
        "breakdown": breakdown_fn() if breakdown_fn is not None else None, **info,
        "zero_sources": sources_fingerprint("microspeed_zero") if name.startswith("microspeed") else "",
    }


def rank_interleaved(names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One rank of the interleaved schedule: build every engine, then step ``i`` of each (rotating order)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in names:
        import_framework(name)
    batches = make_batches(args.warmup + args.steps, args.micro * world, model_config(args.small).seq_len)
    steps: dict[str, StepFn] = {}
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        torch.manual_seed(args.seed)
        model = build_model(args)
        steps[name], info = build_engine(name, model, args)
        info.pop("breakdown_fn", None)
        out[name] = {"times": [], "cpu": [], "phases": [], "losses": [], **info}
        del model
    lo, hi = rank * args.micro, (rank + 1) * args.micro
    for i, (x, y) in enumerate(batches):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            loss, phase = steps[name](x[lo:hi], y[lo:hi])
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            r = out[name]
            r["losses"].append(float(loss.detach().float()))
            if i >= args.warmup:
                r["times"].append(dt)
                r["cpu"].append(dc)
                r["phases"].append(phase)
    dist.barrier()
    return out


# ---------------------------------------------------------------------------------------- parent


def run_interleaved(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Time every engine in one job (``rank_interleaved``); add each engine's memory from a run of its own."""
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    try:
        ranks = run_distributed(rank_interleaved, world_size=args.world, args=(args.engine_list, args),
                                timeout=args.timeout * len(args.engine_list))
    except DistributedTestError as exc:
        return {name: {"failed": str(exc), "wall_s": time.perf_counter() - t0} for name in args.engine_list}
    wall, load = time.perf_counter() - t0, [load0, os.getloadavg()[0]]
    mem_args = argparse.Namespace(**{**vars(args), "steps": args.memory_steps, "warmup": 1})
    out = {}
    for name in args.engine_list:
        rs = [r[name] for r in ranks]
        timing = {
            "step_s": [max(r["times"][i] for r in rs) for i in range(args.steps)],
            "cpu_s": [statistics.fmean(r["cpu"][i] for r in rs) for i in range(args.steps)],
            "phases_s": rs[0]["phases"],
            "losses": [statistics.fmean(r["losses"][i] for r in rs) for i in range(args.warmup + args.steps)],
            "wall_s": wall, "loadavg_1m": load,
            **{k: rs[0][k] for k in ("optimizer", "zero_optimization", "kernel") if k in rs[0]},
        }
        if args.memory_steps > 0:
            print(f"  memory run of {name} ...", flush=True)
            mem = run_engine(name, mem_args)
            if "failed" in mem:
                out[name] = mem
                continue
            timing = {**mem, **timing, "loadavg_1m": load + mem["loadavg_1m"]}
        else:  # no memory figures: NaN keeps the tables' columns (and their ratios) without a number
            nan = float("nan")
            timing.update({k: nan for k in ("peak_rss_mib", "rss_growth_mib", "peak_growth_mib", "rss_built_mib",
                                             "setup_s", "start_s")}, peak_rss_per_rank_mib=[], breakdown=None)
        out[name] = timing
    return out


def run_engine(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run engine ``name`` once in a fresh process group; its per-step numbers (or its failure)."""
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    try:
        ranks = run_distributed(rank_main, world_size=args.world, args=(name, args), timeout=args.timeout)
    except DistributedTestError as exc:
        return {"failed": str(exc), "wall_s": time.perf_counter() - t0}
    mib = 2**20
    r0 = ranks[0]
    return {
        "step_s": [max(r["times"][i] for r in ranks) for i in range(args.steps)],
        "cpu_s": [statistics.fmean(r["cpu"][i] for r in ranks) for i in range(args.steps)],
        "phases_s": r0["phases"],
        "losses": [statistics.fmean(r["losses"][i] for r in ranks) for i in range(args.warmup + args.steps)],
        "peak_rss_mib": max(r["hwm_end"] for r in ranks) / mib,
        "peak_rss_per_rank_mib": [r["hwm_end"] / mib for r in ranks],
        "rss_growth_mib": max(r["rss_end"] - r["rss_built"] for r in ranks) / mib,
        "peak_growth_mib": max(r["hwm_end"] - r["rss_built"] for r in ranks) / mib,
        "rss_built_mib": max(r["rss_built"] for r in ranks) / mib,
        "setup_s": max(r["setup_s"] for r in ranks),
        "start_s": max(r["start_s"] for r in ranks),
        "wall_s": time.perf_counter() - t0,
        "loadavg_1m": [load0, os.getloadavg()[0]],
        "breakdown": [r["breakdown"] for r in ranks] if r0["breakdown"] is not None else None,
        **{k: r0[k] for k in ("plugins", "optimizer", "zero_optimization", "kernel", "zero_sources") if k in r0},
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's repeats pooled: medians over every timed step, memory maxima, per-repeat medians."""
    failed = [r["failed"] for r in runs if "failed" in r]
    if failed:
        return {"failed": failed[0], "wall_s": sum(r["wall_s"] for r in runs)}
    steps = [t for r in runs for t in r["step_s"]]
    phases = [p for r in runs for p in r["phases_s"]]
    first = runs[0]
    return {
        "median_step_s": statistics.median(steps),
        "min_step_s": min(steps),
        "max_step_s": max(steps),
        "repeat_median_step_s": [statistics.median(r["step_s"]) for r in runs],
        "step_ms": [round(t * 1e3, 2) for t in steps],
        "phase_median_s": [statistics.median(p[k] for p in phases) for k in range(3)],
        "median_cpu_s": statistics.median(c for r in runs for c in r["cpu_s"]),
        "losses": first["losses"],
        "repeat_loss_max_abs_diff": max(abs(a - b) for r in runs for a, b in zip(r["losses"], first["losses"],
                                                                                strict=True)),
        **{k: max(r[k] for r in runs) for k in ("peak_rss_mib", "rss_growth_mib", "peak_growth_mib", "rss_built_mib",
                                                 "setup_s", "start_s")},
        "peak_rss_per_rank_mib": [r["peak_rss_per_rank_mib"] for r in runs],
        "wall_s": sum(r["wall_s"] for r in runs),
        "loadavg_1m": [x for r in runs for x in r["loadavg_1m"]],
        "zero_sources": sorted({r.get("zero_sources", "") for r in runs} - {""}),
        **{k: first[k] for k in ("breakdown", "plugins", "optimizer", "zero_optimization", "kernel") if k in first},
    }


def ds_peer(name: str) -> str | None:
    """The DeepSpeed engine at the same stage and bucket as microspeed engine ``name`` (else ``None``)."""
    return "deepspeed" + name[len("microspeed"):] if name.startswith("microspeed") else None


def add_ratios(results: dict[str, dict[str, Any]]) -> None:
    """Ratios to DDP (``*over_ddp``) and to DeepSpeed at the same stage (``*over_ds``); loss agreement."""
    ddp = results.get("ddp", {})
    for name, r in results.items():
        if "failed" in r:
            continue
        if "median_step_s" in ddp:
            r["over_ddp"] = r["median_step_s"] / ddp["median_step_s"]
            r["rss_over_ddp"] = r["peak_rss_mib"] / ddp["peak_rss_mib"]
            r["growth_over_ddp"] = r["peak_growth_mib"] / ddp["peak_growth_mib"]
            r["cpu_over_ddp"] = r["median_cpu_s"] / ddp["median_cpu_s"]
            r["repeat_over_ddp"] = [a / b for a, b in zip(r["repeat_median_step_s"], ddp["repeat_median_step_s"],
                                                          strict=False)]
            r["paired_over_ddp"] = statistics.median(a / b for a, b in zip(r["step_ms"], ddp["step_ms"],
                                                                            strict=False))
            r["loss_max_rel_diff_vs_ddp"] = max(abs(a - b) / max(abs(b), 1e-12)
                                                for a, b in zip(r["losses"], ddp["losses"], strict=True))
        peer = results.get(ds_peer(name) or "", {})
        if "median_step_s" in peer:
            r["over_ds"] = r["median_step_s"] / peer["median_step_s"]
            r["rss_over_ds"] = r["peak_rss_mib"] / peer["peak_rss_mib"]
            r["growth_over_ds"] = r["peak_growth_mib"] / peer["peak_growth_mib"]
            r["cpu_over_ds"] = r["median_cpu_s"] / peer["median_cpu_s"]


def fmt(v: float | None, spec: str) -> str:
    """``format(v, spec)``, or ``-`` for a missing value."""
    return "-" if v is None else format(v, spec)


def print_report(results: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Two tables (time, memory), the microspeed memory breakdowns, the bucket comparison, per-engine facts."""
    print(f"\n{'engine':<22}{'median ms':>10}{'x DDP':>7}{'paired':>7}{'x DS':>7}{'min ms':>9}{'max ms':>9}"
          f"{'fwd/bwd/step ms':>20}"
          f"{'CPU ms':>9}{'x DDP':>7}{'x DS':>7}{'last loss':>11}{'rel diff':>10}")
    for name in names:
        r = results[name]
        if "failed" in r:
            print(f"{name:<22}FAILED: {r['failed'].splitlines()[0][:200]}")
            continue
        ph = "/".join(f"{p * 1e3:.0f}" for p in r["phase_median_s"])
        print(f"{name:<22}{r['median_step_s'] * 1e3:>10.1f}{fmt(r.get('over_ddp'), '.2f'):>7}"
              f"{fmt(r.get('paired_over_ddp'), '.2f'):>7}{fmt(r.get('over_ds'), '.2f'):>7}"
              f"{r['min_step_s'] * 1e3:>9.1f}{r['max_step_s'] * 1e3:>9.1f}{ph:>20}"
              f"{r['median_cpu_s'] * 1e3:>9.1f}{fmt(r.get('cpu_over_ddp'), '.2f'):>7}"
              f"{fmt(r.get('cpu_over_ds'), '.2f'):>7}"
              f"{r['losses'][-1]:>11.5f}{fmt(r.get('loss_max_rel_diff_vs_ddp'), '.1e'):>10}")
    print(f"\n{'engine':<22}{'peak MiB':>10}{'x DDP':>7}{'x DS':>7}{'baseline':>10}{'growth':>8}{'pk grw':>8}"
          f"{'x DDP':>7}{'x DS':>7}")
    for name in names:
        r = results[name]
        if "failed" not in r:
            print(f"{name:<22}{r['peak_rss_mib']:>10.0f}{fmt(r.get('rss_over_ddp'), '.2f'):>7}"
                  f"{fmt(r.get('rss_over_ds'), '.2f'):>7}{r['rss_built_mib']:>10.0f}{r['rss_growth_mib']:>8.0f}"
                  f"{r['peak_growth_mib']:>8.0f}{fmt(r.get('growth_over_ddp'), '.2f'):>7}"
                  f"{fmt(r.get('growth_over_ds'), '.2f'):>7}")
    print("\n  x DDP / x DS: over DDP / over DeepSpeed at the same stage and bucket; paired: median over steps of "
          "the step time over DDP's step of the same index (same moment under --schedule interleaved). "
          "Time: slowest rank per step; "
          "fwd/bwd/step: rank 0's phase medians; CPU: process CPU time per step, mean over ranks. Memory (MiB, max "
          "over ranks): peak = VmHWM; baseline = RSS after the model build; growth = RSS at the end minus baseline; "
          "pk grw = peak minus baseline. rel diff: max relative difference of the per-step losses from DDP's.")
    for name in names:
        r = results[name]
        if r.get("breakdown"):
            parts = "; ".join(f"rank {i}: " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in b.items())
                              for i, b in enumerate(r["breakdown"]))
            print(f"  {name} memory_breakdown (MiB): {parts}")
    for stage in (1, 2, 3):
        a, b = results.get(f"microspeed_z{stage}", {}), results.get(f"microspeed_z{stage}_rb5e8", {})
        if "median_step_s" in a and "median_step_s" in b:
            faster = "5e6" if a["median_step_s"] < b["median_step_s"] else "5e8"
            print(f"  microspeed stage {stage}: reduce_bucket_size 5e6 {a['median_step_s'] * 1e3:.1f} ms "
                  f"(CPU {a['median_cpu_s'] * 1e3:.1f}), 5e8 {b['median_step_s'] * 1e3:.1f} ms "
                  f"(CPU {b['median_cpu_s'] * 1e3:.1f}) -> {faster} is faster by wall time "
                  f"({max(a['median_step_s'], b['median_step_s']) / min(a['median_step_s'], b['median_step_s']):.3f}x)")
    for name in names:
        r = results[name]
        if "failed" not in r:
            print(f"  {name}: start {r['start_s']:.1f} s, set-up {r['setup_s']:.1f} s, whole run {r['wall_s']:.0f} s, "
                  f"load avg {' -> '.join(f'{x:.2f}' for x in r['loadavg_1m'])}; "
                  f"step ms {r['step_ms'][:12]}{' ...' if len(r['step_ms']) > 12 else ''}"
                  + (f"; {r['optimizer']}" if "optimizer" in r else "") + (f"; {r['kernel']} AdamW" if "kernel" in r
                                                                           else "")
                  + (f"; microspeed_zero {','.join(r['zero_sources'])}" if r.get("zero_sources") else "")
                  + (f"; per-repeat medians {[round(t * 1e3) for t in r['repeat_median_step_s']]} ms, x DDP "
                     f"{[round(x, 2) for x in r['repeat_over_ddp']]}" if len(r["repeat_median_step_s"]) > 1
                     and r.get("repeat_over_ddp") else ""))


def main(argv: list[str] | None = None) -> int:
    """Run every engine; print the report; return 1 if any engine failed."""
    args = parse_args(argv)
    cfg = model_config(args.small)
    n_params = sum(p.numel() for p in build_model(args).parameters())
    print(f"zero benchmark: {model_description(args)} ({n_params:,} params), {args.schedule}, "
          f"{args.world} ranks x micro-batch {args.micro} x "
          f"{cfg.seq_len} tokens, {'bf16' if args.bf16 else 'fp32'}, AdamW lr {args.lr}, clip {args.clip}, "
          f"{args.warmup} warm-up + {args.steps} timed steps; torch {torch.__version__}, Python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs, gloo, 1 thread/rank", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {} if args.from_runs else {name: [] for name in args.engine_list}
    for path in args.from_runs:  # runs saved by earlier (maybe interrupted) invocations
        for name, saved in json.loads(Path(path).read_text()).items():
            runs.setdefault(name, []).extend(saved)
    if args.from_runs:
        args.engine_list = list(runs)
    # Round robin over the engines, repeat after repeat: slow drifts of a shared machine hit every engine alike.
    for rep in range(0 if args.from_runs else args.repeats):
        if args.schedule == "interleaved":
            print(f"  running {', '.join(args.engine_list)} interleaved" + (f" (repeat {rep + 1}/{args.repeats})"
                                                                            if args.repeats > 1 else "") + " ...",
                  flush=True)
            for name, r in run_interleaved(args).items():
                runs[name].append(r)
            if args.json_out:
                Path(args.json_out + ".runs").write_text(json.dumps(runs) + "\n")
            continue
        for name in args.engine_list:
            print(f"  running {name}" + (f" (repeat {rep + 1}/{args.repeats})" if args.repeats > 1 else "") + " ...",
                  flush=True)
            r = run_engine(name, args)
            runs[name].append(r)
            if args.json_out:  # every run so far, so that an interrupted benchmark keeps its data
                Path(args.json_out + ".runs").write_text(json.dumps(runs) + "\n")
            if "failed" in r:
                print(f"  {name} FAILED after {r['wall_s']:.0f} s:\n{r['failed']}", flush=True)
            else:
                print(f"  {name}: median {statistics.median(r['step_s']) * 1e3:.1f} ms/step, peak RSS "
                      f"{r['peak_rss_mib']:.0f} MiB, last loss {r['losses'][-1]:.5f} ({r['wall_s']:.0f} s)", flush=True)
    results = {name: combine(rs) for name, rs in runs.items()}
    add_ratios(results)
    print_report(results, args.engine_list)
    meta = {
        "benchmark": "zero", "model": model_description(args), "schedule": args.schedule,
        "params": n_params, "world": args.world, "micro": args.micro,
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "bf16": args.bf16, "lr": args.lr,
        "clip": args.clip,
        "reduce_bucket": args.reduce_bucket, "torch": torch.__version__, "python": platform.python_version(),
        "cpus": os.cpu_count(), "microspeed_core": core_fingerprint(),
        "microspeed_zero": sources_fingerprint("microspeed_zero"), "argv": sys.argv[1:],
    }
    line = json.dumps({**meta, "engines": results})
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(f"  microspeed core {meta['microspeed_core']}, microspeed_zero {meta['microspeed_zero']}")
    print("BENCH_JSON " + line, flush=True)
    failed = [n for n, r in results.items() if "failed" in r]
    if failed:
        print(f"FAILED engines: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
