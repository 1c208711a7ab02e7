"""The fused ops of :mod:`microspeed.ops` against eager PyTorch and ``torch.compile``.

Run::

    python benchmarks/fused_ops.py [--repeats 30] [--warmup 5] [--dtype bf16] [--ops ln,gelu,softmax,adam]
                                   [--no-compile] [--json-out fused_ops.json]

What is timed (one forward + backward, or one optimizer step; median and fastest of ``--repeats`` after
``--warmup``, the implementations taking turns; CUDA-synchronized on a GPU, ``time.perf_counter`` around each
call):

* ``ln``: ``FusedLayerNorm`` against ``torch.nn.LayerNorm`` and ``torch.compile(nn.LayerNorm)``;
* ``gelu``: ``fused_bias_gelu(x, b)`` against ``F.gelu(x + b)`` and its ``torch.compile``;
* ``softmax``: ``fused_scale_mask_softmax(x, scale, padding_mask, causal=True)`` against the eager composition
  ``(x * scale + mask).masked_fill(upper, -inf).softmax(-1)`` and its ``torch.compile``;
* ``adam``: one ``FusedAdam`` step over many tensors against ``torch.optim.AdamW`` with ``foreach=True``
  (eager), ``fused=True`` (GPU only) and a ``torch.compile``-d ``step``.

The ratio column is the baseline's median over ``fused``'s (above 1: fused is faster).

On a GPU the fused ops run their Triton kernels. Without one, the script says so, skips ``torch.compile``
(it needs a C++ toolchain and minutes on a small CPU) and times the ops' PyTorch fallback against eager on CPU
at smaller shapes. Either way it first runs a correctness smoke check: on a GPU the fused ops against the eager
ones at the benchmark shapes; on CPU the Triton kernels under the interpreter (``TRITON_INTERPRET=1``, in a
child process of this script) at tiny shapes, against the ops' references. Prints tables and, last, one line
``BENCH_JSON {...}`` with every number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from microspeed.ops import _triton, fused_adam, fused_bias_gelu, fused_layernorm, fused_softmax

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SHAPES = {  # (GPU, CPU)
    "ln": ((16384, 4096), (2048, 1024)),
    "gelu": ((16384, 4096), (2048, 4096)),
    "softmax": ((8, 16, 1024, 1024), (4, 8, 256, 256)),
    "adam": ((48, 1_048_576), (48, 65_536)),  # (tensors, largest tensor; sizes spread down from it)
}


# -- timing ------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(calls: dict[str, Callable[[], Any]], device: torch.device, warmup: int, repeats: int
               ) -> dict[str, dict[str, Any]]:
    """Median and fastest wall time (ms) of each call over ``repeats`` rounds after ``warmup`` ones.

    The calls take turns within a round (the first one rotating), so that load from other processes on a
    shared machine hits them alike. A call that raises (e.g. a ``torch.compile`` failure) gets ``error``.
    """
    times: dict[str, list[float]] = {name: [] for name in calls}
    errors: dict[str, str] = {}
    names = list(calls)
    for r in range(warmup + repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in errors:
                continue
            try:
                _sync(device)
                start = time.perf_counter()
                calls[name]()
                _sync(device)
            except Exception as exc:  # a failing baseline is a result worth reporting, not a crash
                errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            if r >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"error": errors[name]} if name in errors else
            {"median_ms": statistics.median(times[name]), "min_ms": min(times[name])} for name in names}


def _forward_backward(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dy: torch.Tensor,
                      params: list[torch.Tensor]) -> Callable[[], None]:
    """A closure running ``fn(*inputs)`` and its backward against ``dy`` (the inputs' and ``params``' gradients
    cleared each call)."""

    def run() -> None:
        for t in [*inputs, *params]:
            t.grad = None
        fn(*inputs).backward(dy)

    return run


# -- workloads ---------------------------------------------------------------------------------------------------


def _ln_workload(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Inputs and implementations of the layer-norm comparison."""
    rows, n = shape
    x = torch.randn(rows, n, dtype=dtype, device=device, requires_grad=True)
    fused = fused_layernorm.FusedLayerNorm(n, device=device, dtype=dtype)
    eager = torch.nn.LayerNorm(n, device=device, dtype=dtype)
    eager.load_state_dict(fused.state_dict())
    return {"inputs": [x], "params": [fused.weight, fused.bias, eager.weight, eager.bias],
            "impls": {"fused": fused, "eager": eager}, "compile": eager,
            "bytes": 4 * x.numel() * x.element_size()}  # read x, write y; read x, dy, write dx (params: small)


