"""CPU Adam per parameter, for ZeRO-Offload: microspeed's optimizer vs torch's kernels vs DeepSpeed's CPU Adam.

Run (3-6 minutes on 2 shared cores once DeepSpeed's ``cpu_adam`` extension is built)::

    python benchmarks/bench_cpu_adam.py [--sizes 1M,8M,32M --threads 1,2 --impls ... --repeats R --interleave
                                         --json-out cpu_adam.json]

With ZeRO-Offload the optimizer step runs on the CPU over this rank's fp32 partition: one flat fp32
tensor of parameters, its gradient and two fp32 moments. That is what is timed here, for ``N`` elements
(``--sizes``, default 1M, 8M and 32M; ``K``/``M`` suffixes are powers of two):

* ``microspeed_adam`` / ``microspeed_adamw``: whatever :func:`microspeed.builtin.optimizers.build_optimizer`
  returns for ``{"type": "Adam", "params": {lr, betas, eps}}`` (DeepSpeed's defaults: decoupled decay,
  ``weight_decay`` 0) and for ``{"type": "AdamW", "params": {..., "weight_decay": 0.01}}``. The tables say
  which class and kernel it chose;
* ``torch_adam_{fused,foreach,forloop}``: ``torch.optim.Adam`` with ``fused=True``, ``foreach=True`` or
  ``foreach=False`` (weight_decay 0), and ``torch_adamw_fused``: ``torch.optim.AdamW(fused=True)`` (0.01).
  ``torch_adamw_foreach`` and ``torch_adamw_forloop`` exist too but are not run by default (``--impls``);
* ``deepspeed_adam`` / ``deepspeed_adamw``: DeepSpeed's ``DeepSpeedCPUAdam`` with ``adamw_mode=False``
  (weight_decay 0) / ``True`` (0.01), imported with ``DS_ACCELERATOR=cpu``. Its first use JIT-builds the
  C++ ``cpu_adam`` extension (about 100 s on 2 cores) into ``~/.cache/torch_extensions``; a build that was
  killed leaves a ``lock`` file there on which every later build waits forever: delete it. A failed
  build or import is reported (with its error text) instead of a timing.

Hyperparameters: lr 1e-3, betas (0.9, 0.999), eps 1e-8. Parameters and gradients are ``randn`` from a
fixed seed; the gradient stays the same from step to step.

By default each (implementation, thread count) runs in a fresh subprocess of this script with
``OMP_NUM_THREADS`` and ``torch.set_num_threads`` set to the thread count (``--threads``, default 1 and
2; DeepSpeed's extension uses the OpenMP runtime torch loaded), so nothing is shared between
configurations. Per size: ``--warmup`` untimed steps (3), then ``--steps`` steps (10), each timed with
``time.perf_counter`` around ``optimizer.step()``. ``--repeats R`` runs the whole set R times, in rounds,
and pools the steps. ``--interleave`` instead runs one subprocess per thread count in which every impl
takes its turn step by step (rotating who goes first), so that load from other processes on a shared
machine hits all of them alike; the table then also gives the *paired* ratio, the median over steps of
this impl's step time over DeepSpeed's step time taken next to it.

Reported: the median step time and the fastest step, as nanoseconds per parameter per step, and their
ratio to the DeepSpeed kernel of the same mode (Adam rows to ``deepspeed_adam``, AdamW rows to
``deepspeed_adamw``; below 1 means faster than DeepSpeed). "GB/s" assumes the 28 bytes per parameter
an fp32 Adam step must move (read param, grad, exp_avg, exp_avg_sq; write three of them).

Correctness (one more subprocess per thread count, ``--check-size`` elements, default 1M): every
implementation takes ``--check-steps`` steps (5) from the same start with the same per-step random
gradients; reported is the max abs difference of the parameters from DeepSpeed's (same mode) and from
an fp64 ``torch.optim.Adam``/``AdamW`` reference (for-loop kernel on float64 copies).

Prints tables and, last, one line ``BENCH_JSON {...}`` with every number.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed
os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")  # the core and built-ins only

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

LR, BETAS, EPS, ADAMW_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
BYTES_PER_PARAM = 28  # fp32 Adam: read p, g, m, v; write p, m, v

#: Every implementation, by name -> its mode: "adam" (weight_decay 0) or "adamw" (decoupled, 0.01).
IMPLS: dict[str, str] = {
    "microspeed_adam": "adam",  # build_optimizer({"type": "Adam", ...})
    "microspeed_adamw": "adamw",  # build_optimizer({"type": "AdamW", ..., "weight_decay": 0.01})
    "torch_adam_fused": "adam",
    "torch_adam_foreach": "adam",
    "torch_adam_forloop": "adam",
    "torch_adamw_fused": "adamw",
    "torch_adamw_foreach": "adamw",
    "torch_adamw_forloop": "adamw",
    "deepspeed_adam": "adam",  # DeepSpeedCPUAdam(adamw_mode=False)
    "deepspeed_adamw": "adamw",  # DeepSpeedCPUAdam(adamw_mode=True, weight_decay=0.01)
}
DS_OF_MODE = {"adam": "deepspeed_adam", "adamw": "deepspeed_adamw"}
#: What runs without ``--impls`` (the AdamW for-loop and foreach kernels add a minute and tell nothing new).
DEFAULT_IMPLS = tuple(i for i in IMPLS if i not in ("torch_adamw_foreach", "torch_adamw_forloop"))


def parse_size(text: str) -> int:
    """``"8M"`` -> 8 * 2**20, ``"64K"`` -> 64 * 2**10, ``"1000"`` -> 1000."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def size_label(n: int) -> str:
    """The inverse of :func:`parse_size` where exact (``8388608`` -> ``"8M"``)."""
    for suffix, scale in (("M", 2**20), ("K", 2**10)):
        if n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1M,8M,32M", help="comma-separated element counts (K/M suffixes: 2**10/2**20)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts, one subprocess each")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per size")
    p.add_argument("--steps", type=int, default=10, help="timed steps per size")
    p.add_argument("--interleave", action="store_true",
                   help="one subprocess per thread count that runs every impl, taking turns step by step")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every configuration this many times, in rounds; the medians pool the rounds' steps")
    p.add_argument("--check-size", default="1M", help="elements in the correctness check")
    p.add_argument("--check-steps", type=int, default=5, help="steps in the correctness check")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds per subprocess (the first DeepSpeed one may JIT-build cpu_adam for minutes)")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # an impl, "interleave" or "check"
    p.add_argument("--worker-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.thread_list = [int(t) for t in args.threads.split(",") if t.strip()]
    args.impl_list = [s.strip() for s in args.impls.split(",") if s.strip()]
    unknown = set(args.impl_list) - set(IMPLS)
    if unknown:
        p.error(f"unknown impls {sorted(unknown)}; choose from {','.join(IMPLS)}")
    return args


# ---------------------------------------------------------------------------------- worker


def make_optimizer(impl: str, param: torch.Tensor) -> torch.optim.Optimizer:
    """The optimizer ``impl`` names, over the single tensor ``param``."""
    mode = IMPLS[impl]
    decay = ADAMW_DECAY if mode == "adamw" else 0.0
    if impl.startswith("microspeed_"):
        from microspeed.builtin.optimizers import build_optimizer

        params: dict[str, Any] = {"lr": LR, "betas": list(BETAS), "eps": EPS}
        if mode == "adamw":
            params["weight_decay"] = decay
        return build_optimizer([param], {"type": "AdamW" if mode == "adamw" else "Adam", "params": params})
    if impl.startswith("torch_"):
        cls = torch.optim.AdamW if mode == "adamw" else torch.optim.Adam
        kernel = impl.rsplit("_", 1)[1]
        flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False}}[kernel]
        return cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=decay, **flags)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=decay, adamw_mode=mode == "adamw")


