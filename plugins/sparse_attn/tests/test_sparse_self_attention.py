"""SparseSelfAttention, BertSparseSelfAttention, SparseAttentionUtils and the ``sparse_attention`` section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from microspeed_sparse_attn import (
    BertSparseSelfAttention,
    BigBirdSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseAttentionUtils,
    SparseSelfAttention,
)
from microspeed_sparse_attn.attention_reference import expand_layout
from microspeed_sparse_attn.sparse_self_attention import BACKEND_ENV
from torch import nn

import microspeed
from microspeed.errors import ConfigError


def _qkv(b=2, h=2, t=64, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def _masked_attention(q, k, v, allowed, bias=None):
    """Plain softmax attention over ``allowed`` (bool, broadcastable to the scores) plus an additive ``bias``."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    up = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, up)


def test_cpu_backend_equals_masked_attention_with_every_mask_kind(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    cfg = FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2, attention="unidirectional")
    attn = SparseSelfAttention(cfg, key_padding_mask_mode="mul", attn_mask_mode="add", max_seq_length=128,
                               causal=True)
    q, k, v = _qkv()
    kpm = torch.ones(2, 64)
    kpm[1, 50:] = 0  # the second sequence is padded
    am = torch.randn(64, 64) * 0.1
    rpe = torch.randn(64, 64) * 0.1
    out = attn(q, k, v, rpe=rpe, key_padding_mask=kpm[:, None, None, :], attn_mask=am[None, None])
    assert attn.last_backend == "cpu"
    layout = cfg.make_layout(128)[:, :4, :4]
    allowed = expand_layout(layout, 16)[None] & torch.ones(64, 64, dtype=torch.bool).tril() & (kpm != 0)[:, None, None]
    ref = _masked_attention(q, k, v, allowed, am + rpe)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(_grads(out, [q, k, v]), _grads(ref, [q, k, v]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_per_head_rpe_on_cpu_runs_the_dense_reference_and_is_right(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    cfg = BigBirdSparsityConfig(num_heads=2, block=16, num_random_blocks=1, seed=3)
    attn = SparseSelfAttention(cfg, max_seq_length=64)
    q, k, v = _qkv()
    rpe = torch.randn(2, 64, 64) * 0.1
    out = attn(q, k, v, rpe=rpe)
    assert attn.last_backend == "reference"
    allowed = expand_layout(cfg.make_layout(64), 16)[None]
    torch.testing.assert_close(out, _masked_attention(q, k, v, allowed, rpe), rtol=1e-5, atol=1e-5)


def test_dense_config_equals_torch_sdpa():
    q, k, v = _qkv(t=48)
    out = SparseSelfAttention(DenseSparsityConfig(num_heads=2, block=16), max_seq_length=64, causal=True)(q, k, v)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-5, atol=1e-5)


def test_short_sequences_use_the_top_left_corner_of_the_layout():
    cfg = FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2)
    attn = SparseSelfAttention(cfg, max_seq_length=128)
    assert torch.equal(attn.get_layout(64), cfg.make_layout(128)[:, :4, :4])


@pytest.mark.parametrize("call, match", [
    (lambda a: a(*_qkv(h=3)), r"3 heads but the sparsity config was built for num_heads=2"),
    (lambda a: a(*_qkv(t=40)), r"40 is not a multiple of the block size 16; pad it"),
    (lambda a: a(*_qkv(t=128)), r"exceeds max_seq_length=64"),
    (lambda a: a(*_qkv()[:2], _qkv(t=32)[2]), r"must have one shape"),
    (lambda a: a(torch.randn(2, 64, 16), *_qkv()[1:]), r"query must be a \(batch, heads, seq, head_dim\)"),
])
def test_bad_inputs_name_the_problem(call, match):
    attn = SparseSelfAttention(FixedSparsityConfig(num_heads=2, block=16), max_seq_length=64)
    with pytest.raises(ValueError, match=match):
        call(attn)


def test_bad_constructor_arguments_and_backend_env(monkeypatch):
    cfg = FixedSparsityConfig(num_heads=2, block=16)
    with pytest.raises(ValueError, match=r"attn_mask_mode='div'"):
        SparseSelfAttention(cfg, attn_mask_mode="div")
    with pytest.raises(TypeError, match=r"expected a SparsityConfig"):
        SparseSelfAttention({"mode": "fixed"})
    with pytest.raises(ValueError, match=r"max_seq_length=8"):
        SparseSelfAttention(cfg, max_seq_length=8)
    monkeypatch.setenv(BACKEND_ENV, "gpu")
    with pytest.raises(ValueError, match=rf"{BACKEND_ENV}='gpu': expected one of fused, triton, cpu, reference"):
        SparseSelfAttention(cfg, max_seq_length=64)(*_qkv())


_TRITON_CHILD = textwrap.dedent("""
    import json, sys, torch
    from microspeed_sparse_attn import FixedSparsityConfig, SparseSelfAttention
    results = {}
    cfg = FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2, attention="unidirectional")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g).requires_grad_() for _ in range(3))
    kpm = torch.zeros(1, 64); kpm[0, 56:] = float("-inf")
    outs = {}
    import os
    for backend in ("cpu", "fused", "triton"):
        os.environ["MICROSPEED_SPARSE_ATTN_BACKEND"] = backend
        attn = SparseSelfAttention(cfg, max_seq_length=64, causal=True)
        out = attn(q, k, v, key_padding_mask=kpm)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert attn.last_backend == backend
        outs[backend] = [out] + list(grads)
    for backend in ("fused", "triton"):
        results[backend] = max((a - b).abs().max().item() for a, b in zip(outs[backend], outs["cpu"]))
    print(json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_triton_backends_equal_the_cpu_path_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(BACKEND_ENV, None)
    proc = subprocess.run([sys.executable, "-c", _TRITON_CHILD], capture_output=True, text=True, env=env, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(diffs) == {"fused", "triton"}
    assert all(d < 1e-4 for d in diffs.values()), diffs


# -- BERT ------------------------------------------------------------------------------------------------


class _Cfg:
    hidden_size, num_attention_heads, max_position_embeddings = 32, 2, 64


class _DenseSelfAttention(nn.Module):
    """A BERT-style self-attention (the layer SparseAttentionUtils replaces), bidirectional, additive mask."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x, attention_mask=None):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, 2, 16).transpose(1, 2) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / 4.0
        if attention_mask is not None:
            scores = scores + attention_mask
        return (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, 32)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = _DenseSelfAttention()


class _FakeBert(nn.Module):
    """Just the parts of a HuggingFace BERT that SparseAttentionUtils touches."""

    def __init__(self):
        super().__init__()
        self.config = _Cfg()
        self.bert = nn.Module()
        self.bert.embeddings = nn.Module()
        self.bert.embeddings.position_embeddings = nn.Embedding(64, 32)
        self.bert.embeddings.register_buffer("position_ids", torch.arange(64).expand(1, -1), persistent=False)
        self.bert.encoder = nn.Module()
        self.bert.encoder.layer = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x, mask):
        for layer in self.bert.encoder.layer:
            x = x + layer.attention.self(x, mask)
        return x


def test_replacing_bert_attention_with_a_dense_pattern_keeps_the_outputs():
    torch.manual_seed(0)
    model = _FakeBert()
    x = torch.randn(2, 64, 32)
    mask = torch.zeros(2, 1, 1, 64)
    mask[1, ..., 40:] = -10000.0  # BERT's extended attention mask
    before = model(x, mask)
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 64, DenseSparsityConfig(num_heads=2, block=16))
    assert all(isinstance(layer.attention.self, BertSparseSelfAttention) for layer in model.bert.encoder.layer)
    torch.testing.assert_close(model(x, mask), before, rtol=1e-5, atol=1e-5)