def _gelu_workload(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Inputs and implementations of the bias + GELU comparison."""
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    b = torch.randn(shape[-1], dtype=dtype, device=device, requires_grad=True)

    def eager(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.gelu(x + b)

    return {"inputs": [x, b], "params": [], "impls": {"fused": fused_bias_gelu.fused_bias_gelu, "eager": eager},
            "compile": eager, "bytes": 5 * x.numel() * x.element_size()}


def _softmax_workload(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Inputs and implementations of the scale + padding mask + causal softmax comparison."""
    b, _, tq, tk = shape
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    mask = torch.zeros(b, 1, 1, tk, dtype=dtype, device=device)
    for i in range(b):
        mask[i, ..., tk - (i * tk) // (2 * b):] = float("-inf")
    scale = 1 / math.sqrt(64)
    upper = torch.ones(tq, tk, dtype=torch.bool, device=device).triu(1)

    def fused(x: torch.Tensor) -> torch.Tensor:
        return fused_softmax.fused_scale_mask_softmax(x, scale, mask, causal=True)

    def eager(x: torch.Tensor) -> torch.Tensor:
        return (x * scale + mask).masked_fill(upper, float("-inf")).softmax(-1)

    return {"inputs": [x], "params": [], "impls": {"fused": fused, "eager": eager}, "compile": eager,
            "bytes": 4 * x.numel() * x.element_size()}


def _adam_sizes(count: int, largest: int) -> list[int]:
    """``count`` tensor sizes from ``largest`` down to ~1/1000 of it (a model's mix of big and small tensors)."""
    return [max(1, int(largest * 1000 ** (-i / max(count - 1, 1)))) for i in range(count)]


def _adam_workload(spec: tuple[int, int], device: torch.device, use_compile: bool) -> dict[str, Any]:
    """Optimizers over identical copies of fp32 parameters with fixed gradients."""
    sizes = _adam_sizes(*spec)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=g).to(device) for n in sizes]
    grads = [torch.randn(n, generator=g).to(device) * 1e-2 for n in sizes]

    def params() -> list[torch.nn.Parameter]:
        ps = [torch.nn.Parameter(t.clone()) for t in base]
        for p, grad in zip(ps, grads, strict=True):
            p.grad = grad
        return ps

    opts: dict[str, Any] = {"fused": fused_adam.FusedAdam(params(), lr=1e-3, weight_decay=0.01),
                            "eager": torch.optim.AdamW(params(), lr=1e-3, weight_decay=0.01, foreach=True)}
    if device.type == "cuda":
        opts["torch_fused"] = torch.optim.AdamW(params(), lr=1e-3, weight_decay=0.01, fused=True)
    calls = {name: opt.step for name, opt in opts.items()}
    if use_compile:
        compiled = torch.optim.AdamW(params(), lr=1e-3, weight_decay=0.01, foreach=True)
        calls["compile"] = torch.compile(compiled.step)
        opts["compile"] = compiled
    return {"calls": calls, "opts": opts, "numel": sum(sizes), "tensors": len(sizes),
            "bytes": 28 * sum(sizes)}  # fp32: read p, g, m, v; write p, m, v


# -- the benchmark -------------------------------------------------------------------------------------------------


def bench_op(name: str, args: argparse.Namespace, device: torch.device, use_compile: bool) -> dict[str, Any]:
    """Time one op's implementations; returns their timings and the workload description."""
    on_gpu = device.type == "cuda"
    shape = SHAPES[name][0 if on_gpu else 1]
    dtype = DTYPES[args.dtype] if on_gpu else torch.float32
    if name == "adam":
        work = _adam_workload(shape, device, use_compile)
        rows = time_calls(work["calls"], device, args.warmup, args.repeats)
        backend = sorted(work["opts"]["fused"].backend)
        described = f"{work['tensors']} fp32 tensors, {work['numel'] / 1e6:.1f}M elements"
    else:
        work = {"ln": _ln_workload, "gelu": _gelu_workload, "softmax": _softmax_workload}[name](shape, dtype, device)
        dy = torch.randn_like(work["inputs"][0])
        impls = dict(work["impls"])
        if use_compile:
            impls["compile"] = torch.compile(work["compile"])
        runs = {impl: _forward_backward(fn, work["inputs"], dy, work["params"]) for impl, fn in impls.items()}
        rows = time_calls(runs, device, args.warmup, args.repeats)
        backend = [{"ln": fused_layernorm, "gelu": fused_bias_gelu, "softmax": fused_softmax}[name].backend_for(
            work["inputs"][0])]
        described = f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
    fused_ms = rows["fused"].get("median_ms")
    for row in rows.values():
        if "median_ms" in row:
            row["ratio_vs_fused"] = row["median_ms"] / fused_ms if fused_ms else None
            row["GB_per_s"] = work["bytes"] / row["median_ms"] / 1e6
    return {"shape": described, "fused_backend": backend, "rows": rows}