def describe(opt: torch.optim.Optimizer) -> str:
    """Class and kernel of a built optimizer, e.g. ``AdamW(fused=True, weight_decay=0.0)``."""
    d = opt.defaults
    if hasattr(opt, "adam_w_mode"):  # DeepSpeedCPUAdam
        return f"{type(opt).__name__}(adamw_mode={opt.adam_w_mode}, weight_decay={d.get('weight_decay')})"
    if "fused" not in d:
        return f"{type(opt).__name__}(weight_decay={d.get('weight_decay')})"
    return (f"{type(opt).__name__}(fused={d.get('fused')}, foreach={d.get('foreach')}, "
            f"weight_decay={d.get('weight_decay')})")


def _error_text(err: BaseException) -> str:
    """``Type: message``, with the cause's (DeepSpeed wraps its build errors in a RuntimeError)."""
    text = f"{type(err).__name__}: {err}"
    if err.__cause__ is not None:
        text += f" (caused by {type(err.__cause__).__name__}: {err.__cause__})"
    return text


def time_impls(impls: list[str], sizes: list[int], warmup: int, steps: int, seed: int) -> dict[str, Any]:
    """Wall / CPU seconds of each ``optimizer.step()`` per impl and size; several impls take turns step by step.

    Returns ``{impl: {"optimizer": ..., "sizes": {str(n): {...}}}}``, or ``{impl: {"error": ...}}`` for an impl
    whose optimizer could not be built.
    """
    out: dict[str, Any] = {impl: {"sizes": {}} for impl in impls}
    for n in sizes:
        opts, params = {}, {}
        for impl in impls:
            if "error" in out[impl]:
                continue
            gen = torch.Generator().manual_seed(seed)
            param = torch.randn(n, generator=gen).requires_grad_()
            param.grad = torch.randn(n, generator=gen)
            try:
                opts[impl] = make_optimizer(impl, param)
            except Exception as err:  # noqa: BLE001 - a failed DeepSpeed build is a result to report
                out[impl] = {"error": _error_text(err), "traceback": traceback.format_exc()[-4000:]}
                continue
            params[impl] = param
            out[impl]["optimizer"] = describe(opts[impl])
            for _ in range(warmup):
                opts[impl].step()
        wall: dict[str, list[float]] = {impl: [] for impl in opts}
        cpu: dict[str, list[float]] = {impl: [] for impl in opts}
        order = list(opts)
        for i in range(steps if order else 0):
            for impl in order[i % len(order):] + order[:i % len(order)]:  # rotate: no impl always goes first
                w0, c0 = time.perf_counter(), time.process_time()
                opts[impl].step()
                wall[impl].append(time.perf_counter() - w0)
                cpu[impl].append(time.process_time() - c0)
        for impl in opts:
            assert torch.isfinite(params[impl].detach()).all(), f"{impl}: non-finite parameters"
            med = statistics.median(wall[impl])
            out[impl]["sizes"][str(n)] = {"median_s": med, "ns_per_param": med / n * 1e9, "min_s": min(wall[impl]),
                                          "cpu_median_s": statistics.median(cpu[impl]), "wall_s": wall[impl],
                                          "cpu_s": cpu[impl]}
        del opts, params
    return out


