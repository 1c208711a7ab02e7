"""save_checkpoint / load_checkpoint in one process: layout, full restore, identical continuation, errors,
strict and non-strict names, ``microspeed checkpoint consolidate``, ``get_fp32_state_dict``, ``save_16bit_model``.

(Folds in the first checkpoint tests, ``test_checkpoint_basic.py``; multi-rank checks are in
``test_checkpoint_distributed.py``.)
"""

from __future__ import annotations

import os

import msgpack
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import microspeed
from microspeed import checkpoint
from microspeed.checkpoint import MANIFEST, CheckpointError, CheckpointWarning
from microspeed.cli.checkpoint import main as checkpoint_cli


def _config(fp16=False, bf16=False):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "gradient_clipping": 1.0,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                         "warmup_num_steps": 10, "warmup_type": "linear"}}}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(model_cls, seed, fp16=False, bf16=False, model=None):
    torch.manual_seed(seed)
    return microspeed.initialize(model=model or model_cls(), config=_config(fp16, bf16))[0]


def _batch(step, micro, dtype):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(2, 8, generator=g).to(dtype), torch.randn(2, 1, generator=g).to(dtype)


def _train(engine, first_step, steps):
    """``steps`` optimizer steps of 2 micro-steps each; the loss of every micro-step."""
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for step in range(first_step, first_step + steps):
        for micro in range(2):
            loss = engine(*_batch(step, micro, dtype))
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
    _train(original, 0, 4)
    if fp16:  # the dynamic scale grew (window 2) and is part of what must be restored
        assert _scaler(original).loss_scale > 256
    assert original.save_checkpoint(str(tmp_path), client_state={"epoch": 3, "note": "hi"}) is True

    assert (tmp_path / "latest").read_text() == "global_step4"
    tag = tmp_path / "global_step4"
    assert {MANIFEST, ".metadata", "__0_0.distcp"} <= set(os.listdir(tag))
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]

    resumed = _engine(model_cls, seed=123, fp16=fp16)  # different initial weights
    assert not torch.equal(resumed.module.fc1.weight, original.module.fc1.weight)
    path, client_state = resumed.load_checkpoint(str(tmp_path))
    assert path is not None and "global_step4" in path
    assert client_state == {"epoch": 3, "note": "hi"}
    assert resumed.global_steps == 4 and resumed.global_samples == 16 and resumed.micro_steps == 8
    _assert_same_state(original, resumed, fp16)

    expected = _train(original, 4, 3)
    got = _train(resumed, 4, 3)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b), (expected, got)
    _assert_same_state(original, resumed, fp16)


