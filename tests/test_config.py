"""Bad input is a ConfigError at initialize(), naming the key, the value and the fix."""

from __future__ import annotations

import json

import pytest
import torch

import microspeed
from microspeed import ConfigError


def init(model, config, **kw):
    return microspeed.initialize(model=model, config=config, **kw)


def test_unknown_top_level_key_suggests_closest(tiny_model, base_config):
    with pytest.raises(ConfigError, match=r"train_batch_sise: unknown key\. Did you mean 'train_batch_size'\?"):
        init(tiny_model, {**base_config, "train_batch_sise": 4})


def test_unknown_nested_key_names_path(tiny_model, base_config):
    cfg = {**base_config, "fp16": {"enabled": True, "loss_scale_windw": 100}}
    with pytest.raises(ConfigError, match=r"fp16\.loss_scale_windw: unknown key\. Did you mean 'loss_scale_window'"):
        init(tiny_model, cfg)


def test_misspelled_section(tiny_model, base_config):
    with pytest.raises(ConfigError, match=r"fp61: unknown key\. Did you mean 'fp16'"):
        init(tiny_model, {**base_config, "fp61": {"enabled": True}})


def test_wrong_type_names_key_value_and_accepted(tiny_model, base_config):
    with pytest.raises(ConfigError, match=r"fp16\.enabled: expected true/false, got 'yes'"):
        init(tiny_model, {**base_config, "fp16": {"enabled": "yes"}})
    with pytest.raises(ConfigError, match=r"gradient_clipping: got -1.*expected a number >= 0"):
        init(tiny_model, {**base_config, "gradient_clipping": -1})
    with pytest.raises(ConfigError, match=r"communication_data_type: got 'fp8'; accepted values"):
        init(tiny_model, {**base_config, "communication_data_type": "fp8"})


def test_batch_mismatch_shows_all_numbers(tiny_model):
    cfg = {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(ConfigError, match=r"train_batch_size=10.*=3.*=2.*world size=1"):
        init(tiny_model, cfg)


@pytest.mark.parametrize("given,expected", [
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, (8, 2, 4)),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, (8, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, (6, 2, 3)),
    ({"train_batch_size": 8}, (8, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 5}, (5, 5, 1)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, (4, 2, 2)),
])
def test_batch_triad_any_two_give_the_third(tiny_model, given, expected):
    engine, *_ = init(tiny_model, {**given, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    got = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps())
    assert got == expected


def test_no_batch_size_at_all(tiny_model):
    with pytest.raises(ConfigError, match="train_batch_size / train_micro_batch_size_per_gpu"):
        init(tiny_model, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


def test_auto_refused_where_it_cannot_be_resolved(tiny_model, base_config):
    with pytest.raises(ConfigError, match=r'gradient_clipping: "auto" cannot be resolved'):
        init(tiny_model, {**base_config, "gradient_clipping": "auto"})


def test_unknown_optimizer_and_scheduler_names(tiny_model, base_config):
    with pytest.raises(ConfigError, match=r"optimizer\.type.*AdamW"):
        init(tiny_model, {**base_config, "optimizer": {"type": "AdamWW", "params": {"lr": 0.1}}})
    with pytest.raises(ConfigError, match=r"scheduler\.type.*WarmupLR"):
        init(tiny_model, {**base_config, "scheduler": {"type": "WarmupLRR", "params": {}}})
    with pytest.raises(ConfigError, match=r"optimizer\.type: required key is missing"):
        init(tiny_model, {**base_config, "optimizer": {"params": {"lr": 0.1}}})


def test_plugin_section_without_plugin_names_distribution(tiny_model, base_config):
    # the zero plugin is installed here (requirements.txt): disable it to stand for "not installed"
    cfg = {**base_config, "zero_optimization": {"stage": 2}, "plugins": {"disable": ["zero"]}}
    with pytest.raises(ConfigError, match=r"zero_optimization: this section belongs to the plugin distribution "
                                          r"'microspeed-zero'"):
        init(tiny_model, cfg)


def test_config_from_json_path_and_args(tmp_path, tiny_model, base_config):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(base_config))
    engine, *_ = init(tiny_model, str(path))
    assert engine.train_batch_size() == 4

    import argparse

    parser = microspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, *_ = microspeed.initialize(args=args, model=tiny_model)
    assert engine.train_batch_size() == 4


def test_config_file_errors(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match="does not exist"):
        init(tiny_model, str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        init(tiny_model, str(bad))


def test_optimizer_given_twice(tiny_model, base_config):
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="given both"):
        init(tiny_model, base_config, optimizer=opt)


def test_fp16_and_bf16_together(tiny_model, base_config):
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled"):
        init(tiny_model, {**base_config, "fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_grad_accum_dtype_must_fit_training_dtype(tiny_model, base_config):
    with pytest.raises(ConfigError, match=r"data_types\.grad_accum_dtype: got 'fp16'"):
        init(tiny_model, {**base_config, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}})
