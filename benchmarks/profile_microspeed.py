"""cProfile of microspeed's ``initialize()`` and of a few data-parallel training steps.

Launch like the data-parallel benchmark (2 ranks, gloo, CPU)::

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/profile_microspeed.py \
        [--model demo|small --steps 10 --top 25]

Rank 0 prints the top entries by cumulative and by internal time for ``initialize()`` and for
``--steps`` steps (after ``--warmup`` untimed ones), plus a split of each step into forward,
backward and optimizer step wall time. Profiling adds per-call overhead to Python code, so the
absolute numbers are inflated; use it for *where*, and the benchmarks for *how much*.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import microspeed  # noqa: E402
from microspeed.demo.model import GPT, GPTConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("demo", "small"), default="demo")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--top", type=int, default=25)
    return p.parse_args(argv)


def stats_text(prof: cProfile.Profile, sort: str, top: int) -> str:
    """The ``top`` rows of ``prof`` sorted by ``sort``, as pstats prints them."""
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(sort).print_stats(top)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    """Profile initialize() and a few steps; print on rank 0."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    microspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig.demo() if args.model == "demo" else GPTConfig.tiny()
    torch.manual_seed(0)
    model = GPT(cfg)
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "gradient_clipping": args.clip,
        "steps_per_print": 10**9,
    }
    prof_init = cProfile.Profile()
    t0 = time.perf_counter()
    prof_init.enable()
    engine, *_ = microspeed.initialize(model=model, config=config)
    prof_init.disable()
    init_s = time.perf_counter() - t0

    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (args.micro, cfg.seq_len + 1), generator=g)
    inp, tgt = x[:, :-1], x[:, 1:]

    def one_step(split: dict[str, list[float]] | None) -> None:
        """One step; with ``split``, append its forward / backward / step wall times."""
        dist.barrier()
        a = time.perf_counter()
        loss = engine(inp, tgt)
        b = time.perf_counter()
        engine.backward(loss)
        c = time.perf_counter()
        engine.step()
        d = time.perf_counter()
        if split is not None:
            split["forward"].append(b - a)
            split["backward+reduce"].append(c - b)
            split["step"].append(d - c)

    for _ in range(args.warmup):
        one_step(None)
    split: dict[str, list[float]] = {"forward": [], "backward+reduce": [], "step": []}
    for _ in range(args.steps):  # unprofiled, for the phase split
        one_step(split)
    prof_steps = cProfile.Profile()
    prof_steps.enable()
    for _ in range(args.steps):
        one_step(None)
    prof_steps.disable()

    if rank == 0:
        print(f"model={args.model} params={model.num_parameters():,} world={world} micro={args.micro} "
              f"torch {torch.__version__}")
        print(f"\n=== microspeed.initialize(): {init_s:.2f} s wall (profiled) ===")
        print(stats_text(prof_init, "cumulative", args.top))
        print("phase medians over", args.steps, "unprofiled steps:",
              {k: f"{statistics.median(v) * 1e3:.2f} ms" for k, v in split.items()})
        print(f"\n=== {args.steps} profiled steps, by cumulative time ===")
        print(stats_text(prof_steps, "cumulative", args.top))
        print(f"\n=== {args.steps} profiled steps, by internal time ===")
        print(stats_text(prof_steps, "tottime", args.top))
    dist.barrier()


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
