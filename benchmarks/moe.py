"""Mixture-of-Experts: index routing vs DeepSpeed's dense einsums, gating and the MoE layer vs DeepSpeed 0.19.8.

Usage (one process; the full run takes about 10-15 minutes on 2 cores, most of it in the dense einsums)::

    python benchmarks/moe.py                           # all four parts at 8192 tokens, 16 experts, hidden 1024
    python benchmarks/moe.py --quick                   # smoke run at 1024 tokens, hidden 256 (under a minute)
    python benchmarks/moe.py --parts routing,layer     # some of: routing, gating, layer, gpt
    python benchmarks/moe.py --device cuda             # parts (a) and (c) on the GPU (the Triton kernels run there)
    python benchmarks/moe.py --json-out moe.json

Every comparison runs both sides in this process, on the same inputs (seed ``--seed``), fp32, with torch's
default intra-op threads (``--threads`` to change them).

**(a) Routing: dispatch + combine, forward + backward.** Router logits ``randn(T, E)`` are routed by
:func:`microspeed_moe.gating.route` (top-1 or top-2, capacity factor 1.0 and 2.0, no noise, no random token
selection), giving each token's experts, capacity slots and weights (``[T, k]``). Then, with ``x = randn(T, H)``
and the weights as leaves needing gradients and a fixed upstream gradient ``g = randn(T, H)``:

* *index* (ours, the default backend: the PyTorch index path on CPU, the Triton kernels on CUDA):
  ``y = combine(dispatch(x, experts, slots, E, C), experts, slots, weights); y.backward(g)``;
* *dense* (DeepSpeed's formulation): ``combine_weights, dispatch_mask = to_dense(...)`` from the same routing
  (``[T, E, C]`` each; DeepSpeed's gate builds the same tensors with one-hot einsums), then
  ``y = einsum('sec,ecm->sm', combine_weights, einsum('sec,sm->ecm', dispatch_mask, x)); y.backward(g)``.

Both produce the same ``y``, ``x.grad`` and ``weights.grad`` (checked once, untimed; max abs difference
printed). Reported: the median wall time of ``--repeats`` index runs and ``--dense-repeats`` dense runs, taken
interleaved (each round: one dense run, then ``repeats / dense-repeats`` index runs), so that load from other
processes falls on both alike; and the peak of live tensor bytes allocated during one run. The dense peak is
given twice: *with building* (``to_dense`` inside the measured region, as the gate builds them in a step) and
*einsums only* (the dense tensors made beforehand and not counted).

How the peak is measured on CPU: :class:`LiveBytes`, a ``TorchDispatchMode`` that sees every ATen op run under
it (in backward too), records the storages of the tensors each op returns, drops those that died (weak
references), and keeps the largest sum of live bytes after any op. Tensors made before the region (inputs,
parameters) are not counted; memory a single kernel allocates internally and frees before returning is not
seen (composite ops such as ``einsum`` are seen op by op, so their permuted copies count). On CUDA the peak is
``torch.cuda.max_memory_allocated()`` minus the bytes allocated before the region.

**(b) Gating vs DeepSpeed.** ``microspeed_moe.sharded_moe.top1gating/top2gating`` and DeepSpeed's
``deepspeed.moe.sharded_moe.top1gating/top2gating`` on the same ``[T, E]`` logits: (1) noise and random token
selection off (top-2: ``top2_2nd_expert_sampling=False``); (2) seeded: the same ``torch.manual_seed`` before
each call, with RTS on for top-1 and second-expert sampling on for top-2. Printed: the max abs difference of
``l_aux``, ``combine_weights`` and ``exp_counts``, the dispatch-mask entries that differ, and the median time of
each (dense outputs, as DeepSpeed returns them), plus the time of our sparse :func:`~microspeed_moe.gating.route`
against DeepSpeed's ``sparse_routes=True`` variant of the same gate. Without RTS DeepSpeed's top-1 keeps, in an
over-full expert, whichever tokens ``torch.topk`` returns among tied scores (its order is unspecified) while we
keep the first in token order, so masks may differ there; the count of kept tokens per expert is compared too.

**(c) The whole layer vs DeepSpeed.** ``microspeed_moe.layer.MoE`` and ``deepspeed.moe.layer.MoE`` with the
same ``E`` experts (each ``Linear(H, H)``), DeepSpeed's weights loaded into ours, ``k`` 1 and 2, capacity factor
1.0, DeepSpeed's defaults otherwise (RTS and second-expert sampling on, seeded identically before each forward).
One run: ``out, l_aux, _ = layer(x)``, backward of ``(out, l_aux)`` with ``(g, 1)``. Printed: median time, peak
live bytes (parameter gradients included, the same for both), and the max abs differences of ``out``, ``l_aux``,
``x.grad`` and the parameter gradients. DeepSpeed 0.19.8's own layer already routes by index
(``_sparse_encode``/``_sparse_decode`` in ``sharded_moe.py``); only its gate API returns dense tensors.

All timings of (b) and (c) are interleaved the same way (round-robin over the compared functions).

**(d) The demo GPT with MoE layers** (:func:`microspeed_moe.gpt.moe_gpt`: 4 blocks of width 64, 4 top-1 experts in
blocks 1 and 3) trains through ``microspeed.initialize`` (AdamW 3e-3, clipping 1.0) on ``--gpt-steps`` batches of
8 random 64-byte windows of the stdlib corpus (seeded); printed: the first and last training losses, and the LM
loss on 8 fixed held-out batches (the corpus's last 5 %) before and after.

DeepSpeed runs with ``DS_ACCELERATOR=cpu`` after ``init_process_group("gloo")`` (world size 1) and
``deepspeed.init_distributed(dist_backend="gloo")``; if it cannot be imported, its error is printed and its rows
are left out. A stale ``~/.cache/torch_extensions/py311_cpu/*/lock`` left by a killed build makes its first
import hang: delete it. Prints the tables and, last, one line ``BENCH_JSON {...}``. Entry-point plugins are not
auto-loaded (``MICROSPEED_DISABLE_PLUGIN_AUTOLOAD=1``, ``MICROSPEED_PLUGINS=moe`` unless set).
"""

