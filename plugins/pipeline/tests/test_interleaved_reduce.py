"""Interleaved pipelines with ZeRO-2/3 reduce each gradient element once per micro-batch (pp2 x dp2, fp32).

The pipeline announces each pass's chunk (``microspeed_next_pass``) and each chunk's parameters
(``microspeed_pass_parameters``); ZeRO cuts its segments within one chunk and, when a chunk's backward
ends, reduce-scatters that chunk's segments only — not the other chunk's as zeros (2x the traffic at two
chunks). The reduced elements per step equal gradient accumulation steps x this rank's trainable
elements, as with 1F1B, and the losses equal the single-process run.
"""

from __future__ import annotations

import pytest
import torch
from test_pipeline_zero import GAS, MICRO, _config, _model, reference

from microspeed.testing import run_distributed

STEPS = 2


def _train(runs: list[tuple[str, int, int]]) -> dict:
    """Train each ``(model kind, zero stage, chunks)``: losses and elements reduced per step on this rank."""
    from pipeline_models import pipeline

    import microspeed

    out = {}
    for kind, stage, chunks in runs:
        specs, loss_fn, batches = _model(kind)
        model = pipeline(specs, loss_fn=loss_fn, partition_method="uniform", num_stages=2, num_chunks=chunks)
        engine, *_ = microspeed.initialize(model=model, config=_config(stage))
        reducer = engine.plugin_state("zero").reducer
        reduced = [0]
        launch = reducer.launch

        def counting(seg, launch=launch, reduced=reduced):
            reduced[0] += seg.numel
            launch(seg)

        reducer.launch = counting
        dp, d = engine.topology.data_parallel_size, engine.topology.data_parallel_rank
        losses, counts = [], []
        for step in range(STEPS):
            reduced[0] = 0
            mine = batches(step, dp * GAS, MICRO)[d * GAS:(d + 1) * GAS]
            losses.append(engine.train_batch(iter(mine)).item())
            counts.append(reduced[0])
        # this rank's trainable elements (stage 3: whole sizes; the parameters are placeholders between uses)
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
        out[f"{kind}-z{stage}-c{chunks}"] = {"losses": losses, "reduced": counts, "trainable": trainable}
    return out


@pytest.mark.slow
def test_interleaved_zero2_and_zero3_reduce_each_element_once_per_micro_batch_pp2_dp2():
    runs = [("mlp", 2, 1), ("mlp", 2, 2), ("tied", 2, 2), ("mlp", 3, 2)]
    results = run_distributed(_train, world_size=4, args=(runs,), timeout=240)
    expected = {kind: reference(kind, dp=2)["losses"][:STEPS] for kind in ("mlp", "tied")}
    for rank, res in enumerate(results):
        for name, got in res.items():
            # one reduction of each gradient element per micro-batch: 1F1B's count, not 2x at two chunks
            assert got["reduced"] == [GAS * got["trainable"]] * STEPS, (rank, name, got)
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected[name.split("-")[0]]),
                                       rtol=1e-5, atol=0, msg=lambda m, n=name, r=rank: f"{n} rank {r}: {m}")
