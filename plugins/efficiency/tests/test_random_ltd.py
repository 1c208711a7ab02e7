"""Tests of random-LTD: gather/scatter (Triton kernels vs PyTorch references), the layer hooks, the schedule and
the plugin in an engine.

Why a child process for the kernels: ``@triton.jit`` picks the interpreter (the only way to run the kernels on
CPU tensors) when it decorates them, i.e. when ``microspeed_efficiency.random_ltd_kernels`` is first imported,
and only if ``TRITON_INTERPRET=1`` is in the environment by then. This pytest process may already have imported
Triton kernels without it, so the kernel cases run in ``python test_random_ltd.py IN OUT`` started with
``TRITON_INTERPRET=1`` and ``MICROSPEED_RANDOM_LTD_KERNELS=triton`` (see ``_run_triton_cases``, at the bottom),
and the tests here compare its results with the same cases run through the PyTorch references.

The plugin is loaded explicitly with entry-point autoload off; ``data_efficiency`` (owned by another plugin of
the distribution, which leaves ``data_routing`` open) is claimed here by a stand-in with that shape.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from microspeed_efficiency import random_ltd
from microspeed_efficiency.random_ltd import (
    KERNELS_ENV,
    RandomLTDConfig,
    RandomLTDSchedule,
    RandomLTDScheduler,
    convert_to_random_ltd,
    find_layer_list,
    gather_attention_mask,
    gather_tokens,
    gather_tokens_torch,
    kernel_backend,
    sample_token_indices,
    scatter_tokens,
)
from microspeed_efficiency.random_ltd_plugin import RandomLTDPlugin
from torch import nn

from microspeed.config import Field, Section
from microspeed.demo.model import GPT, GPTConfig
from microspeed.errors import ConfigError
from microspeed.hookspecs import hookimpl
from microspeed.testing import tiny_engine, train_steps

PACKAGE_ROOT = str(Path(random_ltd.__file__).resolve().parents[1])  # the folder holding microspeed_efficiency/
SEQ = 16


class DataEfficiencyStandIn:
    """Claims ``data_efficiency`` with ``data_routing`` open, as the data-efficiency plugin does."""

    @hookimpl
    def microspeed_config_sections(self) -> dict[str, Section]:
        return {"data_efficiency": Section({
            "enabled": Field((bool,), False, "master switch"),
            "seed": Field((int,), 1234, "seed"),
            "data_sampling": Section(open=True),
            "data_routing": Section(open=True),
        })}


PLUGINS = [("data_efficiency_stand_in", DataEfficiencyStandIn), ("random_ltd", RandomLTDPlugin)]


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("MICROSPEED_PLUGINS", raising=False)
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.set_num_threads(1)


def _gpt(n_layer: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=SEQ, n_layer=n_layer, n_head=2, d_model=16))


def _batch(seed: int = 0, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (batch, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _section(**over: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
        "model_mask_name": None, "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {"min_value": 4, "max_value": SEQ, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": 6, "seq_per_step": 4}},
    }
    s.update(over)
    return s


def _engine(section: dict[str, Any] | None = None, model: nn.Module | None = None, **top: Any):
    cfg: dict[str, Any] = {"optimizer": {"type": "SGD", "params": {"lr": 0.05}}, **top}
    if section is not None:
        cfg.setdefault("data_efficiency", {})["data_routing"] = {"random_ltd": section}
    return tiny_engine(cfg, plugins=PLUGINS, model=model if model is not None else _gpt())


# -- gather / scatter: Triton kernels (child process, interpreter) vs PyTorch references -----------------------


def _cases() -> dict[str, dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    cases = {}
    for batch_first in (True, False):
        for dtype in (torch.float32, torch.bfloat16):
            for h, contiguous in ((24, True), (40, False)):
                b, s, k = 3, 64, 20
                full = torch.randn(b, s, 2 * h, generator=g).to(dtype)
                x = full[..., :h] if not contiguous else full[..., :h].contiguous()  # rows with a stride gap
                if not batch_first:
                    x = x.transpose(0, 1)
                idx = torch.rand(b, s, generator=g).topk(k, dim=1).indices.sort(dim=1).values
                shape = (b, k, h) if batch_first else (k, b, h)
                cases[f"bf{int(batch_first)}-{str(dtype)[6:]}-h{h}-c{int(contiguous)}"] = {
                    "x": x, "idx": idx, "batch_first": batch_first,
                    "src": torch.randn(shape, generator=g).to(dtype),
                    "g_part": torch.randn(shape, generator=g).to(dtype),
                    "g_out": torch.randn(x.shape, generator=g).to(dtype),
                }
    return cases


def _run_case(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """gather and scatter, forward and backward, through the backend the environment selects."""
    bf = case["batch_first"]
    x = case["x"].clone().requires_grad_(True)
    part = gather_tokens(x, case["idx"], bf)
    (g_x_gather,) = torch.autograd.grad(part, x, case["g_part"])
    dst = case["x"].clone().requires_grad_(True)
    src = case["src"].clone().requires_grad_(True)
    out = scatter_tokens(dst, src, case["idx"], bf)
    g_dst, g_src = torch.autograd.grad(out, (dst, src), case["g_out"])
    return {"part": part.detach(), "g_x_gather": g_x_gather, "out": out.detach(), "g_dst": g_dst, "g_src": g_src}


@functools.lru_cache(maxsize=1)
def _triton_results(tmp: str) -> dict[str, Any]:
    inputs, outputs = Path(tmp) / "in.pt", Path(tmp) / "out.pt"
    torch.save(_cases(), inputs)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", KERNELS_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    env.update({"TRITON_INTERPRET": "1", KERNELS_ENV: "triton"})
    done = subprocess.run([sys.executable, __file__, str(inputs), str(outputs)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, f"the interpreted Triton run failed:\n{done.stdout}\n{done.stderr}"
    return torch.load(outputs)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("triton", reason="triton is not installed")
    return _triton_results(str(tmp_path_factory.mktemp("random_ltd_triton")))


@pytest.mark.slow
def test_triton_kernels_equal_the_references_forward_and_backward(triton_results: dict[str, Any]) -> None:
    assert triton_results["meta"] == ("triton", True), "the child must run the kernels in the interpreter"
    cases = _cases()
    assert set(cases) <= set(triton_results)
    assert kernel_backend(torch.zeros(1)) == "torch"  # here: the references
    for name, case in cases.items():
        reference = _run_case(case)
        for key, want in reference.items():
            got = triton_results[name][key]
            assert got.dtype == want.dtype and torch.equal(got, want), f"{name}: {key} differs"


def test_references_do_what_they_say() -> None:
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    idx = torch.tensor([[0, 3], [1, 4]])
    part = gather_tokens_torch(x, idx)
    assert torch.equal(part, torch.stack([x[0, [0, 3]], x[1, [1, 4]]]))
    out = scatter_tokens(x, -part, idx)
    assert torch.equal(out[0, [0, 3]], -x[0, [0, 3]]) and torch.equal(out[0, [1, 2, 4]], x[0, [1, 2, 4]])
    assert torch.equal(gather_tokens(x.transpose(0, 1), idx, batch_first=False), part.transpose(0, 1))
    with pytest.raises(ValueError, match="idx: expected an int64"):
        gather_tokens(x, idx.int())
    with pytest.raises(ValueError, match="src: expected shape"):
        scatter_tokens(x, part[:, :1], idx)


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNELS_ENV, "torch")
    assert kernel_backend(torch.zeros(1)) == "torch"
    monkeypatch.setenv(KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match=KERNELS_ENV):
        kernel_backend(torch.zeros(1))


# -- sampling, masks, the layer hooks ----------------------------------------------------------------------------


def test_sampled_indices_are_sorted_distinct_and_uniform() -> None:
    torch.manual_seed(0)
    idx = sample_token_indices(6, 12, 2000)
    assert idx.dtype == torch.int64 and idx.shape == (2000, 6)
    assert bool((idx[:, 1:] > idx[:, :-1]).all()) and int(idx.min()) >= 0 and int(idx.max()) < 12
    freq = torch.bincount(idx.flatten(), minlength=12).float() / 2000  # each position kept with p = 1/2
    assert torch.allclose(freq, torch.full((12,), 0.5), atol=0.05)
    with pytest.raises(ValueError, match="reserved"):
        sample_token_indices(13, 12, 1)


def test_attention_masks_are_cut_to_the_kept_tokens() -> None:
    idx = torch.tensor([[0, 2, 5], [1, 3, 4]])
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))[None, None]
    cut = gather_attention_mask(causal, idx, "decoder")
    assert torch.equal(cut, torch.tril(torch.ones(3, 3, dtype=torch.bool))[None, None])
    assert torch.equal(gather_attention_mask(causal, idx, "encoder"), cut.expand(2, 1, 3, 3))
    full = torch.randn(2, 2, 6, 6)
    enc = gather_attention_mask(full, idx, "encoder")
    assert torch.equal(enc[1, 1], full[1, 1][[1, 3, 4]][:, [1, 3, 4]])
    padding = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])
    assert torch.equal(gather_attention_mask(padding, idx, "encoder"), torch.tensor([[1, 1, 0], [1, 1, 1]]))


def test_layer_processes_the_kept_tokens_and_passes_the_others() -> None:
    """Block output at the kept positions = the block on the kept subsequence; the rest unchanged (and grads)."""
    block = _gpt(2).blocks[1].train()
    handle = convert_to_random_ltd(nn.Sequential(block), ["0"], 6)
    x = torch.randn(3, SEQ, 16, requires_grad=True)
    torch.manual_seed(7)
    got = block(x)
    torch.manual_seed(7)
    idx = sample_token_indices(6, SEQ, 3)
    handle.remove()
    index = idx[..., None].expand(-1, -1, 16)
    want = x.scatter(1, index, block(torch.gather(x, 1, index)))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    kept = torch.zeros(3, SEQ, dtype=torch.bool).scatter(1, idx, True)
    assert torch.equal(got[~kept], x[~kept])
    g_got = torch.autograd.grad(got.square().sum(), x)[0]
    g_want = torch.autograd.grad(want.square().sum(), x)[0]
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=0)


def test_full_token_gather_scatter_is_the_identity_exactly() -> None:
    block = _gpt(2).blocks[0]
    x = torch.randn(2, SEQ, 16, requires_grad=True)
    every = torch.arange(SEQ).expand(2, SEQ).contiguous()
    y = scatter_tokens(x, block(gather_tokens(x, every)), every)
    assert torch.equal(y, block(x))
    g = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(block(x), x, g)[0])


class _SeqFirstLayer(nn.Module):
    """A position-wise layer on ``[S, B, H]`` that takes a mask keyword and returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, str]:
        self.seen.append((tuple(h.shape), tuple(attention_mask.shape)))
        return torch.tanh(self.lin(h)), "extra"