from __future__ import annotations

import os

# Before anything imports torch (or deepspeed).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
os.environ.setdefault("MICROSPEED_PLUGINS", "moe")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

PARTS = ("routing", "gating", "layer", "gpt")
"""The parts of the benchmark, in the order they run."""


# ------------------------------------------------------------------------------------------ measuring


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages allocated by the ops run under it and still alive (see the docstring).

    After every op: forget the storages that died, add those of the op's outputs not seen before, and update
    :attr:`peak`. Storages made before the mode are never counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run the op, then account for its outputs."""
        out = func(*args, **(kwargs or {}))
        self.live = {ptr: entry for ptr, entry in self.live.items() if not entry[0].expired()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in self.live:
                    self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated while ``fn()`` runs (and held by what it returns, until it returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with LiveBytes() as mode:
        fn()
    return mode.peak


def interleaved_medians(fns: dict[str, tuple[Callable[[], Any], int]], rounds: int, warmup: int,
                        device: torch.device) -> dict[str, float]:
    """Median seconds of each ``fn``: ``rounds`` rounds, each calling every ``fn`` ``per_round`` times in turn.

    ``fns`` maps a name to ``(fn, per_round)``. Interleaving makes load from other processes on a shared
    machine fall on all of them alike. ``warmup`` untimed calls of each come first.
    """
    for fn, _ in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (fn, per_round) in fns.items():
            for _ in range(per_round):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of two tensors (as float64)."""
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def mb(n: float) -> str:
    """Bytes as MB, for tables."""
    return f"{n / 1e6:.1f} MB"


# ------------------------------------------------------------------------------------------ DeepSpeed


