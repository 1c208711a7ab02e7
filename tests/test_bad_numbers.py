"""Bad numbers never train silently: each test is the bad input it stops (issue 31).

* NaN and infinity in any numeric config key are refused at ``initialize()``, naming the key;
* a NaN or inf loss (fp32 and bf16, with and without clipping, on one rank or on every ZeRO stage with the
  NaN on one rank only) skips the optimizer step, is counted and logged with the step number, and
  ``max_consecutive_nonfinite_steps`` such steps in a row end the job naming the step;
* an empty dataset, a micro-batch larger than a rank's share, an accumulation no epoch reaches, absurd
  batch sizes and a model with nothing to train are errors at ``initialize()``.
"""

from __future__ import annotations

import math

import pytest
import torch

import microspeed
from microspeed.errors import ConfigError, NonFiniteError
from microspeed.testing import run_distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, **extra}


# ------------------------------------------------------------------------- numbers in the config


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_learning_rate_that_is_not_finite_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr: got (-?inf|nan); expected a finite number"):
        microspeed.initialize(model=_model(), config=_config(optimizer={"type": "Adam", "params": {"lr": value}}))


@pytest.mark.parametrize(("extra", "key"), [
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": math.inf}}}, r"scheduler\.params\.warmup_max_lr"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, math.nan]}}},
     r"optimizer\.params\.betas\[1\]"),
    ({"gradient_clipping": math.inf}, "gradient_clipping"),
    ({"gradient_predivide_factor": math.inf}, "gradient_predivide_factor"),
])
def test_infinity_in_any_numeric_key_is_refused_naming_it(extra, key):
    with pytest.raises(ConfigError, match=key + r": got (inf|nan); expected a finite number"):
        microspeed.initialize(model=_model(), config=_config(**extra))


def test_steps_per_print_keeps_accepting_inf():
    """Accelerate writes ``steps_per_print: inf`` (never log): the one key whose schema accepts it."""
    engine, *_ = microspeed.initialize(model=_model(), config=_config(steps_per_print=math.inf))
    assert engine.config["steps_per_print"] == math.inf


# ------------------------------------------------------------------------ non-finite losses


def _step(engine, poison: float | None = None) -> None:
    x = torch.ones(2, 4, dtype=next(engine.module.parameters()).dtype)
    loss = engine(x).float().pow(2).mean()
    if poison is not None:
        loss = loss + poison  # the loss is NaN/inf while its gradients stay finite: only the loss shows it
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize("poison", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("precision", [None, "bf16"], ids=["fp32", "bf16"])
def test_non_finite_loss_skips_the_step_counts_and_logs_it(precision, clip, poison, capfd):
    extra = {"gradient_clipping": clip, **({precision: {"enabled": True}} if precision else {})}
    engine, *_ = microspeed.initialize(model=_model(), config=_config(**extra))
    _step(engine)
    before = [p.detach().clone() for p in engine.module.parameters()]
    _step(engine, poison)
    assert not engine.was_step_applied()
    assert engine.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())
    err = capfd.readouterr().err
    assert "optimizer step skipped" in err and "step=2" in err, err
    _step(engine)  # a finite step after it trains again
    assert engine.was_step_applied() and engine.skipped_steps == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


def test_nan_gradients_skip_the_step_too():
    engine, *_ = microspeed.initialize(model=_model(), config=_config())
    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = engine(torch.ones(2, 4)).pow(2).mean() * math.nan  # loss and every gradient NaN
    engine.backward(loss)
    engine.step()
    assert (engine.was_step_applied(), engine.skipped_steps) == (False, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))


def test_non_finite_steps_in_a_row_end_the_job_naming_the_step():
    engine, *_ = microspeed.initialize(model=_model(), config=_config(max_consecutive_nonfinite_steps=3))
    _step(engine)
    _step(engine, math.nan)
    _step(engine, math.nan)
    _step(engine)  # a good step resets the count
    _step(engine, math.nan)
    _step(engine, math.nan)
    with pytest.raises(NonFiniteError, match=r"step 7: .*3 optimizer step\(s\) in a row \(steps 5-7\).*"
                                             r"max_consecutive_nonfinite_steps=3"):
        _step(engine, math.inf)
    assert engine.skipped_steps == 5
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


# ------------------------------------------------------------------------ data and batch sizes


def _data(n: int) -> list:
    return [(torch.ones(4), torch.ones(1)) for _ in range(n)]


def test_empty_dataset_is_refused():
    with pytest.raises(ConfigError, match=r"training_data.*dataset is empty"):
        microspeed.initialize(model=_model(), config=_config(), training_data=[])


@pytest.mark.parametrize("drop_last", [False, True])
def test_micro_batch_larger_than_the_dataset_is_refused(drop_last):
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu=8 is larger than the dataset.*5 samples"):
        microspeed.initialize(model=_model(), training_data=_data(5),
                              config=_config(train_micro_batch_size_per_gpu=8, dataloader_drop_last=drop_last))


