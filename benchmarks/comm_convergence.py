"""Convergence and bytes of the 1-bit optimizers (``microspeed-comm``) against Adam and LAMB on the demo GPT.

Run (4 gloo ranks on CPU, one thread each; needs ``pip install -e plugins/comm``)::

    python benchmarks/comm_convergence.py [--steps 300] [--plot benchmarks/results/comm_convergence.png] \
        [--json-out results.json] [--optimizers Adam,OneBitAdam,ZeroOneAdam,Lamb,OneBitLamb]

Five runs of the same problem, one after the other, each on ``--world-size`` fresh ranks
(:func:`microspeed.testing.run_distributed`):

* the same model: the demo GPT (:mod:`microspeed.demo.model`) at a small size (``--d-model``,
  ``--layers``, ``--heads``, ``--seq-len``), built from ``--seed`` on every rank;
* the same data in the same order: non-overlapping sequences of the Python standard library's source
  (:func:`microspeed.demo.data.stdlib_corpus`), shuffled once with ``--seed``; step ``s`` uses the
  global batch of ``world * micro`` sequences ``s * world * micro ...``, rank ``r`` its ``r``-th slice.
  No sequence is seen twice, so the training loss is also a held-out loss;
* the same learning-rate schedule: ``WarmupLR``, linear from 0 to the optimizer's lr over
  ``--warmup-frac`` of the steps, then constant; no gradient clipping, no weight decay, fp32;
* the optimizers (ds_config ``optimizer.type``): ``Adam`` and ``OneBitAdam`` / ``ZeroOneAdam`` at the
  same lr (``--lr``) and betas (``--betas``), ``Lamb`` and ``OneBitLamb`` at the same lr (``--lr-lamb``),
  betas (``--betas-lamb``) and trust-ratio bounds (``max_coeff`` 0.3, ``min_coeff`` 0.01,
  ``bias_correction`` false: 1-bit LAMB has none). The warm-up of the 1-bit optimizers
  (``freeze_step``, ``var_freeze_step``) is ``--freeze-frac`` of the steps; 0/1 Adam gets
  ``var_update_scaler`` 4, ``local_step_scaler`` 30 and ``local_step_clipper`` 4 so that its local
  steps happen within a short run.

Why the Adam family uses ``beta2`` 0.95 by default: DeepSpeed's 1-bit Adam and 0/1 Adam have no bias
correction, and they freeze the variance after the warm-up. With ``beta2`` 0.999 the variance after
100 steps holds only ``1 - 0.999**100`` = 10 % of its eventual weight, so the frozen denominators are
about 3x too small for the rest of the run (at 500 steps: 1-bit Adam 2.59 against Adam's 1.92). With
0.95 the average is warm after a few dozen steps. LAMB's trust ratio cancels that scale, and 1-bit
LAMB's frozen-ratio factor (the max over elements of frozen / fresh denominator) behaves better with
DeepSpeed's default 0.999 (with 0.95 it diverged 15 steps after a freeze at step 200).

Recorded per step: the loss averaged over ranks (a ``torch.distributed.all_reduce`` outside
:mod:`microspeed.comm`, so not counted) and the wire bytes rank 0 sent during forward, backward and
``engine.step()`` (:attr:`microspeed.comm.stats`, ``total_wire_bytes()``: the bandwidth-optimal cost of
each collective; ranks are symmetric). At the end, 0/1 Adam's pending local steps are synchronised
(``optimizer.synchronize()``, not counted), every rank's model is scored on fixed validation sequences,
and the largest difference of the parameters across ranks is recorded (0 means one model).

Reported: final loss = mean of the last ``--tail`` steps' losses; its relative difference from the
baseline's (1-bit Adam and 0/1 Adam vs Adam, 1-bit LAMB vs LAMB), PASS when within ``--tolerance``
(2 %); total wire bytes of the run and their ratio to Adam's (and 0/1 Adam's to 1-bit Adam's); mean
bytes per step after the warm-up; how many steps communicated at full precision, compressed, or not at
all. Prints a table and, last, one line ``BENCH_JSON {...}``. ``--plot`` draws the smoothed loss curves
and the cumulative bytes. The exit status is 1 when a 1-bit optimizer misses the tolerance or diverges.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

OPTIMIZERS = ("Adam", "OneBitAdam", "ZeroOneAdam", "Lamb", "OneBitLamb")
"""Every optimizer the benchmark knows, in the order it runs them."""

BASELINE = {"OneBitAdam": "Adam", "ZeroOneAdam": "Adam", "OneBitLamb": "Lamb"}
"""The full-precision optimizer each 1-bit optimizer is compared with."""

LAMB_COEFFS = {"max_coeff": 0.3, "min_coeff": 0.01}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help="comma-separated subset of " + ",".join(OPTIMIZERS))
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--micro", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="lr of Adam, 1-bit Adam and 0/1 Adam")
    p.add_argument("--lr-lamb", type=float, default=3e-2, help="lr of LAMB and 1-bit LAMB")
    p.add_argument("--betas", default="0.9,0.95", help="beta1,beta2 of Adam, 1-bit Adam and 0/1 Adam")
    p.add_argument("--betas-lamb", default="0.9,0.999", help="beta1,beta2 of LAMB and 1-bit LAMB")
    p.add_argument("--warmup-frac", type=float, default=0.05, help="lr warm-up, as a share of --steps")
    p.add_argument("--freeze-frac", type=float, default=0.2,
                   help="full-precision warm-up of the 1-bit optimizers (freeze_step, var_freeze_step), "
                        "as a share of --steps")
    p.add_argument("--var-update-scaler", type=int, default=4)
    p.add_argument("--local-step-scaler", type=int, default=30)
    p.add_argument("--local-step-clipper", type=int, default=4)
    p.add_argument("--tail", type=int, default=20, help="final loss = mean of the last TAIL steps")
    p.add_argument("--tolerance", type=float, default=0.02, help="largest relative final-loss difference for PASS")
    p.add_argument("--val-batches", type=int, default=8, help="validation micro-batches per rank at the end")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--json-out", default=None, help="also write the BENCH_JSON object to this file")
    p.add_argument("--plot", default=None, help="write the loss / bytes figure to this PNG")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown or not names:
        p.error(f"--optimizers: unknown {unknown}; choose from {','.join(OPTIMIZERS)}")
    args.optimizers = names
    for key in ("betas", "betas_lamb"):
        try:
            b1, b2 = (float(b) for b in getattr(args, key).split(","))
        except ValueError:
            p.error(f"--{key.replace('_', '-')}: expected two numbers like 0.9,0.95, got {getattr(args, key)!r}")
        setattr(args, key, [b1, b2])
    if args.steps < max(args.tail, 10):
        p.error(f"--steps must be at least max(--tail, 10) = {max(args.tail, 10)}")
    return args


def source_fingerprint(package: str) -> str:
    """A short hash of an installed package's ``.py`` sources (which state of the code a result measured)."""
    root = Path(importlib.import_module(package).__file__).parent
    h = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def freeze_step(steps: int, freeze_frac: float) -> int:
    """The 1-bit optimizers' full-precision warm-up, in steps (at least 1)."""
    return max(1, round(steps * freeze_frac))