def _print_table(results: dict[str, Any]) -> None:
    """One table: op, implementation, median, fastest, ratio, effective bandwidth."""
    print(f"{'op':8} {'impl':12} {'median ms':>10} {'min ms':>9} {'ratio':>7} {'GB/s':>7}  workload")
    for op, res in results.items():
        for impl, row in res["rows"].items():
            if "error" in row:
                print(f"{op:8} {impl:12} {row['error']}")
                continue
            print(f"{op:8} {impl:12} {row['median_ms']:10.3f} {row['min_ms']:9.3f} {row['ratio_vs_fused']:7.2f} "
                  f"{row['GB_per_s']:7.1f}  {res['shape']} (fused ran: {','.join(res['fused_backend'])})")


# -- correctness smoke checks ----------------------------------------------------------------------------------


def _smoke_cases(device: torch.device, small: bool) -> dict[str, float]:
    """Max abs differences of the fused ops (forward and gradients) from their fp32 references."""
    torch.manual_seed(0)
    out: dict[str, float] = {}

    def compare(name: str, fused: Callable[..., torch.Tensor], ref: Callable[..., torch.Tensor],
                inputs: list[torch.Tensor]) -> None:
        a = [t.detach().clone().requires_grad_() for t in inputs]
        b = [t.detach().clone().requires_grad_() for t in inputs]
        ya, yb = fused(*a), ref(*b)
        dy = torch.randn_like(ya)
        ga, gb = torch.autograd.grad(ya, a, dy), torch.autograd.grad(yb, b, dy)
        out[name] = max((u.double() - v.double()).abs().max().item() for u, v in zip([ya, *ga], [yb, *gb],
                                                                                      strict=True))

    rows, n = (6, 48) if small else SHAPES["ln"][0]
    x = torch.randn(rows, n, device=device)
    w, b = torch.randn(n, device=device), torch.randn(n, device=device)
    compare("layer_norm", lambda *t: fused_layernorm.fused_layer_norm(*t), fused_layernorm.layer_norm_reference,
            [x, w, b])
    compare("bias_gelu", fused_bias_gelu.fused_bias_gelu, fused_bias_gelu.bias_gelu_reference,
            [torch.randn(rows, n, device=device) * 3, torch.randn(n, device=device)])
    shape = (2, 2, 16, 24) if small else SHAPES["softmax"][0]
    mask = torch.zeros(shape[0], 1, 1, shape[-1], device=device)
    mask[-1, ..., shape[-1] // 2:] = float("-inf")
    compare("softmax", lambda t: fused_softmax.fused_scale_mask_softmax(t, 0.3, mask, causal=True),
            lambda t: fused_softmax.softmax_reference(t, 0.3, mask, causal=True), [torch.randn(shape, device=device)])
    sizes = [33, 9000, 700] if small else _adam_sizes(*SHAPES["adam"][0])
    params = [[torch.nn.Parameter(torch.full((k,), 0.5, device=device)) for k in sizes] for _ in range(2)]
    opts = [fused_adam.FusedAdam(params[0], lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW(params[1], lr=1e-2, weight_decay=0.1, foreach=False)]
    for step in range(3):
        for ps, opt in zip(params, opts, strict=True):
            for i, p in enumerate(ps):
                p.grad = torch.sin(torch.arange(p.numel(), device=device) * 0.37 + step + i)
            opt.step()
    out["adamw_vs_torch"] = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(*params, strict=True))
    out["backends"] = sorted({fused_layernorm.backend_for(x), *opts[0].backend})
    return out


def interpreted_smoke_check() -> dict[str, Any]:
    """Run :func:`_smoke_cases` on tiny CPU shapes in a child with the Triton interpreter forced on."""
    env = {**os.environ, "TRITON_INTERPRET": "1", _triton.BACKEND_ENV: "triton"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--smoke-child"], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the arguments, run the smoke check and the timings, print the tables and ``BENCH_JSON``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="GPU activations' dtype")
    parser.add_argument("--ops", default="ln,gelu,softmax,adam")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--smoke-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke_child:
        print(json.dumps(_smoke_cases(torch.device("cpu"), small=True)))
        return {}
    torch.manual_seed(0)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if on_gpu else "cpu",
                              "torch": torch.__version__, "threads": torch.get_num_threads()}
    if on_gpu:
        print(f"GPU: {report['device']}; the fused ops run their Triton kernels")
        report["smoke"] = _smoke_cases(device, small=False)
    else:
        print("No GPU is available: timing the fused ops' PyTorch fallback against eager PyTorch on CPU "
              "(no torch.compile); the Triton kernels are only checked, under the interpreter, at tiny shapes.")
        report["smoke"] = interpreted_smoke_check()
    print("smoke check (max abs difference from the references):", json.dumps(report["smoke"]))
    use_compile = on_gpu and not args.no_compile
    report["results"] = {op: bench_op(op, args, device, use_compile) for op in args.ops.split(",")}
    _print_table(report["results"])
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    print("BENCH_JSON " + json.dumps(report))
    return report


if __name__ == "__main__":
    main()
