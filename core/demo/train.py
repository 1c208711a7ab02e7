"""The ``microspeed demo`` training script: a byte-level GPT on the Python standard library.

Run by ``microspeed demo`` under torchrun (2 local processes by default); also runnable directly:
``torchrun --nproc-per-node 2 -m microspeed.demo.train --config examples/ds_config_demo.json``.
Shows a progress bar (loss, tokens/s) on rank 0, a falling loss, and saves a checkpoint at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import microspeed
from microspeed.demo.data import ByteSequenceDataset, stdlib_corpus, train_val_split
from microspeed.models import GPT, GPTConfig

_PACKAGED_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config_demo.json")  # in a wheel
DEFAULT_CONFIG = _PACKAGED_CONFIG if os.path.isfile(_PACKAGED_CONFIG) else os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "ds_config_demo.json")
"""``microspeed demo``'s ds_config: the copy an installed wheel carries, else the checkout's ``examples/``."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the demo."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="ds_config JSON")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the scheduler's total)")
    p.add_argument("--out", default="runs/demo", help="checkpoint directory")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus size in bytes")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def load_config(path: str, steps: int | None) -> tuple[dict, int]:
    """Read the ds_config; make the scheduler's length agree with ``steps``."""
    if not os.path.isfile(path):
        raise SystemExit(f"microspeed demo: config {path!r} not found; pass --config PATH "
                         "(the default lives in the repository's examples/ folder).")
    with open(path) as fh:
        config = json.load(fh)
    params = config.get("scheduler", {}).get("params", {})
    if steps is None:
        steps = int(params.get("total_num_steps", 300))
    if "total_num_steps" in params:
        params["total_num_steps"] = steps
        params["warmup_num_steps"] = min(params.get("warmup_num_steps", 0), max(steps // 10, 1))
    return config, steps


@torch.no_grad()
def evaluate(engine: microspeed.Engine, data: torch.Tensor, seq_len: int, batches: int = 8) -> float:
    """Mean loss on the first ``batches`` validation micro-batches."""
    engine.eval()
    ds = ByteSequenceDataset(data, seq_len)
    losses = [engine.module(*[t.unsqueeze(0) for t in ds[i]]).item() for i in range(min(batches * 4, len(ds)))]
    engine.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    """Train, show progress, save a checkpoint, print the loss drop."""
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    config, steps = load_config(args.config, args.steps)
    microspeed.init_distributed()
    rank = torch.distributed.get_rank()
    torch.manual_seed(args.seed)
    gpt_config = GPTConfig.demo()
    model = GPT(gpt_config)
    train_bytes, val_bytes = train_val_split(stdlib_corpus(max_bytes=args.max_bytes))
    dataset = ByteSequenceDataset(train_bytes, gpt_config.seq_len)
    engine, _, loader, _ = microspeed.initialize(model=model, model_parameters=model.parameters(),
                                                 training_data=dataset, config=config)
    data = iter(microspeed.RepeatingLoader(loader))
    tokens_per_step = engine.train_batch_size() * gpt_config.seq_len
    bar = None
    if rank == 0:
        from tqdm import tqdm

        print(f"microspeed demo: GPT {model.num_parameters():,} parameters, {engine.topology.describe()}, "
              f"{len(dataset):,} sequences of {gpt_config.seq_len} bytes, {steps} steps", flush=True)
        bar = tqdm(total=steps, unit="step", dynamic_ncols=True)
    first = last = None
    t0 = time.perf_counter()
    for step in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(next(data))
            engine.backward(loss)
            engine.step()
        value = loss.item()
        first = value if first is None else first
        last = value if last is None else 0.9 * last + 0.1 * value
        if bar is not None:
            rate = tokens_per_step * (step + 1) / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{last:.3f}", tok_s=f"{rate:,.0f}")
            bar.update(1)
    if bar is not None:
        bar.close()
    val = evaluate(engine, val_bytes, gpt_config.seq_len)
    engine.save_checkpoint(args.out)
    if rank == 0:
        print(f"loss {first:.3f} -> {last:.3f} (smoothed); validation loss {val:.3f} "
              f"(uniform bytes: {math.log(256):.3f}); checkpoint in {os.path.abspath(args.out)}", flush=True)


if __name__ == "__main__":
    main()