def check_impls(impls: list[str], n: int, steps: int, seed: int) -> dict[str, Any]:
    """Max abs parameter differences after ``steps`` steps: vs DeepSpeed (same mode) and vs an fp64 reference."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]
    finals: dict[str, torch.Tensor] = {}
    errors: dict[str, str] = {}
    for impl in impls:
        try:
            param = start.clone().requires_grad_()
            opt = make_optimizer(impl, param)
            for g in grads:
                param.grad = g.clone()
                opt.step()
            finals[impl] = param.detach().clone()
        except Exception as err:  # noqa: BLE001 - a failed DeepSpeed build is a result to report
            errors[impl] = _error_text(err)
    refs = {}
    for mode, cls in (("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)):
        param = start.double().requires_grad_()
        opt = cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=ADAMW_DECAY if mode == "adamw" else 0.0,
                  foreach=False)
        for g in grads:
            param.grad = g.double()
            opt.step()
        refs[mode] = param.detach()
    moved = {mode: (ref - start.double()).abs().max().item() for mode, ref in refs.items()}
    rows = {}
    for impl, p in finals.items():
        mode = IMPLS[impl]
        ds = finals.get(DS_OF_MODE[mode])
        rows[impl] = {"max_abs_vs_deepspeed": None if ds is None else (p - ds).abs().max().item(),
                      "max_abs_vs_fp64": (p.double() - refs[mode]).abs().max().item()}
    return {"n": n, "steps": steps, "rows": rows, "errors": errors, "max_abs_update_fp64": moved}


def worker(args: argparse.Namespace) -> None:
    """Run one configuration in this process and print its ``BENCH_JSON`` line(s), one per impl."""
    torch.set_num_threads(args.worker_threads)
    common = {"threads": args.worker_threads, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "torch_threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    impls = args.impl_list if args.worker == "interleave" else [args.worker]
    try:
        if args.worker == "check":
            rows = {"check": check_impls(args.impl_list, parse_size(args.check_size), args.check_steps, args.seed)}
        else:
            setup = {}
            for impl in impls:
                if impl.startswith("deepspeed_"):  # import (and maybe JIT-build) outside the timing
                    t1 = time.perf_counter()
                    try:
                        make_optimizer(impl, torch.zeros(16, requires_grad=True))
                    except Exception:  # noqa: BLE001 - time_impls records the error for this impl
                        pass
                    setup[impl] = time.perf_counter() - t1
            rows = time_impls(impls, args.size_list, args.warmup, args.steps, args.seed)
            for impl, secs in setup.items():
                rows[impl]["setup_s"] = secs
    except Exception as err:  # noqa: BLE001 - reported by the launcher, with the error text
        rows = {impl: {"error": _error_text(err), "traceback": traceback.format_exc()[-4000:]}
                for impl in (["check"] if args.worker == "check" else impls)}
    for impl, row in rows.items():
        row.update(common, impl=impl, interleaved=args.worker == "interleave", worker_s=time.perf_counter() - t0)
        print("BENCH_JSON " + json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------- launcher


def run_worker(args: argparse.Namespace, what: str, threads: int) -> list[dict[str, Any]]:
    """One subprocess of this script for ``what`` (an impl, "interleave" or "check") at ``threads`` threads."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", what, "--worker-threads", str(threads),
           "--sizes", args.sizes, "--impls", ",".join(args.impl_list), "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--check-size", args.check_size, "--check-steps", str(args.check_steps),
           "--seed", str(args.seed)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    expected = args.impl_list if what == "interleave" else [what]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as err:
        tail = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else str(err.stderr or "")
        return [{"impl": impl, "threads": threads, "error": f"timed out after {args.timeout:.0f} s",
                 "traceback": tail[-4000:]} for impl in expected]
    found = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("BENCH_JSON ")]
    if found:
        return found
    return [{"impl": impl, "threads": threads, "error": f"worker exited {proc.returncode} without a result",
             "traceback": (proc.stdout[-2000:] + proc.stderr[-4000:])} for impl in expected]


