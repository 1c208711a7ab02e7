"""A segment larger than ``reduce_bucket_size`` is reduced in column chunks on gloo (``all_to_all_single``).

The token embedding (2048 values), the MLP weights (4096) and, at stage 3, whole modules exceed a bucket of
1000 values, so each goes out as chunks of ``world x 320`` values (333 rounded down to a multiple of 64), one
chunk per gradient hook. On 3 ranks (slices padded) at stages 2 and 3, fp32 and bf16, and with the gradients
streamed to NVMe files (the slice acquired at the first chunk, written at the last), training is bit-identical
to the same engine reducing every segment whole, and the reducer's pool keeps no buffer larger than the bucket
and no more buffers than two reductions in flight use.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from microspeed.testing import run_distributed

BUCKET = 1000
CASES = {
    "stage2": (2, None, False),
    "stage2_bf16": (2, "bf16", False),
    "stage3": (3, None, False),
    "stage2_nvme": (2, None, True),
}


def _train(stage: int, precision: str | None, nvme: str | None, whole: bool) -> dict:
    import torch.distributed as dist
    from microspeed_zero import reduce
    from microspeed_zero.chunking import MAX_IN_FLIGHT

    import microspeed
    from microspeed.models import GPT, GPTConfig
    from microspeed.zero import GatheredParameters

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
    zero = {"stage": stage, "reduce_bucket_size": BUCKET, "stage3_param_persistence_threshold": 0}
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "zero_optimization": zero, "steps_per_print": 10_000}
    if precision:
        cfg[precision] = {"enabled": True}
    original = reduce.GradientReducer._column_width
    if whole:
        reduce.GradientReducer._column_width = lambda self, seg: 0
    try:
        engine, *_ = microspeed.initialize(model=model, config=cfg)
        rt = engine.plugin_state("zero")
        chunked = sum(1 for seg in rt.segments if original(rt.reducer, seg))
        gen = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(6):
            x = torch.randint(0, 64, (2 * world, 17), generator=gen)[2 * rank:2 * rank + 2]
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()))
        pool = [b.numel() for free in rt.reducer.pool.free.values() for b in free]
        params = list(engine.module.parameters())
        with GatheredParameters(params):
            weights = [p.detach().float().clone() for p in params]
    finally:
        reduce.GradientReducer._column_width = original
    return {"losses": losses, "weights": weights, "pool": pool, "chunked": chunked,
            "in_flight": MAX_IN_FLIGHT}


def _body(root: str) -> dict:
    out = {}
    for name, (stage, precision, nvme) in CASES.items():
        runs = []
        for whole in (False, True):
            path = None
            if nvme:
                path = os.path.join(root, f"{name}_{int(whole)}")  # every rank names its own files in it
                os.makedirs(path, exist_ok=True)
            runs.append(_train(stage, precision, path, whole))
        out[name] = runs
    return out


@pytest.fixture(scope="module")
def three_ranks():
    with tempfile.TemporaryDirectory() as root:
        return run_distributed(_body, world_size=3, args=(root,), timeout=500)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_column_chunks_train_bit_identically_to_whole_segments(three_ranks, case):
    """Losses and final weights equal the whole-segment reduction's exactly (the same sums, in the same order)."""
    for rank, result in enumerate(three_ranks):
        chunks, whole = result[case]
        assert chunks["chunked"] > 0, f"rank {rank}: no segment exceeded the bucket; the test checks nothing"
        assert chunks["losses"] == whole["losses"], (rank, chunks["losses"], whole["losses"])
        for a, b in zip(chunks["weights"], whole["weights"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: weights differ by {(a - b).abs().max().item()}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_pool_keeps_buffers_within_the_bucket(three_ranks, case):
    """Chunked, no pooled buffer exceeds ``reduce_bucket_size`` values and at most two per reduction in flight are
    kept; reducing whole segments keeps embedding-sized ones."""
    chunks, whole = three_ranks[0][case]
    assert chunks["pool"] and max(chunks["pool"]) <= BUCKET, chunks["pool"]
    assert len(chunks["pool"]) <= 2 * chunks["in_flight"], chunks["pool"]
    assert max(whole["pool"]) > BUCKET, whole["pool"]
