"""microspeed.elasticity.compute_elastic_config against DeepSpeed 0.16.9's own, on a sweep of inputs.

DeepSpeed removed elasticity in 0.19, so the reference is its last elastic release, read from the
0.16.9 source archive on the package index: the fixture downloads it once with pip into
``~/.cache/microspeed/ds0169`` (``MICROSPEED_DS0169_DIR`` overrides) and executes only
``deepspeed/elasticity/{constants,config,elasticity}.py`` from it, under a private package name
with the two names they import from the rest of DeepSpeed (its version string, a logger) stood in.
Without network access to the index the parity test is skipped, saying so.

Where DeepSpeed returns, microspeed returns the same values (``None`` for "no valid GPU count" is
``[]`` here). Where DeepSpeed raises its own exception, microspeed raises the class of the same
name. Where DeepSpeed fails with a Python error instead (a ``ValueError``, or a ``TypeError``,
``ZeroDivisionError``, ``AssertionError`` or ``NotImplementedError`` from inside its computation),
microspeed raises an elasticity error naming the key — :data:`DEVIATIONS` lists which.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import pytest

from microspeed import ConfigError
from microspeed.elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
)

RELEASE = "0.16.9"
CACHE = Path(os.environ.get("MICROSPEED_DS0169_DIR", Path.home() / ".cache" / "microspeed" / "ds0169"))
ARCHIVE = f"deepspeed-{RELEASE}.tar.gz"
PACKAGE = "_deepspeed_0169_reference"

#: DeepSpeed's error (a Python error raised from inside its computation) -> the elasticity errors microspeed
#: raises for the same input instead.
DEVIATIONS: dict[str, set[str]] = {
    "ValueError": {"ElasticityConfigError", "ElasticityError"},  # non-dict config, micro batch > maximum, ...
    "InvalidVersion": {"ElasticityError"},  # target_deepspeed_version not a version
    "NotImplementedError": {"ElasticityConfigError"},  # version 0.15: not a version of the computation
    "ZeroDivisionError": {"ElasticityConfigError"},  # version 0.1 + return_microbatch without a world size
    # a world size checked against "no valid count" (None); version 0.2 scaling "no valid node count" (None)
    "TypeError": {"ElasticityIncompatibleWorldSize", "ElasticityConfigError"},
    "UFuncTypeError": {"ElasticityConfigError"},  # an empty micro_batch_sizes list
    "AssertionError": {"ElasticityIncompatibleWorldSize"},  # no micro batch divides the per-rank share
}


def _archive() -> Path:
    path = CACHE / ARCHIVE
    if path.is_file():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="download-") as part:
        cmd = [sys.executable, "-m", "pip", "download", f"deepspeed=={RELEASE}", "--no-deps", "--no-binary",
               ":all:", "--disable-pip-version-check", "-d", part]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"cannot download DeepSpeed {RELEASE}'s source archive (pip download timed out after 600 s)")
        got = Path(part) / ARCHIVE
        if done.returncode != 0 or not got.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            pytest.skip(f"cannot download DeepSpeed {RELEASE}'s source archive from the package index "
                        f"(no network?): {' | '.join(tail)}")
        got.replace(path)
    return path


@pytest.fixture(scope="module")
def reference():
    """DeepSpeed 0.16.9's ``deepspeed.elasticity.elasticity`` module, loaded alone from the source archive."""
    pytest.importorskip("numpy", reason="DeepSpeed 0.16.9's elasticity needs numpy")
    pytest.importorskip("packaging", reason="DeepSpeed 0.16.9's elasticity needs packaging")
    sources = {}
    with tarfile.open(_archive()) as tar:
        for name in ("constants", "config", "elasticity"):
            member = tar.extractfile(f"deepspeed-{RELEASE}/deepspeed/elasticity/{name}.py")
            sources[name] = member.read().decode()
    stand_ins = {
        PACKAGE: {"__path__": []},
        f"{PACKAGE}.git_version_info": {"version": RELEASE},
        f"{PACKAGE}.utils": {"logger": logging.getLogger(PACKAGE)},
        f"{PACKAGE}.elasticity": {"__path__": []},
    }
    added = []
    for name, attrs in stand_ins.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
        added.append(name)
    try:
        for name, source in sources.items():
            full = f"{PACKAGE}.elasticity.{name}"
            module = types.ModuleType(full)
            module.__package__ = f"{PACKAGE}.elasticity"
            module.__file__ = f"deepspeed/elasticity/{name}.py"
            sys.modules[full] = module
            added.append(full)
            exec(compile(source, module.__file__, "exec"), module.__dict__)
        yield sys.modules[f"{PACKAGE}.elasticity.elasticity"]
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _normalise(result: tuple) -> tuple:
    batch, valid, *micro = result
    return (int(batch), [int(v) for v in valid or []], *(None if m is None else int(m) for m in micro))


def _outcome(fn, case: dict) -> tuple[str, object]:
    try:
        return "ok", _normalise(fn(case["config"], case["target"], world_size=case["world_size"],
                                   return_microbatch=case["return_microbatch"]))
    except Exception as exc:  # noqa: BLE001 - the class is what is compared
        return "error", exc


