"""ZeRO stages 1–3 train exactly like stage 0 (fp32), and track it under bf16/fp16, on 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch

from microspeed.testing import run_distributed

STEPS = 4


def _model():
    from microspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))


def _train(stage, zero=None, precision=None, gas=1, clip=0.5, steps=STEPS, probe=None):
    """Train on per-rank slices of fixed global batches; return mean losses, grad norms and final weights
    (``probe(engine)`` is called after the last step)."""
    import torch.distributed as dist

    import microspeed
    from microspeed.zero import GatheredParameters

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "gradient_clipping": clip, "steps_per_print": 10_000,
           "zero_optimization": {"stage": stage, **(zero or {})}}
    if precision:
        cfg[precision] = {"enabled": True}
    engine, *_ = microspeed.initialize(model=_model(), config=cfg)
    gen = torch.Generator().manual_seed(5)
    losses, norms = [], []
    for _ in range(steps):
        total = 0.0
        for _ in range(gas):
            x = torch.randint(0, 64, (2 * world, 17), generator=gen)[2 * rank:2 * rank + 2]
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            t = loss.detach().float().clone()
            dist.all_reduce(t)
            total += t.item() / world / gas
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    if probe is not None:
        probe(engine)
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        weights = [p.detach().float().clone() for p in params]
    return losses, norms, weights


FP32_CASES = [
    (1, {}), (1, {"reduce_bucket_size": 3000, "allgather_bucket_size": 2000}),
    (2, {}), (2, {"reduce_bucket_size": 3000, "overlap_comm": False, "contiguous_gradients": False}),
    (3, {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 5000}),
    (3, {"stage3_param_persistence_threshold": 300, "stage3_max_live_parameters": 3000,
         "stage3_max_reuse_distance": 0}),
]
GAS_CASES = [(1, {}), (2, {"reduce_bucket_size": 3000}), (3, {"stage3_param_persistence_threshold": 0})]


def _fp32_runs(cases, gas):
    return _train(0, gas=gas), [_train(stage, zero, gas=gas) for stage, zero in cases]


def _mixed_runs(precision):
    ref = _train(0, precision=precision, steps=6)
    return ref, [_train(s, {"stage3_param_persistence_threshold": 0} if s == 3 else {}, precision=precision,
                        steps=6) for s in (1, 2, 3)]


PAGED_CASES = [(3, zero, 1) for stage, zero in FP32_CASES if stage == 3] + [(3, GAS_CASES[2][1], 2)]


def _paged_runs():
    """Stage 3 with every non-persistent segment's buffer on ``ReleasablePages`` (the tiny model's segments are far
    below the 1 MiB from which a real model's get them); returns the runs and how many segments each paged."""
    from microspeed_zero import stage3

    saved, stage3.PAGED_MIN_BYTES = stage3.PAGED_MIN_BYTES, 0
    paged: list[int] = []
    try:
        runs = [_train(s, zero, gas=gas, probe=lambda e: paged.append(len(e.plugin_state("zero").stage3.pages)))
                for s, zero, gas in PAGED_CASES]
    finally:
        stage3.PAGED_MIN_BYTES = saved
    return _train(0), _train(0, gas=2), runs, paged


def _two_rank_body():
    """Everything checked on 2 ranks, in one spawn (starting ranks is the slow part)."""
    return {"fp32": _fp32_runs(FP32_CASES, 1), "gas": _fp32_runs(GAS_CASES, 2),
            "bf16": _mixed_runs("bf16"), "fp16": _mixed_runs("fp16"), "overflow": _fp16_overflow(),
            "paged": _paged_runs()}


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_two_rank_body, world_size=2, timeout=500)


def _check_same(ref, got, rel):
    ref_losses, ref_norms, ref_w = ref
    losses, norms, weights = got
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= rel * abs(b), (losses, ref_losses)
    for a, b in zip(norms, ref_norms, strict=True):
        assert abs(a - b) <= max(rel, 1e-5) * abs(b), (norms, ref_norms)
    for w, r in zip(weights, ref_w, strict=True):  # Adam magnifies last-bit norm differences where |g| ~ eps
        torch.testing.assert_close(w, r, rtol=1e-4, atol=1e-4)


