"""Block-sparse attention (``microspeed_sparse_attn``) against dense SDPA and FlexAttention, forward + backward.

Usage (the full CPU run takes about 8 minutes on 2 cores at load average 1.5, longer on a busier machine)::

    python benchmarks/sparse_attn.py                          # seq 2k..32k, Fixed and BigBird at ~10 % density
    python benchmarks/sparse_attn.py --quick                  # smoke run at seq 1k and 2k (under a minute)
    python benchmarks/sparse_attn.py --max-seq 16384          # leave out 32k
    python benchmarks/sparse_attn.py --device cuda            # the Triton backends vs SDPA and compiled flex
    python benchmarks/sparse_attn.py --json-out sparse_attn.json

**Shapes.** Batch 1, 4 heads, head dim 64, block 64, fp32 on CPU (``--dtype``; bf16 by default on CUDA),
sequences ``--seqs`` (2048 ... 32768, capped by ``--max-seq``). q, k, v and the upstream gradient are
``randn`` from seed ``--seed``, the same tensors for every method of a sequence length.

**Layouts** (both ``attention='unidirectional'``, one layout for all heads, DeepSpeed's default): for each
sequence the parameters are searched (:func:`choose_layout`) so that the non-zero fraction of the *full*
``blocks x blocks`` grid is as close as the pattern allows to ``--density`` (0.10):

* Fixed: ``FixedSparsityConfig(num_local_blocks=L, num_global_blocks=G)`` over ``L`` in 2..32 and ``G`` in
  {1, 2, 4} dividing ``L`` (its density tends to ``G / 2L`` plus the local windows, so short sequences cannot get
  down to 10 %: the exact density is printed);
* BigBird: ``BigBirdSparsityConfig(num_sliding_window_blocks=3, num_global_blocks=1, num_random_blocks=r,
  seed=--seed)`` with ``r`` found by bisection (random blocks are the pattern's knob that scales with length).

Printed per layout: the parameters, the non-zero blocks (over all heads), the density of the full grid and the
fraction of the causal half (``blocks * (blocks + 1) / 2`` per head) it keeps.

**Methods** (each a peer a user would pick instead):

* ``sparse``: ``SparseSelfAttention(config, max_seq_length=seq, causal=True)(q, k, v)``; on CPU its
  ``last_backend`` is ``cpu`` (the chunked PyTorch path; checked and printed). On CUDA two rows,
  ``sparse-fused`` and ``sparse-triton``, forced with ``MICROSPEED_SPARSE_ATTN_BACKEND``.
* ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``, dense (on CPU torch's flash kernel,
  memory linear in the sequence).
* ``flex``: ``torch.nn.attention.flex_attention`` with the same block mask (:func:`flex_block_mask`:
  ``BlockMask.from_kv_blocks`` with the layout's below-diagonal blocks as full blocks and its diagonal blocks as
  partial ones under a causal ``mask_mod``). Forward + backward is tried eagerly and under ``torch.compile``;
  on CPU it raises (the error is printed). For reference its compiled *forward only* (no grad) is timed too,
  next to the forward only of ``sparse`` and ``sdpa``, for the first pattern only (the compile takes 30-60 s a
  case; ``--no-flex-forward`` skips it). After the failed compile with gradients dynamo would run flex eagerly
  (dense and slow), so the forward-only function is compiled afresh after ``torch._dynamo.reset()``.

**What is measured.** Every ``(method, layout, seq)`` runs in a fresh subprocess (``--worker``) with a time limit
(``--case-timeout``; a case past it reads ``timeout``). In it: build the method (layout, block mask), run it once
forward + backward on a tiny input (seq 128) so that lazy imports (Triton, logging) and one-time set-up fall
before the measured region, make the inputs, read the resident set size (``/proc/self/statm``: *RSS after
inputs*), reset the process's peak RSS to the current RSS (writing 5 to ``/proc/self/clear_refs``, which resets
``ru_maxrss`` too), then run ``--warmup`` + ``iters`` forward + backward passes (``out = attn(q, k, v);
out.backward(grad)``; gradients set to None after each), timing each with ``time.perf_counter``, and read
``resource.getrusage(RUSAGE_SELF).ru_maxrss``. Reported:

* *time*: the median of the timed passes of all rounds of the case (warm-up excluded: the first pass of
  ``sparse`` builds its index tables and plans, cached for the next ones);
* *peak*: that ``ru_maxrss``, the absolute peak resident set of the process during the passes (Python, torch, inputs
  and all; every worker first imports the same libraries: Triton, the plugin, FlexAttention), and *delta* = peak
  minus the RSS after inputs, i.e. what the passes added at their worst: the gradients of q, k, v (3 x the input
  size, the same for all methods), the output, saved tensors and temporaries. Where ``clear_refs`` cannot be
  written, the peak is the process's lifetime ``ru_maxrss``; if that was already reached before the passes (import
  spikes), delta is a lower bound, marked ``<``. The larger delta of the rounds is reported. On CUDA the peak is
  ``torch.cuda.max_memory_allocated`` (the absolute peak) minus the allocation after inputs.

**Interleaving.** The machine is shared, so each sequence runs ``--rounds`` rounds; every round runs one
subprocess per method, in an order rotated from round to round; the time is the median over all rounds' passes.
The load average is printed with every case. Ratios are quoted (``sdpa / sparse``: above 1, sparse is faster;
memory ``sparse / sdpa``: at most 1 meets the target).

**Correctness** (smallest sequence, first round, after the timing): every method's output, and for ``sparse``
the gradients of q, k, v, against dense masked attention computed in float64 (the layout expanded to a
``(heads, seq, seq)`` mask, and the causal triangle); ``sdpa`` against the same with a full layout.

**Cost model.** *µs per block* = the sparse time / its non-zero blocks; the same for SDPA with the causal half's
blocks. Their ratio is the *efficiency* of the sparse path per block, and ``sdpa / sparse`` = (causal half /
non-zero blocks) x efficiency. A least-squares fit ``time = a + b * blocks`` over the sequences checks that the
sparse time grows with its blocks. From each sequence's efficiency the density at which ``sparse`` would be 5x
faster than SDPA is printed: ``density * speedup / 5`` (time taken as proportional to the blocks).

**Density sweep** (``--sweep-seq``, 16k; ``--sweep-densities`` 0.05, 0.10, 0.20): ``sparse`` alone with both
patterns searched for each density, one subprocess per case; printed with its µs per block and the speedup over
the main table's SDPA at that length.

**One thread** (``--one-thread-seqs``, 8k and 16k): ``sparse`` (both layouts) and ``sdpa`` again with
``torch.set_num_threads(1)``, one round.

Prints the tables and, last, one line ``BENCH_JSON {...}``. Entry-point plugins are not auto-loaded
(``MICROSPEED_DISABLE_PLUGIN_AUTOLOAD=1``).
"""