def _fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def merge_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the ``--repeats`` runs of one configuration: steps pooled over the rounds."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[-1]
    row = {k: v for k, v in ok[0].items() if k != "sizes"}
    row["rounds"] = len(ok)
    row["sizes"] = {}
    for n in ok[0]["sizes"]:
        wall = [w for r in ok for w in r["sizes"][n]["wall_s"]]
        cpu = [c for r in ok for c in r["sizes"][n]["cpu_s"]]
        med = statistics.median(wall)
        row["sizes"][n] = {"median_s": med, "ns_per_param": med / int(n) * 1e9, "min_s": min(wall),
                           "min_ns_per_param": min(wall) / int(n) * 1e9, "cpu_median_s": statistics.median(cpu),
                           "round_ns_per_param": [r["sizes"][n]["ns_per_param"] for r in ok],
                           "wall_s": wall, "cpu_s": cpu}
    return row


def add_paired_ratios(rows: list[dict[str, Any]]) -> None:
    """Interleaved runs: the median over steps of (this impl's step time / DeepSpeed's step time taken next to it)."""
    by_key = {(r["impl"], r["threads"]): r for r in rows if "error" not in r}
    for (impl, threads), r in by_key.items():
        ds = by_key.get((DS_OF_MODE[IMPLS[impl]], threads))
        for n, v in r["sizes"].items():
            if ds is not None and len(ds["sizes"][n]["wall_s"]) == len(v["wall_s"]):
                v["paired_ratio_vs_deepspeed"] = statistics.median(
                    a / b for a, b in zip(v["wall_s"], ds["sizes"][n]["wall_s"], strict=True))


