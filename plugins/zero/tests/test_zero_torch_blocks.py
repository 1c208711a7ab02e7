"""ZeRO 1/2/3 on a GPT of torch's own ``nn.TransformerEncoderLayer`` blocks (``nn.MultiheadAttention`` reads
``out_proj.weight`` itself): on 2 ranks, fp32 losses equal single-process training on the whole batch (rel 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from microspeed.testing import run_distributed

STEPS, MICRO, SEQ, VOCAB = 4, 2, 16, 64


def _batches(world: int) -> list[torch.Tensor]:
    """One fixed global batch, trained on ``STEPS`` times (so the loss must fall)."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (MICRO * world, SEQ + 1), generator=gen)] * STEPS


def _model() -> torch.nn.Module:
    from microspeed.models.torch_blocks import TorchBlocksGPT

    torch.manual_seed(0)
    return TorchBlocksGPT(vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4, seq_len=SEQ)


def _single_process(world: int) -> list[float]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for b in _batches(world):
        opt.zero_grad()
        loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _body() -> dict[int, list[float]]:
    import torch.distributed as dist

    import microspeed

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for stage in (1, 2, 3):
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10_000,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine, *_ = microspeed.initialize(model=_model(), config=cfg)
        losses = []
        for b in _batches(world):
            mine = b[MICRO * rank:MICRO * (rank + 1)]
            loss = engine(mine[:, :-1], mine[:, 1:])
            engine.backward(loss)
            engine.step()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        out[stage] = losses
        engine.destroy() if hasattr(engine, "destroy") else None
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero_stages_on_torch_blocks_gpt_match_single_process():
    ref = _single_process(2)
    results = run_distributed(_body, world_size=2, timeout=240)
    for stage, losses in results[0].items():
        assert losses == pytest.approx(ref, rel=1e-5), (stage, ref, losses)
    assert results[0] == results[1]
    assert ref[-1] < ref[0]  # it trains
