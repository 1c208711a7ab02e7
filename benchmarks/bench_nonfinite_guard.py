"""Cost of the non-finite guard: the demo GPT training with it and with it switched off, in one process.

Single process, no launcher needed::

    python benchmarks/bench_nonfinite_guard.py [--steps N --warmup W --model demo|small --clip 0|1.0]

The guard is the kernel's one check of a step's numbers (``engine.grad_norm.finite``: one host sync on the
norm the step computes anyway) and the ``gradient_clipping`` plugin's loss check (``loss * (x - x + 1)``, ``x`` the
loss's value, before backward). Engine A has both switched off (``finite`` answers ``True``; the ``scale_loss``
implementation is removed from its hook), engine B is the engine as shipped; same weights, same batches, steps
alternate A, B, B, A, ... and are timed as in ``bench_hook_overhead.py`` (wall clock and this thread's CPU time).
Prints the medians, the paired overhead, B/A, whether the losses are bit-identical, and one ``BENCH_JSON`` line.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from bench_hook_overhead import overhead, train_step  # noqa: E402 - benchmarks/ is on sys.path as a script
from common import make_batches  # noqa: E402

import microspeed  # noqa: E402
from microspeed.demo.model import GPT, GPTConfig  # noqa: E402


def make_engine(model: torch.nn.Module, micro: int, clip: float, guard: bool) -> Any:
    """An fp32 Adam engine on ``model``; ``guard=False`` switches the non-finite guard off."""
    config = {"train_micro_batch_size_per_gpu": micro, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "gradient_clipping": clip, "steps_per_print": 10**9}
    engine, *_ = microspeed.initialize(model=model, config=config)
    if not guard:
        engine.grad_norm.finite = lambda norm: True
        caller = engine.plugins.hook.microspeed_scale_loss
        for impl in caller.get_hookimpls():
            if type(impl.plugin).__name__ == "GradientClippingPlugin":
                caller._remove_plugin(impl.plugin)
    return engine


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both engines; print the result and return it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--model", choices=("demo", "small"), default="demo")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = GPTConfig.demo() if args.model == "demo" else GPTConfig.tiny()
    torch.manual_seed(1234)
    base = GPT(cfg)
    batches = make_batches(args.warmup + args.steps, args.micro, cfg.seq_len)
    engines = {"A": make_engine(copy.deepcopy(base), args.micro, args.clip, False),
               "B": make_engine(copy.deepcopy(base), args.micro, args.clip, True)}
    wall: dict[str, list[float]] = {"A": [], "B": []}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    losses: dict[str, list[float]] = {"A": [], "B": []}
    for i, (x, y) in enumerate(batches):
        for key in (("A", "B") if i % 2 == 0 else ("B", "A")):
            dt, dc, loss = train_step(engines[key], x, y)
            losses[key].append(loss)
            if i >= args.warmup:
                wall[key].append(dt)
                cpu[key].append(dc)
    w, c = overhead(wall["A"], wall["B"]), overhead(cpu["A"], cpu["B"])
    result = {"benchmark": "nonfinite_guard", "model": args.model, "params": base.num_parameters(),
              "micro": args.micro, "seq_len": cfg.seq_len, "clip": args.clip, "steps": args.steps,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "wall": w, "cpu": c,
              "ratio_wall": w["median_step_s_n_plugins"] / w["median_step_s_0_plugins"],
              "ratio_cpu": c["median_step_s_n_plugins"] / c["median_step_s_0_plugins"],
              "losses_identical": losses["A"] == losses["B"]}
    print(f"{args.model} GPT ({result['params']:,} parameters), clip {args.clip}, {args.steps} steps:")
    for name, m in (("wall", w), ("thread CPU", c)):
        print(f"  {name:10s}: guard off {m['median_step_s_0_plugins'] * 1e3:8.2f} ms, on "
              f"{m['median_step_s_n_plugins'] * 1e3:8.2f} ms, paired overhead {m['overhead_us_median_paired']:7.1f} us "
              f"({m['overhead_pct_median_paired']:+.2f} %)")
    print(f"  on/off: wall {result['ratio_wall']:.4f}, CPU {result['ratio_cpu']:.4f}; losses bit-identical: "
          f"{result['losses_identical']}")
    print("BENCH_JSON " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
