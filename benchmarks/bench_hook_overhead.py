"""Cost of hook dispatch: microspeed with 0 extra plugins vs with 10 no-op plugins.

Single process, no launcher needed::

    python benchmarks/bench_hook_overhead.py [--steps N --warmup W --model demo|small --plugins 10]

Two engines train the same GPT-style model (:mod:`microspeed.demo.model`; same seed, same weights,
same batches) in one process: engine A with the built-in plugins only, engine B with ``--plugins``
extra plugins, each implementing every per-step notification hook (``before_forward``,
``after_forward``, ``before_backward``, ``after_backward``, ``before_step``, ``after_step``,
``after_global_step``) as a no-op. Steps alternate A, B, B, A, A, B, ... so that drifts of a shared
machine affect both alike; each step (forward + backward + step) is timed with ``time.perf_counter``.

Reported:

* median step time of A and of B, and the overhead two ways: the difference of the medians, and
  the median of the paired per-step differences ``B_i - A_i`` (in microseconds and as a percentage
  of A's median step); each both in wall-clock time and in this thread's CPU time
  (``time.thread_time``: with one torch thread every step runs on the main thread, and CPU time does
  not count the time the process waited for a core, which dominates the noise on a shared machine);
* a cross-check from micro-benchmarks: the per-call cost of each of those hooks on a bare
  :class:`microspeed.plugins.PluginManager` with 0 and with ``--plugins`` no-op implementers
  (``timeit`` in thread CPU time, best of several repeats), times the number of calls of that hook in one step
  (counted with pluggy's call monitoring on engine B), summed over the hooks.

Prints a table and, last, one line ``BENCH_JSON {...}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Measure microspeed's core and built-in plugins only, not whatever plugin distributions happen to be installed
# (export MICROSPEED_DISABLE_PLUGIN_AUTOLOAD=0 to include them).
os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import timeit  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from common import core_fingerprint, make_batches  # noqa: E402 - benchmarks/ is on sys.path when run as a script

import microspeed  # noqa: E402
from microspeed.demo.model import GPT, GPTConfig  # noqa: E402
from microspeed.engine import StepContext  # noqa: E402
from microspeed.hookspecs import StepOutcome  # noqa: E402
from microspeed.plugins import PluginManager  # noqa: E402

#: The per-step notification hooks every no-op plugin implements, with the arguments to call them with.
STEP_HOOKS = (
    "microspeed_before_forward",
    "microspeed_after_forward",
    "microspeed_before_backward",
    "microspeed_after_backward",
    "microspeed_before_step",
    "microspeed_after_step",
    "microspeed_after_global_step",
)


class NoopPlugin:
    """Implements every per-step notification hook, doing nothing (taking every argument, as a real one would)."""

    @microspeed.hookimpl
    def microspeed_before_forward(self, engine, ctx) -> None:
        """No-op."""

    @microspeed.hookimpl
    def microspeed_after_forward(self, engine, ctx) -> None:
        """No-op."""

    @microspeed.hookimpl
    def microspeed_before_backward(self, engine, ctx) -> None:
        """No-op."""

    @microspeed.hookimpl
    def microspeed_after_backward(self, engine, ctx) -> None:
        """No-op."""

    @microspeed.hookimpl
    def microspeed_before_step(self, engine) -> None:
        """No-op."""

    @microspeed.hookimpl
    def microspeed_after_step(self, engine, outcome) -> None:
        """No-op."""

    @microspeed.hookimpl
    def microspeed_after_global_step(self, engine) -> None:
        """No-op."""




def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="timed steps per engine (default: 60 demo, 400 small)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--model", choices=("demo", "small"), default="demo",
                   help="demo: GPTConfig.demo(), micro-batch 8 x 128; small: GPTConfig.tiny(), micro-batch 8 x 32")
    p.add_argument("--micro", type=int, default=8, help="sequences per step")
    p.add_argument("--plugins", type=int, default=10, help="number of no-op plugins on engine B")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 60 if args.model == "demo" else 400
    return args




def make_engine(model: torch.nn.Module, micro: int, n_plugins: int) -> Any:
    """A microspeed engine (fp32, Adam, clipping 1.0, no logging) with ``n_plugins`` extra no-op plugins."""
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    extra = [(f"noop{i}", NoopPlugin) for i in range(n_plugins)]
    engine, *_ = microspeed.initialize(model=model, config=config, plugins=extra)
    return engine


def train_step(engine: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One timed step; returns ``(wall seconds, this thread's CPU seconds, loss)``.

    With one torch thread, forward, backward (autograd runs CPU work on the calling thread) and the
    optimizer all run on this thread, so its CPU time is the step's work without the time the
    thread spent descheduled: robust to other processes on a shared machine.
    """
    c0, t0 = time.thread_time(), time.perf_counter()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    dt, dc = time.perf_counter() - t0, time.thread_time() - c0
    return dt, dc, float(loss.detach())