def test_bert_sparse_self_attention_refuses_mismatched_heads():
    with pytest.raises(ValueError, match=r"num_heads=4 but the model has num_attention_heads=2"):
        BertSparseSelfAttention(_Cfg(), FixedSparsityConfig(num_heads=4))


def test_extend_position_embedding_repeats_the_trained_positions():
    model = _FakeBert()
    old = model.bert.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(model, 150)
    new = model.bert.embeddings.position_embeddings.weight
    assert new.shape == (150, 32) and model.config.max_position_embeddings == 150
    torch.testing.assert_close(new[:64], old)
    torch.testing.assert_close(new[64:128], old)
    torch.testing.assert_close(new[128:], old[:22])
    assert model.bert.embeddings.position_ids.shape == (1, 150)
    with pytest.raises(ValueError, match=r"already has 150 positions"):
        SparseAttentionUtils.extend_position_embedding(model, 100)
    with pytest.raises(ValueError, match=r"only BERT and RoBERTa"):
        SparseAttentionUtils.extend_position_embedding(nn.Linear(2, 2), 100)


def test_pad_to_block_size_and_unpad_round_trip():
    ids = torch.randint(1, 100, (2, 50))
    emb = nn.Embedding(100, 8)
    pad_len, ids2, mask2, types2, pos2, embeds2 = SparseAttentionUtils.pad_to_block_size(
        16, ids, torch.ones(2, 50, dtype=torch.long), torch.zeros(2, 50, dtype=torch.long), torch.arange(50)[None],
        emb(ids), 0, emb)
    assert pad_len == 14 and ids2.shape == (2, 64) and (ids2[:, 50:] == 0).all() and (mask2[:, 50:] == 0).all()
    assert types2.shape == (2, 64) and pos2.shape == (1, 64) and (pos2[:, 50:] == 0).all()
    assert embeds2.shape == (2, 64, 8)
    torch.testing.assert_close(embeds2[:, 50:], emb(torch.zeros(2, 14, dtype=torch.long)))
    out = SparseAttentionUtils.unpad_sequence_output(pad_len, embeds2)
    torch.testing.assert_close(out, emb(ids))
    same = SparseAttentionUtils.pad_to_block_size(16, ids[:, :48], None, None, None, None, 0, emb)
    assert same[0] == 0 and same[1].shape == (2, 48)


