"""ZeRO-3 trains models that read parameters outside the module that owns them, exactly like stage 0.

``nn.MultiheadAttention`` (its forward reads ``out_proj.weight``), the Transformer layers, an LM
head tied to the embedding and used through ``F.linear``, a custom layer reading
``self.sub.weight``: fp32 losses equal the un-partitioned run (rel 1e-5) on 1 and 2 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from microspeed.testing import run_distributed

STEPS = 3


class MHAModel(nn.Module):
    """Self-attention over embeddings, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h)


class EncoderModel(nn.Module):
    """An encoder layer and a decoder layer (dropout 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        m = self.enc(h)
        return self.head(self.dec(h, m))


class TransformerModel(nn.Module):
    """``nn.Transformer`` (1 encoder, 1 decoder layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.tf = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.tf(h, h))


class TiedModel(nn.Module):
    """LM head tied to the embedding, applied with ``F.linear`` in the parent's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.mid = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(x)))
        return F.linear(h, self.embed.weight)


class Reader(nn.Module):
    """A custom layer reading ``self.sub.weight`` without calling ``self.sub`` (and no parameters of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.sub = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(h @ self.sub.weight.t() + self.sub.bias)


class CustomModel(nn.Module):
    """Embedding, two :class:`Reader` layers, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList([Reader(), Reader()])
        self.head = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


MODELS = {"mha": MHAModel, "encdec": EncoderModel, "transformer": TransformerModel, "tied": TiedModel,
          "custom": CustomModel}


def _train(name: str, stage: int, zero: dict | None = None) -> list[float]:
    import torch.distributed as dist

    import microspeed

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = MODELS[name]()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, **(zero or {})}}
    engine, *_ = microspeed.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, 32, (2 * world, 9), generator=gen)[2 * rank:2 * rank + 2]
        logits = engine(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 32), x[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    engine.eval()
    with torch.no_grad():  # an inference forward (no backward follows): fused fast paths must not see placeholders
        x = torch.randint(0, 32, (2, 9), generator=gen)
        losses.append(float(engine(x[:, :-1]).float().square().mean()))
    engine.destroy() if hasattr(engine, "destroy") else None
    return losses


Z3 = {"stage3_param_persistence_threshold": 0}
Z3_PREFETCH = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1000,
               "stage3_max_reuse_distance": 0}


def _body() -> dict:
    out = {}
    for name in MODELS:
        out[name] = (_train(name, 0), _train(name, 3, Z3), _train(name, 3, Z3_PREFETCH))
    return out


def _check(results: dict) -> None:
    for name, (ref, z3, z3p) in results.items():
        for run in (z3, z3p):
            assert run == pytest.approx(ref, rel=1e-5), (name, ref, run)


@pytest.mark.slow
def test_zero3_any_model_one_rank():
    _check(run_distributed(_body, world_size=1)[0])


@pytest.mark.slow
def test_zero3_any_model_two_ranks():
    results = run_distributed(_body, world_size=2)
    _check(results[0])
    assert results[0] == results[1]


# -- the API pieces, on one rank in this process -------------------------------------------------------------


def _engine(model: nn.Module, zero: dict):
    import microspeed

    microspeed.init_distributed()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": zero}
    return microspeed.initialize(model=model, config=cfg)[0]


class _TakesWeight(nn.Linear):
    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) @ other


class _External(nn.Module):
    """``b``'s forward reads ``a.weight`` (passed in, as in DeepSpeed's example); registered by hand, so nothing
    is gathered on access."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = _TakesWeight(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x, self.a.weight)


