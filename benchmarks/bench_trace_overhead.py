"""Cost of tracing: off (the default) and on, against a build where tracing cannot happen.

Single process, no launcher needed::

    python benchmarks/bench_trace_overhead.py [--steps N --warmup W --model demo|small]

Engines training the same GPT-style model (:mod:`microspeed.demo.model`; same seed, same weights,
same batches) in one process:

* **A, impossible**: the ``tracing``, ``watchdog`` and ``comms_logger`` plugins disabled
  (``"plugins": {"disable": [...]}``): the plain hook dispatch, nothing that could trace;
* **B, off**: the default build, tracing off (the plugins loaded, nothing attached);
* **C, on**: ``"trace": {"enabled": true}`` writing ``rank0.jsonl`` to a temporary directory;

then, after tracing is stopped, a second phase pairs A with

* **D, watchdog**: ``"watchdog": {"timeout_s": 600}``: the same hook instrumentation as tracing
  (monitor, timed implementations, activity stack) and a watchdog thread, without writing events.

Steps rotate (A B C, B C A, C A B, ...) so that drifts of a shared machine hit all alike; each step
(forward + backward + step) is timed with ``time.perf_counter`` and ``time.thread_time`` (CPU time,
which a shared machine's waits for a core do not inflate). Reported, for both clocks: median step
per engine, and the overhead against A as the median of the paired per-step differences (in
microseconds and in percent of A's median), with the middle half of those differences; the events
and bytes tracing writes per step; and a micro-benchmark of one hook call (``before_forward``, the
built-in implementers) on a bare manager, plain vs instrumented vs traced.

With one process every collective is a no-op (one rank), so collectives are not in these steps;
with tracing off a collective wrapper costs one look at the current context's observers (:mod:`microspeed.comm`).

Prints a table and, last, one line ``BENCH_JSON {...}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.pop("MICROSPEED_TRACE", None)  # the benchmark decides what is traced

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import timeit  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from common import make_batches  # noqa: E402 - benchmarks/ is on sys.path when run as a script

import microspeed  # noqa: E402
from microspeed.demo.model import GPT, GPTConfig  # noqa: E402
from microspeed.engine import StepContext  # noqa: E402
from microspeed.observe import (
    trace,
    watchdog,  # noqa: E402
)
from microspeed.plugins import PluginManager  # noqa: E402

NO_TRACING = ["tracing", "watchdog", "comms_logger"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="timed steps per engine (default: 40 demo, 300 small)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--model", choices=("demo", "small"), default="demo",
                   help="demo: GPTConfig.demo(), micro-batch 8 x 128; small: GPTConfig.tiny(), micro-batch 8 x 32")
    p.add_argument("--micro", type=int, default=8, help="sequences per step")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 40 if args.model == "demo" else 300
    return args




def make_engine(model: torch.nn.Module, micro: int, **sections: Any) -> Any:
    """A microspeed engine (fp32, Adam, clipping 1.0, no logging) with extra config ``sections``."""
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        **sections,
    }
    engine, *_ = microspeed.initialize(model=model, config=config)
    return engine


def train_step(engine: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One timed step; returns ``(wall seconds, thread CPU seconds)``."""
    c0, t0 = time.thread_time(), time.perf_counter()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t0, time.thread_time() - c0