def test_manifest_and_tensor_keys(tmp_path, tiny_model):
    """Small values in msgpack; tensors in DCP keyed by parameter name (optimizer state too, fp32 masters)."""
    engine = _engine(type(tiny_model), seed=0, fp16=True)
    _train(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path), tag="t", client_state={"pair": (1, 2), "x": torch.arange(3)})
    manifest = checkpoint.read_manifest(str(tmp_path / "t"))
    assert manifest["world_size"] == 1 and manifest["counters"]["global_steps"] == 1
    assert manifest["torch_version"] == torch.__version__ and manifest["config"]["fp16"]["enabled"] is True
    assert ["mixed_precision", microspeed.__version__] in manifest["plugins"]
    assert manifest["plugin_states"]["mixed_precision"]["scaler"]["cur_scale"] == 256.0
    assert manifest["optimizer"]["param_groups"][0]["params"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert manifest["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert len(manifest["rng"]) == 1 and isinstance(manifest["rng"][0]["torch"], bytes)
    keys = set(checkpoint.read_tensor_index(str(tmp_path / "t")).state_dict_metadata)
    assert {"model/fc1.weight", "master/fc1.weight", "optim/fc1.weight/exp_avg", "optim/fc2.bias/exp_avg_sq",
            "client/x"} <= keys
    assert not any(k.startswith("optim/0") for k in keys)
    step = manifest["optimizer"]["state"]["fc2.bias"]["step"]  # a 0-d tensor is a small value
    assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and float(step) == 1.0
    _, client = _engine(type(tiny_model), seed=1, fp16=True).load_checkpoint(str(tmp_path), tag="t")
    assert client["pair"] == (1, 2) and torch.equal(client["x"], torch.arange(3))


def test_tag_and_save_latest(tmp_path, tiny_model):
    engine = _engine(type(tiny_model), seed=0)
    _train(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path), tag="first")
    _train(engine, 1, 1)
    engine.save_checkpoint(str(tmp_path), tag="second", save_latest=False)
    assert (tmp_path / "latest").read_text() == "first"
    assert (tmp_path / "second" / MANIFEST).is_file()

    fresh = _engine(type(tiny_model), seed=1)
    fresh.load_checkpoint(str(tmp_path), tag="second")
    assert fresh.global_steps == 2
    fresh.load_checkpoint(str(tmp_path))  # latest: "first"
    assert fresh.global_steps == 1
    engine.save_checkpoint(str(tmp_path), tag="first")  # overwriting a tag replaces it whole
    fresh.load_checkpoint(str(tmp_path))
    assert fresh.global_steps == 2
    with pytest.raises(CheckpointError, match="plain folder name"):
        engine.save_checkpoint(str(tmp_path), tag="../elsewhere")


def test_load_from_an_empty_dir_returns_none_with_a_warning(tmp_path, tiny_model):
    engine = _engine(type(tiny_model), seed=0)
    before = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.warns(CheckpointWarning, match="latest"):
        assert engine.load_checkpoint(str(tmp_path)) == (None, {})
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    assert engine.global_steps == 0


def test_missing_tag_is_a_clear_error(tmp_path, tiny_model):
    engine = _engine(type(tiny_model), seed=0)
    expected_file = os.path.join(str(tmp_path), "global_step7", MANIFEST)
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


class _Wider(torch.nn.Module):
    """TinyNet's layers plus one more (``extra``), minus nothing."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 1)
        self.extra = torch.nn.Linear(2, 2)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y) + 0 * self.extra.weight.sum()


def test_strict_and_non_strict_names(tmp_path, tiny_model):
    engine = _engine(type(tiny_model), seed=0)
    _train(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path))
    wider = _engine(None, seed=1, model=_Wider())
    with pytest.raises(CheckpointError) as info:
        wider.load_checkpoint(str(tmp_path))
    assert "extra.weight" in str(info.value) and "extra.bias" in str(info.value)
    assert "Missing in the checkpoint (2)" in str(info.value)
    extra_before = wider.module.extra.weight.detach().clone()
    with pytest.warns(CheckpointWarning, match=r"extra\.weight") as record:
        wider.load_checkpoint(str(tmp_path), load_module_strict=False)
    assert any("optimizer parameters differ" in str(w.message) for w in record)
    assert torch.equal(wider.module.fc1.weight, engine.module.fc1.weight)
    assert torch.equal(wider.module.extra.weight, extra_before)
    state = wider.optimizer.state_dict()["state"]
    assert torch.equal(state[0]["exp_avg"], engine.optimizer.state_dict()["state"][0]["exp_avg"])
    assert 4 not in state  # extra.weight: no saved state, left fresh
    _train(wider, 1, 1)  # and it trains on

    # the other way round: the checkpoint has names the module lacks
    wider.save_checkpoint(str(tmp_path), tag="wide")
    narrow = _engine(type(tiny_model), seed=2)
    with pytest.raises(CheckpointError, match=r"Unexpected, only in the checkpoint \(2\).*extra\.bias"):
        narrow.load_checkpoint(str(tmp_path), tag="wide")
    with pytest.warns(CheckpointWarning, match="extra.weight"):
        narrow.load_checkpoint(str(tmp_path), tag="wide", load_module_strict=False)
    assert torch.equal(narrow.module.fc2.weight, wider.module.fc2.weight)


def test_shape_mismatch_names_the_parameter(tmp_path, tiny_model):
    engine = _engine(type(tiny_model), seed=0)
    engine.save_checkpoint(str(tmp_path))
    other = type(tiny_model)()
    other.fc1 = torch.nn.Linear(8, 16, bias=False)
    other.fc1.bias = torch.nn.Parameter(torch.zeros(3))
    wrong = _engine(None, seed=0, model=other)
    with pytest.raises(CheckpointError, match=r"fc1\.bias: checkpoint \[16\] vs \[3\]"):
        wrong.load_checkpoint(str(tmp_path), load_optimizer_states=False)


def test_truncated_and_foreign_files_are_clear_errors(tmp_path, tiny_model):
    engine = _engine(type(tiny_model), seed=0)
    _train(engine, 0, 1)
    tag = tmp_path / "global_step1"

    engine.save_checkpoint(str(tmp_path))
    data = tag / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated") as info:
        engine.load_checkpoint(str(tmp_path))
    assert info.value.path == str(data) and str(data) in str(info.value)

    engine.save_checkpoint(str(tmp_path))
    size = data.stat().st_size
    data.write_bytes(os.urandom(size))  # right length, foreign bytes
    with pytest.raises(CheckpointError, match="reading checkpoint tensors failed") as info:
        engine.load_checkpoint(str(tmp_path))
    assert str(data) in str(info.value)

    engine.save_checkpoint(str(tmp_path))
    manifest = tag / MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="not a readable microspeed manifest") as info:
        engine.load_checkpoint(str(tmp_path))
    assert str(manifest) in str(info.value)
    manifest.write_bytes(msgpack.packb({"hello": "world"}))
    with pytest.raises(CheckpointError, match="not a microspeed manifest"):
        engine.load_checkpoint(str(tmp_path))

    engine.save_checkpoint(str(tmp_path))
    (tag / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata is not a readable"):
        engine.load_checkpoint(str(tmp_path))
    (tag / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata is missing"):
        checkpoint.get_fp32_state_dict(str(tmp_path))


def test_load_module_only_and_without_optimizer_states(tmp_path, tiny_model):
    engine = _engine(type(tiny_model), seed=0, bf16=True)
    _train(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path))
    fresh = _engine(type(tiny_model), seed=1, bf16=True)
    fresh.load_checkpoint(str(tmp_path), load_module_only=True)
    assert fresh.global_steps == 0 and fresh.optimizer.state_dict()["state"] == {}
    assert _masters(fresh)[0].dtype == torch.float32
    for m, n in zip(_masters(fresh), _masters(engine), strict=True):  # masters follow the loaded weights
        assert torch.equal(m, n)
    fresh = _engine(type(tiny_model), seed=1, bf16=True)
    fresh.load_checkpoint(str(tmp_path), load_optimizer_states=False, load_lr_scheduler_states=False)
    assert fresh.global_steps == 2 and fresh.optimizer.state_dict()["state"] == {}
    assert fresh.lr_scheduler.state_dict() != engine.lr_scheduler.state_dict()


def test_fp32_checkpoint_into_fp16_engine(tmp_path, tiny_model):
    """Precision changes at load: the fp16 engine's masters get the exact fp32 weights."""
    engine = _engine(type(tiny_model), seed=0)
    _train(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path))
    half = _engine(type(tiny_model), seed=1, fp16=True)
    half.load_checkpoint(str(tmp_path))
    for (name, p), m in zip(engine.module.named_parameters(), _masters(half), strict=True):
        assert torch.equal(m, p) and torch.equal(dict(half.module.named_parameters())[name], p.half())
    state = half.optimizer.state_dict()["state"][0]
    assert torch.equal(state["exp_avg"], engine.optimizer.state_dict()["state"][0]["exp_avg"])


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("counter", torch.zeros(2))

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.emb(x)), y)


