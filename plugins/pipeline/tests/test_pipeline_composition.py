"""The pipeline with ZeRO-1, fp16/bf16, activation checkpointing and eval; what cannot combine is refused.

ZeRO-2/3, tensor parallelism and tied weights with ZeRO: test_pipeline_zero.py."""

from __future__ import annotations

import pytest
import torch
from pipeline_models import build_reference, micro_batches, mlp_specs, pipeline
from test_pipeline_parity import GAS, MICRO, _config, reference_losses

import microspeed
from microspeed.testing import run_distributed


def _cast(batches, dtype):
    return [(x.to(dtype), y.to(dtype)) for x, y in batches] if dtype is not None else batches


def _train(stages: int, extra: dict, steps: int, pipeline_kwargs: dict | None = None, dtype=None) -> dict:
    import microspeed

    model = pipeline(mlp_specs(), num_stages=stages, partition_method="uniform", **(pipeline_kwargs or {}))
    engine, *_ = microspeed.initialize(model=model, config=_config(extra))
    dp, d = engine.topology.data_parallel_size, engine.topology.data_parallel_rank
    losses = []
    for step in range(steps):
        mine = micro_batches(step, dp * GAS, MICRO)[d * GAS:(d + 1) * GAS]
        losses.append(engine.train_batch(iter(_cast(mine, dtype))).item())
    evaluated = engine.eval_batch(iter(_cast(micro_batches(99, dp * GAS, MICRO)[d * GAS:(d + 1) * GAS], dtype)))
    return {"losses": losses, "eval": evaluated.item(), "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps}


def _reference_engine(extra: dict, steps: int, dtype=None) -> dict:
    """The same layers as one module through the plain engine (default batch loop), one process."""
    import microspeed

    model = build_reference(mlp_specs())
    model.loss_fn = torch.nn.functional.mse_loss  # a function, not a submodule (Sequential would run it)
    engine, *_ = microspeed.initialize(model=model, config=_config(extra))
    losses = [engine.train_batch(iter(_cast(micro_batches(step, GAS, MICRO), dtype))).item() for step in range(steps)]
    return {"losses": losses, "eval": engine.eval_batch(iter(_cast(micro_batches(99, GAS, MICRO), dtype))).item()}


@pytest.mark.slow
def test_zero_stage1_across_the_data_axis_of_a_pipeline():
    results = run_distributed(_train, world_size=4, args=(2, {"zero_optimization": {"stage": 1}}, 4), timeout=180)
    expected = reference_losses(2)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        assert r["global_steps"] == 4 and r["micro_steps"] == 4 * GAS


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_pipeline_matches_the_plain_engine(precision):
    # as in DeepSpeed, inputs are cast by fp16.auto_cast, or come in the model's dtype
    extra = {"fp16": {"enabled": True, "auto_cast": True}} if precision == "fp16" else {"bf16": {"enabled": True}}
    dtype = torch.bfloat16 if precision == "bf16" else None
    results = run_distributed(_train, world_size=2, args=(2, extra, 4, None, dtype), timeout=180)
    expected = run_distributed(_reference_engine, world_size=1, args=(extra, 4, dtype), timeout=120)[0]
    tol = 2e-3 if precision == "fp16" else 2e-2
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected["losses"]), rtol=tol, atol=0)
        torch.testing.assert_close(r["eval"], expected["eval"], rtol=tol, atol=0)


@pytest.mark.slow
def test_activation_checkpointing_in_the_pipeline_changes_nothing_but_memory():
    plain = run_distributed(_train, world_size=2, args=(2, {}, 3), timeout=120)
    ckpt = run_distributed(_train, world_size=2, args=(2, {}, 3, {"activation_checkpoint_interval": 2}), timeout=120)
    for a, b in zip(plain, ckpt, strict=True):
        assert a["losses"] == b["losses"] and a["eval"] == b["eval"]


@pytest.mark.slow
def test_eval_batch_equals_the_single_process_loss():
    results = run_distributed(_train, world_size=2, args=(2, {}, 0), timeout=120)
    model = build_reference(mlp_specs())
    expected = torch.stack([torch.nn.functional.mse_loss(model(x), y) for x, y in micro_batches(99, GAS, MICRO)])
    for r in results:  # both stages report the last stage's loss
        torch.testing.assert_close(r["eval"], expected.mean().item(), rtol=1e-6, atol=0)