from __future__ import annotations

import os

# Before anything imports torch; the workers inherit these.
os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

HEADS, HEAD_DIM, BLOCK, BATCH = 4, 64, 64, 1
"""The shape of every case (the issue's): batch 1, 4 heads, head dim 64, block 64."""

FULL_SEQS = (2048, 4096, 8192, 16384, 32768)
"""The sequence lengths of the full run."""

QUICK_SEQS = (1024, 2048)
"""The sequence lengths of ``--quick``."""

LAYOUT_KINDS = ("fixed", "bigbird")
"""The two patterns measured."""

BACKEND_ENV = "MICROSPEED_SPARSE_ATTN_BACKEND"
"""The environment variable that forces a backend of ``SparseSelfAttention``."""

WORKER_TAG = "WORKER_JSON "
"""The prefix of the one line a worker prints with its result."""


# ------------------------------------------------------------------------------------------ layouts


def make_config(kind: str, params: dict[str, int], seed: int) -> Any:
    """The sparsity configuration ``kind`` (``'fixed'`` or ``'bigbird'``) with ``params``, unidirectional."""
    from microspeed_sparse_attn import BigBirdSparsityConfig, FixedSparsityConfig

    if kind == "fixed":
        return FixedSparsityConfig(num_heads=HEADS, block=BLOCK, attention="unidirectional", **params)
    if kind == "bigbird":
        return BigBirdSparsityConfig(num_heads=HEADS, block=BLOCK, attention="unidirectional", seed=seed, **params)
    raise ValueError(f"kind: expected one of {LAYOUT_KINDS}, got {kind!r}")


def layout_stats(layout: torch.Tensor) -> dict[str, float]:
    """Non-zero blocks (all heads), density of the full grid and the fraction of the causal half they make."""
    heads, n, _ = layout.shape
    nnz = int((layout != 0).sum())
    return {"blocks": n, "nnz": nnz, "density": nnz / (heads * n * n),
            "causal_fraction": nnz / (heads * n * (n + 1) / 2)}


def choose_layout(kind: str, seq: int, target: float, seed: int) -> dict[str, Any]:
    """The parameters of pattern ``kind`` whose layout for ``seq`` has the density closest to ``target``.

    Fixed: ``num_local_blocks`` 2..32 and ``num_global_blocks`` in {1, 2, 4} (dividing it); ties go to the
    smaller window. BigBird: window 3, one global block, ``num_random_blocks`` by bisection (the density grows with
    it), then the best of the neighbours. Returns ``{"kind", "params", **layout_stats}``.
    """
    if not 0 < target < 1:
        raise ValueError(f"density: expected a fraction in (0, 1), got {target!r}")
    n = seq // BLOCK
    tried: dict[tuple[tuple[str, int], ...], dict[str, float]] = {}

    def stats(params: dict[str, int]) -> dict[str, float]:
        key = tuple(sorted(params.items()))
        if key not in tried:
            tried[key] = layout_stats(make_config(kind, params, seed).make_layout(seq))
        return tried[key]

    if kind == "fixed":
        candidates = [{"num_local_blocks": local, "num_global_blocks": glob}
                      for local in range(2, 33) for glob in (1, 2, 4)
                      if local % glob == 0 and glob < local and glob / (2 * local) <= 1.5 * target]
    elif kind == "bigbird":
        base = {"num_sliding_window_blocks": min(3, n), "num_global_blocks": 1}
        lo, hi = 0, n
        while lo < hi:  # the smallest r whose density reaches the target
            mid = (lo + hi) // 2
            if stats({**base, "num_random_blocks": mid})["density"] >= target:
                hi = mid
            else:
                lo = mid + 1
        candidates = [{**base, "num_random_blocks": r} for r in (lo - 1, lo, lo + 1) if 0 <= r <= n]
    else:
        raise ValueError(f"kind: expected one of {LAYOUT_KINDS}, got {kind!r}")
    best = min(candidates, key=lambda p: abs(stats(p)["density"] - target))
    return {"kind": kind, "params": best, **stats(best)}