# -- the config section ----------------------------------------------------------------------------------


def _gpt(dropout=0.0, seq_len=64):
    from microspeed.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=seq_len, n_layer=2, n_head=2, d_model=32, dropout=dropout))


def _train(section, steps=3, seq=64, model=None):
    config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if section is not None:
        config["sparse_attention"] = section
    engine, *_ = microspeed.initialize(model=model or _gpt(seq_len=max(64, seq)), config=config)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 256, (2, seq + 1), generator=g)
        loss = engine((x[:, :-1], x[:, 1:]))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


@pytest.mark.parametrize("seq", [64, 40])
def test_section_dense_mode_trains_exactly_like_sdpa(seq):
    _, dense = _train(None, seq=seq)
    engine, sparse = _train({"mode": "dense", "block": 16}, seq=seq)
    blocks = engine.module.blocks
    assert all(b.attn.attention_fn is not None for b in blocks)
    assert engine.plugin_state("sparse_attn").replaced == ["blocks.0.attn", "blocks.1.attn"]
    torch.testing.assert_close(torch.tensor(sparse), torch.tensor(dense), rtol=1e-5, atol=0)


def test_section_fixed_mode_changes_what_the_model_attends_to():
    engine, losses = _train({"mode": "fixed", "block": 16, "num_local_blocks": 2, "num_global_blocks": 1,
                             "attention": "unidirectional"}, steps=1)
    fn = engine.module.blocks[0].attn.attention_fn
    assert isinstance(fn.attention.sparsity_config, FixedSparsityConfig) and fn.attention.causal
    q, k, v = (t.detach() for t in _qkv(t=64))
    allowed = expand_layout(fn.attention.get_layout(64), 16)[None] & torch.ones(64, 64, dtype=torch.bool).tril()
    torch.testing.assert_close(fn(q, k, v), _masked_attention(q, k, v, allowed), rtol=1e-5, atol=1e-5)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (fn(q, k, v) - full).abs().max() > 0.1  # blocks outside the pattern are really left out


@pytest.mark.parametrize("section, model, match", [
    ({"mode": "fixed", "num_sliding_window_blocks": 3}, None, r"sparse_attention.num_sliding_window_blocks"),
    ({"mode": "triangle"}, None, r"sparse_attention.mode: got 'triangle'"),
    ({"mode": "fixed"}, nn.Linear(4, 4), r"no attention module that declares itself replaceable"),
    ({"mode": "fixed"}, "dropout", r"attention dropout 0.1"),
])
def test_section_refusals(section, model, match):
    model = _gpt(dropout=0.1) if model == "dropout" else model
    with pytest.raises(ConfigError, match=match):
        microspeed.initialize(model=model or _gpt(), config={"train_batch_size": 1, "sparse_attention": section})


def _random_layouts(world_size):
    import torch.distributed as dist

    engine, _ = _train({"mode": "bigbird", "block": 16, "num_random_blocks": 1}, steps=1)
    layout = engine.module.blocks[0].attn.attention_fn.attention.master_layout
    gathered = [torch.zeros_like(layout) for _ in range(world_size)]
    dist.all_gather(gathered, layout)
    return [g.tolist() for g in gathered]


@pytest.mark.slow
def test_random_blocks_are_the_same_on_every_rank():
    from microspeed.testing import run_distributed

    results = run_distributed(_random_layouts, world_size=2, args=(2,), timeout=120)
    assert results[0][0] == results[0][1]
