"""The demo GPT with Mixture-of-Experts layers, trained like a DeepSpeed script; expert parallel on 2 ranks:
``torchrun --nproc_per_node 2 examples/moe/train_gpt_moe.py --ep-size 2``.

A DeepSpeed script, unchanged but for ``import microspeed as deepspeed``: the model's every ``--every``-th block
has an MoE layer (``deepspeed.moe.layer.MoE``, ``--experts`` experts, top-``--k``) in place of its MLP, built by
:func:`microspeed_moe.gpt.moe_gpt`; it trains with ``engine(batch)``, ``engine.backward(loss)``,
``engine.step()``. The loss is the LM loss plus 0.01 times the load-balancing losses (``--aux-loss-coef``).
With ``--ep-size 2`` each of the 2 ranks holds half of every layer's experts and tokens travel to them by
``all_to_all``; ``--ep-size 1`` (and plain ``python examples/moe/train_gpt_moe.py``, one process) keeps all
experts on every rank. ``--ep-size`` must divide the number of processes and ``--experts``.

Rank 0 prints the loss (averaged over the ranks), the LM loss alone, the auxiliary loss and the busiest
expert's share of the tokens of the first MoE layer.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import microspeed as deepspeed
from microspeed.demo.data import ByteSequenceDataset, stdlib_corpus
from microspeed.demo.model import GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> list[float]:
    """Train for ``--steps`` steps; return the rank-averaged losses (rank 0 prints them)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(HERE, "ds_config_moe.json"))
    p.add_argument("--ep-size", type=int, default=1, help="ranks each MoE layer's experts are spread over")
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer")
    p.add_argument("--k", type=int, default=1, help="experts per token (1: Switch, 2: GShard)")
    p.add_argument("--every", type=int, default=2, help="every n-th block is an MoE block")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)

    from microspeed_moe.gpt import moe_gpt

    deepspeed.init_distributed()  # before the model: each rank must know which experts it holds
    with open(args.config) as fh:
        config = json.load(fh)
    torch.manual_seed(args.seed)  # the same replicated weights on every rank; experts seeded by global index
    gpt = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=64, dropout=0.0)
    model = moe_gpt(gpt, num_experts=args.experts, k=args.k, ep_size=args.ep_size, every=args.every,
                    capacity_factor=args.capacity_factor, aux_loss_coef=args.aux_loss_coef)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = ByteSequenceDataset(stdlib_corpus(max_bytes=400_000), gpt.seq_len)
    loader = torch.utils.data.DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(), shuffle=True,
                                         generator=torch.Generator().manual_seed(args.seed + rank))
    data_iter = iter(deepspeed.RepeatingLoader(loader))
    if rank == 0:
        moe_blocks = [i for i in range(gpt.n_layer) if model.moe_config.is_moe_block(i)]
        print(f"{world} process(es), ep_size {args.ep_size}: {args.experts} experts (top-{args.k}) in blocks "
              f"{moe_blocks} of {gpt.n_layer}, {sum(p.numel() for p in model.parameters()):,} parameters on rank 0",
              flush=True)
    losses = []
    for step in range(args.steps):
        loss = engine(next(data_iter))
        engine.backward(loss)
        engine.step()
        stats = torch.stack([loss.detach(), model.last_lm_loss, model.last_l_aux])
        dist.all_reduce(stats)
        stats /= world
        losses.append(stats[0].item())
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            counts = model.last_exp_counts[0]
            print(f"step {step:4d}  loss {stats[0]:.4f}  lm {stats[1]:.4f}  l_aux {stats[2]:.4f}  "
                  f"busiest expert {counts.max().item() / counts.sum().item():.0%} of tokens", flush=True)
    return losses


if __name__ == "__main__":
    main()
