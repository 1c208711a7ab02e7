"""Tests for the demo model (microspeed.demo.model) and its data (microspeed.demo.data)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader

from microspeed.demo.data import (
    ByteSequenceDataset,
    random_token_dataset,
    stdlib_corpus,
    train_val_split,
)
from microspeed.demo.model import GPT, Block, CausalSelfAttention, GPTConfig


def _model(seed: int = 0, config: GPTConfig | None = None) -> GPT:
    torch.manual_seed(seed)
    return GPT(config or GPTConfig.tiny())


def _batch(b: int = 4, cfg: GPTConfig | None = None, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = cfg or GPTConfig.tiny()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_config_presets_and_validation() -> None:
    tiny, demo = GPTConfig.tiny(), GPTConfig.demo()
    assert (tiny.n_layer, tiny.d_model, tiny.seq_len) == (2, 32, 32)
    assert demo.vocab_size == 256 and demo.seq_len == 128
    assert GPTConfig() == GPTConfig(256, 128, 4, 4, 128, 0.0, True)
    with pytest.raises(ValueError):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(AttributeError):
        tiny.n_layer = 3  # type: ignore[misc]


def test_structure() -> None:
    model = _model()
    cfg = model.config
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == cfg.n_layer
    assert all(isinstance(b, Block) for b in model.blocks)
    attn = model.blocks[0].attn
    assert isinstance(attn, CausalSelfAttention)
    assert (attn.n_head, attn.d_model) == (cfg.n_head, cfg.d_model)

    class Replacement(CausalSelfAttention):
        pass

    torch.manual_seed(0)
    swapped = GPT(cfg, attention=Replacement)
    assert all(type(b.attn) is Replacement for b in swapped.blocks)
    torch.testing.assert_close(swapped(_batch(2)), model(_batch(2)))  # same init, same maths


def test_shapes_and_batch_tuple() -> None:
    model = _model().eval()
    x, y = _batch(3)
    logits = model(x)
    assert logits.shape == (3, 32, 256) and logits.dtype == torch.float32
    assert model(x[:, :5]).shape == (3, 5, 256)
    loss = model(x, y)
    assert loss.dim() == 0
    assert torch.equal(model((x, y)), loss)  # a DataLoader batch as one argument
    assert torch.equal(model([x, y]), loss)
    with pytest.raises(ValueError):
        model(torch.zeros(1, 33, dtype=torch.long))  # longer than seq_len
    with pytest.raises(TypeError):
        model((x, y), y)


def test_causal() -> None:
    model = _model().eval()
    x, _ = _batch(2)
    x2 = x.clone()
    x2[:, 20:] = (x2[:, 20:] + 1) % 256
    torch.testing.assert_close(model(x)[:, :20], model(x2)[:, :20])
    assert not torch.allclose(model(x)[:, 20:], model(x2)[:, 20:])


def test_initial_loss_near_uniform() -> None:
    for cfg in (GPTConfig.tiny(), GPTConfig.demo()):
        loss = _model(0, cfg)(*_batch(4, cfg)).item()
        assert abs(loss - math.log(256)) < 0.3, loss


def test_deterministic_init() -> None:
    a, b, c = _model(0).state_dict(), _model(0).state_dict(), _model(1).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])


def test_init_statistics() -> None:
    model = _model(0, GPTConfig(n_layer=8, d_model=128))
    std = model.blocks[0].mlp.fc.weight.std().item()
    resid = model.blocks[0].mlp.proj.weight.std().item()
    assert abs(std - 0.02) < 0.002
    assert abs(resid - 0.02 / math.sqrt(16)) < 0.0005
    assert torch.count_nonzero(model.blocks[0].attn.qkv.bias) == 0


def test_tied_weights() -> None:
    model = _model()
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # shared parameter listed once
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    untied = _model(0, GPTConfig(**{**GPTConfig.tiny().__dict__, "tie_weights": False}))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.num_parameters() == model.num_parameters() + 256 * 32


def test_overfits_one_batch_fp32() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = _batch(4)
    losses = []
    for _ in range(30):
        loss = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forward_backward(dtype: torch.dtype) -> None:
    model = _model().to(dtype)
    logits = model(_batch(2)[0])
    assert logits.dtype == dtype
    loss = model(_batch(2))
    assert loss.dtype == torch.float32 and abs(loss.item() - math.log(256)) < 0.3
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == dtype, name
        assert torch.isfinite(p.grad).all(), name


def test_generate() -> None:
    model = _model().eval()
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, 40, temperature=0)  # longer than seq_len: context is cropped
    assert out.shape == (1, 43) and torch.equal(out[:, :3], prompt)
    assert torch.equal(out, model.generate(prompt, 40, temperature=0))


def test_dataset_shift_and_length() -> None:
    data = torch.arange(100)
    ds = ByteSequenceDataset(data, seq_len=8)
    assert len(ds) == 12  # (100 - 1) // 8
    for i in (0, 5, len(ds) - 1):
        x, y = ds[i]
        assert x.shape == y.shape == (8,) and x.dtype == torch.int64
        assert torch.equal(x, data[i * 8 : i * 8 + 8])
        assert torch.equal(y, x + 1)
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])
    with pytest.raises(IndexError):
        ds[len(ds)]
    x, y = next(iter(DataLoader(ds, batch_size=4)))
    assert x.shape == (4, 8) and torch.equal(y[:, :-1], x[:, 1:])


def test_train_val_split() -> None:
    data = torch.arange(1000)
    train, val = train_val_split(data, 0.1)
    assert train.numel() == 900 and val.numel() == 100
    assert torch.equal(torch.cat([train, val]), data)
    with pytest.raises(ValueError):
        train_val_split(data, 1.0)


def test_random_token_dataset() -> None:
    ds = random_token_dataset(10, 16, vocab=50, seed=3)
    assert len(ds) == 10
    x, y = ds[9]
    assert x.shape == (16,) and int(x.max()) < 50
    assert torch.equal(ds.data, random_token_dataset(10, 16, vocab=50, seed=3).data)
    assert not torch.equal(ds.data, random_token_dataset(10, 16, vocab=50, seed=4).data)


def test_stdlib_corpus_deterministic() -> None:
    a = stdlib_corpus(max_bytes=300_000)
    b = stdlib_corpus(max_bytes=300_000)
    assert a.dtype == torch.int64 and a.dim() == 1
    assert a.numel() == 300_000
    assert torch.equal(a, b)
    assert 0 <= int(a.min()) and int(a.max()) <= 255
    text = bytes(a[:100_000].to(torch.uint8).tolist())
    assert b"def " in text and b"import " in text
    c = stdlib_corpus(max_bytes=1000, seed=None)
    assert c.numel() == 1000 and torch.equal(c, stdlib_corpus(max_bytes=1000, seed=None))


def test_fused_kernels_are_used_when_a_gpu_is_present(monkeypatch):
    """With a GPU the demo model builds FusedLayerNorm and fused bias+GELU; same parameters, same results."""
    from microspeed.demo import model as demo
    from microspeed.ops.fused_layernorm import FusedLayerNorm

    torch.manual_seed(0)
    plain = demo.GPT(demo.GPTConfig.tiny())
    monkeypatch.setattr(demo, "fused_kernels_wanted", lambda: True)
    monkeypatch.setenv("MICROSPEED_OPS_BACKEND", "torch")  # this machine has no GPU: the kernels' PyTorch path
    torch.manual_seed(0)
    fused = demo.GPT(demo.GPTConfig.tiny())
    assert isinstance(fused.ln_f, FusedLayerNorm) and all(b.mlp.fused for b in fused.blocks)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    x = torch.randint(0, 256, (2, 17))
    torch.testing.assert_close(fused(x[:, :-1], x[:, 1:]), plain(x[:, :-1], x[:, 1:]), rtol=1e-6, atol=1e-6)
