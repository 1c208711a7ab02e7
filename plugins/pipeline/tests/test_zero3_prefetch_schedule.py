"""ZeRO-3 prefetches across the pipeline schedule (pp2 x dp2, 4 ranks, fp32).

The pipeline announces each compute pass and the next one (``microspeed_next_pass``); ZeRO-3 keeps the
segments the next pass uses first (the last layers of a forward are the first of the backward that follows
in 1F1B) and prefetches the next pass's first segments, within ``stage3_max_reuse_distance`` and
``stage3_max_live_parameters``. Counted per step with the partitioner's ``stats``:

* synchronous gathers (a segment needed and neither prefetched nor kept): one per pass before (the pass's
  first segment), at most one per step now (the first forward after the optimizer step);
* all-gathers per step never more than with prefetching and keeping switched off (which gathers every
  segment once per pass, as before); with the default budgets each segment is gathered once per step;
* losses bit-identical to the run without prefetching; the peak of gathered elements within a tight
  ``stage3_max_live_parameters``.
"""

from __future__ import annotations

import pytest
import torch
from pipeline_models import micro_batches, mlp_specs, pipeline

from microspeed.testing import run_distributed

STEPS, MICRO, GAS = 3, 2, 4
TIGHT = 2200  # elements: two 32x32 Linear segments (1056 each) and a bit
OFF = {"stage3_max_live_parameters": 1, "stage3_max_reuse_distance": 0}  # no prefetch, no keeping: as before


def _train(runs: list[tuple[str, int, dict]]) -> dict:
    """Train each ``(name, chunks, zero keys)``; per-step losses (exact) and gather counters on this rank."""
    import microspeed

    out = {}
    for name, chunks, extra in runs:
        model = pipeline(mlp_specs(14), loss_fn=torch.nn.functional.mse_loss, partition_method="uniform",
                         num_stages=2, num_chunks=chunks)
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **extra}}
        engine, *_ = microspeed.initialize(model=model, config=cfg)
        part = engine.plugin_state("zero").stage3
        dp, d = engine.topology.data_parallel_size, engine.topology.data_parallel_rank
        losses, steps = [], []
        for step in range(STEPS):
            part.stats.update(gathers=0, sync=0, peak_live=0)
            mine = micro_batches(step, dp * GAS, MICRO)[d * GAS:(d + 1) * GAS]
            losses.append(engine.train_batch(iter(mine)).item())
            steps.append(dict(part.stats))
        out[name] = {"losses": losses, "steps": steps, "segments": len(part.segments),
                     "passes": 2 * GAS * chunks, "live_after": part.live_elements()}
    return out


@pytest.mark.slow
def test_zero3_prefetch_across_1f1b_and_interleaved_schedules_pp2_dp2():
    runs = [("1f1b", 1, {}), ("1f1b-off", 1, OFF), ("1f1b-tight", 1, {"stage3_max_live_parameters": TIGHT}),
            ("interleaved", 2, {}), ("interleaved-off", 2, OFF)]
    results = run_distributed(_train, world_size=4, args=(runs,), timeout=240)
    for rank, res in enumerate(results):
        on, off, tight = res["1f1b"], res["1f1b-off"], res["1f1b-tight"]
        # prefetching and keeping change when parameters are gathered, never their values
        assert on["losses"] == off["losses"] == tight["losses"], (rank, on["losses"], off["losses"], tight["losses"])
        assert res["interleaved"]["losses"] == res["interleaved-off"]["losses"], rank
        for name in ("1f1b", "interleaved"):
            got, before = res[name], res[f"{name}-off"]
            for step, (now, old) in enumerate(zip(got["steps"], before["steps"], strict=True)):
                # before: every pass gathered each of its segments, the pass's start synchronously
                assert old["sync"] == old["gathers"] >= got["passes"], (rank, name, step, old)
                assert now["gathers"] <= old["gathers"], (rank, name, step, now, old)
                if step:  # steady state: only the first forward after the optimizer step waits
                    assert now["sync"] <= 1, (rank, name, step, now)
            assert got["live_after"] == 0, (rank, name, got["live_after"])  # nothing outlives the step
        # 1F1B keeps every segment from its first use to the step: each one gathered once a step
        assert all(s["gathers"] == on["segments"] for s in on["steps"][1:]), (rank, on)
        assert max(s["peak_live"] for s in on["steps"]) > TIGHT, (rank, on)  # the default budget keeps more
        # a tight live budget: never more gathered at once, and still fewer waits and gathers than before
        for now, old in zip(tight["steps"][1:], off["steps"][1:], strict=True):
            assert now["peak_live"] <= TIGHT, (rank, now)
            assert now["sync"] < old["sync"] and now["gathers"] <= old["gathers"], (rank, now, old)