def count_hook_calls(engine: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    """How many times each pluggy hook is called during one training step of ``engine``."""
    counts: collections.Counter[str] = collections.Counter()
    undo = engine.plugins.add_hookcall_monitoring(lambda name, impls, kw: counts.update([name]),
                                                  lambda outcome, name, impls, kw: None)
    try:
        train_step(engine, x, y)
    finally:
        undo()
    return dict(counts)


def hook_kwargs() -> dict[str, dict[str, Any]]:
    """Arguments to call each step hook with in the micro-benchmark (engine=None: no implementer reads it)."""
    ctx = StepContext()
    outcome = StepOutcome(applied=True, grad_norm=1.0)
    out = {}
    for name in STEP_HOOKS:
        kw: dict[str, Any] = {"engine": None}
        if name in ("microspeed_before_forward", "microspeed_after_forward", "microspeed_before_backward",
                    "microspeed_after_backward"):
            kw["ctx"] = ctx
        if name == "microspeed_after_step":
            kw["outcome"] = outcome
        out[name] = kw
    return out


def per_call_seconds(n_plugins: int, repeat: int = 5) -> dict[str, float]:
    """Best-of-``repeat`` seconds per call of each step hook on a bare manager with ``n_plugins`` no-ops.

    Timed in this thread's CPU time, like the steps, so that waiting for a core is not counted.
    """
    pm = PluginManager()
    for i in range(n_plugins):
        pm.register_plugin(NoopPlugin, f"noop{i}")
    kwargs = hook_kwargs()
    out = {}
    for name in STEP_HOOKS:
        caller, kw = getattr(pm.hook, name), kwargs[name]
        timer = timeit.Timer(lambda caller=caller, kw=kw: caller(**kw), timer=time.thread_time)
        number, _ = timer.autorange()  # enough calls for >= 0.2 s
        number = max(number // 2, 5_000)
        out[name] = min(timer.repeat(repeat=repeat, number=number)) / number
    return out


def overhead(a: list[float], b: list[float]) -> dict[str, Any]:
    """Overhead of B over A from paired per-step samples: medians, paired median, its middle half."""
    med_a, med_b = statistics.median(a), statistics.median(b)
    paired = [y - x for x, y in zip(a, b, strict=True)]
    q = statistics.quantiles(paired, n=4)
    med_p = statistics.median(paired)
    return {
        "median_step_s_0_plugins": med_a, "median_step_s_n_plugins": med_b,
        "overhead_us_median_paired": med_p * 1e6, "overhead_pct_median_paired": 100 * med_p / med_a,
        "overhead_us_diff_of_medians": (med_b - med_a) * 1e6,
        "overhead_pct_diff_of_medians": 100 * (med_b - med_a) / med_a,
        "paired_diff_us_iqr": [q[0] * 1e6, q[2] * 1e6],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table and the JSON line; return the result."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = GPTConfig.demo() if args.model == "demo" else GPTConfig.tiny()
    torch.manual_seed(args.seed)
    base = GPT(cfg)
    batches = make_batches(args.warmup + args.steps, args.micro, cfg.seq_len)
    load_before = os.getloadavg()[0]

    eng_a = make_engine(copy.deepcopy(base), args.micro, 0)
    eng_b = make_engine(copy.deepcopy(base), args.micro, args.plugins)
    extra_impls = {h: len(eng_b.plugins.implementers(h)) - len(eng_a.plugins.implementers(h)) for h in STEP_HOOKS}
    assert all(n == args.plugins for n in extra_impls.values()), extra_impls

    wall: dict[str, list[float]] = {"A": [], "B": []}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    losses: dict[str, list[float]] = {"A": [], "B": []}
    t_start = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        for key in order:
            dt, dc, loss = train_step(eng_a if key == "A" else eng_b, x, y)
            losses[key].append(loss)
            if i >= args.warmup:
                wall[key].append(dt)
                cpu[key].append(dc)
    train_s = time.perf_counter() - t_start

    calls = count_hook_calls(eng_b, *batches[-1])
    per0, per_n = per_call_seconds(0), per_call_seconds(args.plugins)
    predicted = sum(calls.get(h, 0) * (per_n[h] - per0[h]) for h in STEP_HOOKS)
    w, c = overhead(wall["A"], wall["B"]), overhead(cpu["A"], cpu["B"])
    result = {
        "benchmark": "hook_overhead", "model": args.model, "params": base.num_parameters(), "micro": args.micro,
        "seq_len": cfg.seq_len, "steps": args.steps, "warmup": args.warmup, "plugins": args.plugins,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        "cpus": os.cpu_count(), "loadavg_1m": [load_before, os.getloadavg()[0]], "train_wall_s": train_s,
        "wall": w, "cpu": c,
        "hook_calls_per_step": {h: calls.get(h, 0) for h in STEP_HOOKS},
        "other_hook_calls_per_step": {h: n for h, n in calls.items() if h not in STEP_HOOKS},
        "per_call_us_0_impls": {h: v * 1e6 for h, v in per0.items()},
        "per_call_us_n_impls": {h: v * 1e6 for h, v in per_n.items()},
        "predicted_overhead_us": predicted * 1e6,
        "predicted_overhead_pct": 100 * predicted / c["median_step_s_0_plugins"],
        "losses_identical": losses["A"] == losses["B"],
        "microspeed_core": core_fingerprint(), "microspeed_plugins_a": eng_a.plugins.names(),
    }

    print(f"bench_hook_overhead: model={args.model} ({base.num_parameters():,} params), micro-batch "
          f"{args.micro} x {cfg.seq_len}, {args.warmup} warm-up + {args.steps} timed steps per engine, "
          f"threads={torch.get_num_threads()}, torch {torch.__version__}, load avg {load_before:.2f}")
    print(f"\n{'':<30}{'wall clock':>14}{'thread CPU time':>18}")
    for label, key in (("A: built-ins only, median", "median_step_s_0_plugins"),
                       (f"B: + {args.plugins} no-op plugins, median", "median_step_s_n_plugins")):
        print(f"{label:<30}{w[key] * 1e3:>11.3f} ms{c[key] * 1e3:>15.3f} ms")
    for label, key, pct in (("overhead, median paired diff", "overhead_us_median_paired", "overhead_pct_median_paired"),
                            ("overhead, diff of medians", "overhead_us_diff_of_medians",
                             "overhead_pct_diff_of_medians")):
        print(f"{label:<30}{w[key]:>11.1f} us{c[key]:>15.1f} us")
        print(f"{'  as % of a step':<30}{w[pct]:>12.3f} %{c[pct]:>16.3f} %")
    print(f"{'  paired diffs, middle half':<30}{w['paired_diff_us_iqr'][0]:>7.0f}..{w['paired_diff_us_iqr'][1]:.0f} us"
          f"{c['paired_diff_us_iqr'][0]:>9.0f}..{c['paired_diff_us_iqr'][1]:.0f} us")
    print(f"\n{'hook':<32}{'calls/step':>11}{'us/call, 0 impl':>17}{f'us/call, {args.plugins} impl':>18}")
    for h in STEP_HOOKS:
        print(f"{h:<32}{calls.get(h, 0):>11}{per0[h] * 1e6:>17.3f}{per_n[h] * 1e6:>18.3f}")
    print(f"other pluggy hook calls per step (not implemented by the no-op plugins): "
          f"{result['other_hook_calls_per_step']}")
    print(f"\ncross-check, predicted from timeit: {predicted * 1e6:.1f} us per step "
          f"({result['predicted_overhead_pct']:.4f} % of A's median step in CPU time)")
    verdict = {True: "met", False: "NOT met"}
    print(f"target < 1 % of a step: measured (wall) {verdict[w['overhead_pct_median_paired'] < 1]}, "
          f"measured (CPU time) {verdict[c['overhead_pct_median_paired'] < 1]}, "
          f"predicted {verdict[result['predicted_overhead_pct'] < 1]}")
    print(f"losses of A and B identical at every step: {result['losses_identical']}")
    print(f"microspeed core {result['microspeed_core']}; engine A's plugins: {', '.join(eng_a.plugins.names())}")
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print("BENCH_JSON " + line, flush=True)
    return result


if __name__ == "__main__":
    main()