def flex_block_mask(layout: torch.Tensor, block: int, seq: int, device: str | torch.device) -> Any:
    """FlexAttention's ``BlockMask`` for ``layout`` with causal masking: blocks below the diagonal are full
    blocks, diagonal blocks partial ones under the ``q >= k`` mask_mod; blocks above it are dropped."""
    from torch.nn.attention.flex_attention import BlockMask

    heads, n, _ = layout.shape
    keep = (layout != 0).to("cpu")
    full = keep & torch.ones(n, n, dtype=torch.bool).tril(-1)
    partial = keep & torch.eye(n, dtype=torch.bool)

    def tables(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = mask.sum(-1).to(torch.int32)[None]
        order = torch.sort(mask.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)[None]
        return counts.to(device), order.contiguous().to(device)

    def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx >= kv_idx

    kv_num, kv_idx = tables(partial)
    full_num, full_idx = tables(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=causal,
                                    seq_lengths=(seq, seq))


def dense_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor | None,
                           block: int) -> torch.Tensor:
    """Causal attention restricted to ``layout`` (None: all blocks), dense, in q's dtype: the reference."""
    seq = q.shape[-2]
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    if layout is not None:
        expanded = (layout != 0).to(q.device).repeat_interleave(block, 1).repeat_interleave(block, 2)
        allowed = allowed & expanded
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return probs @ v


# ------------------------------------------------------------------------------------------ the worker


