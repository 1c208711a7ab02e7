"""Curriculum scheduler (against DeepSpeed's and the formulas) and the legacy ``curriculum_learning`` plugin."""

from __future__ import annotations

import math
import os

import pytest
import torch
from microspeed_efficiency.curriculum import CurriculumScheduler
from microspeed_efficiency.curriculum_plugin import CurriculumPlugin, accepts_curriculum_seqlen, truncate_batch

import microspeed
from microspeed.demo.data import random_token_dataset
from microspeed.demo.model import GPT, GPTConfig
from microspeed.testing import tiny_engine, train_steps

LINEAR = {"min_difficulty": 8, "max_difficulty": 1024, "schedule_type": "fixed_linear",
          "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8}}
ROOT = {"min_difficulty": 5, "max_difficulty": 300, "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 77, "difficulty_step": 16, "root_degree": 2}}
CUBE = {"min_difficulty": 64, "max_difficulty": 2048, "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 1000, "difficulty_step": 8, "root_degree": 3}}
DISCRETE = {"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
            "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]}}
STEPS = [0, 1, 2, 3, 5, 6, 10, 11, 17, 38, 50, 76, 77, 78, 99, 100, 101, 500, 999, 1000, 5000]


@pytest.fixture
def engine_env(monkeypatch):
    """Only the built-ins plus the plugins a test passes (an installed microspeed-efficiency would clash)."""
    monkeypatch.setenv("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("MICROSPEED_PLUGINS", raising=False)


def _deepspeed_scheduler():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler as Reference
    except Exception as exc:  # noqa: BLE001 - any import failure means: no reference to compare with
        pytest.skip(f"DeepSpeed's CurriculumScheduler cannot be imported: {type(exc).__name__}: {exc}")
    return Reference


# -- the scheduler --------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [LINEAR, ROOT, CUBE, DISCRETE], ids=["linear", "sqrt", "cbrt", "discrete"])
def test_matches_deepspeed(config):
    reference_cls = _deepspeed_scheduler()
    ours, reference = CurriculumScheduler(config), reference_cls(config)
    assert [ours.get_difficulty(s) for s in STEPS] == [reference.get_difficulty(s) for s in STEPS]
    # update_difficulty follows steps in order and stops moving at max_difficulty
    steps = range(1, 1200)
    assert [ours.update_difficulty(s) for s in steps] == [reference.update_difficulty(s) for s in steps]


def test_custom_matches_deepspeed():
    reference_cls = _deepspeed_scheduler()
    config = {"min_difficulty": 2, "max_difficulty": 50, "schedule_type": "custom"}
    ours, reference = CurriculumScheduler(config), reference_cls(config)
    for sched in (ours, reference):
        sched.set_custom_get_difficulty(lambda step: min(2 + 3 * step, 50))
    assert [ours.update_difficulty(s) for s in range(30)] == [reference.update_difficulty(s) for s in range(30)]


def test_fixed_root_formula():
    sched = CurriculumScheduler(ROOT)
    lo, hi, total, q = 5, 300, 77, 16
    for step in STEPS:
        raw = math.floor((step / total) ** 0.5 * (hi - lo) + lo)
        expected = min(max(raw - raw % q, 16), hi)  # 16: the first multiple of q at or above min_difficulty
        assert sched.get_difficulty(step) == expected, step
    # 300 is no multiple of 16: at total_curriculum_step the schedule is at 288; past it the root keeps
    # growing until the clamp to max_difficulty, as DeepSpeed's does
    assert sched.get_difficulty(0) == 16 and sched.get_difficulty(77) == sched.get_difficulty(79) == 288
    assert sched.get_difficulty(10**6) == 300


def test_fixed_linear_formula_and_update():
    sched = CurriculumScheduler({"min_difficulty": 8, "max_difficulty": 32, "schedule_type": "fixed_linear",
                                 "schedule_config": {"total_curriculum_step": 12, "difficulty_step": 4}})
    assert sched.get_current_difficulty() == 8
    seen = [sched.update_difficulty(s) for s in range(1, 16)]
    assert seen == [min(math.floor(s / 12 * 24 + 8) // 4 * 4, 32) for s in range(1, 16)]
    assert seen[-1] == 32 and sched.get_current_difficulty() == 32
    sched.update_difficulty(1)  # at max_difficulty the difficulty no longer moves
    assert sched.get_current_difficulty() == 32


def test_fixed_discrete_formula():
    sched = CurriculumScheduler(DISCRETE)
    assert [sched.get_difficulty(s) for s in range(0, 13)] == [1] * 6 + [2] * 5 + [3] * 2


def test_state_dict_round_trip():
    sched = CurriculumScheduler(LINEAR)
    sched.update_difficulty(40)
    again = CurriculumScheduler(LINEAR)
    again.load_state_dict(sched.state_dict())
    assert again.get_current_difficulty() == sched.get_current_difficulty() > 8
    with pytest.raises(KeyError, match="current_difficulty"):
        again.load_state_dict({})


def test_custom_without_function_is_an_error():
    sched = CurriculumScheduler({"min_difficulty": 1, "max_difficulty": 4, "schedule_type": "custom"})
    with pytest.raises(RuntimeError, match="set_custom_get_difficulty"):
        sched.update_difficulty(1)
    with pytest.raises(TypeError, match="callable"):
        sched.set_custom_get_difficulty(3)


@pytest.mark.parametrize(("change", "key"), [
    ({"min_difficulty": None}, "curriculum_learning.min_difficulty"),
    ({"max_difficulty": "big"}, "curriculum_learning.max_difficulty"),
    ({"min_difficulty": 2000}, "curriculum_learning.min_difficulty"),
    ({"schedule_type": "fixed_cubic"}, "curriculum_learning.schedule_type"),
    ({"schedule_config": {"difficulty_step": 8}}, "curriculum_learning.schedule_config.total_curriculum_step"),
    ({"schedule_config": {"total_curriculum_step": 0, "difficulty_step": 8}},
     "curriculum_learning.schedule_config.total_curriculum_step"),
    ({"schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8, "degree": 2}},
     "curriculum_learning.schedule_config.degree"),
    ({"schedule_type": "fixed_root"}, "curriculum_learning.schedule_config.root_degree"),
    ({"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, 16], "max_step": [5, 9]}},
     "curriculum_learning.schedule_config.max_step"),
    ({"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, 16, 32], "max_step": [9, 5]}},
     "curriculum_learning.schedule_config.max_step"),
    ({"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [], "max_step": []}},
     "curriculum_learning.schedule_config.difficulty"),
])
def test_bad_configs_name_the_key(change, key):
    with pytest.raises(microspeed.ConfigError, match=key.replace(".", r"\.")):
        CurriculumScheduler({**LINEAR, **change})


# -- the legacy plugin ------------------------------------------------------------------------------


def test_truncate_batch():
    x, y, mask, flat = torch.zeros(2, 10), torch.ones(2, 10, 3), torch.zeros(2, 4), torch.arange(10)
    out = truncate_batch(((x, y), {"mask": mask, "ids": flat}, [x], "text"), 6)
    assert out[0][0].shape == (2, 6) and out[0][1].shape == (2, 6, 3)
    assert out[1]["mask"] is mask and out[1]["ids"] is flat  # already short / one dimension: unchanged
    assert out[2][0].shape == (2, 6) and out[3] == "text"


def _legacy(start=8, end=32, total=6, step=8):
    return {"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": start,
                                    "max_difficulty": end, "schedule_type": "fixed_linear",
                                    "schedule_config": {"total_curriculum_step": total, "difficulty_step": step}}}


def _gpt_engine(config, **kwargs):
    data = random_token_dataset(64, 32, seed=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())  # seq_len 32
    engine = tiny_engine({**config, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
                         plugins=[("curriculum", CurriculumPlugin)], model=model, training_data=data, **kwargs)
    seen = []

    def record(module, args):
        x = args[0][0] if isinstance(args[0], (tuple, list)) else args[0]
        seen.append(x.shape[1])

    model.register_forward_pre_hook(record)
    return engine, seen


def test_gpt_sees_the_schedule(engine_env):
    engine, seen = _gpt_engine(_legacy(8, 32, 6, 8))
    reference = CurriculumScheduler(_legacy(8, 32, 6, 8)["curriculum_learning"])
    losses = train_steps(engine, 8)
    assert all(math.isfinite(v) for v in losses)
    expected = [reference.get_difficulty(step) for step in range(1, 9)]  # set at global_steps + 1
    assert expected == [8, 16, 16, 24, 24, 32, 32, 32]
    assert seen == expected
    assert engine.plugin_state("curriculum_learning").difficulty == 32
    assert engine.metrics["curriculum_seqlen"] == 32


def test_accumulation_and_eval(engine_env):
    engine, seen = _gpt_engine({**_legacy(8, 32, 4, 8), "train_micro_batch_size_per_gpu": 2,
                                "gradient_accumulation_steps": 2})
    train_steps(engine, 3)
    assert seen == [8, 8, 16, 16, 24, 24]  # one difficulty per optimizer step; step 3 of 4: floor(26) -> 24
    engine.eval()
    x = torch.zeros(2, 32, dtype=torch.long)
    engine(x, x)
    assert seen[-1] == 32  # evaluation sees whole sequences


class _SeqlenModel(torch.nn.Module):
    """Takes curriculum_seqlen itself (as Megatron's GPT does) and records what it got."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)
        self.got: list[tuple[int, int | None]] = []

    def forward(self, x, y, curriculum_seqlen=None):
        self.got.append((x.shape[1], curriculum_seqlen))
        n = curriculum_seqlen or x.shape[1]
        return ((self.linear(x[:, :n, None].float()).squeeze(-1) - y[:, :n]) ** 2).mean()


def test_forward_with_curriculum_seqlen_gets_the_kwarg(engine_env):
    model = _SeqlenModel()
    assert accepts_curriculum_seqlen(model) and not accepts_curriculum_seqlen(GPT(GPTConfig.tiny()))
    engine = tiny_engine(_legacy(8, 32, 6, 8), plugins=[("curriculum", CurriculumPlugin)], model=model)
    x = torch.randn(2, 32)
    train_steps(engine, 3, batch=(x, x))
    assert model.got == [(32, 8), (32, 16), (32, 16)]  # the batch is left whole; the model cuts it


def test_checkpoint_restores_the_difficulty(engine_env, tmp_path):
    engine, _ = _gpt_engine(_legacy(8, 32, 100, 8))
    train_steps(engine, 40)
    saved = engine.plugin_state("curriculum_learning").scheduler.get_current_difficulty()
    assert saved == 16
    engine.save_checkpoint(str(tmp_path))
    fresh, seen = _gpt_engine(_legacy(8, 32, 100, 8))
    assert fresh.plugin_state("curriculum_learning").scheduler.get_current_difficulty() == 8
    fresh.load_checkpoint(str(tmp_path))
    assert fresh.plugin_state("curriculum_learning").scheduler.get_current_difficulty() == 16
    assert fresh.global_steps == 40
    train_steps(fresh, 1)
    assert seen == [16]


def test_config_section(engine_env):
    engine = tiny_engine({"curriculum_learning": {"enabled": False}}, plugins=[("curriculum", CurriculumPlugin)])
    assert engine.config["curriculum_learning"]["curriculum_type"] == "seqlen"
    assert engine.plugin_state("curriculum_learning").scheduler is None
    with pytest.raises(microspeed.ConfigError, match=r"curriculum_learning\.schedule_config\.difficulty_step"):
        tiny_engine({"curriculum_learning": {**_legacy()["curriculum_learning"],
                                             "schedule_config": {"total_curriculum_step": 10}}},
                    plugins=[("curriculum", CurriculumPlugin)])
    with pytest.raises(microspeed.ConfigError, match=r"curriculum_learning\.curriculum_type"):
        tiny_engine({"curriculum_learning": {"enabled": True, "curriculum_type": "vocab"}},
                    plugins=[("curriculum", CurriculumPlugin)])
    with pytest.raises(microspeed.ConfigError, match=r"curriculum_learning\.schedule_config\.total_steps"):
        tiny_engine({"curriculum_learning": {"schedule_config": {"total_steps": 10}}},
                    plugins=[("curriculum", CurriculumPlugin)])
    with pytest.raises(microspeed.ConfigError, match="curriculum_learning: this section belongs"):
        tiny_engine({**_legacy(), "plugins": {"disable": ["curriculum"]}}, plugins=[("curriculum", CurriculumPlugin)])