def load_deepspeed() -> tuple[Any, str | None]:
    """DeepSpeed (on a gloo process group of this one process), or ``(None, the error)``."""
    try:
        if not dist.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import deepspeed
            from deepspeed.moe import layer as _layer  # noqa: F401
            from deepspeed.moe import sharded_moe as _gates  # noqa: F401

            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
            deepspeed.init_distributed(dist_backend="gloo")
        return deepspeed, None
    except Exception as exc:  # any failure: report it and measure microspeed alone
        return None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"


# ------------------------------------------------------------------------------------------ (a) routing


def routing_part(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Index routing vs the dense einsums (see the module docstring, part (a))."""
    print(f"\n(a) dispatch + combine, forward + backward: T={args.tokens} tokens, E={args.experts} experts, "
          f"H={args.hidden}, fp32, {device}")
    print(f"{'k':>2} {'cf':>4} {'C':>5} | {'index time':>10} {'index peak':>11} | {'dense time':>10} "
          f"{'dense peak':>11} {'(einsums)':>11} | {'time x':>7} {'mem x':>7} {'(einsums)':>9} | max diff")
    rows = []
    for k in (1, 2):
        for cf in args.capacity_factors:
            row = _routing_case(args, device, k, cf)
            rows.append(row)
            print(f"{k:>2} {cf:>4} {row['capacity']:>5} | {row['index_s'] * 1e3:>8.1f}ms "
                  f"{mb(row['index_peak_bytes']):>11} | {row['dense_s'] * 1e3:>8.0f}ms "
                  f"{mb(row['dense_peak_bytes']):>11} {mb(row['dense_einsums_only_peak_bytes']):>11} | "
                  f"{row['time_ratio']:>6.1f}x {row['mem_ratio']:>6.1f}x {row['mem_ratio_einsums_only']:>8.1f}x | "
                  f"{row['max_abs_diff']:.1e}", flush=True)
    how = "cuda allocator" if device.type == "cuda" else "live tensor bytes (TorchDispatchMode)"
    print(f"    index = microspeed_moe.routing ({rows[0]['backend']} backend); dense = to_dense + DeepSpeed's "
          f"einsums; 'x' = dense / index (higher: ours better); peak = {how}")
    return rows


def _routing_case(args: argparse.Namespace, device: torch.device, k: int, cf: float) -> dict:
    """One row of part (a): top-``k`` routing at capacity factor ``cf``."""
    from microspeed_moe.gating import route
    from microspeed_moe.routing import combine, dense_combine, dense_dispatch, dispatch, kernel_backend, to_dense

    tokens, experts, hidden = args.tokens, args.experts, args.hidden
    g = torch.Generator().manual_seed(args.seed + 10 * k)
    logits = torch.randn(tokens, experts, generator=g)
    r = route(logits, k=k, capacity_factor=cf, min_capacity=4, use_rts=False, top2_2nd_expert_sampling=False)
    cap = r.capacity
    ex, sl = r.experts.to(device), r.slots.to(device)
    x = torch.randn(tokens, hidden, generator=g).to(device).requires_grad_()
    w = r.weights.detach().to(device).requires_grad_()
    grad_y = torch.randn(tokens, hidden, generator=g).to(device)

    def index_step() -> torch.Tensor:
        x.grad = w.grad = None
        y = combine(dispatch(x, ex, sl, experts, cap), ex, sl, w)
        y.backward(grad_y)
        return y.detach()

    def dense_step(prebuilt: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x.grad = w.grad = None
        cw, mask = prebuilt if prebuilt is not None else to_dense(ex, sl, w, experts, cap)
        y = dense_combine(dense_dispatch(x, mask), cw)
        y.backward(grad_y)
        return y.detach()

    y_index = index_step()
    gx_index, gw_index = x.grad.clone(), w.grad.clone()
    y_dense = dense_step()
    diff = max(max_diff(y_index, y_dense), max_diff(gx_index, x.grad), max_diff(gw_index, w.grad))
    del y_index, y_dense, gx_index, gw_index
    index_per_round = max(1, -(-args.repeats // args.dense_repeats))
    t = interleaved_medians({"index": (index_step, index_per_round), "dense": (dense_step, 1)}, args.dense_repeats,
                            0, device)
    t_index, t_dense = t["index"], t["dense"]
    m_index = peak_bytes(index_step, device)
    m_dense = peak_bytes(dense_step, device)
    prebuilt = to_dense(ex, sl, w, experts, cap)
    m_einsum = peak_bytes(lambda: dense_step(prebuilt), device)
    return {"k": k, "capacity_factor": cf, "capacity": cap, "backend": kernel_backend(x), "device": str(device),
            "kept_fraction": float((r.slots >= 0).float().mean()),
            "index_s": t_index, "dense_s": t_dense, "index_peak_bytes": m_index,
            "dense_peak_bytes": m_dense, "dense_einsums_only_peak_bytes": m_einsum,
            "time_ratio": t_dense / t_index, "mem_ratio": m_dense / m_index,
            "mem_ratio_einsums_only": m_einsum / m_index, "max_abs_diff": diff}


# ------------------------------------------------------------------------------------------ (b) gating


def _compare_gate(ours: tuple, theirs: tuple) -> dict:
    """Differences of two dense gate outputs ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
    l_o, cw_o, m_o, c_o = ours
    l_t, cw_t, m_t, c_t = (torch.as_tensor(v) for v in theirs)
    same_shape = cw_o.shape == cw_t.shape
    return {
        "capacity": int(cw_o.shape[2]), "same_shape": same_shape,
        "l_aux": max_diff(l_o, l_t),
        "combine_weights": max_diff(cw_o, cw_t) if same_shape else float("nan"),
        "dispatch_mask_mismatches": int((m_o != m_t).sum()) if same_shape else -1,
        "exp_counts": max_diff(c_o, c_t),
        "kept_per_expert_equal": bool(torch.equal(m_o.sum((0, 2)), m_t.sum((0, 2)))),
        "weight_sum_per_expert": max_diff(cw_o.sum((0, 2)), cw_t.sum((0, 2))),
    }


def gating_part(args: argparse.Namespace, ds: Any) -> list[dict]:
    """Our gates vs DeepSpeed's on the same logits (see the module docstring, part (b))."""
    print(f"\n(b) gating vs DeepSpeed 0.19.8: T={args.tokens}, E={args.experts}, fp32 logits; times are medians of "
          f"{args.gate_repeats}")
    print(f"{'gate':>5} {'cf':>4} {'mode':>8} {'C':>5} | {'l_aux':>8} {'combine':>8} {'mask !=':>8} {'counts':>7} "
          f"{'kept/exp':>8} | {'ours':>8} {'DS':>8} {'DS/ours':>7} | {'route':>8} {'DS sparse':>9} {'ratio':>6}")
    rows = []
    for k in (1, 2):
        for cf in args.capacity_factors:
            for mode in ("off", "seeded"):
                row = _gating_case(args, ds, k, cf, mode)
                rows.append(row)
                print(f"{'top' + str(k):>5} {cf:>4} {mode:>8} {row['capacity']:>5} | {row['l_aux']:>8.1e} "
                      f"{row['combine_weights']:>8.1e} {row['dispatch_mask_mismatches']:>8} "
                      f"{row['exp_counts']:>7.0f} {'same' if row['kept_per_expert_equal'] else 'DIFF':>8} | "
                      f"{row['ours_s'] * 1e3:>6.1f}ms {row['deepspeed_s'] * 1e3:>6.1f}ms {row['time_ratio']:>6.2f}x | "
                      f"{row['route_s'] * 1e3:>6.2f}ms {row['deepspeed_sparse_s'] * 1e3:>7.2f}ms "
                      f"{row['sparse_time_ratio']:>5.2f}x", flush=True)
    print("    differences are max abs (mask: entries that differ); 'kept/exp': tokens kept per expert equal; "
          "ratios DS / ours (higher: ours faster)")
    return rows


def _gating_case(args: argparse.Namespace, ds: Any, k: int, cf: float, mode: str) -> dict:
    """One row of part (b): top-``k`` at capacity factor ``cf``, noise and RTS ``"off"`` or ``"seeded"``."""
    from microspeed_moe import gating, sharded_moe

    logits = torch.randn(args.tokens, args.experts, generator=torch.Generator().manual_seed(args.seed + k))
    if k == 1:
        kw = {"use_rts": mode == "seeded"}
        ours_gate, ds_gate = sharded_moe.top1gating, ds.moe.sharded_moe.top1gating
    else:
        kw = {"top2_2nd_expert_sampling": mode == "seeded"}
        ours_gate, ds_gate = sharded_moe.top2gating, ds.moe.sharded_moe.top2gating

    def seeded(fn: Callable[..., Any], *fn_args: Any, **fn_kwargs: Any) -> Callable[[], Any]:
        def call() -> Any:
            torch.manual_seed(args.seed)  # the same RTS priorities / second-expert noise for both
            return fn(*fn_args, **fn_kwargs)
        return call

    ours_fn = seeded(ours_gate, logits, cf, 4, **kw)
    ds_fn = seeded(lambda: ds_gate(logits.clone(), cf, 4, **kw))  # DeepSpeed's top-2 adds noise in place
    route_fn = seeded(gating.route, logits, k=k, capacity_factor=cf, min_capacity=4, **kw)
    ds_sparse_fn = seeded(lambda: ds_gate(logits.clone(), cf, 4, sparse_routes=True, **kw))
    row = {"k": k, "capacity_factor": cf, "mode": mode, **_compare_gate(ours_fn(), ds_fn())}
    t = interleaved_medians({"ours": (ours_fn, 1), "ds": (ds_fn, 1), "route": (route_fn, 1),
                             "sparse": (ds_sparse_fn, 1)}, args.gate_repeats, 1, torch.device("cpu"))
    t_ours, t_ds, t_route, t_sparse = t["ours"], t["ds"], t["route"], t["sparse"]
    row.update(ours_s=t_ours, deepspeed_s=t_ds, time_ratio=t_ds / t_ours, route_s=t_route,
               deepspeed_sparse_s=t_sparse, sparse_time_ratio=t_sparse / t_route)
    return row


# ------------------------------------------------------------------------------------------ (c) layer


def layer_part(args: argparse.Namespace, ds: Any, device: torch.device) -> list[dict]:
    """Our MoE layer vs DeepSpeed's, identical weights (see the module docstring, part (c))."""
    print(f"\n(c) MoE layer vs deepspeed.moe.layer.MoE: T={args.tokens}, E={args.experts}, expert "
          f"Linear({args.hidden}, {args.hidden}), capacity factor 1.0, fp32, forward + backward, {device}")
    print(f"{'k':>2} | {'ours':>8} {'peak':>10} | {'DeepSpeed':>9} {'peak':>10} | {'DS/ours t':>9} {'DS/ours m':>9} | "
          f"{'out':>7} {'l_aux':>7} {'x.grad':>7} {'p.grad':>7}")
    rows = []
    for k in (1, 2):
        row = _layer_case(args, ds, device, k)
        rows.append(row)
        d = row["max_abs_diff"]
        print(f"{k:>2} | {row['ours_s'] * 1e3:>6.0f}ms {mb(row['ours_peak_bytes']):>10} | "
              f"{row['deepspeed_s'] * 1e3:>7.0f}ms {mb(row['deepspeed_peak_bytes']):>10} | "
              f"{row['time_ratio']:>8.2f}x {row['mem_ratio']:>8.2f}x | {d['out']:>7.1e} {d['l_aux']:>7.1e} "
              f"{d['x_grad']:>7.1e} {d['param_grad']:>7.1e}", flush=True)
    print("    DeepSpeed 0.19.8's layer routes by index too (_sparse_encode/_sparse_decode); ratios DS / ours")
    return rows


def _layer_case(args: argparse.Namespace, ds: Any, device: torch.device, k: int) -> dict:
    """One row of part (c): top-``k`` layers with the same weights."""
    from microspeed_moe.layer import MoE

    hidden = args.hidden
    torch.manual_seed(args.seed)
    expert = torch.nn.Linear(hidden, hidden)
    theirs = ds.moe.layer.MoE(hidden, expert, num_experts=args.experts, k=k, capacity_factor=1.0, min_capacity=4)
    ours = MoE(hidden, expert, num_experts=args.experts, k=k, capacity_factor=1.0, min_capacity=4)
    ours.load_state_dict(theirs.state_dict())
    ours.to(device)
    theirs.to(device)
    g = torch.Generator().manual_seed(args.seed + k)
    x = torch.randn(args.tokens, hidden, generator=g).to(device).requires_grad_()
    grad_y = torch.randn(args.tokens, hidden, generator=g).to(device)

    def step(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = None
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(args.seed + 100)  # the same RTS priorities and second-expert noise for both
        out, l_aux, _ = layer(x)
        torch.autograd.backward([out, l_aux], [grad_y, torch.ones_like(l_aux)])
        return out.detach(), l_aux.detach()

    out_o, l_o = step(ours)
    gx_o = x.grad.clone()
    grads_o = {n: p.grad.clone() for n, p in ours.named_parameters()}
    out_t, l_t = step(theirs)
    grads_t = dict(theirs.named_parameters())
    diffs = {"out": max_diff(out_o, out_t), "l_aux": max_diff(l_o, l_t), "x_grad": max_diff(gx_o, x.grad),
             "param_grad": max(max_diff(grads_o[n], grads_t[n].grad) for n in grads_o)}
    del out_o, out_t, gx_o, grads_o, grads_t
    t = interleaved_medians({"ours": (lambda: step(ours), 1), "theirs": (lambda: step(theirs), 1)},
                            args.layer_repeats, 1, device)
    t_o, t_t = t["ours"], t["theirs"]
    m_o = peak_bytes(lambda: step(ours), device)
    m_t = peak_bytes(lambda: step(theirs), device)
    return {"k": k, "ours_s": t_o, "deepspeed_s": t_t, "ours_peak_bytes": m_o, "deepspeed_peak_bytes": m_t,
            "time_ratio": t_t / t_o, "mem_ratio": m_t / m_o, "max_abs_diff": diffs}


# ------------------------------------------------------------------------------------------ (d) GPT


def gpt_part(args: argparse.Namespace) -> dict:
    """The demo GPT with MoE layers trains (see the module docstring, part (d))."""
    from microspeed_moe.gpt import moe_gpt

    import microspeed
    from microspeed.demo.data import ByteSequenceDataset, stdlib_corpus, train_val_split
    from microspeed.demo.model import GPTConfig

    cfg, micro = GPTConfig(seq_len=64, n_layer=4, n_head=4, d_model=64), 8
    train_data, val_data = train_val_split(stdlib_corpus(max_bytes=1_000_000), val_fraction=0.05)
    train, val = ByteSequenceDataset(train_data, cfg.seq_len), ByteSequenceDataset(val_data, cfg.seq_len)
    g = torch.Generator().manual_seed(args.seed)

    def batch(data: ByteSequenceDataset, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [data[int(i)] for i in idx]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    batches = [batch(train, torch.randint(len(train), (micro,), generator=g)) for _ in range(args.gpt_steps)]
    held_out = [batch(val, torch.arange(j * micro, (j + 1) * micro)) for j in range(8)]
    torch.manual_seed(args.seed)
    model = moe_gpt(cfg, num_experts=4, k=1, every=2, capacity_factor=1.25)
    config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**6, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}}}
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = microspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def held_out_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = []
            for b in held_out:
                model(b)
                losses.append(model.last_lm_loss.item())  # the LM loss alone, without the auxiliary term
        model.train()
        return statistics.mean(losses)

    val_before = held_out_loss()
    losses, lm = [], []
    t0 = time.perf_counter()
    for b in batches:
        loss = engine(b)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lm.append(model.last_lm_loss.item())
    seconds = time.perf_counter() - t0
    val_after = held_out_loss()
    n = len(losses)
    print(f"\n(d) demo GPT, 4 blocks of width 64, 4 experts (top-1) in blocks 1 and 3, {n} steps of {micro} x "
          f"{cfg.seq_len} random stdlib bytes: training loss {losses[0]:.3f} -> {losses[-1]:.3f} (LM {lm[0]:.3f} -> "
          f"{lm[-1]:.3f}; mean of the first / last 5 {statistics.mean(losses[:5]):.3f} / "
          f"{statistics.mean(losses[-5:]):.3f}); held-out LM loss {val_before:.3f} -> {val_after:.3f}; "
          f"{seconds / n * 1e3:.0f} ms/step; l_aux {model.last_l_aux.item():.3f} (2 layers, 1.0 each when balanced)")
    return {"steps": n, "first_loss": losses[0], "last_loss": losses[-1], "first5_mean": statistics.mean(losses[:5]),
            "last5_mean": statistics.mean(losses[-5:]), "first_lm_loss": lm[0], "last_lm_loss": lm[-1],
            "held_out_before": val_before, "held_out_after": val_after, "s_per_step": seconds / n,
            "losses": losses}


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: --tokens 1024 --hidden 256, fewer repeats and GPT steps (under a minute)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--tokens", type=int, default=None, help="tokens per routing call (default 8192; --quick 1024)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 1024; --quick 256)")
    p.add_argument("--capacity-factors", default="1.0,2.0", help="comma-separated capacity factors for (a), (b)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs of the index path (default 10; --quick 3)")
    p.add_argument("--dense-repeats", type=int, default=None,
                   help="timed runs of the dense path (default 3; --quick 2)")
    p.add_argument("--gate-repeats", type=int, default=None, help="timed runs of each gate (default 10; --quick 3)")
    p.add_argument("--layer-repeats", type=int, default=None, help="timed runs of each layer (default 5; --quick 2)")
    p.add_argument("--gpt-steps", type=int, default=None, help="training steps in (d) (default 60; --quick 15)")
    p.add_argument("--device", default="cpu", help="device for (a) and (c): cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the BENCH_JSON object to this file")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("tokens", 8192, 1024), ("hidden", 1024, 256), ("repeats", 10, 3),
                              ("dense_repeats", 3, 2), ("gate_repeats", 10, 3), ("layer_repeats", 5, 2),
                              ("gpt_steps", 60, 15)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        args.capacity_factors = [float(v) for v in args.capacity_factors.split(",") if v.strip()]
    except ValueError:
        p.error(f"--capacity-factors: expected comma-separated numbers, got {args.capacity_factors!r}")
    if not args.capacity_factors or any(v <= 0 for v in args.capacity_factors):
        p.error("--capacity-factors: give at least one number > 0")
    args.parts = [v.strip() for v in args.parts.split(",") if v.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        p.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device: expected cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here; use --device cpu")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the chosen parts; print tables and ``BENCH_JSON``."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    result: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "json_out"},
        "machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "platform": platform.platform(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
    }
    print(f"microspeed MoE benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, parts {', '.join(args.parts)}")
    ds = None
    if {"gating", "layer"} & set(args.parts):
        ds, error = load_deepspeed()
        result["machine"]["deepspeed"] = getattr(ds, "__version__", None)
        if error:
            result["deepspeed_error"] = error
            print(f"DeepSpeed unavailable, its rows are left out: {error}")
    if "routing" in args.parts:
        result["routing"] = routing_part(args, device)
    if "gating" in args.parts and ds is not None:
        result["gating"] = gating_part(args, ds)
    if "layer" in args.parts and ds is not None:
        result["layer"] = layer_part(args, ds, device)
    if "gpt" in args.parts:
        result["gpt"] = gpt_part(args)
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print("BENCH_JSON " + line)
    return result


if __name__ == "__main__":
    main()