def _rss_bytes() -> int:
    """The resident set size of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    """The peak resident set size of this process so far (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> bool:
    """Reset this process's peak resident set (``ru_maxrss``, ``VmHWM``) to its current RSS by writing 5 to
    ``/proc/self/clear_refs`` (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference, in float64."""
    return float((a.detach().double() - b.detach().double()).abs().max())


def _preload() -> None:
    """Import what any method imports (Triton, the plugin's kernels, FlexAttention, microspeed's logging), so that
    every worker holds the same libraries and the absolute peaks compare what the methods do."""
    import torch.nn.attention.flex_attention  # noqa: F401
    from microspeed_sparse_attn import cpu_attention, sparse_self_attention  # noqa: F401
    from microspeed_sparse_attn.matmul import triton_available

    from microspeed.log import get_logger  # noqa: F401

    triton_available("cpu")


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one case (see the module docstring) in this process; returns the result dict."""
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    _preload()
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    seq, method = spec["seq"], spec["method"]
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "load_before": os.getloadavg()[0]}
    layout = None
    if spec.get("layout"):
        config = make_config(spec["layout"]["kind"], spec["layout"]["params"], spec["seed"])
        layout = config.make_layout(seq)
        nnz = int((layout != 0).sum())
        if nnz != spec["layout"]["nnz"]:
            raise RuntimeError(f"layout rebuilt with {nnz} blocks, the parent chose {spec['layout']['nnz']}")

    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    fwd_only: Any = None
    if method.startswith("sparse"):
        from microspeed_sparse_attn import SparseSelfAttention

        if method != "sparse":
            os.environ[BACKEND_ENV] = method.split("-", 1)[1]
        module = SparseSelfAttention(config, max_seq_length=seq, causal=True)
        attn = module
        fwd_only = module
    elif method == "sdpa":
        import torch.nn.functional as F

        def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        fwd_only = attn
    elif method == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        block_mask = flex_block_mask(layout, BLOCK, seq, device)
        compiled = torch.compile(flex_attention)

        def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return compiled(q, k, v, block_mask=block_mask)

        fwd_only = attn
    else:
        raise ValueError(f"method: unknown {method!r}")

    if method != "flex":  # run the code paths once on a tiny input: lazy imports (triton, logging) stay out of
        small = [torch.randn(BATCH, HEADS, 2 * BLOCK, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
                 for _ in range(3)]  # the measured region (flex would compile for this shape: left out)
        attn(*small).sum().backward()
        del small
    gen = torch.Generator().manual_seed(spec["seed"])
    shape = (BATCH, HEADS, seq, HEAD_DIM)
    q, k, v, grad = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    sync()
    result["rss_after_inputs"] = _rss_bytes()
    result["maxrss_before"] = _maxrss_bytes()
    result["peak_reset"] = _reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base_alloc = torch.cuda.memory_allocated(device)

    def step() -> None:
        out = attn(q, k, v)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    train_ok = True
    if method == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        attempts = [("compiled", lambda: attn(q, k, v))]
        if not cuda:  # eager flex on CUDA would materialise the scores; on CPU it is the other thing a user tries
            attempts.insert(0, ("eager", lambda: flex_attention(q, k, v, block_mask=block_mask)))
        errors: dict[str, str | None] = {}
        for name, fn in attempts:
            try:
                fn().backward(grad)
                errors[name] = None
            except Exception as exc:  # the expected outcome on CPU: record it
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            q.grad = k.grad = v.grad = None
        result["fwd_bwd_error"] = {name: e for name, e in errors.items() if e is not None} or None
        train_ok = errors["compiled"] is None
        if not train_ok:  # after a failed compile dynamo runs flex_attention eagerly (dense, slow): start afresh
            torch._dynamo.reset()
            compiled_fwd = torch.compile(flex_attention)

            def fwd_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return compiled_fwd(q, k, v, block_mask=block_mask)
    if train_ok:
        times = []
        for i in range(spec["warmup"] + spec["iters"]):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - t0)
        result["times"] = times
    result["maxrss_after"] = _maxrss_bytes()
    if cuda:
        result["peak_abs"] = torch.cuda.max_memory_allocated(device)
        result["peak_delta"] = result["peak_abs"] - base_alloc
    else:
        result["peak_abs"] = result["maxrss_after"]
        result["peak_delta"] = result["maxrss_after"] - result["rss_after_inputs"]
    result["peak_is_lower_bound"] = (not cuda and not result["peak_reset"]
                                     and result["maxrss_before"] >= result["maxrss_after"])
    if method.startswith("sparse"):
        result["backend"] = module.last_backend
    if spec.get("fwd_iters") and fwd_only is not None:
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        times = []
        with torch.no_grad():
            for i in range(1 + spec["fwd_iters"]):  # one warm-up (the compile, for flex)
                sync()
                t0 = time.perf_counter()
                fwd_only(qd, kd, vd)
                sync()
                if i:
                    times.append(time.perf_counter() - t0)
                else:
                    result["fwd_first_s"] = time.perf_counter() - t0
        result["fwd_times"] = times
    if spec.get("check"):
        result["check"] = _check(spec, method, fwd_only, attn, layout, q, k, v, grad, train_ok)
    result["load_after"] = os.getloadavg()[0]
    return result


def _check(spec: dict[str, Any], method: str, fwd_only: Any, attn: Any, layout: torch.Tensor | None,
           q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, train_ok: bool) -> dict[str, float]:
    """Max abs differences of the output (and gradients, when the method trains) from dense masked attention."""
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = dense_masked_attention(*ref_in, layout if method != "sdpa" else None, BLOCK)
    ref.backward(grad.double())
    out: dict[str, float] = {}
    if train_ok:
        y = attn(q, k, v)
        y.backward(grad)
        out["out"] = _max_diff(y, ref)
        for name, t, r in zip("qkv", (q, k, v), ref_in, strict=True):
            out[f"d{name}"] = _max_diff(t.grad, r.grad)
        q.grad = k.grad = v.grad = None
    else:
        with torch.no_grad():
            out["out"] = _max_diff(fwd_only(q.detach(), k.detach(), v.detach()), ref)
    return out


# ------------------------------------------------------------------------------------------ the parent


def run_case(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one case in a fresh subprocess (``--worker``); ``{"error": ...}`` on a timeout or a crash."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    env = dict(os.environ)
    env.pop(BACKEND_ENV, None)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(WORKER_TAG):
            return json.loads(line[len(WORKER_TAG):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def _iters(seq: int, quick: bool) -> int:
    """Timed passes per subprocess: fewer at long sequences."""
    if quick:
        return 2
    return {2048: 5, 4096: 4, 8192: 3, 16384: 2}.get(seq, 5 if seq < 2048 else 1)


def _case_name(method: str, layout: dict[str, Any] | None) -> str:
    return method if layout is None else f"{method}/{layout['kind']}"


def _failure(errors: dict[str, str]) -> str:
    """``fails (eager, compiled): <first sentence of the error>``, one entry per distinct error."""
    by_msg: dict[str, list[str]] = {}
    for how, msg in errors.items():
        by_msg.setdefault(msg.split(". ")[0], []).append(how)
    return "; ".join(f"fails ({', '.join(hows)}): {msg}" for msg, hows in by_msg.items())


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def measure(args: argparse.Namespace, seqs: list[int], layouts: dict[int, dict[str, dict[str, Any]]],
            methods: list[str], rounds: int, threads: int | None, flex: bool, check_seq: int | None,
            fwd_iters: bool) -> dict[str, dict[int, dict[str, Any]]]:
    """Run every case of ``seqs`` ``rounds`` times, methods interleaved; returns ``{case: {seq: summary}}``.

    ``methods`` are the timed ones (``sparse*`` once per layout, ``sdpa`` once); ``flex`` adds one flex case per
    layout in the first round. A summary holds the pooled times, the first round's memory figures (each round's
    too), the error if any, and the check.
    """
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for seq in seqs:
        cases: list[tuple[str, dict[str, Any] | None]] = []
        for method in methods:
            if method.startswith("sparse"):
                cases += [(method, layouts[seq][kind]) for kind in args.layouts]
            else:
                cases.append((method, None))
        for r in range(rounds):
            order = cases[r % len(cases):] + cases[:r % len(cases)]
            if flex and r == 0:  # --quick: one pattern (on CPU both fail the same way)
                order += [("flex", layouts[seq][kind]) for kind in args.layouts[:1 if args.quick else None]]
            for method, layout in order:
                name = _case_name(method, layout)
                spec = {"method": method, "seq": seq, "layout": layout, "seed": args.seed, "device": args.device,
                        "dtype": args.dtype, "threads": threads, "warmup": args.warmup,
                        "iters": _iters(seq, args.quick), "check": check_seq == seq and r == 0,
                        "fwd_iters": _iters(seq, args.quick) if fwd_iters and r == 0 else 0}
                if method == "flex" and args.device == "cpu" and (not args.flex_forward
                                                                  or layout["kind"] != args.layouts[0]):
                    spec["fwd_iters"], spec["check"] = 0, False  # both compile flex (30-60 s): one pattern only
                t0 = time.perf_counter()
                res = run_case(spec, args.case_timeout)
                wall = time.perf_counter() - t0
                summary = out.setdefault(name, {}).setdefault(seq, {"times": [], "fwd_times": [], "rounds": []})
                summary["rounds"].append(res)
                summary["times"] += res.get("times", [])
                summary["fwd_times"] += res.get("fwd_times", [])
                for key in ("error", "fwd_bwd_error", "check", "backend", "fwd_first_s"):
                    if key in res:
                        summary[key] = res[key]
                mem = "" if "peak_delta" not in res else (
                    f"delta {'<' if res['peak_is_lower_bound'] else ''}{_mb(res['peak_delta'])}, "
                    f"peak {_mb(res['peak_abs'])}")
                times = ", ".join(_ms(t) for t in res.get("times", []))
                err = res.get("error") or (res.get("fwd_bwd_error") and _failure(res["fwd_bwd_error"]))
                print(f"  seq {seq:>5} r{r} {name:<15} [{times}] {mem} {err or ''} "
                      f"(load {res.get('load_before', os.getloadavg()[0]):.1f}, {wall:.0f} s)", flush=True)
    for per_seq in out.values():
        for summary in per_seq.values():
            summary["time"] = _median(summary["times"])
            summary["fwd_time"] = _median(summary["fwd_times"])
            first = next((r for r in summary["rounds"] if "peak_delta" in r), None)
            if first is not None and summary["time"] is not None:
                deltas = [r["peak_delta"] for r in summary["rounds"] if "peak_delta" in r]
                summary["peak_delta"] = max(deltas)
                summary["peak_abs"] = max(r["peak_abs"] for r in summary["rounds"] if "peak_abs" in r)
                summary["peak_lower_bound"] = any(r.get("peak_is_lower_bound") for r in summary["rounds"])
    return out


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = a + b x``: ``(a, b, largest relative residual)``."""
    n = len(xs)
    if n < 2:
        return 0.0, ys[0] / xs[0] if n else 0.0, 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    a = my - b * mx
    worst = max(abs(a + b * x - y) / y for x, y in zip(xs, ys, strict=True))
    return a, b, worst


