"""Sequence-length curriculum (legacy ``curriculum_learning``) vs none on the demo GPT: tokens to a loss.

Usage (one process, CPU; about 3-4 minutes per seed on 2 busy cores with the defaults)::

    PYTHONPATH=plugins/efficiency python benchmarks/curriculum.py                 # seed 0
    PYTHONPATH=plugins/efficiency python benchmarks/curriculum.py --seeds 0 1 2   # medians over seeds
    python benchmarks/curriculum.py --quick                                       # smoke run, under a minute
    python benchmarks/curriculum.py --json-out curriculum.json

(``PYTHONPATH`` only while microspeed-efficiency is not installed.)

**What runs.** The demo GPT (:class:`microspeed.demo.model.GPT`; by default a small one, 2 blocks of width 64,
2 heads, ``seq_len`` 128, for time; ``--model demo`` is ``GPTConfig.demo()``) trains through
``microspeed.initialize`` (AdamW, WarmupLR to ``--lr`` over 20 steps, gradient clipping 1.0, micro-batch
``--batch``) on byte sequences of 128 tokens cut from the Python standard library's sources
(:mod:`microspeed.demo.data`). Two runs per seed, with the same initial weights and the same sequence of
batches:

* *baseline*: every step sees whole 128-token sequences;
* *curriculum*: ``"curriculum_learning": {"enabled": true, "curriculum_type": "seqlen", "min_difficulty": 16,
  "max_difficulty": 128, "schedule_type": "fixed_root", "schedule_config": {"total_curriculum_step":
  frac * steps, "difficulty_step": 8, "root_degree": 2}}`` (``--schedule``, ``--frac``, ``--min-len``,
  ``--root-degree``) — the plugin cuts each batch to the scheduled length (the demo GPT has no
  ``curriculum_seqlen`` argument).

The default schedule (``fixed_root``, square root, over the first 15 % of the steps) is the one that came
closest to the baseline in the stable regime: it reaches long sequences soon, so the position embeddings past
the current length go untrained only briefly (``fixed_linear`` over 30 %: 1.17x the baseline's tokens; this:
1.02x, medians of 3 seeds; see BENCHMARKS.md for every configuration tried). ``--baseline-lr`` lets the baseline
run at another learning rate (e.g. the best stable one) than the curriculum run; ``--warmup`` and ``--clip`` set
WarmupLR's steps and gradient clipping for both.

Every ``--eval-every`` steps both are evaluated on the same held-out batches at the full length 128 (the loss
that matters: a short-context loss is not comparable). The *smoothed* loss is the mean of the last
``--window`` evaluations. The target is the baseline's final smoothed loss; for each run the first evaluation
whose smoothed loss is at or below it gives the *steps* and *tokens* (sum of batch x sequence length actually
trained on) to the target. The curriculum run trains ``--steps`` steps and, if it has not reached the target by
then, on up to ``--max-extra`` times as many. Printed per seed and as medians: final smoothed losses at
``--steps``, steps and tokens to the target, the ratios curriculum / baseline (target: tokens ratio < 1), and
the curriculum's smoothed loss at the first evaluation after as many tokens as the whole baseline run
(``curriculum_at_equal_tokens``; ``None`` when the curriculum run stopped earlier, having reached the target).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")  # the plugin is passed below, by itself
os.environ.pop("MICROSPEED_PLUGINS", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "efficiency"))

import torch  # noqa: E402
from microspeed_efficiency.curriculum_plugin import CurriculumPlugin  # noqa: E402

import microspeed  # noqa: E402
from microspeed.demo.data import ByteSequenceDataset, stdlib_corpus, train_val_split  # noqa: E402
from microspeed.demo.model import GPT, GPTConfig  # noqa: E402

SEQ = 128


def model_config(name: str) -> GPTConfig:
    """``small`` (2 blocks, width 64) or ``demo`` (``GPTConfig.demo()``), both with ``seq_len`` 128."""
    if name == "demo":
        return GPTConfig.demo()
    return GPTConfig(seq_len=SEQ, n_layer=2, n_head=2, d_model=64)


def make_data(batch: int, n_batches: int, n_val: int, seed: int) -> tuple[list, list]:
    """Training batches (a seeded order of the corpus' sequences) and held-out evaluation batches."""
    corpus = stdlib_corpus(max_bytes=(n_batches + n_val + 8) * batch * SEQ + 1, seed=0)
    train, val = train_val_split(corpus, val_fraction=0.1)
    train_set, val_set = ByteSequenceDataset(train, SEQ), ByteSequenceDataset(val, SEQ)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed))

    def stack(ds, idx):
        rows = [ds[int(i)] for i in idx]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    batches = [stack(train_set, order[(k * batch + torch.arange(batch)) % len(order)]) for k in range(n_batches)]
    val_batches = [stack(val_set, range(k * batch, (k + 1) * batch)) for k in range(min(n_val, len(val_set) // batch))]
    return batches, val_batches


def train(args, cfg: GPTConfig, batches: list, val_batches: list, seed: int, curriculum: bool,
          target: float | None = None) -> dict:
    """One run; returns its evaluation curve, tokens per step and wall time."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    lr = args.lr if curriculum else args.baseline_lr
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                     "warmup_num_steps": args.warmup, "warmup_type": "linear"}},
        "steps_per_print": 10**9,
    }
    if args.clip > 0:
        config["gradient_clipping"] = args.clip
    total = max(int(args.frac * args.steps), 1)
    if curriculum:
        schedule = {"total_curriculum_step": total, "difficulty_step": 8}
        if args.schedule == "fixed_root":
            schedule["root_degree"] = args.root_degree
        config["curriculum_learning"] = {
            "enabled": True, "curriculum_type": "seqlen", "min_difficulty": args.min_len, "max_difficulty": SEQ,
            "schedule_type": args.schedule, "schedule_config": schedule}
    engine, *_ = microspeed.initialize(model=model, config=config, plugins=[("curriculum", CurriculumPlugin)])
    lengths: list[int] = []
    model.register_forward_pre_hook(lambda m, a: lengths.append(a[0].shape[1]) if m.training else None)
    evals: list[tuple[int, int, float]] = []  # (step, tokens so far, eval loss)
    tokens, start = 0, time.perf_counter()
    limit = args.steps if not curriculum else int(args.steps * args.max_extra)
    step = 0
    while step < limit:
        x, y = batches[step % len(batches)]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        tokens += args.batch * lengths[-1]
        step += 1
        if step % args.eval_every == 0:
            engine.eval()
            with torch.no_grad():
                value = sum(float(engine(vx, vy)) for vx, vy in val_batches) / len(val_batches)
            engine.train()
            evals.append((step, tokens, value))
            if step >= args.steps and target is not None and smoothed(evals, args.window)[-1] <= target:
                break
    return {"evals": evals, "seconds": time.perf_counter() - start, "lengths": lengths[:: max(args.steps // 10, 1)]}


def smoothed(evals: list[tuple[int, int, float]], window: int) -> list[float]:
    """The mean of the last ``window`` evaluation losses at each evaluation."""
    values = [e[2] for e in evals]
    return [statistics.fmean(values[max(0, i + 1 - window): i + 1]) for i in range(len(values))]


def to_target(evals: list[tuple[int, int, float]], window: int, target: float) -> tuple[int | None, int | None]:
    """Steps and tokens at the first evaluation whose smoothed loss is <= ``target`` (``None`` if never)."""
    for (step, tokens, _), value in zip(evals, smoothed(evals, window), strict=True):
        if value <= target + 1e-12:
            return step, tokens
    return None, None


def at_step(evals: list[tuple[int, int, float]], window: int, step: int) -> float:
    """The smoothed loss at the evaluation of ``step``."""
    values = smoothed(evals, window)
    return next(v for (s, _, _), v in zip(evals, values, strict=True) if s == step)


def at_tokens(evals: list[tuple[int, int, float]], window: int, tokens: int) -> float | None:
    """The smoothed loss at the first evaluation after at least ``tokens`` trained tokens (``None`` if never)."""
    values = smoothed(evals, window)
    return next((v for (_, t, _), v in zip(evals, values, strict=True) if t >= tokens), None)


def one_seed(args, seed: int) -> dict:
    """Baseline and curriculum for one seed."""
    cfg = model_config(args.model)
    batches, val_batches = make_data(args.batch, args.steps, args.val_batches, seed)
    base = train(args, cfg, batches, val_batches, seed, curriculum=False)
    target = at_step(base["evals"], args.window, args.steps)
    cur = train(args, cfg, batches, val_batches, seed, curriculum=True, target=target)
    b_steps, b_tokens = to_target(base["evals"], args.window, target)
    c_steps, c_tokens = to_target(cur["evals"], args.window, target)
    row = {"seed": seed, "target_loss": target, "baseline_final": target,
           "curriculum_final": at_step(cur["evals"], args.window, args.steps),
           "baseline_steps": b_steps, "baseline_tokens": b_tokens,
           "curriculum_steps": c_steps, "curriculum_tokens": c_tokens,
           "tokens_ratio": c_tokens / b_tokens if c_tokens else None,
           "steps_ratio": c_steps / b_steps if c_steps else None,
           "baseline_tokens_total": base["evals"][-1][1],
           "curriculum_at_equal_tokens": at_tokens(cur["evals"], args.window, base["evals"][-1][1]),
           "baseline_max_eval": max(e[2] for e in base["evals"]),
           "curriculum_max_eval_after_first": max(e[2] for e in cur["evals"][1:]) if len(cur["evals"]) > 1 else None,
           "baseline_seconds": base["seconds"], "curriculum_seconds": cur["seconds"],
           "curriculum_lengths_sampled": cur["lengths"],
           "baseline_curve": base["evals"], "curriculum_curve": cur["evals"]}
    print(f"seed {seed}: target (baseline final smoothed eval loss) {target:.4f}; curriculum at step {args.steps}: "
          f"{row['curriculum_final']:.4f}")
    print(f"  at equal tokens ({row['baseline_tokens_total']}): baseline {target:.4f}, curriculum "
          f"{row['curriculum_at_equal_tokens']}")
    print(f"  baseline   reaches it at step {b_steps} after {b_tokens} tokens ({base['seconds']:.0f} s)")
    if c_steps is None:
        limit = int(args.steps * args.max_extra)
        print(f"  curriculum does not reach it within {limit} steps ({cur['seconds']:.0f} s)")
    else:
        print(f"  curriculum reaches it at step {c_steps} after {c_tokens} tokens ({cur['seconds']:.0f} s): "
              f"tokens x{row['tokens_ratio']:.3f}, steps x{row['steps_ratio']:.3f}")
    return row


def main(argv: list[str] | None = None) -> dict:
    """Parse arguments, run every seed, print medians; return the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="baseline optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the curriculum run")
    parser.add_argument("--baseline-lr", type=float, default=None, help="peak learning rate of the baseline "
                        "(default: --lr; set it to compare against the best stable baseline)")
    parser.add_argument("--warmup", type=int, default=20, help="WarmupLR steps")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: none)")
    parser.add_argument("--schedule", choices=("fixed_linear", "fixed_root"), default="fixed_root")
    parser.add_argument("--root-degree", type=float, default=2.0, help="fixed_root only")
    parser.add_argument("--min-len", type=int, default=16, help="min_difficulty (first sequence length)")
    parser.add_argument("--frac", type=float, default=0.15, help="total_curriculum_step as a fraction of --steps")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--window", type=int, default=3, help="evaluations averaged into the smoothed loss")
    parser.add_argument("--max-extra", type=float, default=1.5, help="curriculum may train this many times --steps")
    parser.add_argument("--model", choices=("small", "demo"), default="small")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="60 steps, 4 validation batches")
    parser.add_argument("--json-out", type=str, default=None)
    args = parser.parse_args(argv)
    if args.baseline_lr is None:
        args.baseline_lr = args.lr
    if args.quick:
        args.steps, args.val_batches, args.eval_every = 60, 4, 5
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"curriculum benchmark: model {args.model}, {args.steps} steps x {args.batch} x {SEQ} tokens, lr {args.lr} "
          f"(baseline {args.baseline_lr}), warmup {args.warmup}, clip {args.clip}, "
          f"curriculum {args.schedule} {args.min_len} -> {SEQ} over {int(args.frac * args.steps)} steps; "
          f"torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    rows = [one_seed(args, seed) for seed in args.seeds]

    def median(key):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else None

    summary = {k: median(k) for k in ("baseline_final", "curriculum_final", "baseline_steps", "baseline_tokens",
                                      "curriculum_steps", "curriculum_tokens", "tokens_ratio", "steps_ratio",
                                      "curriculum_at_equal_tokens",
                                      "baseline_seconds", "curriculum_seconds")}
    summary["reached"] = sum(r["curriculum_steps"] is not None for r in rows)
    print(f"medians over {len(rows)} seed(s) (curriculum reached the target in {summary['reached']}):")
    for key, value in summary.items():
        if key != "reached":
            print(f"  {key:20s} {value if value is None or isinstance(value, int) else round(value, 4)}")
    result = {"args": vars(args), "rows": rows, "summary": summary}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
