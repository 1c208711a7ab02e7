"""The demo GPT with MoE layers (:mod:`microspeed_moe.gpt`): it trains, its loss is LM + coef * l_aux, and
expert parallelism (ep_size 2 on 2 ranks) gives the losses of ep_size 1 in one process (fp32, relative 1e-5)."""

from __future__ import annotations

import functools

import pytest
import torch
from microspeed_moe.gpt import MoEBlock, MoEGPT, MoEGPTConfig, moe_gpt

from microspeed.demo.data import ByteSequenceDataset, stdlib_corpus
from microspeed.models import Block, GPTConfig
from microspeed.testing import run_distributed

GPT = GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=32)
MICRO = 4
PARITY_MOE = {"num_experts": 4, "k": 2, "every": 1, "capacity_factor": 1.0, "min_capacity": 2, "use_rts": False,
              "top2_2nd_expert_sampling": False}


@functools.cache
def _dataset() -> ByteSequenceDataset:
    return ByteSequenceDataset(stdlib_corpus(max_bytes=200_000), GPT.seq_len)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch at ``step``: ``MICRO`` sequences of the stdlib corpus, spread over it."""
    data = _dataset()
    rows = [data[(7919 * (step * 8 + rank * MICRO + j)) % len(data)] for j in range(MICRO)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def _config(lr: float) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": lr}}}


def test_structure_loss_and_logging() -> None:
    torch.manual_seed(0)
    model = moe_gpt(GPTConfig(seq_len=32, n_layer=4, n_head=2, d_model=32), num_experts=4, k=2, every=2,
                    aux_loss_coef=0.5)
    assert [type(b) for b in model.blocks] == [Block, MoEBlock, Block, MoEBlock]
    x, y = _batch(0, 0)
    loss = model((x, y))
    assert loss.dim() == 0 and len(model.last_exp_counts) == 2
    assert all(int(c.sum()) == 2 * x.numel() for c in model.last_exp_counts)  # k=2 choices per token, counted
    torch.testing.assert_close(loss.detach(), model.last_lm_loss + 0.5 * model.last_l_aux)
    assert model.last_l_aux > 0
    loss.backward()
    gate = model.blocks[1].mlp.deepspeed_moe.gate.wg.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0  # the router learns through weights and l_aux
    assert model(x).shape == (*x.shape, GPT.vocab_size)  # no targets: logits
    experts = model.blocks[1].mlp.deepspeed_moe.experts.deepspeed_experts
    assert not torch.equal(experts["0"].fc.weight, experts["1"].fc.weight)  # each expert initialised on its own


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="every=3 leaves no MoE block"):
        moe_gpt(GPT, every=3)
    with pytest.raises(ValueError, match="aux_loss_coef"):
        MoEGPTConfig(aux_loss_coef=-1.0)
    with pytest.raises(ValueError, match="k=5 exceeds num_experts=4"):
        MoEGPTConfig(num_experts=4, k=5)
    with pytest.raises(ValueError, match="ep_size=3 must divide num_experts=4"):
        MoEGPTConfig(num_experts=4, ep_size=3)
    with pytest.raises(TypeError, match="unknown MoE option"):
        moe_gpt(GPT, capacity=2)
    with pytest.raises(TypeError, match="expected a MoEGPTConfig"):
        MoEGPT(GPT, moe={"num_experts": 4})


def test_trains_with_initialize_and_loss_falls() -> None:
    import microspeed

    torch.manual_seed(0)
    model = moe_gpt(GPT, num_experts=4, k=1, every=1)
    engine, *_ = microspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(3e-3))
    losses = []
    for step in range(30):
        loss = engine(_batch(step, 0))
        engine.backward(loss)
        engine.step()
        losses.append(model.last_lm_loss.item())
    assert losses[0] > 5.0  # about log(256) at the start
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


def _train(ep_size: int, steps: int) -> list[float]:
    import torch.distributed as dist

    import microspeed

    torch.manual_seed(0)
    model = moe_gpt(GPT, ep_size=ep_size, **PARITY_MOE)
    engine, *_ = microspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(1e-2))
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        loss = engine(_batch(step, rank))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _reference(world: int, steps: int) -> list[float]:
    """ep_size 1 in one process: every rank's micro-batch through the same experts, losses averaged."""
    torch.manual_seed(0)
    model = moe_gpt(GPT, ep_size=1, **PARITY_MOE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        loss = torch.stack([model(_batch(step, r)) for r in range(world)]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.slow
def test_expert_parallel_equals_one_process() -> None:
    steps = 4
    results = run_distributed(_train, world_size=2, args=(2, steps), timeout=180)
    expected = _reference(2, steps)
    assert expected[-1] < expected[0]
    for rank, losses in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")