def _refusals() -> dict:
    import microspeed

    out = {}
    model = pipeline(mlp_specs(), num_stages=2)
    for key, extra in {"schedule": {"pipeline": {"schedule": "bogus"}}}.items():
        try:
            microspeed.initialize(model=model, config=_config(extra))
            out[key] = "accepted"
        except microspeed.ConfigError as exc:
            out[key] = str(exc)
    engine, *_ = microspeed.initialize(model=model, config=_config())
    try:
        engine(torch.randn(2, 8))
        out["forward"] = "accepted"
    except RuntimeError as exc:
        out["forward"] = str(exc)
    batches = micro_batches(0, GAS, MICRO)
    batches[2] = (torch.randn(MICRO + 1, 8), torch.randn(MICRO + 1, 4))  # one micro-batch of another shape
    try:
        engine.train_batch(iter(batches))
        out["shapes"] = "accepted"
    except (ValueError, RuntimeError) as exc:
        out["shapes"] = str(exc)
    return out


def _changing_shapes() -> list[float]:
    """Shapes may change between batches: the header is negotiated again each batch."""
    import microspeed

    engine, *_ = microspeed.initialize(model=pipeline(mlp_specs(), num_stages=2), config=_config())
    return [engine.train_batch(iter(micro_batches(step, GAS, MICRO + step))).item() for step in range(3)]


@pytest.mark.slow
def test_what_cannot_combine_is_refused_clearly():
    results = run_distributed(_refusals, world_size=2, timeout=120)
    for r in results:
        assert "pipeline.schedule" in r["schedule"]
        assert "engine.train_batch(data_iter)" in r["forward"]
    assert "same shapes" in results[0]["shapes"]  # the first stage sends; it names the problem


@pytest.mark.slow
def test_shapes_may_change_between_batches():
    results = run_distributed(_changing_shapes, world_size=2, timeout=120)
    assert results[0] == results[1] and len(results[0]) == 3


def test_pipeline_section_without_a_pipeline_module_is_refused():
    cfg = _config({"pipeline": {"schedule": "1f1b"}})
    with pytest.raises(microspeed.ConfigError, match="PipelineModule"):
        microspeed.initialize(model=torch.nn.Linear(2, 2), config=cfg)


def _zero_save_or_resume(stages: int, path: str, save_after: int | None, resume: bool, steps: int) -> list[float]:
    import microspeed

    model = pipeline(mlp_specs(), num_stages=stages, partition_method="uniform")
    engine, *_ = microspeed.initialize(model=model, config=_config({"zero_optimization": {"stage": 1}}))
    dp, d = engine.topology.data_parallel_size, engine.topology.data_parallel_rank
    start = 0
    if resume:
        engine.load_checkpoint(path)
        start = engine.global_steps
    losses = []
    for step in range(start, steps):
        losses.append(engine.train_batch(iter(micro_batches(step, dp * GAS, MICRO)[d * GAS:(d + 1) * GAS])).item())
        if save_after is not None and step + 1 == save_after:
            engine.save_checkpoint(path)
    return losses


@pytest.mark.slow
def test_zero1_pipeline_checkpoint_resumes_under_another_split(tmp_path):
    expected = reference_losses(2, steps=4)
    run_distributed(_zero_save_or_resume, world_size=4, args=(2, str(tmp_path), 2, False, 2), timeout=180)
    for losses in run_distributed(_zero_save_or_resume, world_size=2, args=(1, str(tmp_path), None, True, 4),
                                  timeout=180):  # pp2 x dp2 -> pp1 x dp2
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[2:]), rtol=1e-5, atol=0)


def _onebit_pipeline() -> dict:
    import torch.distributed as dist

    import microspeed

    model = pipeline(mlp_specs(), num_stages=2, partition_method="uniform")
    cfg = _config({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 4}},
                   "gradient_clipping": 0.0})
    engine, *_ = microspeed.initialize(model=model, config=cfg)
    dp, d = engine.topology.data_parallel_size, engine.topology.data_parallel_rank
    losses = [engine.train_batch(iter(micro_batches(step % 2, dp * GAS, MICRO)[d * GAS:(d + 1) * GAS])).item()
              for step in range(8)]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(dp)]
    dist.all_gather(replicas, flat, group=engine.topology.data_parallel_group)
    return {"losses": losses, "replicas_equal": all(torch.equal(r, replicas[0]) for r in replicas),
            "compressing": engine.owner("gradient_reduction") == "comm"}


@pytest.mark.slow
def test_onebit_adam_compresses_across_the_data_axis_of_a_pipeline():
    for r in run_distributed(_onebit_pipeline, world_size=4, timeout=180):
        assert r["compressing"] and r["replicas_equal"]
        assert r["losses"][-1] < r["losses"][1]  # the two alternating batches: compare like with like