def test_ds_status_external_parameters_and_leaves():
    from microspeed.zero import (
        ZeroParamStatus,
        get_z3_leaf_modules,
        register_external_parameter,
        set_z3_leaf_modules,
        unregister_external_parameter,
        unset_z3_leaf_modules,
        z3_leaf_module,
    )

    torch.manual_seed(0)
    model = _External()
    register_external_parameter(model.b, model.a.weight)
    with pytest.raises(RuntimeError, match="not a torch.nn.Parameter"):
        register_external_parameter(model.b, torch.zeros(1))
    engine = _engine(model, {"stage": 3, "stage3_param_persistence_threshold": 0})
    p = engine.module.a.weight
    assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.ds_shape == (4, 4) and p.ds_numel == 16
    assert len({q.ds_id for q in engine.module.parameters()}) == 4
    seen = {}
    engine.module.b.register_forward_pre_hook(lambda m, a: seen.update(status=p.ds_status))
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    assert seen["status"] == ZeroParamStatus.AVAILABLE  # gathered with b, before b ran
    assert not engine.plugin_state("zero").stage3.auto_external  # nothing left to gather on access
    unregister_external_parameter(model.b, model.a.weight)
    with pytest.raises(RuntimeError, match="not a registered external"):
        unregister_external_parameter(model.b, model.a.weight)

    mha = MHAModel()
    assert set_z3_leaf_modules(mha, [nn.MultiheadAttention]) == [mha.attn] and z3_leaf_module(mha.attn)
    assert get_z3_leaf_modules(mha) == [mha.attn]
    assert set_z3_leaf_modules(mha, ["Linear"]) == [mha.head]  # exact class name: not out_proj's subclass
    unset_z3_leaf_modules(mha, ["torch.nn.modules.linear.Linear", nn.MultiheadAttention])
    assert get_z3_leaf_modules(mha) == []
    with pytest.raises(ValueError, match="No modules"):
        set_z3_leaf_modules(mha, [nn.Conv1d])


def test_leaf_module_config_and_engine_api():
    torch.manual_seed(0)
    engine = _engine(CustomModel(), {"stage": 3, "stage3_param_persistence_threshold": 0,
                                     "leaf_module": {"classes": ["Reader"], "names": ["head"]}})
    assert engine.module.layers[0]._z3_leaf and engine.module.head._z3_leaf
    x = torch.randint(0, 32, (2, 8))
    engine.backward(engine(x).square().mean())
    engine.step()
    z = engine.plugin_state("zero").stage3
    assert not z.auto_external  # the Reader leaves gathered their sub-trees: nothing found on access
    assert engine.zero_optimization() and engine.zero_optimization_stage() == 3
    assert engine.zero_optimization_partition_weights() and engine.zero_optimization_partition_gradients()
    assert engine.zero_offload_optimizer() is None and not engine.zero_cpu_offload()
    whole = engine._zero3_consolidated_16bit_state_dict()
    assert whole["head.weight"].shape == (32, 16)
    with torch.no_grad():
        ref = engine.module.head.weight  # released: an empty placeholder outside forward
    assert ref.numel() == 0

    engine = _engine(CustomModel(), {"stage": 2, "cpu_offload": True})
    assert engine.zero_optimization_stage() == 2 and engine.zero_cpu_offload()
    assert engine.zero_offload_optimizer()["device"] == "cpu" and not engine.zero_optimization_partition_weights()
    assert engine.plugin_state("zero").master_device == torch.device("cpu")
    with pytest.raises(ValueError, match="stage 3"):
        engine._zero3_consolidated_16bit_state_dict()


def test_every_deepspeed_zero_key_is_accepted_with_a_notice(caplog):
    """Every key of DeepSpeed 0.19.8's DeepSpeedZeroConfig and offload configs is known; those without effect log
    one line saying why (never "did you mean")."""
    import logging

    from microspeed_zero.config import NOTICE_KEYS, zero_section

    ds = pytest.importorskip("deepspeed.runtime.zero.config", reason="real DeepSpeed (reference) not installed")
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    section = zero_section()
    for name, f in ds.DeepSpeedZeroConfig.model_fields.items():
        assert name in section.fields or f.alias in section.fields, name
    for sub, cls in (("offload_param", DeepSpeedZeroOffloadParamConfig),
                     ("offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig)):
        for name in cls.model_fields:
            assert name in section.fields[sub].fields, f"{sub}.{name}"
    zero: dict = {"stage": 2, "offload_optimizer": {}, "offload_param": {}}
    for key, (default, _why) in NOTICE_KEYS.items():
        value = {True: False, False: True}.get(default, 3) if not isinstance(default, float) else 0.5
        sec, _, leaf = key.rpartition(".")
        (zero[sec] if sec else zero)[leaf] = value
    zero["offload_optimizer"]["device"] = "cpu"
    with caplog.at_level(logging.WARNING, logger="microspeed.zero"):
        engine = _engine(CustomModel(), zero)
    lines = [r.getMessage() for r in caplog.records if "has no effect here" in r.getMessage()]
    assert len(lines) == len(NOTICE_KEYS), set(NOTICE_KEYS) - {ln.split("=")[0][18:] for ln in lines}
    assert engine.zero_round_robin_gradients() is True