def timing_table(rows: list[dict[str, Any]], sizes: list[int], threads: int, key: str = "ns_per_param") -> str:
    """Markdown: ns/param/step per size (``key``), and the ratio to DeepSpeed's kernel of the same mode."""
    by_impl = {r["impl"]: r for r in rows if r["threads"] == threads}
    what = "median" if key == "ns_per_param" else "fastest step"
    head = " | ".join(f"{size_label(n)}" for n in sizes)
    ratio_head = " / ".join(size_label(n) for n in sizes)
    paired = key == "ns_per_param" and any(
        "paired_ratio_vs_deepspeed" in v for r in by_impl.values() for v in r.get("sizes", {}).values())
    lines = [f"| impl (threads={threads}) | optimizer | {head} | ÷ DeepSpeed ({ratio_head}) "
             + (f"| paired ÷ DeepSpeed ({ratio_head}) " if paired else "") + f"| GB/s at {size_label(sizes[-1])} |",
             "|---|---|" + "---:|" * len(sizes) + "---|" + ("---|" if paired else "") + "---:|"]
    lines.insert(0, f"{what}, ns per parameter per step:\n")
    for impl, r in by_impl.items():
        if "error" in r:
            lines.append(f"| {impl} | **failed**: {r['error'][:300]} |" + " |" * (len(sizes) + 2 + paired))
            continue
        ds = by_impl.get(DS_OF_MODE[IMPLS[impl]], {})
        cells, ratios = [], []
        for n in sizes:
            ns = r["sizes"][str(n)][key]
            cells.append(f"{ns:.3f}")
            ds_ns = ds.get("sizes", {}).get(str(n), {}).get(key) if "error" not in ds else None
            ratios.append(_fmt_ratio(ns / ds_ns if ds_ns else None))
        gbs = BYTES_PER_PARAM / r["sizes"][str(sizes[-1])][key]
        pair = " / ".join(_fmt_ratio(r["sizes"][str(n)].get("paired_ratio_vs_deepspeed")) for n in sizes)
        lines.append(f"| {impl} | `{r.get('optimizer', '')}` | {' | '.join(cells)} | {' / '.join(ratios)} "
                     + (f"| {pair} " if paired else "") + f"| {gbs:.1f} |")
    return "\n".join(lines)


def check_table(check: dict[str, Any]) -> str:
    """Markdown: max abs parameter differences after the check's steps."""
    lines = [f"| impl (threads={check['threads']}) | max abs diff vs DeepSpeed (same mode) | max abs diff vs fp64 |",
             "|---|---:|---:|"]
    for impl, r in check.get("rows", {}).items():
        vs_ds = "—" if r["max_abs_vs_deepspeed"] is None else f"{r['max_abs_vs_deepspeed']:.3g}"
        lines.append(f"| {impl} | {vs_ds} | {r['max_abs_vs_fp64']:.3g} |")
    for impl, err in check.get("errors", {}).items():
        lines.append(f"| {impl} | **failed**: {err[:300]} | |")
    return "\n".join(lines)