def test_accumulation_no_epoch_reaches_is_refused():
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=4 is more than the 3 micro-batches"):
        microspeed.initialize(model=_model(), training_data=_data(6),
                              config=_config(gradient_accumulation_steps=4))


@pytest.mark.parametrize("extra", [{"train_batch_size": 10**12, "train_micro_batch_size_per_gpu": None},
                                   {"gradient_accumulation_steps": 10**12}], ids=["train_batch", "accumulation"])
def test_absurd_batch_values_are_refused_with_training_data(extra):
    config = {k: v for k, v in _config(**extra).items() if v is not None}
    with pytest.raises(ConfigError, match=r"(train_micro_batch_size_per_gpu|gradient_accumulation_steps)="
                                          r"1000000000000 is"):
        microspeed.initialize(model=_model(), training_data=_data(64), config=config)


def test_batch_past_the_64_bit_sample_counter_is_refused():
    with pytest.raises(ConfigError, match=r"train_batch_size=\d+ .*64-bit sample counter"):
        microspeed.initialize(model=_model(), config=_config(gradient_accumulation_steps=2**62))


def test_model_with_nothing_to_train_is_refused_when_an_optimizer_is_asked_for():
    model = _model().requires_grad_(False)
    with pytest.raises(ConfigError, match=r"model Sequential has no trainable parameters.*optimizer"):
        microspeed.initialize(model=model, config=_config())
    engine, optimizer, *_ = microspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2})
    assert optimizer is None  # evaluation only (DeepSpeed allows it too): forward works
    assert engine(torch.ones(2, 4)).shape == (2, 1)


# ------------------------------------------------------------------------ ZeRO on two ranks


def _zero_nan_on_one_rank() -> list:
    """Stages 1-3 (fp32 and bf16, with and without clipping) and 1-bit Adam past its warm-up (gradients stay
    local): a NaN loss on one rank alone skips the step on both ranks; two in a row end the job on both."""
    import torch.distributed as dist

    from microspeed.zero import GatheredParameters

    def weights(engine):
        params = list(engine.module.parameters())
        with GatheredParameters(params):
            return [p.detach().float().clone() for p in params]

    out = []
    onebit = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 1}}}
    for stage, precision, clip in [(1, None, 0.0), (2, "bf16", 1.0), (3, None, 1.0), (3, "bf16", 0.0), (0, "1-bit", 0)]:
        extra = {"zero_optimization": {"stage": stage}, "gradient_clipping": clip,
                 "max_consecutive_nonfinite_steps": 2, **({precision: {"enabled": True}} if precision else {})}
        if precision == "1-bit":  # no ZeRO; after the first step the gradients stay local (compressed momentum)
            extra = {"max_consecutive_nonfinite_steps": 2, **onebit}
        engine, *_ = microspeed.initialize(model=_model(), config=_config(**extra))
        _step(engine)
        before = weights(engine)
        _step(engine, math.nan if dist.get_rank() == 1 else None)
        after = weights(engine)
        skipped = (engine.was_step_applied(), engine.skipped_steps,
                   all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                   all(torch.isfinite(w).all() for w in after))
        _step(engine)
        trained = engine.was_step_applied() and any(not torch.equal(a, b) for a, b in
                                                    zip(after, weights(engine), strict=True))
        _step(engine, math.inf if dist.get_rank() == 0 else None)
        try:
            _step(engine, math.nan if dist.get_rank() == 0 else None)
            ended = None
        except NonFiniteError as exc:
            ended = str(exc).split(":")[0]
        out.append((stage, precision, skipped, trained, ended))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero_stages_skip_a_nan_on_one_rank_on_every_rank():
    results = run_distributed(_zero_nan_on_one_rank, world_size=2, timeout=280)
    expected = [(stage, precision, (False, 1, True, True), True, "step 5")
                for stage, precision in [(1, None), (2, "bf16"), (3, None), (3, "bf16"), (0, "1-bit")]]
    assert results == [expected, expected]


def _pipeline_nan_in_one_micro_batch() -> tuple:
    """Two pipeline stages, ``train_batch()``: one micro-batch's NaN target makes the last stage's loss NaN."""
    from microspeed_pipeline.module import LayerSpec, PipelineModule

    def batches(nan: bool) -> list:
        data = [(torch.ones(2, 4), torch.ones(2, 1)) for _ in range(2)]
        return [data[0], (data[1][0], data[1][1] * math.nan)] if nan else data

    torch.manual_seed(0)
    specs = [LayerSpec(torch.nn.Linear, 4, 8), LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, 8, 1)]
    module = PipelineModule(specs, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    engine, *_ = microspeed.initialize(model=module, config=_config(gradient_accumulation_steps=2))
    engine.train_batch(iter(batches(False)))
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.train_batch(iter(batches(True)))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    out = (engine.was_step_applied(), engine.skipped_steps, unchanged)
    engine.train_batch(iter(batches(False)))
    return out + (engine.was_step_applied(),)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_pipeline_train_batch_skips_a_nan_loss_on_every_stage():
    assert run_distributed(_pipeline_nan_in_one_micro_batch, world_size=2, timeout=150) == [(False, 1, True, True)] * 2
