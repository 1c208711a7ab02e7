"""save_checkpoint / load_checkpoint: layout, full restore, identical continuation (fp32 and fp16), errors."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import TensorDataset

import microspeed
from microspeed.checkpoint import MODEL_FILE


def _config(fp16=False):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "gradient_clipping": 1.0,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                         "warmup_num_steps": 10, "warmup_type": "linear"}}}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


def _engine(model_cls, seed, fp16=False):
    torch.manual_seed(seed)
    return microspeed.initialize(model=model_cls(), config=_config(fp16))[0]


def _batch(step, micro, fp16):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x, y = torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)
    return (x.half(), y.half()) if fp16 else (x, y)


def _train(engine, first_step, steps, fp16=False):
    """``steps`` optimizer steps of 2 micro-steps each; the loss of every micro-step."""
    losses = []
    for step in range(first_step, first_step + steps):
        for micro in range(2):
            loss = engine(*_batch(step, micro, fp16))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().clone())
    return losses


def _scaler(engine):
    return engine.plugins.get_plugin("mixed_precision").scaler


def _masters(engine):
    return [p.detach().clone() for g in engine.optimizer.param_groups for p in g["params"]]


def _assert_same_state(a, b, fp16):
    for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
        assert torch.equal(p, q)
    for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
        assert getattr(a, k) == getattr(b, k), k
    assert a.get_lr() == b.get_lr()
    assert a.lr_scheduler.state_dict() == b.lr_scheduler.state_dict()
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and len(sa["state"]) == 4
    for i in sa["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)
    if fp16:
        for m, n in zip(_masters(a), _masters(b), strict=True):
            assert m.dtype == torch.float32 and torch.equal(m, n)
        assert _scaler(a).state_dict() == _scaler(b).state_dict()


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_save_load_restores_everything_and_continues_identically(tmp_path, tiny_model, fp16):
    model_cls = type(tiny_model)
    original = _engine(model_cls, seed=0, fp16=fp16)
    _train(original, 0, 4, fp16)
    if fp16:  # the dynamic scale grew (window 2) and is part of what must be restored
        assert _scaler(original).loss_scale > 256
    assert original.save_checkpoint(str(tmp_path), client_state={"epoch": 3, "note": "hi"}) is True

    assert (tmp_path / "latest").read_text() == "global_step4"
    assert (tmp_path / "global_step4" / MODEL_FILE).is_file()
    assert (tmp_path / "global_step4" / "rng_rank0.pt").is_file()

    resumed = _engine(model_cls, seed=123, fp16=fp16)  # different initial weights
    assert not torch.equal(resumed.module.fc1.weight, original.module.fc1.weight)
    path, client_state = resumed.load_checkpoint(str(tmp_path))
    assert path is not None and "global_step4" in path
    assert client_state == {"epoch": 3, "note": "hi"}
    assert resumed.global_steps == 4 and resumed.global_samples == 16 and resumed.micro_steps == 8
    _assert_same_state(original, resumed, fp16)

    expected = _train(original, 4, 3, fp16)
    got = _train(resumed, 4, 3, fp16)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b), (expected, got)
    _assert_same_state(original, resumed, fp16)


def test_tag_and_save_latest(tmp_path, tiny_model):
    engine = _engine(type(tiny_model), seed=0)
    _train(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path), tag="first")
    _train(engine, 1, 1)
    engine.save_checkpoint(str(tmp_path), tag="second", save_latest=False)
    assert (tmp_path / "latest").read_text() == "first"
    assert (tmp_path / "second" / MODEL_FILE).is_file()

    fresh = _engine(type(tiny_model), seed=1)
    fresh.load_checkpoint(str(tmp_path), tag="second")
    assert fresh.global_steps == 2
    fresh.load_checkpoint(str(tmp_path))  # latest: "first"
    assert fresh.global_steps == 1


def test_load_from_an_empty_dir_returns_none(tmp_path, tiny_model):
    engine = _engine(type(tiny_model), seed=0)
    before = [p.detach().clone() for p in engine.module.parameters()]
    assert engine.load_checkpoint(str(tmp_path)) == (None, {})
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    assert engine.global_steps == 0


def test_missing_tag_is_a_clear_error(tmp_path, tiny_model):
    engine = _engine(type(tiny_model), seed=0)
    expected_file = os.path.join(str(tmp_path), "global_step7", MODEL_FILE)
    with pytest.raises(FileNotFoundError, match="global_step7") as info:
        engine.load_checkpoint(str(tmp_path), tag="global_step7")
    assert expected_file in str(info.value)
    (tmp_path / "latest").write_text("global_step9\n")  # latest names a tag that was never written
    with pytest.raises(FileNotFoundError, match=r"global_step9.*does not exist"):
        engine.load_checkpoint(str(tmp_path))


def test_training_dataloader_position_is_restored(tmp_path, tiny_model):
    data = TensorDataset(torch.randn(24, 8), torch.randn(24, 1))

    def make(seed):
        torch.manual_seed(seed)
        return microspeed.initialize(model=type(tiny_model)(), config=_config(), training_data=data)[0]

    engine = make(0)
    it = iter(engine.training_dataloader)
    for _ in range(4):
        engine.backward(engine(*next(it)))
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    remaining = [b[0] for b in it]

    resumed = make(1)
    resumed.load_checkpoint(str(tmp_path))
    got = [b[0] for b in resumed.training_dataloader]
    assert len(got) == len(remaining) == 8
    assert all(torch.equal(a, b) for a, b in zip(got, remaining, strict=True))
