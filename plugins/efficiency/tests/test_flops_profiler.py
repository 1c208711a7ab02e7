"""The flops profiler (``microspeed_efficiency.flops_profiler``) and the ``flops_profiler`` config section."""

from __future__ import annotations

import importlib.metadata
import re

import pytest
import torch
from microspeed_efficiency import flops_profiler as fp
from microspeed_efficiency.flops_plugin import FlopsProfilerPlugin
from microspeed_efficiency.flops_profiler import (
    CPU_ATTENTION_FLOPS,
    FlopsProfiler,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from microspeed.demo.model import GPT, Block, GPTConfig
from microspeed.errors import ConfigError
from microspeed.testing import tiny_engine, train_steps


def _gpt() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig.tiny()
    return GPT(config), torch.randint(0, config.vocab_size, (2, config.seq_len))


def _convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, stride=2, groups=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, 10),
    )


def _flop_counter_total(model: nn.Module, *args, custom_mapping=None) -> int:
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=custom_mapping) as counter:
        model(*args)
    return counter.get_total_flops()


def test_gpt_totals_equal_flop_counter_mode():
    model, tokens = _gpt()
    expected = _flop_counter_total(model, tokens)
    flops, macs, params = get_model_profile(model, args=[tokens], print_profile=False, as_string=False)
    assert expected > 0
    assert flops == expected
    assert macs * 2 == flops
    assert params == sum(p.numel() for p in model.parameters())
    # hand count: every Linear is 2*B*T*in*out (the tied lm_head included); CPU attention is not priced
    c, n = model.config, tokens.numel()
    per_block = 2 * n * (c.d_model * 3 * c.d_model + c.d_model * c.d_model + 2 * c.d_model * 4 * c.d_model)
    assert flops == c.n_layer * per_block + 2 * n * c.d_model * c.vocab_size


def test_gpt_per_module_counts_equal_flop_counter_mode():
    model, tokens = _gpt()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens)
    theirs = {name.removeprefix("GPT").lstrip("."): sum(ops.values())
              for name, ops in counter.get_flop_counts().items() if name != "Global"}
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad():
        model(tokens)
    prof.stop_profile()
    ours = {name: record.flops for name, record in prof.profiles.items() if record.flops}
    assert ours.pop("blocks") == sum(ours[f"blocks.{i}"] for i in range(model.config.n_layer))  # container sum
    assert ours == theirs and len(ours) > 10