def _case(section: dict | None = None, *, world_size: int = 0, env_world_size: str | None = None,
          target: str = RELEASE, return_microbatch: bool = False, config: object = None) -> dict:
    if config is None:
        config = {} if section is None else {"elasticity": section}
    return {"config": config, "world_size": world_size, "env_world_size": env_world_size, "target": target,
            "return_microbatch": return_microbatch}


def _sweep() -> list[dict]:
    """Edge cases by hand, then a seeded random sample of the whole input space."""
    base = {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}
    cases = [
        _case(base, world_size=w) for w in (0, 1, 2, 3, 4, 7, 9, 16, 840, 1680)
    ] + [
        _case({**base, "version": 0.1}, world_size=w) for w in (0, 1, 2, 4, 5, 9)
    ] + [
        _case(config=[1, 2]),  # not a dict
        _case(None),  # no elasticity section
        _case({"enabled": False, "max_train_batch_size": 100, "micro_batch_sizes": [2]}),
        _case({"max_train_batch_size": 100, "micro_batch_sizes": [2]}),  # enabled missing: disabled
        _case({"enabled": True, "micro_batch_sizes": [2]}),
        _case({"enabled": True, "max_train_batch_size": 100}),
        _case({**base, "micro_batch_sizes": 4}),
        _case({**base, "micro_batch_sizes": [2, 2.5]}),
        _case({**base, "micro_batch_sizes": [2, 0]}),
        _case({**base, "micro_batch_sizes": [2, -4]}),
        _case({**base, "micro_batch_sizes": [], "version": 0.1}),
        _case({**base, "min_gpus": 0}), _case({**base, "max_gpus": 0}), _case({**base, "min_gpus": 8, "max_gpus": 4}),
        _case({**base, "model_parallel_size": 0}), _case({**base, "num_gpus_per_node": 0}),
        _case({**base, "min_time": -1}), _case({**base, "min_time": 20, "version": 0.1}),
        _case({**base, "model_parallel_size": 2, "version": 0.1}),
        _case({**base, "version": 0.3}), _case({**base, "version": 0.15}),
        _case({**base, "version": "0.2"}, world_size=2),
        _case({**base, "version": "0.1"}), _case({**base, "version": 1}),
        _case(base, target="0.3.7"), _case(base, target="0.3.8", world_size=2), _case(base, target="0.3.8rc1"),
        _case(base, target="not-a-version"), _case(base, target="1.0", world_size=4),
        _case({**base, "version": 0.1, "max_train_batch_size": 5}),  # micro batch 6 > maximum
        _case({**base, "version": 0.2, "max_train_batch_size": 5}, world_size=1),
        _case(base),  # version 0.2 without a world size: WORLD_SIZE unset
        _case(base, env_world_size="4"), _case(base, env_world_size="x"),
        _case(base, env_world_size="4", return_microbatch=True),
        _case(base, env_world_size="5", return_microbatch=True),
        _case({**base, "version": 0.1}, return_microbatch=True),
        _case({**base, "version": 0.1}, return_microbatch=True, world_size=4),
        _case({**base, "num_gpus_per_node": 4, "model_parallel_size": 3}, world_size=4),
        _case({**base, "num_gpus_per_node": 8, "model_parallel_size": 2}, world_size=16),
        _case({**base, "num_gpus_per_node": 8, "model_parallel_size": 2}, world_size=4),
        _case({**base, "num_gpus_per_node": 4, "min_gpus": 1, "max_gpus": 3}, world_size=4),
        _case({**base, "version": 0.1, "min_gpus": 900, "max_gpus": 1000, "prefer_larger_batch": False}),
        _case({**base, "version": 0.1, "min_gpus": 900, "max_gpus": 1000, "prefer_larger_batch": False},
              world_size=2),
        _case({**base, "version": 0.1, "min_gpus": 900, "max_gpus": 1000}, world_size=2),
        _case({"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [8]}, world_size=1),
        _case({"enabled": True, "max_train_batch_size": 10 ** 6, "micro_batch_sizes": [1], "version": 0.1}),
    ]
    rng = random.Random(18)
    micro_choices = [[1], [2], [8], [2, 4, 6], [3, 5], [2, 3, 7], [4, 2], [6, 4, 2], [16, 32], [5, 10, 15],
                     [1, 2, 3, 4], [12], [7, 11]]
    for _ in range(1500):
        section = {"enabled": True, "max_train_batch_size": rng.choice([1, 7, 16, 24, 64, 100, 250, 512, 1000, 2000,
                                                                        3000]),
                   "micro_batch_sizes": list(rng.choice(micro_choices))}
        if rng.random() < 0.7:
            lo = rng.choice([1, 1, 2, 3, 4, 8])
            section["min_gpus"], section["max_gpus"] = lo, rng.choice([lo, lo + 1, 4, 8, 16, 64, 10000])
        if rng.random() < 0.5:
            section["prefer_larger_batch"] = rng.random() < 0.5
        version = rng.choice([0.1, 0.2, 0.2, None])
        if version is not None:
            section["version"] = version
        if version != 0.1 and rng.random() < 0.5:
            gpn = rng.choice([1, 2, 4, 8])
            section["num_gpus_per_node"] = gpn
            section["model_parallel_size"] = rng.choice([m for m in (1, 2, 4) if m <= gpn] + [3])
        world = rng.choice([0, 0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32])
        env = str(rng.choice([1, 2, 4, 8])) if world == 0 and rng.random() < 0.5 else None
        cases.append(_case(section, world_size=world, env_world_size=env,
                           return_microbatch=world == 0 and rng.random() < 0.3))
    return cases


def _compare(case: dict, ours: tuple[str, object], theirs: tuple[str, object]) -> str | None:
    """``None`` when microspeed's outcome is DeepSpeed's, else what differs."""
    if theirs[0] == "ok":
        return None if ours == theirs else f"DeepSpeed returned {theirs[1]}, microspeed {ours[1]!r}"
    their_name = type(theirs[1]).__name__
    if ours[0] == "ok":
        return f"DeepSpeed raised {their_name}: {theirs[1]}, microspeed returned {ours[1]}"
    our_name = type(ours[1]).__name__
    allowed = {their_name} if their_name.startswith("Elasticity") else DEVIATIONS.get(their_name, set())
    if our_name not in allowed:
        return f"DeepSpeed raised {their_name}: {theirs[1]}, microspeed {our_name}: {ours[1]} (allowed: {allowed})"
    return None


def test_compute_elastic_config_equals_deepspeed_0169_on_a_sweep(reference, monkeypatch):
    tally: dict[str, int] = {}
    problems = []
    for case in _sweep():
        if case["env_world_size"] is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", case["env_world_size"])
        theirs = _outcome(reference.compute_elastic_config, case)
        ours = _outcome(compute_elastic_config, case)
        kind = "ok" if theirs[0] == "ok" else type(theirs[1]).__name__
        tally[kind] = tally.get(kind, 0) + 1
        problem = _compare(case, ours, theirs)
        if problem:
            problems.append(f"{case}: {problem}")
        if ours[0] == "error":
            assert isinstance(ours[1], ElasticityError) and isinstance(ours[1], ConfigError), ours[1]
    assert not problems, f"{len(problems)} differences, first ones:\n" + "\n".join(problems[:10])
    # The sweep reaches every outcome: values and each of DeepSpeed's errors.
    assert tally["ok"] >= 500, tally
    for kind in ("ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize", "ValueError"):
        assert tally.get(kind, 0) >= 1, (kind, tally)


def test_the_sweep_reaches_both_versions_and_the_fallback(reference, monkeypatch):
    """The sweep's successful calls cover version 0.1, version 0.2 in the list and outside it (own batch)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    section = {"enabled": True, "max_train_batch_size": 100, "micro_batch_sizes": [3, 5], "version": 0.2}
    # Outside the list: 7 ranks get a batch of their own, valid only for 7.
    ours = compute_elastic_config({"elasticity": section}, RELEASE, world_size=7)
    assert ours == _normalise(reference.compute_elastic_config({"elasticity": section}, RELEASE, world_size=7))
    assert ours[1] == [7] and ours[0] % 7 == 0
    cases = _sweep()
    versions = {str(c["config"].get("elasticity", {}).get("version", 0.2)) for c in cases
                if isinstance(c["config"], dict)}
    assert {"0.1", "0.2"} <= versions


def test_known_values_of_the_documented_example():
    """DeepSpeed's documented example (max 2000, micro batches 2/4/6): batch 1680, valid for 32 GPU counts."""
    section = {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1}
    batch, valid = compute_elastic_config({"elasticity": section}, RELEASE)
    assert batch == 1680 and len(valid) == 32 and valid[:8] == [1, 2, 3, 4, 5, 6, 7, 8] and valid[-1] == 840
    assert compute_elastic_config({"elasticity": section}, RELEASE, world_size=4) == (1680, valid, 6)
    assert compute_elastic_config({"elasticity": section}, RELEASE, world_size=8)[2] == 6  # 210 per rank: 6 divides
    assert compute_elastic_config({"elasticity": section}, RELEASE, world_size=5)[2] == 6
    with pytest.raises(ElasticityIncompatibleWorldSize, match="world size 9"):
        compute_elastic_config({"elasticity": section}, RELEASE, world_size=9)
    with pytest.raises(ElasticityConfigError, match="elasticity.max_train_batch_size"):
        compute_elastic_config({"elasticity": {"enabled": True, "micro_batch_sizes": [2]}}, RELEASE)


@pytest.mark.parametrize("a, b", list(itertools.combinations([0.1, 0.2], 2)))
def test_versions_agree_on_one_gpu_per_node(a, b):
    """Version 0.2 with one GPU per node and no model parallelism searches what version 0.1 searches."""
    section = {"enabled": True, "max_train_batch_size": 512, "micro_batch_sizes": [2, 8]}
    one = compute_elastic_config({"elasticity": {**section, "version": a}}, RELEASE, world_size=4)
    two = compute_elastic_config({"elasticity": {**section, "version": b}}, RELEASE, world_size=4)
    assert one == two