def run_rotation(engines: dict[str, Any], batches: list[tuple[torch.Tensor, torch.Tensor]],
                 warmup: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step every engine on every batch, rotating their order; wall and CPU step times after ``warmup``."""
    keys = list(engines)
    times: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    for i, (x, y) in enumerate(batches):
        order = keys[i % len(keys):] + keys[:i % len(keys)]
        for key in order:
            dt, ct = train_step(engines[key], x, y)
            if i >= warmup:
                times[key].append(dt)
                cpu[key].append(ct)
    return times, cpu


def paired(base: list[float], other: list[float]) -> dict[str, float]:
    """Median of ``other_i - base_i`` (us), its share of ``base``'s median (%), and the middle half (us)."""
    diffs = [b - a for a, b in zip(base, other, strict=True)]
    q = statistics.quantiles(diffs, n=4)
    med = statistics.median(diffs)
    return {"us": med * 1e6, "pct": 100 * med / statistics.median(base), "iqr_us": [q[0] * 1e6, q[2] * 1e6]}


STEP_HOOKS = ("microspeed_before_forward", "microspeed_after_forward", "microspeed_before_backward",
              "microspeed_scale_loss", "microspeed_backward", "microspeed_after_backward",
              "microspeed_reduce_gradients", "microspeed_before_step", "microspeed_optimizer_step",
              "microspeed_clip_gradients", "microspeed_after_step", "microspeed_after_global_step")


def identical_dispatch(a: Any, b: Any) -> bool:
    """Whether engines ``a`` and ``b`` dispatch every per-step hook the same way.

    Same implementers in the same order, pluggy's plain ``_multicall`` (no monitor), no chain
    listener: with tracing off, the step runs exactly the code it runs without the plugin.
    """
    return all(a.plugins.implementers(h) == b.plugins.implementers(h) for h in STEP_HOOKS) and \
        a.plugins._inner_hookexec == b.plugins._inner_hookexec


def hook_call_us(repeat: int = 5) -> dict[str, float]:
    """Microseconds per ``before_forward`` call on a bare manager with the built-ins: plain, instrumented, traced."""
    pm = PluginManager()
    pm.load_all(disabled=NO_TRACING)
    kw = {"engine": None, "ctx": StepContext()}
    caller = pm.hook.microspeed_before_forward

    def best() -> float:
        timer = timeit.Timer(lambda: caller(**kw))
        number = max(timer.autorange()[0] // 2, 2_000)
        return min(timer.repeat(repeat=repeat, number=number)) / number * 1e6

    out = {"implementers": len(pm.implementers("microspeed_before_forward")), "plain": best()}
    from microspeed import comm

    comm.activate(comm.default_context())  # trace.probe and the module-level calls: the default context's
    trace.probe.watching = True  # instrumented as for the watchdog: no events written
    trace.instrument(pm)
    out["instrumented"] = best()
    with tempfile.TemporaryDirectory() as d:
        trace.start(d)
        out["traced"] = best()
        trace.stop()
    trace.probe.watching = False
    trace.probe.release_if_unused()
    return out


def collective_wrapper_us(repeat: int = 5) -> dict[str, float]:
    """Microseconds per ``comm.all_reduce`` call around a no-op: the wrapper's own cost, off and traced.

    ``torch.distributed.all_reduce`` is replaced by a no-op and the world size by 2 for the
    measurement (restored after), so only microspeed's wrapper is timed.
    """
    from microspeed import comm
    from microspeed.comm import collectives

    comm.activate(comm.default_context())
    tensor = torch.zeros(1024)
    real_all_reduce, real_world = collectives.dist.all_reduce, collectives.get_world_size
    collectives.dist.all_reduce = lambda *a, **k: None
    collectives.get_world_size = lambda group=None: 2
    try:
        def best(fn: Any) -> float:
            timer = timeit.Timer(fn)
            number = max(timer.autorange()[0] // 2, 2_000)
            return min(timer.repeat(repeat=repeat, number=number)) / number * 1e6

        def without_observers(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
            """The wrapper as it was before observers existed (byte count, then the call)."""
            if collectives.get_world_size(group) == 1:
                return None
            comm.stats.record("all_reduce", comm._nbytes(tensor))
            return collectives.dist.all_reduce(tensor, op=op or collectives.dist.ReduceOp.SUM, group=group,
                                               async_op=async_op)

        out = {"noop_call": best(lambda: collectives.dist.all_reduce(tensor)),
               "no_observers_build": best(lambda: without_observers(tensor)),
               "off": best(lambda: comm.all_reduce(tensor))}
        with tempfile.TemporaryDirectory() as d:
            trace.start(d)
            out["traced"] = best(lambda: comm.all_reduce(tensor))
            trace.stop()
    finally:
        collectives.dist.all_reduce, collectives.get_world_size = real_all_reduce, real_world
        comm.stats.reset()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table and the JSON line; return the result."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = GPTConfig.demo() if args.model == "demo" else GPTConfig.tiny()
    torch.manual_seed(args.seed)
    base = GPT(cfg)
    batches = make_batches(args.warmup + args.steps, args.micro, cfg.seq_len)

    with tempfile.TemporaryDirectory(prefix="bench-trace-") as trace_dir:
        engines = {
            "A": make_engine(copy.deepcopy(base), args.micro, plugins={"disable": NO_TRACING}),
            "B": make_engine(copy.deepcopy(base), args.micro),
            "C": make_engine(copy.deepcopy(base), args.micro, trace={"enabled": True, "output_path": trace_dir}),
        }
        probe_c = trace.probe_for(engines["C"].plugin_state("comms_logger"))  # each engine has its own probe
        assert "tracing" not in engines["A"].plugins.names() and probe_c.is_attached(engines["C"].plugins)
        assert not trace.probe_for(engines["B"].plugin_state("comms_logger")).is_attached(engines["B"].plugins)
        same_path = identical_dispatch(engines["A"], engines["B"])
        t_start = time.perf_counter()
        times, cpu = run_rotation(engines, batches, args.warmup)
        trace.stop(engines["C"].plugin_state("comms_logger"))
        path = os.path.join(trace_dir, "rank0.jsonl")
        with open(path) as f:
            events = [json.loads(line) for line in f]
        trace_bytes = os.path.getsize(path)
    n_steps = len(batches)
    first = min(e["t_ns"] for e in events if e["event"] == "hook" and e["hook"] == "before_forward")
    per_step_events = sum(1 for e in events if e["t_ns"] >= first and not e["event"].startswith("trace")) / n_steps
    hook_calls = sum(1 for e in events if e["t_ns"] >= first and e["event"] == "hook") / n_steps

    # Phase 2: the watchdog's instrumentation alone (tracing is stopped, so nothing is written).
    engines2 = {"A": engines["A"], "D": make_engine(copy.deepcopy(base), args.micro, watchdog={"timeout_s": 600})}
    context_d = engines2["D"].plugin_state("comms_logger")
    assert trace.probe_for(context_d).is_attached(engines2["D"].plugins) and trace.active(context_d) is None
    times2, cpu2 = run_rotation(engines2, batches, args.warmup)
    watchdog.stop(context_d)
    train_s = time.perf_counter() - t_start
    micro = hook_call_us()
    coll = collective_wrapper_us()

    med = {k: statistics.median(v) for k, v in times.items()}
    med["D"] = statistics.median(times2["D"])
    med["A2"] = statistics.median(times2["A"])
    over = {"off": paired(times["A"], times["B"]), "on": paired(times["A"], times["C"]),
            "watchdog": paired(times2["A"], times2["D"])}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    med_cpu["D"], med_cpu["A2"] = statistics.median(cpu2["D"]), statistics.median(cpu2["A"])
    over_cpu = {"off": paired(cpu["A"], cpu["B"]), "on": paired(cpu["A"], cpu["C"]),
                "watchdog": paired(cpu2["A"], cpu2["D"])}
    result = {
        "benchmark": "trace_overhead", "model": args.model, "params": base.num_parameters(), "micro": args.micro,
        "seq_len": cfg.seq_len, "steps": args.steps, "warmup": args.warmup, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0], "train_wall_s": train_s,
        "median_step_s": med, "overhead": over, "median_step_cpu_s": med_cpu, "overhead_cpu": over_cpu,
        "step_s": times, "step_s_phase2": times2,
        "trace_events_per_step": per_step_events, "trace_bytes_per_step": trace_bytes / n_steps,
        "hook_call_us": micro, "collective_wrapper_us": coll, "off_dispatch_identical": same_path,
        "hook_calls_per_step": hook_calls,
        "predicted_us": {"on": hook_calls * (micro["traced"] - micro["plain"]),
                         "watchdog": hook_calls * (micro["instrumented"] - micro["plain"])},
    }

    print(f"bench_trace_overhead: model={args.model} ({base.num_parameters():,} params), micro-batch "
          f"{args.micro} x {cfg.seq_len}, {args.warmup} warm-up + {args.steps} timed steps per engine, "
          f"threads={torch.get_num_threads()}, torch {torch.__version__}, load avg {os.getloadavg()[0]:.2f}")
    rows = (("B", "B: tracing off (default)", "off"), ("C", "C: tracing on", "on"),
            ("D", "D: watchdog on (phase 2, vs A there)", "watchdog"))
    for clock, medians, overheads in (("wall", med, over), ("thread CPU", med_cpu, over_cpu)):
        print(f"\n{clock + ' time':<44}{'median step ms':>15}{'overhead vs A, us':>19}{'%':>9}{'middle half, us':>20}")
        print(f"{'A: tracing impossible (plugins disabled)':<44}{medians['A'] * 1e3:>15.3f}")
        for key, label, name in rows:
            o = overheads[name]
            iqr = f"{o['iqr_us'][0]:.0f} .. {o['iqr_us'][1]:.0f}"
            print(f"{label:<44}{medians[key] * 1e3:>15.3f}{o['us']:>19.1f}{o['pct']:>+9.3f}{iqr:>20}")
    print(f"\ntracing writes {per_step_events:.1f} events and {trace_bytes / n_steps / 1024:.1f} KiB per step")
    print(f"one before_forward call ({micro['implementers']} implementers): plain {micro['plain']:.2f} us, "
          f"instrumented {micro['instrumented']:.2f} us, traced {micro['traced']:.2f} us")
    pred = result["predicted_us"]
    print(f"predicted from it, {hook_calls:.0f} hook calls per step: tracing on {pred['on']:.0f} us "
          f"({100 * pred['on'] / med['A'] / 1e6:.3f} %), watchdog {pred['watchdog']:.0f} us "
          f"({100 * pred['watchdog'] / med['A'] / 1e6:.3f} %)")
    print(f"tracing off dispatches every step hook exactly as the build without it: {same_path}")
    print(f"comm.all_reduce around a no-op: {coll['off']:.2f} us off, {coll['traced']:.2f} us traced; "
          f"the wrapper without observers {coll['no_observers_build']:.2f} us, "
          f"the no-op alone {coll['noop_call']:.2f} us")
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print("BENCH_JSON " + line, flush=True)
    return result


if __name__ == "__main__":
    main()
