"""The demo GPT trained as a pipeline: ``torchrun --nproc-per-node 2 examples/pipeline/train_gpt.py``.

A DeepSpeed pipeline script, unchanged but for ``import microspeed as deepspeed``: the model is a
``PipelineModule`` of layer specs (embedding and head tied across the first and last stage), trained
with ``engine.train_batch()``. ``--stages`` must divide the number of processes; the rest is data
parallelism. ``--chunks 2`` runs the interleaved 1F1B schedule.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import microspeed as deepspeed
from microspeed.demo.data import ByteSequenceDataset, stdlib_corpus
from microspeed.demo.model import GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> list[float]:
    """Train for ``--steps`` batches; return the losses (rank 0 prints them)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=os.path.join(HERE, "ds_config_pipeline.json"))
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)

    from microspeed_pipeline.gpt import gpt_pipeline

    deepspeed.init_distributed()
    with open(args.config) as fh:
        config = json.load(fh)
    torch.manual_seed(args.seed)
    gpt = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=64, dropout=0.0)
    model = gpt_pipeline(gpt, num_stages=args.stages, num_chunks=args.chunks, seed_layers=True,
                         base_seed=args.seed)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    data = ByteSequenceDataset(stdlib_corpus(max_bytes=400_000), gpt.seq_len)
    loader = torch.utils.data.DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(), shuffle=True,
                                         generator=torch.Generator().manual_seed(args.seed + engine.topology
                                                                                 .data_parallel_rank))
    data_iter = iter(deepspeed.RepeatingLoader(loader))
    losses = []
    for step in range(args.steps):
        losses.append(engine.train_batch(data_iter).item())
        if engine.topology.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