def test_consolidate_cli_get_fp32_state_dict_and_save_16bit_model(tmp_path):
    """fp32 weights from masters (bf16 run), tied weights stored once, no process group needed."""
    engine = _engine(None, seed=0, bf16=True, model=_Tied())
    x = torch.randint(0, 10, (2,))
    for _ in range(2):
        for _ in range(2):
            engine.backward(engine(x, x))
            engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    index = checkpoint.read_tensor_index(str(tmp_path / "ckpt" / "global_step2")).state_dict_metadata
    assert "model/emb.weight" in index and "model/head.weight" not in index  # the tie is stored once

    assert engine.save_16bit_model(str(tmp_path / "out")) is True
    sixteen = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    order = list(engine.module.state_dict())
    assert list(sixteen) == order and set(order) == {"emb.weight", "head.weight", "counter"}
    assert sixteen["emb.weight"].dtype == torch.bfloat16
    assert torch.equal(sixteen["emb.weight"], engine.module.emb.weight)

    masters = dict(zip(["emb.weight"], _masters(engine), strict=True))
    if dist.is_initialized():  # consolidation never needs a process group
        dist.destroy_process_group()
    sd = checkpoint.get_fp32_state_dict(str(tmp_path / "ckpt"))
    assert list(sd) == order
    assert sd["emb.weight"].dtype == torch.float32 and torch.equal(sd["emb.weight"], masters["emb.weight"])
    assert sd["head.weight"] is sd["emb.weight"]
    out = tmp_path / "full.pt"
    assert checkpoint_cli(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 0
    assert not dist.is_initialized()
    full = torch.load(out, weights_only=True)
    assert full.keys() == sd.keys() and all(torch.equal(full[k], sd[k]) for k in sd)
    assert checkpoint_cli(["consolidate", str(tmp_path / "nothing"), str(out)]) == 1
    assert checkpoint_cli(["info", str(tmp_path / "ckpt")]) == 0


def test_exclude_frozen_parameters_leaves_them_out_and_loads_non_strict(tmp_path, tiny_model):
    """DeepSpeed's ``save_checkpoint(exclude_frozen_parameters=True)`` (Lightning always passes the keyword)."""
    tiny_net = type(tiny_model)
    tiny_model.fc1.weight.requires_grad_(False)
    engine = _engine(tiny_net, 0, model=tiny_model)
    engine.save_checkpoint(str(tmp_path), tag="t", exclude_frozen_parameters=True)
    with open(tmp_path / "t" / MANIFEST, "rb") as f:
        keys = msgpack.unpackb(f.read(), strict_map_key=False)["model"]["keys"]
    assert "fc1.weight" not in keys and "fc1.bias" in keys
    other = _engine(tiny_net, 1)
    frozen_before = other.module.fc1.weight.detach().clone()
    with pytest.raises(CheckpointError, match="load_module_strict=False"):
        other.load_checkpoint(str(tmp_path), tag="t")
    with pytest.warns(CheckpointWarning):
        other.load_checkpoint(str(tmp_path), tag="t", load_module_strict=False, load_optimizer_states=False)
    assert torch.equal(other.module.fc1.weight, frozen_before)
    assert torch.equal(other.module.fc1.bias, engine.module.fc1.bias)