def test_seq_batch_order_masks_and_tuple_outputs() -> None:
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([_SeqFirstLayer(), _SeqFirstLayer()])
    handle = convert_to_random_ltd(model, [1], 5, model_type="encoder", hidden_state_order="seq_batch_dim",
                                   mask_name="attention_mask")
    layer = model.layers[1]
    h = torch.randn(12, 3, 8)
    mask = torch.ones(3, 1, 12, 12)
    out, extra = layer(h, attention_mask=mask)
    assert extra == "extra" and layer.seen == [((5, 3, 8), (3, 1, 5, 5))]
    changed = (out != h).any(dim=-1)  # [S, B]
    assert changed.sum(dim=0).tolist() == [5, 5, 5]
    assert torch.equal(out[changed], torch.tanh(layer.lin(h[changed])))
    assert handle.layers[0].last_tokens == 5 and handle.layers[0].name == "layers.1"
    with pytest.raises(TypeError, match="model_mask_name is 'attention_mask'"):
        layer(h)
    layer.eval()
    layer.seen.clear()
    layer(h, attention_mask=mask)
    assert layer.seen == [((12, 3, 8), (3, 1, 12, 12))]


def test_conversion_errors_name_the_problem() -> None:
    model = _gpt(4)
    with pytest.raises(ValueError, match="index 4 is out of range for 'blocks'"):
        convert_to_random_ltd(model, [4], 8)
    with pytest.raises(ValueError, match="no module named 'blocks.9'"):
        convert_to_random_ltd(model, ["blocks.9"], 8)
    with pytest.raises(ValueError, match="names a layer twice"):
        convert_to_random_ltd(model, [1, "blocks.1"], 8)
    handle = convert_to_random_ltd(model, ["blocks.2"], 8)
    with pytest.raises(ValueError, match="already drops tokens"):
        convert_to_random_ltd(model, [2], 8)
    handle.remove()
    convert_to_random_ltd(model, [2], 8).remove()
    two = nn.Module()
    two.a, two.b = nn.ModuleList([nn.Linear(2, 2)] * 2), nn.ModuleList([nn.Linear(2, 2)] * 3)
    with pytest.raises(ValueError, match=r"found 2 among the model's ModuleLists \[a \(2\), b \(3\)\]"):
        find_layer_list(two)
    assert find_layer_list(two, 3)[0] == "b"


