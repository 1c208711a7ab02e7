"""ZeRO-3 prefetches across passes in plain data-parallel training (dp2, fp32, gradient accumulation 2).

Without a schedule announcing passes, a forward with gradients is followed by its backward and a backward
inside the accumulation window by the next micro-step's forward: ZeRO-3 keeps what the next pass uses
first and prefetches the rest within its budgets. Counted with the partitioner's ``stats`` per step, against
the same run with prefetching and keeping off (``stage3_max_live_parameters: 1``, which gathers every
segment once per pass, as before): losses bit-identical, all-gathers per step never more (each segment
gathered once per step with the default budgets), synchronous gathers down from one per pass to none (the
optimizer step launches the next forward's first gathers behind it; with ``overlap_comm: false`` it does
not, and the first forward after the step waits for one), and at most ``stage3_max_live_parameters``
elements gathered at once. A step's counts include what its end prefetched for the next step (the first
step's, the order being recorded then, exceed the steady ones by that).
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
    runs = [("on", {}), ("off", OFF), ("tight", {"stage3_max_live_parameters": TIGHT}),
            ("serial", {"overlap_comm": False})]
    for rank, res in enumerate(run_distributed(_train, world_size=2, args=(runs,), timeout=180)):
        on, off, tight, serial = res["on"], res["off"], res["tight"], res["serial"]
        assert on["losses"] == off["losses"] == tight["losses"] == serial["losses"], rank
        ahead = TIGHT // SEGMENT  # what the end of a step prefetches for the next one under the tight budget
        for step, (now, old, lean, ser) in enumerate(zip(on["steps"], off["steps"], tight["steps"], serial["steps"],
                                                         strict=True)):
            assert old["sync"] == old["gathers"] == 2 * GAS * LAYERS, (rank, old)  # every pass gathers all
            assert now["gathers"] <= old["gathers"], (rank, now)
            if step:  # steady state (the first step records the order): each segment gathered once, no wait
                assert now["gathers"] == ser["gathers"] == LAYERS and now["sync"] == 0, (rank, now)
                assert ser["sync"] == 1, (rank, ser)  # no prefetch behind the step: the first forward waits once
            assert old["peak_live"] <= lean["peak_live"] <= TIGHT < now["peak_live"], (rank, lean, old, now)
            assert lean["gathers"] <= old["gathers"] + (0 if step else ahead), (rank, lean, old)
            assert lean["sync"] < old["sync"], (rank, lean, old)
        # after the last step the next forward's first segments are in flight, within the live budget
        assert (on["live_after"], tight["live_after"]) == (LAYERS * SEGMENT, TIGHT), rank
        assert off["live_after"] == serial["live_after"] == 0, rank