def test_cpu_attention_mapping_matches_flop_counter_with_same_mapping():
    model, tokens = _gpt()
    plain = get_model_profile(model, args=[tokens], print_profile=False, as_string=False)[0]
    expected = _flop_counter_total(model, tokens, custom_mapping=CPU_ATTENTION_FLOPS)
    flops = get_model_profile(model, args=[tokens], print_profile=False, as_string=False,
                              custom_mapping=CPU_ATTENTION_FLOPS)[0]
    c = model.config
    b, t, h = tokens.shape[0], tokens.shape[1], c.n_head
    attention = c.n_layer * 2 * 2 * b * h * t * t * (c.d_model // h)  # QK^T and PV
    assert flops == expected == plain + attention


def test_gpt_block_and_module_attribution():
    model, tokens = _gpt()
    block = model.blocks[0]
    x = torch.randn(2, model.config.seq_len, model.config.d_model)
    assert isinstance(block, Block)
    prof = FlopsProfiler(block)
    prof.start_profile()
    with torch.no_grad():
        block(x)
    prof.stop_profile()
    assert prof.get_total_flops() == _flop_counter_total(block, x) > 0
    attn, mlp = prof.get_module_profile("attn"), prof.get_module_profile("mlp")
    assert attn.flops + mlp.flops == prof.get_total_flops()
    assert attn.flops == prof.get_module_profile("attn.qkv").flops + prof.get_module_profile("attn.proj").flops
    assert prof.get_module_profile("ln_1").flops == 0 and prof.get_module_profile("ln_1").calls == 1
    assert prof.get_total_duration() >= attn.latency > 0
    assert prof.get_total_params() == sum(p.numel() for p in block.parameters())
    prof.end_profile()
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.get_total_flops()


def test_convnet_totals_equal_flop_counter_mode_and_input_shape():
    net = _convnet()
    expected = _flop_counter_total(net, torch.ones(4, 3, 16, 16))
    flops, macs, params = get_model_profile(net, input_shape=(4, 3, 16, 16), print_profile=False, as_string=False)
    assert flops == expected > 0
    # conv1: 2*B*Ho*Wo*Cout*Cin*k*k; conv2 (groups 2, stride 2: 7x7 out); linear 2*B*16*10
    conv1 = 2 * 4 * 16 * 16 * 8 * 3 * 9
    conv2 = 2 * 4 * 3 * 3 * 16 * (8 // 2) * 9
    assert flops == conv1 + conv2 + 2 * 4 * 16 * 10
    assert macs == flops // 2
    assert params == sum(p.numel() for p in net.parameters())


def test_ignore_modules_excluded_by_class_and_instance():
    net = _convnet()
    full = get_model_profile(net, input_shape=(2, 3, 16, 16), print_profile=False, as_string=False)[0]
    no_linear = get_model_profile(net, input_shape=(2, 3, 16, 16), print_profile=False, as_string=False,
                                  ignore_modules=[nn.Linear])[0]
    assert full - no_linear == 2 * 2 * 16 * 10
    no_first_conv = get_model_profile(net, input_shape=(2, 3, 16, 16), print_profile=False, as_string=False,
                                      ignore_modules=[net[0]])[0]
    assert full - no_first_conv == 2 * 2 * 16 * 16 * 8 * 3 * 9
    with pytest.raises(TypeError, match="ignore_modules"):
        get_model_profile(net, input_shape=(2, 3, 16, 16), print_profile=False, ignore_modules=["Linear"])


def test_strings_and_printed_profile(tmp_path, capsys):
    assert number_to_string(8388608) == "8.39 M"
    assert macs_to_string(4194304) == "4.19 MMACs"
    assert params_to_string(1.3e9) == "1.3 B"
    assert number_to_string(0) == "0 "
    model, tokens = _gpt()
    flops, macs, params = get_model_profile(model, args=[tokens], module_depth=1, top_modules=2)
    out = capsys.readouterr().out
    assert (flops, macs, params) == ("4.19 M", "2.1 MMACs", "34.69 K")
    assert "fwd flops per GPU:" in out and "(4194304 flops)" in out
    assert "Top 2 modules" in out and "depth 1:" in out and "depth 2:" not in out
    assert re.search(r"\(blocks\): ModuleList: .* 75\.00% MACs", out)  # a container sums its children
    assert "(attn)" not in out  # deeper than module_depth
    target = tmp_path / "sub" / "profile.txt"
    get_model_profile(model, args=[tokens], output_file=str(target), detailed=False)
    text = target.read_text()
    assert "(4194304 flops)" in text and "Detailed profile" not in text
    assert capsys.readouterr().out == ""


def test_bad_arguments_are_refused():
    model, tokens = _gpt()
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(model, input_shape=[2, 3])
    with pytest.raises(ValueError, match="input_shape=.*args=.*kwargs"):
        get_model_profile(model)
    with pytest.raises(ValueError, match="module_depth"):
        get_model_profile(model, args=[tokens], module_depth=-2)
    with pytest.raises(ValueError, match="top_modules"):
        get_model_profile(model, args=[tokens], top_modules=0)
    with pytest.raises(TypeError, match="nn.Module"):
        FlopsProfiler("not a model")
    prof = FlopsProfiler(model)
    prof.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        prof.start_profile()
    prof.end_profile()


def test_profiling_leaves_the_model_clean():
    model, tokens = _gpt()
    model.train()
    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    get_model_profile(model, args=[tokens], print_profile=False)
    assert model.training
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks_before
    # no counting mode left behind: another FlopCounterMode sees the same total
    assert _flop_counter_total(model, tokens) == get_model_profile(model, args=[tokens], print_profile=False,
                                                                    as_string=False)[0]


def test_deepspeed_namespace_alias():
    import microspeed as deepspeed
    import microspeed.profiling.flops_profiler as alias

    assert deepspeed.profiling.flops_profiler is fp

    assert alias is fp
    assert alias.get_model_profile is get_model_profile


# ------------------------------------------------------------------------------------------------------
# The ``flops_profiler`` config section.


def _plugin_pairs():
    installed = any(ep.name == "flops_profiler"
                    for ep in importlib.metadata.entry_points(group="microspeed.plugins"))
    return [] if installed else [("flops_profiler", FlopsProfilerPlugin())]


def test_training_writes_the_profile_with_the_model_profile_total(tmp_path):
    torch.manual_seed(0)
    config = GPTConfig.tiny()
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    out = tmp_path / "flops.txt"
    engine = tiny_engine({"flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 2,
                                             "top_modules": 2, "output_file": str(out)}},
                         plugins=_plugin_pairs(), model=model)
    train_steps(engine, 1, batch=batch)
    assert not out.exists()  # profile_step 1 = the second step
    train_steps(engine, 2, batch=batch)
    text = out.read_text()
    state = engine.plugin_state("flops_profiler")
    expected = get_model_profile(model, args=list(batch), print_profile=False, as_string=False)[0]
    assert state.result.fwd_flops == expected > 0
    assert f"({expected} flops)" in text
    assert state.result.fwd_bwd_flops == 3 * expected
    for label in ("bwd latency:", "step latency:", "iter latency", "samples/second:", "fwd+bwd flops per",
                  "batch size per GPU:", "Profile summary at step 1"):
        assert label in text
    assert state.result.bwd_latency > 0 and state.result.step_latency > 0
    assert state.result.iter_latency >= state.result.fwd_latency + state.result.bwd_latency
    # hooks and the counting mode are gone after the profiled step
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert _flop_counter_total(model, *batch) > 0


def test_recompute_factor_and_disabled_section(tmp_path):
    torch.manual_seed(0)
    engine = tiny_engine({"flops_profiler": {"enabled": True, "profile_step": 0, "recompute_fwd_factor": 1,
                                             "output_file": str(tmp_path / "p.txt")}}, plugins=_plugin_pairs())
    train_steps(engine, 1)
    result = engine.plugin_state("flops_profiler").result
    assert result.fwd_flops == 2 * 2 * (8 * 16 + 16 * 1)  # TinyModel: two Linear layers, micro-batch 2
    assert result.fwd_bwd_flops == 4 * result.fwd_flops
    off = tiny_engine({}, plugins=_plugin_pairs())
    train_steps(off, 3)
    assert off.plugin_state("flops_profiler").result is None
    assert off.plugin_state("flops_profiler").settings.enabled is False


@pytest.mark.parametrize("section, match", [
    ({"enabled": True, "profile_stepp": 1}, "profile_stepp"),
    ({"module_depth": -2}, "module_depth"),
    ({"top_modules": 0}, "top_modules"),
    ({"recompute_fwd_factor": -0.5}, "recompute_fwd_factor"),
    ({"output_file": 3}, "output_file"),
])
def test_bad_keys_refused(section, match):
    with pytest.raises(ConfigError, match=match):
        tiny_engine({"flops_profiler": section}, plugins=_plugin_pairs())


def test_section_unknown_without_the_plugin():
    with pytest.raises(ConfigError, match="flops_profiler"):
        tiny_engine({"flops_profiler": {"enabled": True}, "plugins": {"disable": ["flops_profiler"]}},
                    plugins=_plugin_pairs())


def test_step_key_of_deepspeeds_unit_tests_is_noticed_not_refused(tmp_path):
    """DeepSpeed's own tests write ``flops_profiler.step``, which DeepSpeed ignores: accepted with a notice."""
    torch.manual_seed(0)
    engine = tiny_engine({"flops_profiler": {"enabled": True, "step": 5, "profile_step": 0,
                                             "output_file": str(tmp_path / "p.txt")}}, plugins=_plugin_pairs())
    notices = " ".join(engine.config.notices)
    assert "flops_profiler.step: accepted, no effect here" in notices and "profile_step" in notices
    assert "did you mean" not in notices
    train_steps(engine, 1)  # profile_step 0 decides, as in DeepSpeed
    assert engine.plugin_state("flops_profiler").result is not None and (tmp_path / "p.txt").exists()