# -- schedule --------------------------------------------------------------------------------------------------


def test_schedule_grows_linearly_in_multiples_of_seq_per_step() -> None:
    s = RandomLTDSchedule(min_value=128, max_value=2048, require_steps=100, seq_per_step=16)
    assert s.value_at(0) == 128
    assert s.value_at(1) == 144  # floor(128 + 19.2) = 147 -> 144
    assert s.value_at(50) == 1088
    assert s.value_at(99) == 2016 and s.value_at(100) == 2048 and s.value_at(10**6) == 2048
    values = [s.value_at(t) for t in range(120)]
    assert values == sorted(values) and all(v % 16 == 0 for v in values)
    sched = RandomLTDScheduler(s, total_layer_num=24, random_ltd_layer_num=22, global_batch_size=8)
    sched.update(0)
    sched.update(0)  # a second micro-step of step 0 counts nothing
    sched.update(1)
    assert sched.consumed_layer_tokens == 8 * (128 * 22 + 2048 * 2) + 8 * (144 * 22 + 2048 * 2)


# -- the plugin ------------------------------------------------------------------------------------------------


def _record_tokens(model: GPT) -> list[list[int]]:
    """Per forward, the tokens each block's attention saw."""
    per_call: list[list[int]] = []

    def pre(i: int):
        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if i == 0:
                per_call.append([])
            per_call[-1].append(args[0].shape[1])
        return hook

    for i, block in enumerate(model.blocks):
        block.attn.register_forward_pre_hook(pre(i))
    return per_call


