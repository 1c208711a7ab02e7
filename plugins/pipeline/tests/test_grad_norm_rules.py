"""The pipeline's gradient norm through the kernel's one mechanism (``microspeed_grad_norm_rules``).

On 2 stages × 2 tensor-parallel ranks, a model whose embedding is tied to its output head (a copy on
each stage) and whose blocks are tensor parallel (replicated biases on both tensor ranks): the norm the
kernel computes with the pipeline's rules equals the pipeline's former hand-made sum (each gradient
counted once over the slice group) and the single-process model's norm.
"""

from __future__ import annotations

import pytest
import torch
from pipeline_models import HIDDEN, Block, build_reference, lm_head, lm_loss, pipeline, token_batches

from microspeed.testing import run_distributed

MICRO, GAS = 2, 2


def _specs(tp: bool) -> list:
    from microspeed_pipeline.module import LayerSpec, TiedLayerSpec
    from pipeline_models import VOCAB
    from torch import nn

    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN), LayerSpec(Block, HIDDEN, HIDDEN, tp=tp),
            LayerSpec(Block, HIDDEN, HIDDEN, tp=tp),
            TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN, forward_fn=lm_head)]


def _former_norm(engine, grid, module) -> torch.Tensor:
    """The pipeline plugin's former ``clip_gradients`` sum: non-duplicate squares summed over the slice group."""
    import torch.distributed as dist
    from microspeed_pipeline.tensor_parallel import is_tensor_parallel_duplicate

    duplicates = set(module.tied_duplicate_names())
    duplicates |= {n for n, p in engine.module.named_parameters()
                   if is_tensor_parallel_duplicate(p, group=grid.get_model_parallel_group())}
    counted = [p.grad for n, p in engine.module.named_parameters() if p.grad is not None and n not in duplicates]
    sq = torch.stack([g.float().norm() for g in counted]).square().sum()
    dist.all_reduce(sq, group=grid.get_slice_parallel_group())
    return sq.sqrt()


def _pp2_tp2() -> dict:
    from microspeed_pipeline import PipeModelDataParallelTopology

    import microspeed

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    module = pipeline(_specs(tp=True), topology=topo, loss_fn=lm_loss, partition_method="uniform")
    engine, *_ = microspeed.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0})
    seen: dict = {}
    step = engine.optimizer.step

    def measuring_step(*args, **kwargs):
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        seen["kernel"] = engine.grad_norm(grads).item()
        seen["former"] = _former_norm(engine, module.mpu(), module).item()
        return step(*args, **kwargs)

    engine.optimizer.step = measuring_step
    engine.train_batch(iter(token_batches(0, GAS, MICRO)))
    rules = engine.plugins.hook.microspeed_grad_norm_rules(engine=engine)
    skipped = sorted(n for answer in rules for n, r in (answer or {}).items() if r.skip)
    return {**seen, "reported": engine.get_global_grad_norm(), "skipped": skipped,
            "stage": module.mpu().get_stage_id(), "tp_rank": module.mpu().get_model_parallel_rank()}


def _reference_norm() -> float:
    model = build_reference(_specs(tp=False))
    loss = torch.stack([lm_loss(model(x), y) for x, y in token_batches(0, GAS, MICRO)]).mean()
    loss.backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


@pytest.mark.slow
def test_norm_through_rules_equals_the_former_sum_and_the_single_process_norm():
    results = run_distributed(_pp2_tp2, world_size=4, timeout=180)
    expected = _reference_norm()
    for r in results:
        assert r["kernel"] == pytest.approx(r["former"], rel=1e-6)
        assert r["reported"] == pytest.approx(r["kernel"], rel=1e-6)
        assert r["kernel"] == pytest.approx(expected, rel=1e-5)
    by_place = {(r["stage"], r["tp_rank"]): r["skipped"] for r in results}
    assert any(by_place[(1, t)] and all("weight" in n or "bias" in n for n in by_place[(1, t)]) for t in (0, 1))
    assert by_place[(0, 0)] == []  # the first stage's tensor rank 0 counts everything it holds
    assert by_place[(0, 1)] and by_place[(1, 1)]  # replicated biases and the embedding on tensor rank 1