def launcher(args: argparse.Namespace) -> int:
    """Run every (impl, threads) configuration and the checks in subprocesses; print tables and BENCH_JSON."""
    locks = glob.glob(os.path.expanduser("~/.cache/torch_extensions/*/cpu_adam/lock"))
    if locks and any(i.startswith("deepspeed_") for i in args.impl_list):
        print(f"warning: {locks} exists; if no build is running it is stale (a killed build) and DeepSpeed will "
              "wait on it forever: delete it", file=sys.stderr)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    # DeepSpeed first: its first use may JIT-build the extension, which should not overlap anything timed.
    order = sorted(args.impl_list, key=lambda i: not i.startswith("deepspeed_"))
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    checks = []
    for rnd in range(args.repeats):
        for threads in args.thread_list:
            for what in (["interleave"] if args.interleave else order):
                for r in run_worker(args, what, threads):
                    runs.setdefault((r["impl"], threads), []).append(r)
                    summary = r.get("error") or ", ".join(f"{size_label(int(n))}: {v['ns_per_param']:.3f}"
                                                          for n, v in r["sizes"].items())
                    print(f"[{time.perf_counter() - t0:6.1f} s] round {rnd + 1}/{args.repeats} {r['impl']} "
                          f"threads={threads}: {summary} ns/param", file=sys.stderr, flush=True)
                    if "error" in r and r.get("traceback"):
                        print(r["traceback"], file=sys.stderr)
            if not args.no_check and rnd == 0:
                c = run_worker(args, "check", threads)[0]
                checks.append(c)
                if "error" in c:
                    print(f"check threads={threads} failed: {c['error']}\n{c.get('traceback', '')}", file=sys.stderr)
    rows = [merge_rounds(results) for results in runs.values()]
    if args.interleave:
        add_paired_ratios(rows)
    total_s = time.perf_counter() - t0

    print(f"\nCPU Adam step over one flat fp32 tensor; {args.repeats} x {args.steps} timed steps after "
          f"{args.warmup} warm-up per configuration (÷ DeepSpeed < 1: faster than DeepSpeedCPUAdam)")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"python {platform.python_version()}, load avg {load_before[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after, {total_s:.0f} s in all\n")
    for key in ("ns_per_param", "min_ns_per_param"):
        for threads in args.thread_list:
            print(timing_table(rows, args.size_list, threads, key) + "\n")
    for c in checks:
        if "rows" in c:
            print(f"correctness: {c['steps']} steps on {size_label(c['n'])} elements; the fp64 reference moved each "
                  f"parameter by up to {max(c['max_abs_update_fp64'].values()):.3g}\n")
            print(check_table(c) + "\n")
        else:
            print(f"correctness check (threads={c.get('threads')}) failed: {c.get('error')}\n")
    result = {"benchmark": "cpu_adam", "sizes": args.size_list, "threads": args.thread_list, "warmup": args.warmup,
              "steps": args.steps, "repeats": args.repeats, "interleave": args.interleave, "rows": rows,
              "checks": checks,
              "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
              "machine": platform.machine(), "loadavg_1m": [load_before[0], os.getloadavg()[0]], "total_s": total_s,
              "microspeed_core": _core_fingerprint()}
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print("BENCH_JSON " + line, flush=True)
    failed = [r for r in rows if "error" in r and not r["impl"].startswith("deepspeed_")]
    return 1 if failed else 0


def _core_fingerprint() -> str | None:
    try:
        from common import core_fingerprint  # benchmarks/ is on sys.path when run as a script

        return core_fingerprint()
    except Exception:  # noqa: BLE001 - a missing microspeed should not hide the timings
        return None


if __name__ == "__main__":
    cli = parse_args()
    if cli.worker:
        worker(cli)
    else:
        sys.exit(launcher(cli))