def test_each_layer_sees_the_scheduled_tokens_at_each_step() -> None:
    engine = _engine(_section(), gradient_accumulation_steps=2, train_micro_batch_size_per_gpu=2)
    per_call = _record_tokens(engine.module)
    train_steps(engine, 8, batch=_batch())
    # K(t) = floor(4 + 12 t / 6) rounded down to a multiple of 4; then 16 = the sequence: no dropping
    expected = [4, 4, 8, 8, 12, 12, 16, 16]
    assert per_call == [[SEQ, k, k, SEQ] for k in expected for _ in range(2)]
    handle = engine.plugin_state("random_ltd")
    assert [layer.name for layer in handle.layers] == ["blocks.1", "blocks.2"]
    assert engine.metrics["random_ltd_tokens"] == 16
    assert [n for n, _ in engine.module.named_parameters()] == [n for n, _ in _gpt().named_parameters()]
    per_call.clear()
    handle.scheduler.load_state_dict({"current_value": 4, "current_step": 8, "consumed_layer_tokens": 0})
    engine.module.eval()
    with torch.no_grad():
        engine(*_batch())
    assert per_call == [[SEQ] * 4]  # eval: every token


def test_keeping_every_token_equals_the_plain_model_exactly() -> None:
    keep_all = _section(random_ltd_schedule={"min_value": SEQ, "max_value": SEQ,
                                             "schedule_config": {"require_steps": 1, "seq_per_step": 1}})
    plain, ltd = _engine(None), _engine(keep_all)
    assert ltd.plugin_state("random_ltd") is not None and plain.plugin_state("random_ltd") is None
    batches = [_batch(i) for i in range(4)]
    torch.manual_seed(1)
    a = train_steps(plain, 4, batch=lambda i: batches[i])
    torch.manual_seed(1)
    b = train_steps(ltd, 4, batch=lambda i: batches[i])
    assert a == b
    for p, q in zip(plain.module.parameters(), ltd.module.parameters(), strict=True):
        assert torch.equal(p, q)


def test_dropping_trains_and_resumes_the_schedule(tmp_path: Path) -> None:
    engine = _engine(_section())
    losses = train_steps(engine, 3, batch=_batch())
    assert all(torch.isfinite(torch.tensor(losses)))
    state = engine.plugin_state("random_ltd").scheduler.state_dict()
    assert state["current_value"] == 8 and state["current_step"] == 2
    engine.save_checkpoint(str(tmp_path))
    resumed = _engine(_section())
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.plugin_state("random_ltd").scheduler.state_dict() == state
    per_call = _record_tokens(resumed.module)
    train_steps(resumed, 1, batch=_batch())
    assert per_call == [[SEQ, 8, 8, SEQ]]  # step 3: floor(4 + 12 * 3 / 6) = 10 -> 8
    train_steps(engine, 1, batch=_batch())  # the run that was not interrupted
    assert resumed.plugin_state("random_ltd").scheduler.state_dict() == engine.plugin_state(
        "random_ltd").scheduler.state_dict()
    assert state["consumed_layer_tokens"] == 2 * (2 * (4 + 4 + 8) + 2 * 3 * SEQ)  # batch 2, 2 + 2 layers, 3 steps


