"""ZeRO-3 prefetches across passes in plain data-parallel training (dp2, fp32, gradient accumulation 2).

Without a schedule announcing passes, a forward with gradients is followed by its backward and a backward
inside the accumulation window by the next micro-step's forward: ZeRO-3 keeps what the next pass uses
first and prefetches the rest within its budgets. Counted with the partitioner's ``stats`` per step, against
the same run with prefetching and keeping off (``stage3_max_live_parameters: 1``, which gathers every
segment once per pass, as before): losses bit-identical, all-gathers per step never more (each segment
gathered once per step with the default budgets), synchronous gathers down from one per pass to one per
step (the first forward after the optimizer step), and at most ``stage3_max_live_parameters`` elements
gathered at once.
"""

from __future__ import annotations

import pytest
import torch

from microspeed.testing import run_distributed

STEPS, GAS, LAYERS, WIDTH = 3, 2, 6, 16
SEGMENT = WIDTH * WIDTH + WIDTH  # one Linear's weight and bias (dp2 pads nothing: an even count)
OFF = {"stage3_max_live_parameters": 1, "stage3_max_reuse_distance": 0}
TIGHT = 3 * SEGMENT


def _train(runs: list[tuple[str, dict]]) -> dict:
    import microspeed

    out = {}
    for name, extra in runs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **extra}}
        engine, *_ = microspeed.initialize(model=model, config=cfg)
        part = engine.plugin_state("zero").stage3
        g = torch.Generator().manual_seed(1 + engine.topology.data_parallel_rank)
        losses, steps = [], []
        for _ in range(STEPS):
            part.stats.update(gathers=0, sync=0, peak_live=0)
            for _ in range(GAS):
                loss = engine(torch.randn(2, WIDTH, generator=g)).square().mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            steps.append(dict(part.stats))
        out[name] = {"losses": losses, "steps": steps, "live_after": part.live_elements()}
    return out


@pytest.mark.slow
def test_zero3_prefetch_across_passes_dp2():
    runs = [("on", {}), ("off", OFF), ("tight", {"stage3_max_live_parameters": TIGHT})]
    for rank, res in enumerate(run_distributed(_train, world_size=2, args=(runs,), timeout=180)):
        on, off, tight = res["on"], res["off"], res["tight"]
        assert on["losses"] == off["losses"] == tight["losses"], rank
        for step, (now, old, lean) in enumerate(zip(on["steps"], off["steps"], tight["steps"], strict=True)):
            assert old["sync"] == old["gathers"] == 2 * GAS * LAYERS, (rank, old)  # every pass gathers all
            assert now["gathers"] <= old["gathers"], (rank, now)
            if step:  # steady state (the first step records the order): each segment gathered once, one wait
                assert now["gathers"] == LAYERS and now["sync"] <= 1, (rank, now)
            assert old["peak_live"] <= lean["peak_live"] <= TIGHT < now["peak_live"], (rank, lean, old, now)
            assert lean["gathers"] <= old["gathers"] and lean["sync"] < old["sync"], (rank, lean, old)
        assert on["live_after"] == off["live_after"] == tight["live_after"] == 0, rank