def optimizer_section(name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The ds_config ``optimizer`` section of optimizer ``name`` under the benchmark's options ``opts``."""
    freeze = freeze_step(opts["steps"], opts["freeze_frac"])
    if name == "Adam":
        params: dict[str, Any] = {"lr": opts["lr"]}
    elif name == "OneBitAdam":
        params = {"lr": opts["lr"], "freeze_step": freeze, "bias_correction": False}
    elif name == "ZeroOneAdam":
        params = {"lr": opts["lr"], "var_freeze_step": freeze, "var_update_scaler": opts["var_update_scaler"],
                  "local_step_scaler": opts["local_step_scaler"], "local_step_clipper": opts["local_step_clipper"],
                  "bias_correction": False}
    elif name == "Lamb":
        params = {"lr": opts["lr_lamb"], "bias_correction": False, **LAMB_COEFFS}
    elif name == "OneBitLamb":
        params = {"lr": opts["lr_lamb"], "freeze_step": freeze, "bias_correction": False, **LAMB_COEFFS}
    else:
        raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")
    betas = opts["betas_lamb"] if "Lamb" in name else opts["betas"]
    return {"type": name, "params": {**params, "betas": list(betas)}}


def ds_config(name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The whole ds_config of one run: micro-batch, the optimizer, and the shared ``WarmupLR`` schedule."""
    lr = optimizer_section(name, opts)["params"]["lr"]
    warmup = max(2, round(opts["steps"] * opts["warmup_frac"]))
    return {
        "train_micro_batch_size_per_gpu": opts["micro"],
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": optimizer_section(name, opts),
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                      "warmup_num_steps": warmup, "warmup_type": "linear"}},
    }


def gpt_config(opts: dict[str, Any]) -> Any:
    """The benchmark's :class:`~microspeed.demo.model.GPTConfig`."""
    from microspeed.demo.model import GPTConfig

    return GPTConfig(vocab_size=256, seq_len=opts["seq_len"], n_layer=opts["layers"], n_head=opts["heads"],
                     d_model=opts["d_model"])


def _dataset(opts: dict[str, Any]) -> tuple[Any, torch.Tensor, int]:
    """``(dataset, order, n_val)``: the sequences, their shuffled training order, and how many validation ones."""
    from microspeed.demo.data import ByteSequenceDataset, stdlib_corpus

    world, micro, seq = opts["world_size"], opts["micro"], opts["seq_len"]
    n_train = opts["steps"] * world * micro
    n_val = opts["val_batches"] * world * micro
    data = ByteSequenceDataset(stdlib_corpus(max_bytes=(n_train + n_val) * seq + 1, seed=opts["seed"]), seq)
    if len(data) < n_train + n_val:
        raise RuntimeError(f"the standard library has only {len(data)} sequences of {seq} bytes; "
                           f"{n_train + n_val} are needed: lower --steps, --micro or --seq-len")
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(opts["seed"]))
    return data, order, n_val


def _batch(data: Any, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [data[int(i)] for i in indices]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def _rank_mean(value: float) -> float:
    """``value`` averaged over ranks with plain ``torch.distributed`` (never counted by ``microspeed.comm``)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train_rank(name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank of one run: train ``opts['steps']`` steps with optimizer ``name``; rank 0 returns the record."""
    import torch.distributed as dist

    import microspeed
    from microspeed import comm
    from microspeed.demo.model import GPT

    rank, world = dist.get_rank(), dist.get_world_size()
    micro, steps = opts["micro"], opts["steps"]
    data, order, n_val = _dataset(opts)
    torch.manual_seed(opts["seed"])
    model = GPT(gpt_config(opts))
    n_params = sum(p.numel() for p in model.parameters())
    engine, *_ = microspeed.initialize(model=model, config=ds_config(name, opts))
    comm.stats.reset()  # bytes of the steps only (not the initial broadcast of the parameters)

    losses: list[float] = []
    wire: list[int] = []
    coeffs: list[tuple[float, float]] = []  # LAMB's trust ratios per step: (mean, max) over the parameters
    val_order, train_order = order[:n_val], order[n_val:]
    t0 = time.perf_counter()
    for step in range(steps):
        start = step * world * micro + rank * micro
        batch = _batch(data, train_order[start:start + micro])
        before = comm.stats.total_wire_bytes()
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        wire.append(comm.stats.total_wire_bytes() - before)
        losses.append(_rank_mean(loss.item()))
        if hasattr(engine.optimizer, "get_lamb_coeffs"):
            c = engine.optimizer.get_lamb_coeffs() or [float("nan")]
            coeffs.append((sum(c) / len(c), max(c)))
        if not math.isfinite(losses[-1]):
            break
    seconds = time.perf_counter() - t0
    counted_outside_steps = comm.stats.total_wire_bytes() - sum(wire)  # 0 unless the loss average was counted
    wire_by_op = {k: int(v) for k, v in comm.stats.wire.items() if v}
    synchronize = getattr(engine.optimizer, "synchronize", None)
    if synchronize is not None:  # 0/1 Adam: finish pending local steps (not counted) so that one model is scored
        synchronize()

    # Every rank scores its own model on its share of fixed validation sequences; the spread checks one model.
    engine.eval()
    with torch.no_grad():
        val = [engine.module(*_batch(data, val_order[i * world * micro + rank * micro:][:micro])).item()
               for i in range(opts["val_batches"])]
    engine.train()
    val_loss = _rank_mean(sum(val) / len(val))
    flat = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    spread = (hi - lo).max().item()
    if rank != 0:
        return {}
    return {"optimizer": name, "config": ds_config(name, opts), "n_params": n_params, "losses": losses,
            "wire": wire, "lamb_coeffs": coeffs, "seconds": seconds, "val_loss": val_loss,
            "param_spread_across_ranks": spread, "wire_by_op": wire_by_op,
            "wire_counted_outside_steps": counted_outside_steps, "torch": torch.__version__}


def summarize(runs: dict[str, dict[str, Any]], opts: dict[str, Any]) -> dict[str, Any]:
    """Final losses, relative differences, bytes and ratios of the finished ``runs``."""
    tail, freeze = opts["tail"], freeze_step(opts["steps"], opts["freeze_frac"])
    out: dict[str, Any] = {}
    for name, r in runs.items():
        losses, wire = r["losses"], r["wire"]
        finished = len(losses) == opts["steps"] and all(math.isfinite(x) for x in losses)
        full = 2 * (opts["world_size"] - 1) / opts["world_size"] * 4 * r["n_params"]  # an fp32 all-reduce
        kinds = {"full": 0, "compressed": 0, "none": 0}
        for b in wire:
            kinds["none" if b == 0 else "full" if b >= 0.9 * full else "compressed"] += 1
        out[name] = {
            "final_loss": sum(losses[-tail:]) / len(losses[-tail:]) if finished else float("nan"),
            "first_loss": losses[0],
            "val_loss": r["val_loss"],
            "finished": finished,
            "steps_run": len(losses),
            "total_wire_bytes": sum(wire),
            "wire_bytes_per_step_after_warmup": sum(wire[freeze:]) / max(1, len(wire[freeze:])),
            "steps_by_communication": kinds,
            "param_spread_across_ranks": r["param_spread_across_ranks"],
            "wire_by_op": r["wire_by_op"],
            "wire_counted_outside_steps": r["wire_counted_outside_steps"],
            "seconds": r["seconds"],
        }
    for name, base in BASELINE.items():
        if name in out and base in out:
            rel = (out[name]["final_loss"] - out[base]["final_loss"]) / out[base]["final_loss"]
            out[name]["baseline"] = base
            out[name]["rel_diff_vs_baseline"] = rel
            out[name]["pass"] = bool(out[name]["finished"] and abs(rel) <= opts["tolerance"])
    for name in out:
        if "Adam" in out:
            out[name]["bytes_vs_adam"] = out[name]["total_wire_bytes"] / max(1, out["Adam"]["total_wire_bytes"])
    if "ZeroOneAdam" in out and "OneBitAdam" in out:
        out["ZeroOneAdam"]["bytes_vs_onebitadam"] = (out["ZeroOneAdam"]["total_wire_bytes"]
                                                     / max(1, out["OneBitAdam"]["total_wire_bytes"]))
    return out


def print_table(summary: dict[str, Any], opts: dict[str, Any]) -> None:
    """The Markdown results table."""
    print(f"\n| optimizer | final loss (last {opts['tail']}) | vs baseline | within {opts['tolerance']:.0%} "
          "| val loss | total wire MiB | × Adam | KiB/step after warm-up | steps full / 1-bit / none |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---|")
    for name, s in summary.items():
        rel = f"{s['rel_diff_vs_baseline']:+.2%} vs {s['baseline']}" if "baseline" in s else "–"
        if not s["finished"]:
            rel = f"diverged: loss not finite at step {s['steps_run']}"
        ok = ("PASS" if s["pass"] else "FAIL") if "pass" in s else "–"
        ratio = f"{s['bytes_vs_adam']:.4f}" if "bytes_vs_adam" in s else "–"
        k = s["steps_by_communication"]
        print(f"| {name} | {s['final_loss']:.4f} | {rel} | {ok} | {s['val_loss']:.4g} "
              f"| {s['total_wire_bytes'] / 2**20:.2f} | {ratio} | {s['wire_bytes_per_step_after_warmup'] / 1024:.1f} "
              f"| {k['full']} / {k['compressed']} / {k['none']} |")
    if "bytes_vs_onebitadam" in summary.get("ZeroOneAdam", {}):
        print(f"\n0/1 Adam's bytes over the run ÷ 1-bit Adam's: {summary['ZeroOneAdam']['bytes_vs_onebitadam']:.3f}")


def plot(runs: dict[str, dict[str, Any]], opts: dict[str, Any], path: str) -> None:
    """Two panels: the loss curves (moving average over 10 steps, log y) and the cumulative wire bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"Adam": ("tab:blue", "-"), "OneBitAdam": ("tab:orange", "--"), "ZeroOneAdam": ("tab:green", ":"),
              "Lamb": ("tab:red", "-"), "OneBitLamb": ("tab:purple", "--")}
    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(13, 5))
    window = 10
    for name, r in runs.items():
        color, ls = styles[name]
        losses = torch.tensor(r["losses"], dtype=torch.float64)
        kernel = torch.ones(1, 1, window, dtype=torch.float64) / window
        smooth = torch.nn.functional.conv1d(losses.view(1, 1, -1), kernel).view(-1) if len(losses) >= window else losses
        steps = range(len(losses) - len(smooth) + 1, len(losses) + 1)
        ax_loss.plot(steps, smooth.tolist(), color=color, linestyle=ls, label=name)
        cumulative = torch.tensor(r["wire"], dtype=torch.float64).cumsum(0) / 2**20
        ax_bytes.plot(range(1, len(cumulative) + 1), cumulative.tolist(), color=color, linestyle=ls, label=name)
    freeze = freeze_step(opts["steps"], opts["freeze_frac"])
    for ax in (ax_loss, ax_bytes):
        ax.axvline(freeze, color="grey", linewidth=0.8, linestyle="-.")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_loss.set_ylabel(f"training loss (mean over ranks, moving average of {window})")
    ax_loss.set_title(f"demo GPT, {opts['world_size']} ranks; grey: end of the 1-bit warm-up (step {freeze})")
    ax_bytes.set_ylabel("cumulative wire bytes sent by rank 0 (MiB)")
    ax_bytes.set_title("communication over the run")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run every selected optimizer, print the table and ``BENCH_JSON``; exit 1 if a comparison failed."""
    args = parse_args(argv)
    from microspeed.testing import run_distributed

    opts = {k: v for k, v in vars(args).items() if k not in ("json_out", "plot", "optimizers")}
    cfg = gpt_config(opts)
    fingerprints = (source_fingerprint("microspeed"), source_fingerprint("microspeed_comm"))
    print(f"comm_convergence: GPT d_model {cfg.d_model}, {cfg.n_layer} layers, {cfg.n_head} heads, seq {cfg.seq_len}; "
          f"{args.world_size} ranks × {args.micro} sequences, {args.steps} steps, "
          f"1-bit warm-up {freeze_step(args.steps, args.freeze_frac)} steps; torch {torch.__version__}; "
          f"sources: microspeed {fingerprints[0]}, microspeed_comm {fingerprints[1]}", flush=True)
    runs: dict[str, dict[str, Any]] = {}
    for name in args.optimizers:
        t0 = time.perf_counter()
        result = run_distributed(train_rank, world_size=args.world_size, args=(name, opts), timeout=args.timeout)[0]
        runs[name] = result
        losses = result["losses"]
        print(f"  {name:12s} loss {losses[0]:.3f} -> {sum(losses[-args.tail:]) / len(losses[-args.tail:]):.4f} "
              f"(last {args.tail}), {sum(result['wire']) / 2**20:.2f} MiB on the wire, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    n_params = next(iter(runs.values()))["n_params"]
    summary = summarize(runs, opts)
    print_table(summary, opts)
    if args.plot:
        plot(runs, opts, args.plot)
        print(f"plot: {args.plot}")
    record = {"benchmark": "comm_convergence", "options": opts, "n_params": n_params, "torch": torch.__version__,
              "microspeed_core": fingerprints[0], "microspeed_comm": fingerprints[1],
              "summary": summary,
              "curves": {n: {"losses": r["losses"], "wire": r["wire"], "lamb_coeffs": r["lamb_coeffs"]}
                         for n, r in runs.items()}}
    line = json.dumps(record)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(line + "\n")
    print("BENCH_JSON " + line, flush=True)
    return 0 if all(s.get("pass", True) for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
