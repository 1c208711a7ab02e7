"""The tied-embedding tensor-parallel GPT (:mod:`microspeed_pipeline.gpt3d`) under pp × tp × dp, with checkpoints
that resume under other topologies and ZeRO stages, with the losses of one uninterrupted process.

Every run trains the same global batch per step (``GLOBAL`` micro-batches of ``MICRO`` sequences, split
over the data axis: ``gradient_accumulation_steps = GLOBAL / dp``), so per-step losses of any topology
equal the single-process run: relative 1e-5 in fp32, ``BF16_RTOL`` (2e-2) in bf16.
"""

from __future__ import annotations

import pytest
import torch

from microspeed.testing import run_distributed

MICRO, GLOBAL, LR, STEPS, SAVE_AT = 2, 4, 1e-2, 4, 2
FP32_RTOL = 1e-5
BF16_RTOL = 2e-2
"""Stated bf16 tolerance: per-step losses of a bf16 run vs the fp32 single-process run (relative)."""


def model_config():
    """The tiny GPT: vocabulary 64, width 32, 4 heads, 2 blocks, sequences of 8."""
    from microspeed.models import GPTConfig

    return GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, d_model=32)


def reference_losses(steps: int = STEPS, clip: float = 0.0) -> list[float]:
    """tp1/pp1/dp1 in this process (plain torch loop, fp32): the model ``gpt3d_pipeline`` gives one process."""
    from microspeed_pipeline.gpt3d import gpt3d_batches, gpt3d_loss, gpt3d_pipeline

    cfg = model_config()
    model = gpt3d_pipeline(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    out = []
    for step in range(steps):
        loss = torch.stack([gpt3d_loss(model(x), y) for x, y in gpt3d_batches(cfg, step, GLOBAL, MICRO)]).mean()
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        out.append(loss.item())
    return out


def _engine(pp: int, tp: int, zero: int, bf16: bool, clip: float) -> tuple:
    """An engine over the gpt3d model on pp × tp × (world / pp / tp); returns ``(engine, dp)``."""
    import torch.distributed as dist
    from microspeed_pipeline import PipeModelDataParallelTopology
    from microspeed_pipeline.gpt3d import gpt3d_pipeline

    import microspeed

    world = dist.get_world_size() if dist.is_initialized() else 1
    dp = world // (pp * tp)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GLOBAL // dp,
              "steps_per_print": 10**6, "optimizer": {"type": "Adam", "params": {"lr": LR}},
              "gradient_clipping": clip, "zero_optimization": {"stage": zero}}
    if bf16:
        config["bf16"] = {"enabled": True}
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    engine, *_ = microspeed.initialize(model=gpt3d_pipeline(model_config(), topology=topo), config=config)
    return engine, dp


def _steps(engine: object, dp: int, steps: int, save: str | None = None, save_at: int = SAVE_AT) -> list[float]:
    from microspeed_pipeline.gpt3d import gpt3d_batches

    d, gas = engine.topology.data_parallel_rank, GLOBAL // dp
    losses = []
    for step in range(engine.global_steps, steps):
        mine = gpt3d_batches(model_config(), step, GLOBAL, MICRO)[d * gas:(d + 1) * gas]
        losses.append(engine.train_batch(iter(mine)).item())
        if save is not None and step + 1 == save_at:
            engine.save_checkpoint(save)
    return losses


def train(pp: int, tp: int, zero: int = 0, bf16: bool = False, clip: float = 0.0, load: str | None = None,
          save: str | None = None, steps: int = STEPS, save_at: int = SAVE_AT) -> list[float]:
    """One rank of a pp × tp × dp run: resume from ``load`` if given, train to ``steps``, save at ``save_at``.

    Returns the losses of the steps it ran.
    """
    engine, dp = _engine(pp, tp, zero, bf16, clip)
    if load is not None:
        engine.load_checkpoint(load)
    return _steps(engine, dp, steps, save, save_at)


def save_then_resume(first: tuple[int, int, int], second: tuple[int, int, int], path: str, bf16: bool,
                     clip: float) -> tuple[list[float], list[float]]:
    """Train ``first`` = (pp, tp, ZeRO stage) to ``SAVE_AT`` and save; a second engine on ``second`` loads it
    and trains on, on the same ranks. Returns both engines' losses."""
    engine, dp = _engine(*first, bf16, clip)
    before = _steps(engine, dp, SAVE_AT, path)
    engine, dp = _engine(*second, bf16, clip)
    engine.load_checkpoint(path)
    return before, _steps(engine, dp, STEPS)


