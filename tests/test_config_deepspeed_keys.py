"""Configs written for DeepSpeed 0.19.8: its keys are never typos; a notice for no-effect keys; all errors at once."""

from __future__ import annotations

import base64
import json

import pytest
import torch

import microspeed
from microspeed import ConfigError
from microspeed.bootstrap import _NOTICES_LOGGED
from microspeed.compat.deepspeed_keys import DEEPSPEED_KEYS, NO_EFFECT, REFUSED, is_deepspeed_key


def _base(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}


def _init(config, **kw):
    torch.manual_seed(0)
    return microspeed.initialize(model=torch.nn.Linear(4, 1), config=config, **kw)[0]


def test_table_knows_the_keys_clients_write():
    for key in ("steps_per_print", "aio.block_size", "wandb.project", "comet.api_key", "memory_breakdown",
                "checkpoint.tag_validation", "fp16.fp16_master_weights_and_grads",
                "zero_optimization.round_robin_gradients", "zero_optimization.cpu_offload",
                "zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size",
                "pipeline.activation_checkpoint_interval", "flops_profiler.profile_step", "amp.opt_level"):
        assert is_deepspeed_key(key), key
    assert not is_deepspeed_key("stepz_per_print") and not is_deepspeed_key("fp16.loss_scale_windw")
    assert set(NO_EFFECT) <= DEEPSPEED_KEYS and set(REFUSED) <= DEEPSPEED_KEYS


def test_steps_per_print_inf_is_accepted_and_never_logs(capsys):
    engine = _init(_base(steps_per_print=float("inf")))
    assert engine.steps_per_print() == float("inf") and engine.config.notices == []
    for _ in range(3):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    assert engine.global_steps == 3
    assert " train " not in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"steps_per_print: got 2\.5; expected a whole number > 0 or inf"):
        _init(_base(steps_per_print=2.5))


def test_keys_clients_write_are_accepted_with_one_notice_each(capsys):
    """Lightning always writes ``aio`` (microspeed-zero acts on it: no notice); accelerate/HF configs carry wandb,
    comet, checkpoint, memory_breakdown."""
    cfg = _base(aio={"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                     "thread_count": 1}, wandb={"enabled": False, "project": "p"}, comet={"enabled": False},
                memory_breakdown=False, checkpoint={"tag_validation": "Warn", "load_universal": False},
                fp16={"enabled": False, "fp16_master_weights_and_grads": False})
    _NOTICES_LOGGED.clear()
    engine = _init(cfg)
    notices = engine.config.notices
    assert [n.split(":")[0] for n in notices] == ["wandb", "comet", "memory_breakdown",
                                                  "checkpoint.load_universal", "fp16.fp16_master_weights_and_grads"]
    assert all("accepted, no effect here: " in n and "did you mean" not in n.lower() for n in notices)
    assert engine.config.get("aio.block_size") == 1048576  # kept, for a plugin that may read it
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "no effect here" in line].__len__() == len(notices)
    assert "microspeed's monitor writes tensorboard and csv_monitor only" in err
    _init(cfg)  # the same notices are not logged twice in one process
    assert "no effect here" not in capsys.readouterr().err


def test_deepspeed_key_we_do_not_implement_is_not_called_a_typo():
    with pytest.raises(ConfigError) as info:
        _init(_base(data_types={"param_dtype": "bf16"}))
    msg = str(info.value)
    assert "data_types.param_dtype: a DeepSpeed 0.19.8 key" in msg and "did you mean" not in msg.lower()


def test_refused_keys_say_why_when_they_turn_something_on():
    with pytest.raises(ConfigError, match=r"amp: a DeepSpeed key microspeed does not support: NVIDIA Apex AMP"):
        _init(_base(amp={"enabled": True, "opt_level": "O1"}))
    with pytest.raises(ConfigError, match=r"gradient_allreduce_op: .*always averaged"):
        _init(_base(gradient_allreduce_op="sum"))
    engine = _init(_base(amp={"enabled": False}, gradient_allreduce_op="mean"))  # off: nothing to refuse
    assert engine.config.notices == []


def test_every_problem_at_once_typos_first():
    """A misspelt scheduler type used to hide behind 'a scheduler needs an optimizer'."""
    cfg = {"train_batch_size": 2, "fp16": {"enabled": "yes"}, "stepz_per_print": 3,
           "scheduler": {"type": "WarmupLRR", "params": {}}}
    with pytest.raises(ConfigError) as info:
        _init(cfg)
    problems = info.value.problems
    assert len(problems) == 4 and str(info.value).startswith("the ds_config has 4 problems:")
    typos = sorted(problems[:2])  # typos first, in the config's order
    assert typos[0].startswith("scheduler.type: got 'WarmupLRR'") and "did you mean 'WarmupLR'" in typos[0]
    assert typos[1].startswith("stepz_per_print: unknown key. Did you mean 'steps_per_print'?")
    assert problems[2].startswith("fp16.enabled: expected true/false, got 'yes'")
    assert problems[3].startswith("scheduler: a scheduler needs an optimizer")


def test_json_file_is_read_as_deepspeed_reads_it(tmp_path):
    """DeepSpeed loads ds_config files with hjson: comments and trailing commas are fine, duplicates are not."""
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  // micro batch per rank\n  "train_micro_batch_size_per_gpu": 2,\n'
                    '  "gradient_accumulation_steps": 3,  # accumulate\n'
                    '  "optimizer": {"type": "SGD", "params": {"lr": 0.5,},},\n}\n')
    engine = _init(str(path))
    assert engine.gradient_accumulation_steps() == 3 and engine.get_lr() == [0.5]
    path.write_text('{"train_batch_size": 2, "train_batch_size": 4}')
    with pytest.raises(ConfigError, match=r"duplicate keys \['train_batch_size'\]"):
        _init(str(path))
    encoded = base64.urlsafe_b64encode(json.dumps(_base(gradient_accumulation_steps=2)).encode()).decode()
    assert _init(encoded).gradient_accumulation_steps() == 2  # as DeepSpeed's launcher passes it
    with pytest.raises(ConfigError, match=r"file '/no/such/ds_config.json' does not exist"):
        _init("/no/such/ds_config.json")