def _check_cases(cases, ref, got):
    for (stage, zero), g in zip(cases, got, strict=True):
        try:
            _check_same(ref, g, 1e-5)
        except AssertionError as exc:
            raise AssertionError(f"stage {stage} {zero}: {exc}") from exc


@pytest.mark.timeout(600)
def test_fp32_stages_match_stage0_on_2_ranks(two_ranks):
    """Per-step losses (rel <= 1e-5), grad norms and final weights of every stage equal stage 0's."""
    ref, got = two_ranks[0]["fp32"]
    _check_cases(FP32_CASES, ref, got)
    assert two_ranks[1]["fp32"][1][0][0] == got[0][0]  # every rank saw the same losses


@pytest.mark.timeout(600)
def test_fp32_gradient_accumulation_matches_stage0(two_ranks):
    """GAS 2: stage 1 reduces once per window, stages 2 and 3 every micro-step into the partition."""
    _check_cases(GAS_CASES, *two_ranks[0]["gas"])


@pytest.mark.timeout(600)
def test_fp32_stage3_on_releasable_pages_matches_stage0(two_ranks):
    """Stage 3 with gathered buffers whose pages a release gives back (``MADV_FREE``, the tensors kept) and a gather
    refills, released and gathered again between forward and backward too (``max_live`` 3000, reuse 0): losses,
    norms and weights equal stage 0's."""
    ref, ref_gas, runs, paged = two_ranks[0]["paged"]
    assert all(n > 0 for n in paged), paged
    for (stage, zero, gas), got in zip(PAGED_CASES, runs, strict=True):
        try:
            _check_same(ref if gas == 1 else ref_gas, got, 1e-5)
        except AssertionError as exc:
            raise AssertionError(f"stage {stage} {zero} gas {gas}: {exc}") from exc


def _four_rank_body():
    return _fp32_runs([FP32_CASES[0], FP32_CASES[2], FP32_CASES[4]], 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fp32_stages_match_stage0_on_4_ranks():
    ref, got = run_distributed(_four_rank_body, world_size=4, timeout=280)[0]
    _check_cases([FP32_CASES[0], FP32_CASES[2], FP32_CASES[4]], ref, got)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_stages_track_stage0(two_ranks, precision):
    """bf16/fp16 with fp32 masters: every stage's losses track stage 0's within mixed-precision tolerance."""
    ref, got = two_ranks[0][precision]
    for stage, g in zip((1, 2, 3), got, strict=True):
        for a, b in zip(g[0], ref[0], strict=True):
            assert abs(a - b) <= 2e-3 * abs(b), (precision, stage, g[0], ref[0])
        for a, b in zip(g[1], ref[1], strict=True):
            assert abs(a - b) <= 2e-2 * abs(b), (precision, stage, g[1], ref[1])
        # weight matrices only: where the true gradient is ~0 (attention's key bias) Adam turns
        # 16-bit rounding noise into +-lr steps, so biases differ by design
        for w, r in zip(g[2], ref[2], strict=True):
            if w.dim() >= 2:
                assert (w - r).norm() <= 5e-2 * r.norm(), (precision, stage, (w - r).norm(), r.norm())


def _fp16_overflow():
    """An injected inf on rank 1 skips the step on every rank, lowers the scale, and training goes on."""
    import torch.distributed as dist

    import microspeed

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
           "zero_optimization": {"stage": 2}, "steps_per_print": 10_000}
    engine, *_ = microspeed.initialize(model=_model(), config=cfg)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = engine(x[:, :-1], x[:, 1:])
    if dist.get_rank() == 1:
        loss = loss * float("inf")
    engine.backward(loss)
    engine.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    out = (engine.was_step_applied(), engine.skipped_steps, engine.metrics["loss_scale"], unchanged)
    loss = engine(x[:, :-1], x[:, 1:])
    engine.backward(loss)
    engine.step()
    return out + (engine.was_step_applied(),)


@pytest.mark.timeout(600)
def test_fp16_overflow_skips_on_every_rank(two_ranks):
    assert [r["overflow"] for r in two_ranks] == [(False, 1, 128.0, True, True)] * 2