def consolidated_loss(ck: str, step: int) -> float:
    """Load the checkpoint's fp32 weights (read whole, no process group) into the plain one-process model;
    its loss on ``step``'s global batch."""
    from microspeed_pipeline.gpt3d import gpt3d_batches, gpt3d_loss, gpt3d_pipeline

    from microspeed.checkpoint import get_fp32_state_dict

    model = gpt3d_pipeline(model_config())
    state = get_fp32_state_dict(ck)
    assert list(state) == list(model.state_dict())  # full tensors, the tied weight once, the plain model's keys
    model.load_state_dict(state)
    with torch.no_grad():
        return torch.stack([gpt3d_loss(model(x), y)
                            for x, y in gpt3d_batches(model_config(), step, GLOBAL, MICRO)]).mean().item()


def _close(results: list[list[float]], expected: list[float], rtol: float, what: str) -> None:
    for rank, losses in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=rtol, atol=0,
                                   msg=lambda m, r=rank: f"{what}, rank {r}: {m}")


def test_gpt3d_builds_the_same_weights_for_every_topology_and_is_the_plain_model():
    from microspeed_pipeline.gpt3d import gpt3d_batches, gpt3d_pipeline

    cfg = model_config()
    a, b = gpt3d_pipeline(cfg), gpt3d_pipeline(cfg)
    assert [n for n, _ in a.named_parameters()][0] == "tied_modules.embed.weight"
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.get_parameter("2.q.weight"), a.get_parameter("3.q.weight"))  # layers differ
    x, _ = gpt3d_batches(cfg, 0, 1, MICRO)[0]
    logits = a(x)
    assert logits.shape == (MICRO, cfg.seq_len, cfg.vocab_size)
    # the head is the embedding's weight: logits of the final normalised stream against it
    emb = a.tied_modules["embed"].weight
    assert torch.equal(a.tied_modules["embed"](x[:, :1])[:, 0], emb[x[:, 0]])


@pytest.mark.slow
def test_pp2_tp2_checkpoint_resumes_under_tp2_dp2_and_pp2(tmp_path):
    """fp32, no ZeRO, clipping: pp2 × tp2 × dp1 saves; pp1 × tp2 × dp2 and pp2 × tp1 × dp1 resume."""
    expected = reference_losses(clip=1.0)
    ck = str(tmp_path / "pp2tp2")
    saved = run_distributed(train, world_size=4, args=(2, 2), kwargs={"clip": 1.0, "save": ck, "steps": SAVE_AT},
                            timeout=240)
    _close(saved, expected[:SAVE_AT], FP32_RTOL, "pp2 x tp2 x dp1")
    for world, pp, tp in ((4, 1, 2), (2, 2, 1)):
        resumed = run_distributed(train, world_size=world, args=(pp, tp), kwargs={"clip": 1.0, "load": ck},
                                  timeout=240)
        _close(resumed, expected[SAVE_AT:], FP32_RTOL, f"resumed pp{pp} x tp{tp} x dp{world // (pp * tp)}")


@pytest.mark.slow
def test_zero_checkpoints_of_pipelines_with_tied_weights_resume_under_other_stages_and_tensor_parallel(tmp_path):
    """ZeRO-1 pp2 × dp2 (tied weights on both stages) saves; ZeRO-3 pp1 × dp2 resumes and saves; pp2 × tp2 resumes.

    fp32: the tied weight's optimizer state is written once (the later stage's copy is a duplicate),
    ZeRO's flat pieces reload into other flat partitions and into tensor-parallel boxes.
    """
    expected = reference_losses()
    a, b = str(tmp_path / "zero1_pp2"), str(tmp_path / "zero3_dp2")
    saved = run_distributed(train, world_size=4, args=(2, 1), kwargs={"zero": 1, "save": a, "steps": SAVE_AT},
                            timeout=240)
    _close(saved, expected[:SAVE_AT], FP32_RTOL, "ZeRO-1 pp2 x dp2")
    zero3 = run_distributed(train, world_size=2, args=(1, 1), kwargs={"zero": 3, "load": a, "save": b,
                                                                       "save_at": SAVE_AT + 1}, timeout=240)
    _close(zero3, expected[SAVE_AT:], FP32_RTOL, "ZeRO-3 pp1 x dp2 resumed")
    tp = run_distributed(train, world_size=4, args=(2, 2), kwargs={"load": b}, timeout=240)
    _close(tp, expected[SAVE_AT + 1:], FP32_RTOL, "pp2 x tp2 resumed from ZeRO-3")


