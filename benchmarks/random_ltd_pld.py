"""Step time of the demo GPT with random-LTD and with progressive layer drop (PLD), against the plain model.

Single process, no launcher needed::

    PYTHONPATH=plugins/efficiency python benchmarks/random_ltd_pld.py [--steps 20 --warmup 3 --layers 6 \\
        --d-model 128 --seq-len 256 --micro-batch 8 --keep 0.5 --thetas 1.0,0.75,0.5]

Engines train the same :class:`microspeed.demo.model.GPT` (same seed, same weights, same batches of the stdlib
corpus), fp32, AdamW, one torch thread, gradient accumulation 1, in one process:

* ``baseline`` — the plain model (the random-LTD and PLD plugins are registered but off);
* ``random_ltd`` — random-LTD on the middle layers (all but the first and the last) with a fixed schedule that
  keeps ``--keep`` of the tokens (``min_value = max_value = keep * seq_len``);
* ``pld θ̄=…`` — PLD with ``theta = θ̄`` and ``gamma = 1000``, so θ(t) = θ̄ from the second step on: the step time
  at that point of the schedule. ``θ̄ = 1.0`` measures the cost of the mechanism alone (every layer runs).

Steps go round-robin over the engines (A, B, C, ..., then the next step of each) so that drifts of a shared
machine affect all alike; each optimizer step (forward + backward + step) is timed with ``time.perf_counter``
(wall clock) and ``time.thread_time`` (this thread's CPU time: with one torch thread the step runs on the main
thread, and CPU time leaves out the time spent waiting for a core, which dominates the noise on a shared machine).
Reported per engine: median step time (wall and CPU), tokens per second (``micro_batch * seq_len / median`` wall),
the ratio of the baseline's median to it (speed-up, above 1 is faster; wall and CPU), the median of the paired
per-round wall ratios, the expected
fraction of layer-token work (random-LTD: ``(L - m + m * keep) / L`` for ``m`` dropping layers; PLD:
``sum_i keep_i / L``) and the mean loss of the timed steps. Last line: ``BENCH_JSON {...}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from common import make_batches  # noqa: E402 - benchmarks/ is on sys.path when run as a script
from microspeed_efficiency.pld_plugin import ProgressiveLayerDropPlugin  # noqa: E402
from microspeed_efficiency.random_ltd_plugin import RandomLTDPlugin  # noqa: E402

import microspeed  # noqa: E402
from microspeed.config import Field, Section  # noqa: E402
from microspeed.demo.model import GPT, GPTConfig  # noqa: E402
from microspeed.hookspecs import hookimpl  # noqa: E402


class DataEfficiencySection:
    """Claims ``data_efficiency`` (with ``data_routing`` open) when the data-efficiency plugin cannot be imported."""

    @hookimpl
    def microspeed_config_sections(self) -> dict[str, Section]:
        """``data_efficiency``: ``enabled`` and an open ``data_routing``."""
        return {"data_efficiency": Section({"enabled": Field((bool,), False, "switch"),
                                            "data_routing": Section(open=True)}, open=False)}


def _data_efficiency_plugin() -> Any:
    try:
        from microspeed_efficiency.data_efficiency_plugin import DataEfficiencyPlugin
    except ImportError:
        return DataEfficiencySection
    return DataEfficiencyPlugin


def build_engine(args: argparse.Namespace, section: dict[str, Any]) -> Any:
    """An engine on the benchmark's GPT (seeded) with the random-LTD and PLD plugins registered."""
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads, d_model=args.d_model))
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "steps_per_print": 10**9, **section}
    plugins = [("data_efficiency", _data_efficiency_plugin()), ("random_ltd", RandomLTDPlugin),
               ("progressive_layer_drop", ProgressiveLayerDropPlugin)]
    engine, *_ = microspeed.initialize(model=model, config=config, plugins=plugins)
    return engine


def configurations(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], float]]:
    """``(name, ds_config additions, expected fraction of layer-token work)`` per engine."""
    layers = args.layers
    middle = list(range(1, layers - 1))
    keep_tokens = int(args.keep * args.seq_len)
    out: list[tuple[str, dict[str, Any], float]] = [("baseline", {}, 1.0)]
    out.append((f"random_ltd keep={args.keep:g}", {"data_efficiency": {"enabled": True, "data_routing": {
        "enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": layers, "random_ltd_layer_num": len(middle),
            "random_ltd_layer_id": middle, "model_mask_name": None, "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": keep_tokens, "max_value": keep_tokens, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 1, "seq_per_step": 1}}}}}},
        (layers - len(middle) + len(middle) * keep_tokens / args.seq_len) / layers))
    for theta in args.thetas:
        keep = [1.0 - (i + 1) / layers * (1.0 - theta) for i in range(layers)]
        out.append((f"pld theta={theta:g}", {"progressive_layer_drop": {"enabled": True, "theta": theta,
                                                                         "gamma": 1000.0}}, sum(keep) / layers))
    return out


def main() -> None:
    """Run the benchmark and print the table and ``BENCH_JSON``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per engine")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per engine first")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--keep", type=float, default=0.5, help="fraction of tokens random-LTD keeps in the middle layers")
    p.add_argument("--thetas", type=lambda s: [float(v) for v in s.split(",")], default=[1.0, 0.75, 0.5])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)

    configs = configurations(args)
    engines = [build_engine(args, section) for _, section, _ in configs]
    batches = make_batches(args.warmup + args.steps, args.micro_batch, args.seq_len)
    times: list[list[float]] = [[] for _ in engines]
    cpu: list[list[float]] = [[] for _ in engines]
    losses: list[list[float]] = [[] for _ in engines]
    for step, (x, y) in enumerate(batches):
        order = range(len(engines)) if step % 2 == 0 else reversed(range(len(engines)))
        for k in order:
            engine = engines[k]
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if step >= args.warmup:
                times[k].append(dt)
                cpu[k].append(dc)
                losses[k].append(float(loss.detach()))

    base, base_cpu = statistics.median(times[0]), statistics.median(cpu[0])
    rows = []
    tokens = args.micro_batch * args.seq_len
    for (name, _, work), t, c, lo in zip(configs, times, cpu, losses, strict=True):
        med, med_cpu = statistics.median(t), statistics.median(c)
        paired = statistics.median(b / s for b, s in zip(times[0], t, strict=True))
        rows.append({"engine": name, "median_step_ms": 1e3 * med, "median_cpu_ms": 1e3 * med_cpu,
                     "tokens_per_s": tokens / med, "speedup": base / med, "cpu_speedup": base_cpu / med_cpu,
                     "paired_speedup": paired, "expected_work": work, "mean_loss": statistics.fmean(lo)})
    print(f"GPT: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq {args.seq_len}, micro-batch "
          f"{args.micro_batch}; {args.steps} timed steps (+{args.warmup} warm-up) per engine, round-robin; "
          f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, 1 thread")
    print(f"{'engine':<22}{'wall step':>11}{'CPU step':>11}{'tokens/s':>10}{'speed-up':>10}{'paired':>8}"
          f"{'CPU s-up':>10}{'work':>7}{'loss':>8}")
    for r in rows:
        print(f"{r['engine']:<22}{r['median_step_ms']:>8.1f} ms{r['median_cpu_ms']:>8.1f} ms{r['tokens_per_s']:>10.0f}"
              f"{r['speedup']:>10.2f}{r['paired_speedup']:>8.2f}{r['cpu_speedup']:>10.2f}{r['expected_work']:>7.2f}"
              f"{r['mean_loss']:>8.3f}")
    print("BENCH_JSON " + json.dumps({"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
