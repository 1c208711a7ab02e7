"""MoE with bf16 and fp32 gradient accumulation (``data_types.grad_accum_dtype`` fp32) on the built-in reducer.

Four ranks, ``ep_size`` 2 (so every expert has two expert-data-parallel copies), two micro-batches per step:
the per-step losses equal one process with ``ep_size`` 1 and the same bf16 / fp32-accumulation config that
runs all eight micro-batches of a step (bf16 tolerance: relative 2e-2 — both runs compute in bf16, the
sums run in another order), and each expert's copies hold bitwise-equal weights and fp32 masters (their
fp32 accumulated gradients were summed over the copies and divided by the data-parallel size once).
The same run under ZeRO stages 1, 2 and 3 (which keep their own fp32 accumulation and reduce experts over
their replica groups) gives the same losses; at stages 1 and 2 the expert copies' bf16 weights are equal too.
"""

from __future__ import annotations

import pytest
import torch
from moe_models import Net, batch, config

from microspeed.testing import run_distributed

WORLD, EP, GAS, STEPS = 4, 2, 2, 3
BF16_ACCUM = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."
CASES = {"no_zero": {}, **{f"zero{s}": {"zero_optimization": {"stage": s}} for s in (1, 2, 3)}}


def _bf16(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``step`` in bf16 (the model's dtype)."""
    return tuple(t.to(torch.bfloat16) for t in batch(step, rank))


def _step_losses(engine, micro_batches) -> list[float]:
    """Train STEPS steps of ``micro_batches(step)``; each step's mean micro-batch loss on this rank."""
    out = []
    for step in range(STEPS):
        losses = []
        for b in micro_batches(step):
            loss = engine(b)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        out.append(torch.stack(losses).mean())
    return out


def _train() -> dict:
    """Per case, on each rank: ep_size 2 with GAS 2; step losses (averaged over ranks), expert weights, masters."""
    import torch.distributed as dist

    import microspeed

    rank = dist.get_rank()
    out = {}
    for case, extra in CASES.items():
        engine, *_ = microspeed.initialize(model=Net(ep_size=EP, k=2, drop_tokens=False), config=config(
            {**BF16_ACCUM, "gradient_accumulation_steps": GAS, **extra}))
        losses = _step_losses(engine, lambda step: [_bf16(step * GAS + m, rank) for m in range(GAS)])
        mean = torch.stack(losses)
        dist.all_reduce(mean)
        names = {id(p): n for n, p in engine.module.named_parameters()}
        masters = {names[id(p)]: m.detach().clone() for p, m in engine.plugin_state("mixed_precision").pairs
                   if names[id(p)].startswith(PREFIX)}
        experts = {} if case == "zero3" else {  # stage 3 holds partitions
            n: p.detach().clone() for n, p in engine.module.named_parameters() if n.startswith(PREFIX)}
        out[case] = {"losses": (mean / WORLD).tolist(), "experts": experts, "masters": masters}
    return out


def _reference() -> list[float]:
    """One process, ep_size 1, the same config: every rank's micro-batches of a step accumulated (GAS 8)."""
    import microspeed

    engine, *_ = microspeed.initialize(model=Net(ep_size=1, k=2, drop_tokens=False), config=config(
        {**BF16_ACCUM, "gradient_accumulation_steps": GAS * WORLD}))
    losses = _step_losses(engine, lambda step: [_bf16(step * GAS + m, r) for r in range(WORLD) for m in range(GAS)])
    return [x.item() for x in losses]


@pytest.mark.slow
def test_moe_bf16_fp32_accumulation_equals_one_process_and_keeps_expert_copies_equal():
    """dp4 x ep2, bf16 + fp32 accumulation, GAS 2: losses as one process (rel 2e-2); expert copies identical."""
    runs = run_distributed(_train, world_size=WORLD, timeout=300)
    reference = torch.tensor(run_distributed(_reference, world_size=1, timeout=120)[0])
    initial = Net(ep_size=1, k=2, drop_tokens=False).state_dict()
    for case in CASES:
        results = [run[case] for run in runs]
        torch.testing.assert_close(torch.tensor(results[0]["losses"]), reference, rtol=2e-2, atol=0,
                                   msg=lambda m, c=case: f"{c}: {m}")
        assert len({tuple(r["losses"]) for r in results}) == 1, case
        if case == "zero3":
            continue
        copies: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        for r in results:
            for name, weight in r["experts"].items():
                copies.setdefault(name, []).append((weight, r["masters"].get(name)))
        assert {n[len(PREFIX):].split(".")[0] for n in copies} == {"0", "1", "2", "3"}, case
        for name, held in copies.items():
            assert len(held) == WORLD // EP, (case, name)
            for weight, master in held[1:]:
                assert torch.equal(weight, held[0][0]), (case, name)
                if case == "no_zero":
                    assert torch.equal(master, held[0][1]), name
            assert not torch.equal(held[0][0], initial[name].to(torch.bfloat16)), f"{case}: {name} did not train"