def print_layouts(layouts: dict[int, dict[str, dict[str, Any]]]) -> None:
    """The layout table."""
    print("\nLayouts (block 64, 4 heads, unidirectional; nnz over all heads)")
    print(f"{'seq':>6} {'pattern':<8} {'parameters':<58} {'nnz':>8} {'density':>8} {'of causal half':>14}")
    for seq, per_kind in layouts.items():
        for kind, lay in per_kind.items():
            params = ", ".join(f"{k}={v}" for k, v in lay["params"].items())
            print(f"{seq:>6} {kind:<8} {params:<58} {lay['nnz']:>8} {lay['density'] * 100:>7.2f}% "
                  f"{lay['causal_fraction'] * 100:>13.2f}%")


def summarize(args: argparse.Namespace, seqs: list[int], layouts: dict[int, dict[str, dict[str, Any]]],
              main: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Print the main table (time, memory, ratios) and return its rows."""
    sparse_methods = [m for m in main if m.startswith("sparse")]
    rows = []
    print("\nForward + backward, batch 1, 4 heads, head dim 64 (time: median; delta: peak RSS - RSS after inputs; "
          "peak: ru_maxrss)")
    print(f"{'seq':>6} {'method':<22} {'time':>9} {'delta':>10} {'peak':>10} {'sdpa/this time':>14} "
          f"{'this/sdpa delta':>15} {'us/block':>9}  note")
    for seq in seqs:
        sd = main.get("sdpa", {}).get(seq, {})
        n = seq // BLOCK
        causal_blocks = HEADS * n * (n + 1) // 2
        for name in ["sdpa", *sparse_methods, *[m for m in main if m.startswith("flex")]]:
            s = main.get(name, {}).get(seq)
            if s is None:
                continue
            kind = name.split("/", 1)[1] if "/" in name else None
            blocks = layouts[seq][kind]["nnz"] if kind else causal_blocks
            note = s.get("error") or ""
            if s.get("fwd_bwd_error"):
                note = _failure(s["fwd_bwd_error"])
            if s.get("backend"):
                note = f"backend {s['backend']} " + note
            row = {"seq": seq, "method": name, "time_s": s["time"], "fwd_time_s": s["fwd_time"],
                   "peak_delta_bytes": s.get("peak_delta"), "peak_abs_bytes": s.get("peak_abs"),
                   "peak_lower_bound": s.get("peak_lower_bound"), "blocks": blocks,
                   "us_per_block": s["time"] / blocks * 1e6 if s["time"] else None,
                   "speedup_vs_sdpa": sd["time"] / s["time"] if s["time"] and sd.get("time") else None,
                   "mem_vs_sdpa": (s["peak_delta"] / sd["peak_delta"]
                                   if s.get("peak_delta") and sd.get("peak_delta") else None),
                   "note": note, "check": s.get("check"),
                   "load": [r.get("load_before") for r in s["rounds"]]}
            rows.append(row)
            lb = "<" if s.get("peak_lower_bound") else ""
            per_block = "-" if row["us_per_block"] is None else f"{row['us_per_block']:.0f}"
            print(f"{seq:>6} {name:<22} {_ms(s['time']):>9} {lb + _mb(s.get('peak_delta')):>10} "
                  f"{_mb(s.get('peak_abs')):>10} {_ratio(sd.get('time'), s['time']):>14} "
                  f"{_ratio(s.get('peak_delta'), sd.get('peak_delta')):>15} {per_block:>9}  {note}")
    return rows


def print_forward(seqs: list[int], main: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The forward-only (no grad) table: sparse, SDPA and compiled flex; returns its rows."""
    names = [n for n in main if any(main[n].get(s, {}).get("fwd_time") is not None for s in seqs)]
    if not names:
        return []
    print("\nForward only (no grad; median; for reference: flex has no backward on CPU)")
    print(f"{'seq':>6} " + " ".join(f"{n:>18}" for n in names) + "   sdpa / each")
    rows = []
    for seq in seqs:
        t = {n: main[n].get(seq, {}).get("fwd_time") for n in names}
        sd = t.get("sdpa")
        print(f"{seq:>6} " + " ".join(f"{_ms(t[n]):>18}" for n in names) + "   " +
              ", ".join(f"{n} {_ratio(sd, t[n])}" for n in names if n != "sdpa"))
        first = {n: main[n].get(seq, {}).get("fwd_first_s") for n in names if n.startswith("flex")}
        rows.append({"seq": seq, **{f"{n}_s": t[n] for n in names}, **{f"{n}_first_s": v for n, v in first.items()}})
    firsts = [(r["seq"], v) for r in rows for k, v in r.items() if k.endswith("_first_s") and v is not None]
    if firsts:
        print("  flex's first forward (torch.compile included): " + ", ".join(f"{s}: {v:.0f} s" for s, v in firsts))
    return rows


def print_checks(main: dict[str, dict[int, dict[str, Any]]], seq: int) -> dict[str, Any]:
    """The correctness lines (max abs diff from dense masked attention in float64) at ``seq``."""
    print(f"\nCorrectness at seq {seq}: max abs diff from dense masked attention (float64; layout expanded, causal)")
    checks = {}
    for name, per_seq in main.items():
        check = per_seq.get(seq, {}).get("check")
        if check:
            checks[name] = check
            print(f"  {name:<22} " + "  ".join(f"{k} {v:.1e}" for k, v in check.items()))
    return checks


def cost_model(seqs: list[int], layouts: dict[int, dict[str, dict[str, Any]]], rows: list[dict[str, Any]],
               target: float) -> dict[str, Any]:
    """Time per non-zero block, the linear fit, the efficiency against SDPA and the density a ``target``x speedup
    needs, per sparse method; printed and returned."""
    by = {(r["method"], r["seq"]): r for r in rows}
    out: dict[str, Any] = {}
    print(f"\nCost model: us per non-zero block; fit time = a + b * blocks over the sequences; efficiency = SDPA's "
          f"us per causal block / sparse's; density for {target:g}x = density * speedup / {target:g}")
    for name in sorted({r["method"] for r in rows if r["method"].startswith("sparse")}):
        kind = name.split("/", 1)[1]
        pts = [(by[(name, s)]["blocks"], by[(name, s)]["time_s"]) for s in seqs
               if (name, s) in by and by[(name, s)]["time_s"]]
        if not pts:
            continue
        a, b, worst = fit_line([p[0] for p in pts], [p[1] for p in pts])
        per_seq = []
        for s in seqs:
            r, sd = by.get((name, s)), by.get(("sdpa", s))
            if not r or not r["time_s"] or not sd or not sd["time_s"]:
                continue
            eff = sd["us_per_block"] / r["us_per_block"]
            dens = layouts[s][kind]["density"]
            per_seq.append({"seq": s, "us_per_block": r["us_per_block"], "sdpa_us_per_block": sd["us_per_block"],
                            "efficiency": eff, "speedup": r["speedup_vs_sdpa"], "density": dens,
                            "density_for_target": dens * r["speedup_vs_sdpa"] / target})
        out[name] = {"fit_a_s": a, "fit_b_us_per_block": b * 1e6, "fit_worst_rel_residual": worst,
                     "per_seq": per_seq}
        print(f"  {name}: fit a = {a * 1e3:.0f} ms, b = {b * 1e6:.1f} us/block, worst residual {worst * 100:.0f} %")
        for p in per_seq:
            print(f"    seq {p['seq']:>5}: {p['us_per_block']:.1f} us/block (sdpa {p['sdpa_us_per_block']:.1f}), "
                  f"efficiency {p['efficiency']:.2f}, speedup {p['speedup']:.2f}x at density "
                  f"{p['density'] * 100:.1f} % -> {target:g}x at ~{p['density_for_target'] * 100:.1f} %")
    return out


def sweep(args: argparse.Namespace, sdpa: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Sparse alone at ``--sweep-seq`` for each ``--sweep-densities`` and pattern; printed and returned."""
    seq = args.sweep_seq
    print(f"\nDensity sweep at seq {seq} (sparse only, one subprocess per case; speedup over the SDPA time above)")
    rows = []
    for density in args.sweep_densities:
        lays = {kind: choose_layout(kind, seq, density, args.seed) for kind in args.layouts}
        res = measure(args, [seq], {seq: lays}, ["sparse"], 1, args.threads, False, None, False)
        for kind, lay in lays.items():
            s = res[f"sparse/{kind}"][seq]
            t = s["time"]
            rows.append({"target": density, "kind": kind, "params": lay["params"], "nnz": lay["nnz"],
                         "density": lay["density"], "causal_fraction": lay["causal_fraction"], "time_s": t,
                         "peak_delta_bytes": s.get("peak_delta"),
                         "us_per_block": t / lay["nnz"] * 1e6 if t else None,
                         "speedup_vs_sdpa": sdpa["time_s"] / t if t and sdpa and sdpa.get("time_s") else None,
                         "error": s.get("error")})
    print(f"{'pattern':<8} {'parameters':<58} {'density':>8} {'causal':>7} {'time':>9} {'us/block':>9} "
          f"{'speedup':>8} {'delta':>9}")
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items())
        per_block = "-" if r["us_per_block"] is None else f"{r['us_per_block']:.1f}"
        speed = "-" if r["speedup_vs_sdpa"] is None else f"{r['speedup_vs_sdpa']:.2f}x"
        print(f"{r['kind']:<8} {params:<58} {r['density'] * 100:>7.2f}% {r['causal_fraction'] * 100:>6.1f}% "
              f"{_ms(r['time_s']):>9} {per_block:>9} {speed:>8} {_mb(r['peak_delta_bytes']):>9} {r['error'] or ''}")
    for kind in args.layouts:
        pts = [(r["nnz"], r["time_s"]) for r in rows if r["kind"] == kind and r["time_s"]]
        if len(pts) >= 2 and sdpa and sdpa.get("time_s"):
            a, b, worst = fit_line([p[0] for p in pts], [p[1] for p in pts])
            need = (sdpa["time_s"] / 5 - a) / b if b > 0 else float("nan")
            n = seq // BLOCK
            verdict = (f"5x SDPA needs <= {need:.0f} blocks = density {need / (HEADS * n * n) * 100:.1f} %"
                       if need > 0 else "5x SDPA is out of reach at this length (the fit's fixed cost a alone "
                       "exceeds SDPA / 5)")
            print(f"  {kind}: fit a = {a * 1e3:.0f} ms, b = {b * 1e6:.1f} us/block (worst residual "
                  f"{worst * 100:.0f} %); {verdict}")
            rows.append({"kind": kind, "fit_a_s": a, "fit_b_us_per_block": b * 1e6, "blocks_for_5x": need,
                         "density_for_5x": need / (HEADS * n * n)})
    return rows


def one_thread(args: argparse.Namespace, layouts: dict[int, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Sparse and SDPA with one thread at ``--one-thread-seqs``; printed and returned."""
    seqs = args.one_thread_seqs
    print(f"\nOne thread (torch.set_num_threads(1)), seq {seqs}, one round")
    res = measure(args, seqs, layouts, ["sparse", "sdpa"], 1, 1, False, None, False)
    rows = []
    for seq in seqs:
        sd = res["sdpa"][seq]["time"]
        for name in res:
            t = res[name][seq]["time"]
            rows.append({"seq": seq, "method": name, "time_s": t, "speedup_vs_sdpa": sd / t if sd and t else None})
            print(f"  seq {seq:>5} {name:<16} {_ms(t):>9}  sdpa/this {_ratio(sd, t)}")
    return rows


def targets(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Check the issue's CPU targets: >= 5x SDPA at 16k and 32k, memory <= SDPA's everywhere, trains where flex
    cannot; printed and returned."""
    sparse = [r for r in rows if r["method"].startswith("sparse") and r["time_s"]]
    long_rows = [r for r in sparse if r["seq"] >= 16384]
    speed = {f"{r['method']}@{r['seq']}": r["speedup_vs_sdpa"] for r in long_rows}
    mem = {f"{r['method']}@{r['seq']}": r["mem_vs_sdpa"] for r in sparse}
    flex_fails = [r for r in rows if r["method"].startswith("flex") and r["note"].startswith("fails")]
    result = {
        "speed_5x_at_16k_32k": bool(speed) and all(v is not None and v >= 5 for v in speed.values()),
        "speedups": speed,
        "memory_not_above_sdpa": bool(mem) and all(v is not None and v <= 1 for v in mem.values()),
        "memory_ratios": mem,
        "trains_where_flex_cannot": bool(sparse) and bool(flex_fails),
    }
    print("\nTargets")
    print(f"  >= 5x faster than SDPA at 16k and 32k: {'met' if result['speed_5x_at_16k_32k'] else 'NOT met'} "
          f"({', '.join(f'{k} {v:.2f}x' for k, v in speed.items() if v) or 'not measured'})")
    print(f"  peak memory <= SDPA's at every length: {'met' if result['memory_not_above_sdpa'] else 'NOT met'} "
          f"({', '.join(f'{k} {v:.2f}' for k, v in mem.items() if v)})")
    print(f"  trains where FlexAttention cannot: {'yes' if result['trains_where_flex_cannot'] else 'no'} "
          f"({len(flex_fails)} flex cases fail forward + backward)")
    return result


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: seq 1k and 2k, one round, under a minute")
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="sequence lengths (multiples of 64)")
    p.add_argument("--max-seq", type=int, default=None, help="leave out longer sequences (32k takes minutes)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUT_KINDS), choices=LAYOUT_KINDS)
    p.add_argument("--density", type=float, default=0.10, help="target non-zero fraction of the full block grid")
    p.add_argument("--rounds", type=int, default=None, help="subprocess rounds per sequence (2; quick 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed passes per subprocess")
    p.add_argument("--case-timeout", type=float, default=None, help="seconds per subprocess (600; quick 120)")
    p.add_argument("--sweep-seq", type=int, default=None, help="sequence of the density sweep (16384; quick 2048)")
    p.add_argument("--sweep-densities", type=float, nargs="*", default=None,
                   help="(0.05 0.10 0.20; quick 0.20; none: skip)")
    p.add_argument("--one-thread-seqs", type=int, nargs="*", default=None, help="(8192 16384; quick none)")
    p.add_argument("--no-flex", dest="flex", action="store_false", help="leave out FlexAttention")
    p.add_argument("--no-flex-forward", dest="flex_forward", action="store_false",
                   help="on CPU, do not compile flex for the forward-only timing")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="(float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the workers (torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the BENCH_JSON object to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return args
    q = args.quick
    args.seqs = args.seqs or list(QUICK_SEQS if q else FULL_SEQS)
    if args.max_seq is not None:
        args.seqs = [s for s in args.seqs if s <= args.max_seq]
    for name, value in (("--seqs", args.seqs), ("--one-thread-seqs", args.one_thread_seqs or [])):
        bad = [s for s in value if s <= 0 or s % BLOCK]
        if bad:
            p.error(f"{name}: {bad} are not positive multiples of the block size {BLOCK}")
    if not args.seqs:
        p.error("--seqs/--max-seq: no sequence length left to measure; raise --max-seq")
    if not 0 < args.density < 1:
        p.error(f"--density: expected a fraction in (0, 1), got {args.density}")
    args.rounds = args.rounds or (1 if q else 2)
    args.case_timeout = args.case_timeout or (120.0 if q else 600.0)
    args.sweep_seq = args.sweep_seq or (2048 if q else 16384)
    if args.sweep_seq % BLOCK:
        p.error(f"--sweep-seq: {args.sweep_seq} is not a multiple of the block size {BLOCK}")
    if args.sweep_densities is None:
        args.sweep_densities = [0.20] if q else [0.05, 0.10, 0.20]
    if args.one_thread_seqs is None:
        args.one_thread_seqs = [] if q else [s for s in (8192, 16384) if s <= max(args.seqs)]
    if q:
        args.flex_forward = False
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch; run on a GPU machine or drop --device")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the tables and ``BENCH_JSON``."""
    args = parse_args(argv)
    if args.worker is not None:
        res = run_worker(json.loads(args.worker))
        print(WORKER_TAG + json.dumps(res), flush=True)
        return res
    t_start = time.perf_counter()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    machine = {"cpus": os.cpu_count(), "threads": args.threads or torch.get_num_threads(),
               "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
               "triton": triton_version, "load_start": os.getloadavg(),
               "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}
    print(f"sparse_attn benchmark: {args.device}, {args.dtype}, torch {torch.__version__}, triton {triton_version}, "
          f"{machine['cpus']} CPUs, {machine['threads']} threads, load {machine['load_start'][0]:.1f}")
    seqs = sorted(set(args.seqs))
    layouts = {seq: {kind: choose_layout(kind, seq, args.density, args.seed) for kind in args.layouts}
               for seq in sorted(set(seqs) | set(args.one_thread_seqs))}
    print_layouts(layouts)
    methods = ["sparse-fused", "sparse-triton", "sdpa"] if args.device == "cuda" else ["sparse", "sdpa"]
    print("\nCases (each a fresh subprocess; times of the timed passes, memory, load average, wall time)")
    main_res = measure(args, seqs, layouts, methods, args.rounds, args.threads, args.flex, seqs[0], True)
    rows = summarize(args, seqs, layouts, main_res)
    fwd_rows = print_forward(seqs, main_res)
    checks = print_checks(main_res, seqs[0])
    model = cost_model(seqs, layouts, rows, 5.0)
    sweep_rows: list[dict[str, Any]] = []
    if args.sweep_densities:
        sd = next((r for r in rows if r["method"] == "sdpa" and r["seq"] == args.sweep_seq), None)
        sweep_rows = sweep(args, sd)
    thread_rows = one_thread(args, layouts) if args.one_thread_seqs and args.device == "cpu" else []
    goals = targets(args, rows) if args.device == "cpu" else {}
    machine["load_end"] = os.getloadavg()
    machine["wall_s"] = time.perf_counter() - t_start
    print(f"\nLoad average at the end {machine['load_end'][0]:.1f}; wall {machine['wall_s']:.0f} s")
    result = {"args": {k: v for k, v in vars(args).items() if k not in ("json_out", "worker")},
              "machine": machine, "layouts": layouts, "main": rows, "forward_only": fwd_rows, "checks": checks,
              "cost_model": model, "sweep": sweep_rows, "one_thread": thread_rows, "targets": goals}
    line = json.dumps(result, default=str)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print("BENCH_JSON " + line)
    return result


if __name__ == "__main__":
    main()
