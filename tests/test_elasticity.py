"""The ``elasticity`` section at ``initialize()``: the batch triad for the world size, as DeepSpeed 0.16.9 sets it.

Expected triads were computed with DeepSpeed 0.16.9's ``compute_elastic_config`` (tests/test_elasticity_parity.py
checks microspeed's function against it): max_train_batch_size 64 with micro batches 2/3/8 gives the global
batch 48 at every world size, as micro 8 x 6 steps on 1 rank, 8 x 3 on 2 ranks, 3 x 4 on 4 ranks. A checkpoint
written at 2 or 4 ranks resumes on 1 rank with that rank's triad and the same global batch.
"""

from __future__ import annotations

import pytest

import microspeed
from microspeed import ConfigError
from microspeed.elasticity import ElasticityConfigError, ElasticityIncompatibleWorldSize
from microspeed.testing import TinyModel, run_distributed, tiny_engine, train_steps

SECTION = {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 3, 8]}
OPTIMIZER = {"type": "SGD", "params": {"lr": 0.05}}
#: world size -> (train_batch_size, micro batch, gradient accumulation steps), from DeepSpeed 0.16.9.
EXPECTED = {1: (48, 8, 6), 2: (48, 8, 3), 4: (48, 3, 4)}


def _config(**section) -> dict:
    return {"elasticity": {**SECTION, **section}, "optimizer": OPTIMIZER}


def _triad(engine) -> tuple[int, int, int]:
    return engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()


def _elastic_rank(version: float, save_dir: str | None = None) -> dict:
    engine = tiny_engine(_config(version=version), defaults=False)
    losses = train_steps(engine, 2)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    return {"triad": _triad(engine), "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "global_samples": engine.global_samples, "losses": losses}


@pytest.mark.parametrize("version", [0.1, 0.2])
def test_world_size_1_takes_deepspeeds_elastic_triad_and_trains(version):
    out = _elastic_rank(version)
    assert out["triad"] == EXPECTED[1]
    assert out["global_steps"] == 2 and out["micro_steps"] == 2 * EXPECTED[1][2]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_more_ranks_keep_the_global_batch_with_deepspeeds_micro_batch_and_accumulation(world_size, tmp_path):
    results = run_distributed(_elastic_rank, world_size=world_size, args=(0.2, str(tmp_path)), timeout=180)
    for out in results:
        assert out["triad"] == EXPECTED[world_size]
        assert out["global_steps"] == 2 and out["micro_steps"] == 2 * EXPECTED[world_size][2]
        assert out["global_samples"] == 2 * 48
    # Restarted on one rank from that checkpoint: the same global batch, as micro 8 x 6 steps; counters go on.
    engine = tiny_engine(_config(), defaults=False)
    engine.load_checkpoint(str(tmp_path))
    assert _triad(engine) == EXPECTED[1] and engine.global_steps == 2 and engine.global_samples == 2 * 48
    train_steps(engine, 1)
    assert engine.global_steps == 3 and engine.global_samples == 3 * 48


def test_ignore_non_elastic_batch_info_overrides_a_given_triad():
    cfg = {**_config(ignore_non_elastic_batch_info=True), "train_batch_size": 16, "gradient_accumulation_steps": 2}
    assert _triad(tiny_engine(cfg, defaults=False)) == EXPECTED[1]


def test_a_disabled_section_leaves_the_users_triad():
    cfg = {"elasticity": {**SECTION, "enabled": False}, "optimizer": OPTIMIZER, "train_batch_size": 4}
    assert _triad(tiny_engine(cfg, defaults=False)) == (4, 4, 1)


@pytest.mark.parametrize("config, error, names", [
    ({"train_batch_size": 48}, ElasticityConfigError, "train_batch_size"),
    ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 6}, ElasticityConfigError,
     "train_micro_batch_size_per_gpu, gradient_accumulation_steps"),
    ({"elasticity": {"enabled": True, "micro_batch_sizes": [2]}}, ElasticityConfigError,
     "elasticity.max_train_batch_size"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, ElasticityConfigError,
     "elasticity.micro_batch_sizes"),
    ({"elasticity": {**SECTION, "micro_batch_sizes": [2, 0]}}, ConfigError, "elasticity.micro_batch_sizes"),
    ({"elasticity": {**SECTION, "micro_batch_sizes": 8}}, ConfigError, "elasticity.micro_batch_sizes"),
    ({"elasticity": {**SECTION, "micro_batch_sizes": [128]}}, ElasticityConfigError, "elasticity.micro_batch_sizes"),
    ({"elasticity": {**SECTION, "min_gpus": 8, "max_gpus": 4}}, ElasticityConfigError, "elasticity.min_gpus"),
    ({"elasticity": {**SECTION, "max_gpus": 0}}, ConfigError, "elasticity.max_gpus"),
    ({"elasticity": {**SECTION, "min_time": -1}}, ConfigError, "elasticity.min_time"),
    ({"elasticity": {**SECTION, "version": 0.3}}, ConfigError, "elasticity.version"),
    ({"elasticity": {**SECTION, "version": 0.1, "model_parallel_size": 2}}, ElasticityConfigError,
     "elasticity.model_parallel_size"),
    ({"elasticity": {**SECTION, "num_gpus_per_node": 4, "model_parallel_size": 3}}, ConfigError,
     "elasticity.num_gpus_per_node"),
    ({"elasticity": {**SECTION, "max_gpu": 4}}, ConfigError, "Did you mean 'max_gpus'"),
    ({"elasticity": {**SECTION, "enabled": "yes"}}, ConfigError, "elasticity.enabled"),
    # version 0.1: world size 1 is not a valid count when at least 2 GPUs are asked for
    ({"elasticity": {**SECTION, "min_gpus": 2, "version": 0.1}}, ElasticityIncompatibleWorldSize, "world size 1"),
])
def test_bad_elasticity_configs_are_refused_naming_the_key(config, error, names):
    cfg = {**_config(), **config}
    with pytest.raises(error) as info:
        microspeed.initialize(model=TinyModel(), config=cfg)
    assert names in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_version_02_gives_a_world_size_outside_its_list_a_batch_of_its_own():
    """As DeepSpeed 0.16.9: (64, [1], 8) for world size 1 when min_gpus is 2 (version 0.1 refuses it)."""
    assert _triad(tiny_engine(_config(min_gpus=2), defaults=False)) == (64, 8, 8)


def test_the_scheduler_config_must_match(monkeypatch):
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", '{"enabled": true, "max_train_batch_size": 32, '
                                                      '"micro_batch_sizes": [2, 3, 8]}')
    with pytest.raises(ElasticityConfigError, match="elasticity.max_train_batch_size.*scheduler"):
        tiny_engine(_config(), defaults=False)
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", '{"enabled": true, "max_train_batch_size": 64, '
                                                      '"micro_batch_sizes": [2, 3, 8]}')
    assert _triad(tiny_engine(_config(), defaults=False)) == EXPECTED[1]