@pytest.mark.parametrize("section, match", [
    (_section(foo=1), r"data_efficiency\.data_routing\.random_ltd\.foo: unknown key"),
    (_section(random_ltd_schedule={"min_value": 4, "max_value": 16, "schedule_config": {
        "require_steps": 6, "seq_per_step": 4, "root_degree": 2}}),
     r"random_ltd\.random_ltd_schedule\.schedule_config\.root_degree: unknown key"),
    (_section(random_ltd_layer_num=3), r"random_ltd\.random_ltd_layer_num: got 3, but random_ltd_layer_id lists 2"),
    (_section(random_ltd_layer_id=[1, 4]), r"random_ltd\.random_ltd_layer_id: \[4\] out of range"),
    (_section(model_type="seq2seq"), r"random_ltd\.model_type: got 'seq2seq'"),
    (_section(hidden_state_order="bsh"), r"random_ltd\.hidden_state_order: got 'bsh'"),
    (_section(total_layer_num="4"), r"random_ltd\.total_layer_num: expected an integer > 0"),
    (_section(random_ltd_schedule={"min_value": 2, "max_value": 16, "schedule_config": {
        "require_steps": 6, "seq_per_step": 4}}), r"random_ltd\.random_ltd_schedule\.min_value: got 2, below"),
    (_section(random_ltd_schedule={"min_value": 8, "max_value": 4, "schedule_config": {
        "require_steps": 6, "seq_per_step": 4}}), r"random_ltd\.random_ltd_schedule\.max_value: got 4"),
    (_section(random_ltd_schedule={"min_value": 4, "max_value": 16, "schedule_type": "fixed_root",
                                   "schedule_config": {"require_steps": 6, "seq_per_step": 4}}),
     r"random_ltd\.random_ltd_schedule\.schedule_type: got 'fixed_root'"),
    (_section(layer_token_lr_schedule={"enabled": True}), r"random_ltd\.layer_token_lr_schedule\.enabled"),
    ({"enabled": True, "total_layer_num": 4}, r"random_ltd\.random_ltd_layer_num: required"),
    (_section(total_layer_num=6, random_ltd_layer_id=[1, 2]), r"random_ltd\.total_layer_num: 6, but cannot tell"),
])
def test_bad_config_is_refused_at_initialize(section: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _engine(section)


def test_contradicting_switches_and_unknown_routing_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"data_efficiency\.enabled: false, but .*random_ltd\.enabled is true"):
        _engine(_section(), data_efficiency={"enabled": False})
    with pytest.raises(ConfigError, match=r"data_efficiency\.data_routing\.curriculum: unknown key"):
        tiny_engine({"data_efficiency": {"data_routing": {"curriculum": {}}}}, plugins=PLUGINS, model=_gpt())
    engine = _engine(_section(), data_efficiency={"enabled": True, "data_routing": {"enabled": True}})
    assert engine.plugin_state("random_ltd") is not None
    off = _engine({"enabled": False, "total_layer_num": 4})
    assert off.plugin_state("random_ltd") is None
    assert RandomLTDConfig.from_section(None).enabled is False


def _run_triton_cases(inputs: str, outputs: str) -> None:
    """The child process: run every case of ``inputs`` through the (interpreted) kernels, save to ``outputs``."""
    from microspeed_efficiency import random_ltd_kernels

    assert random_ltd_kernels.INTERPRETED, "TRITON_INTERPRET=1 must be set before the kernels are imported"
    cases = torch.load(inputs)
    results: dict[str, Any] = {name: _run_case(case) for name, case in cases.items()}
    results["meta"] = (kernel_backend(torch.zeros(1)), random_ltd_kernels.INTERPRETED)
    torch.save(results, outputs)


if __name__ == "__main__":
    _run_triton_cases(sys.argv[1], sys.argv[2])