@pytest.mark.slow  # 4 ranks twice (8 s): the full suite runs it
def test_zero3_bf16_tp2_dp2_saves_and_pp2_tp2_resumes_with_the_single_process_losses(tmp_path):
    """4 ranks, ZeRO-3 + bf16 + clipping: pp1 × tp2 × dp2 saves ZeRO pieces of tensor-parallel shards;
    a pp2 × tp2 × dp1 engine on the same ranks loads them and trains on (losses within ``BF16_RTOL``)."""
    expected = reference_losses(clip=1.0)
    results = run_distributed(save_then_resume, world_size=4,
                              args=((1, 2, 3), (2, 2, 3), str(tmp_path / "ck"), True, 1.0), timeout=240)
    _close([r[0] for r in results], expected[:SAVE_AT], BF16_RTOL, "ZeRO-3 bf16 pp1 x tp2 x dp2")
    _close([r[1] for r in results], expected[SAVE_AT:], BF16_RTOL, "ZeRO-3 bf16 pp2 x tp2 x dp1 resumed")
    plain = consolidated_loss(str(tmp_path / "ck"), SAVE_AT)
    torch.testing.assert_close(plain, results[0][1][0], rtol=BF16_RTOL / 4, atol=0)


@pytest.mark.slow
def test_3d_pp2_tp2_dp2_zero3_bf16_trains_saves_and_resumes_under_pp1_tp2_dp2_and_pp2_tp1_dp1(tmp_path):
    """Issue 17's 3D case: tied-embedding GPT, pp2 × tp2 × dp2, ZeRO-3, bf16, clipping; resumes elsewhere."""
    expected = reference_losses(clip=1.0)
    ck = str(tmp_path / "3d")
    full = run_distributed(train, world_size=8, args=(2, 2), kwargs={"zero": 3, "bf16": True, "clip": 1.0,
                                                                     "save": ck}, timeout=400)
    _close(full, expected, BF16_RTOL, "pp2 x tp2 x dp2 ZeRO-3 bf16")
    torch.testing.assert_close(consolidated_loss(ck, SAVE_AT), full[0][SAVE_AT], rtol=BF16_RTOL / 4, atol=0)
    for world, pp, tp in ((4, 1, 2), (2, 2, 1)):
        resumed = run_distributed(train, world_size=world, args=(pp, tp),
                                  kwargs={"zero": 3, "bf16": True, "clip": 1.0, "load": ck}, timeout=300)
        _close(resumed, expected[SAVE_AT:], BF16_RTOL, f"resumed pp{pp} x tp{tp} x dp{world // (pp * tp)}")
        _close(resumed, full[0][SAVE_AT:], BF16_RTOL / 4, "resumed vs the uninterrupted 3D run")


@pytest.mark.slow
@pytest.mark.parametrize(("first", "second"), [((1, 2, 1), (2, 2, 2)), ((2, 1, 2), (1, 2, 3)), ((2, 2, 3), (2, 1, 1))],
                         ids=["zero1-tp2xdp2->zero2-pp2xtp2", "zero2-pp2xdp2->zero3-tp2xdp2",
                              "zero3-pp2xtp2->zero1-pp2xdp2"])
def test_zero_stage_and_topology_change_on_resume_fp32(tmp_path, first, second):
    """fp32, 4 ranks, clipping: (pp, tp, ZeRO stage) saves, another (pp, tp, stage) loads; losses equal 1e-5."""
    expected = reference_losses(clip=1.0)
    results = run_distributed(save_then_resume, world_size=4, args=(first, second, str(tmp_path / "ck"), False, 1.0),
                              timeout=240)
    _close([r[0] for r in results], expected[:SAVE_AT], FP32_RTOL, f"saved {first}")
    _close([r[1] for r in results], expected[SAVE_AT:], FP32_RTOL, f"resumed {second}")
