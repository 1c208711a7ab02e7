"""``compute_elastic_config``: DeepSpeed 0.16.9's elasticity API, with its signature and return values."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from microspeed.elasticity.batch_sizes import batch_for_gpus_v01, batch_for_gpus_v02
from microspeed.elasticity.config import (
    LATEST_VERSION,
    MINIMUM_DEEPSPEED_VERSION,
    SCHEDULER_CONFIG_ENV,
    SECTION,
    ElasticityConfig,
)
from microspeed.elasticity.errors import ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize

_VERSION = re.compile(r"^\s*v?(\d+(?:\.\d+)*)(.*)$", re.I)
_PRE_RELEASE = re.compile(r"^[-_.]?(a|alpha|b|beta|c|rc|pre|preview|dev)", re.I)


def _release(version: str) -> tuple[tuple[int, ...], bool]:
    """``(release numbers, is a pre-release)`` of a version string, PEP 440 style."""
    match = _VERSION.match(str(version))
    if not match:
        raise ElasticityError(f"target_deepspeed_version: {version!r} is not a version number (e.g. \"0.16.9\").")
    numbers = tuple(int(p) for p in match.group(1).split("."))
    return numbers, bool(_PRE_RELEASE.match(match.group(2)))


def _at_least(version: str, minimum: str) -> bool:
    (have, pre), (need, _) = _release(version), _release(minimum)
    width = max(len(have), len(need))
    have, need = have + (0,) * (width - len(have)), need + (0,) * (width - len(need))
    return have > need or (have == need and not pre)


def elasticity_enabled(ds_config: Mapping[str, Any]) -> bool:
    """Whether ``ds_config`` has an ``elasticity`` section with ``"enabled": true``."""
    section = ds_config.get(SECTION)
    return bool(section.get("enabled", False)) if isinstance(section, Mapping) else False


def ensure_immutable_elastic_config(runtime_elastic_config_dict: Mapping[str, Any]) -> None:
    """Refuse an ``elasticity`` section that differs from the one the resource scheduler scaled the job with.

    The scheduler publishes its section as JSON in ``DEEPSPEED_ELASTICITY_CONFIG``; ``max_train_batch_size``,
    ``micro_batch_sizes`` and ``version`` must match. Without the variable there is nothing to compare.
    """
    published = os.environ.get(SCHEDULER_CONFIG_ENV)
    if published is None:
        return
    try:
        scheduler = ElasticityConfig(json.loads(published))
    except json.JSONDecodeError as exc:
        raise ElasticityConfigError(f"{SCHEDULER_CONFIG_ENV}: not valid JSON ({exc}).") from None
    runtime = ElasticityConfig(runtime_elastic_config_dict)
    for key in ("max_train_batch_size", "micro_batch_sizes", "version"):
        if getattr(runtime, key) != getattr(scheduler, key):
            raise ElasticityConfigError(
                f"{SECTION}.{key}: the resource scheduler scaled this job with {getattr(scheduler, key)!r} "
                f"({SCHEDULER_CONFIG_ENV}) but the config passed to training has {getattr(runtime, key)!r}; "
                "give both the same elasticity section.")


def _largest_micro_batch(batch: int, world_size: int, micro_batches: list[int]) -> int:
    for micro in sorted(set(micro_batches), reverse=True):
        if batch // world_size % micro == 0:
            return micro
    raise ElasticityIncompatibleWorldSize(
        f"{SECTION}.micro_batch_sizes: none of {micro_batches} divides the per-rank share "
        f"{batch // world_size} of the batch {batch} at world size {world_size}.")


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False) -> tuple[Any, ...]:
    """The elastic global batch size and the GPU counts it is valid for (DeepSpeed 0.16.9's API).

    The same ``ds_config`` always gives the same answer, so a scheduler and the training job agree.

    Args:
        ds_config: a ds_config dict with an enabled ``elasticity`` section.
        target_deepspeed_version: the DeepSpeed version the job is meant for; releases before 0.3.8
            had no elasticity and are refused.
        world_size: the data-parallel world size the job runs at (0: unknown). When > 0 it must be
            one of the valid counts, and the micro batch for it is returned too. Version 0.2 needs
            it, or the ``WORLD_SIZE`` environment variable.
        return_microbatch: also return a micro batch size when ``world_size`` is 0 (version 0.2:
            the one for ``WORLD_SIZE``).

    Returns:
        ``(final_batch_size, valid_gpus)``, or ``(final_batch_size, valid_gpus, micro_batch_size)``
        when ``world_size > 0`` or ``return_microbatch``. Version 0.2 lists data-parallel sizes
        (GPUs / model-parallel size). Where DeepSpeed returns ``None`` for "no valid count" this
        returns ``[]``.

    Raises:
        ElasticityConfigError: the section is missing, disabled or invalid (the key is named).
        ElasticityError: ``target_deepspeed_version`` predates elasticity, or version 0.2's
            ``num_gpus_per_node`` is not a multiple of ``model_parallel_size``.
        ElasticityIncompatibleWorldSize: ``world_size`` is not a valid count.

    Where DeepSpeed 0.16.9 fails with a plain Python error instead (a non-dict config or a micro
    batch above the maximum: ``ValueError``; an unknown version: ``NotImplementedError``; version 0.1
    with ``return_microbatch`` and no world size: ``ZeroDivisionError``; no valid GPU count at all:
    ``TypeError``), this raises the elasticity error above that names the key; every one is a
    :class:`microspeed.ConfigError` and so a ``ValueError``.
    """
    if not isinstance(ds_config, dict):
        raise ElasticityConfigError(f"ds_config: expected a dict, got {type(ds_config).__name__}: {ds_config!r}.")
    if SECTION not in ds_config:
        raise ElasticityConfigError(f"{SECTION}: missing from the config; add an \"{SECTION}\" section to run "
                                    "an elastic training job.")
    section = ds_config[SECTION]
    if not isinstance(section, Mapping):
        raise ElasticityConfigError(f"{SECTION}: expected an object, got {section!r}.")
    if not section.get("enabled", False):
        raise ElasticityConfigError(f"{SECTION}.enabled: elasticity is disabled; set \"enabled\": true to run an "
                                    "elastic training job.")
    config = ElasticityConfig(section)
    version = config.version_number
    if config.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(f"{SECTION}.model_parallel_size: {config.model_parallel_size} needs "
                                    f"{SECTION}.version 0.2 (version {config.version} has no model parallelism).")
    if version > LATEST_VERSION:
        raise ElasticityConfigError(f"{SECTION}.version: {config.version} is newer than the latest supported, "
                                    f"{LATEST_VERSION}.")
    if not _at_least(target_deepspeed_version, MINIMUM_DEEPSPEED_VERSION):
        raise ElasticityError(f"target_deepspeed_version: {target_deepspeed_version} predates elasticity (needs "
                              f">= {MINIMUM_DEEPSPEED_VERSION}).")

    micro_batch_for_env = None
    if version == 0.1:
        batch, found = batch_for_gpus_v01(config.micro_batch_sizes, config.max_train_batch_size, config.min_gpus,
                                          config.max_gpus, prefer_larger=config.prefer_larger_batch)
        valid = found or []
    elif version == 0.2:
        if world_size != 0:
            current = world_size
        elif os.environ.get("WORLD_SIZE", "").isnumeric():
            current = int(os.environ["WORLD_SIZE"])
        else:
            raise ElasticityConfigError(
                f"{SECTION}.version: 0.2 needs the world size to compute the batch; pass world_size= or set "
                f"WORLD_SIZE (now {os.environ.get('WORLD_SIZE')!r}).")
        batch, valid, micro_batch_for_env = batch_for_gpus_v02(
            config.micro_batch_sizes, config.max_train_batch_size, current, config.min_gpus, config.max_gpus,
            prefer_larger=config.prefer_larger_batch, num_gpus_per_node=config.num_gpus_per_node,
            model_parallel_size=config.model_parallel_size)
    else:
        raise ElasticityConfigError(f"{SECTION}.version: {config.version} is not a version of the batch "
                                    "computation; use 0.1 or 0.2.")
    batch = int(batch)

    if world_size > 0:
        if world_size not in valid:
            raise ElasticityIncompatibleWorldSize(
                f"{SECTION}: world size {world_size} is not one of the valid GPU counts {valid} for "
                f"max_train_batch_size={config.max_train_batch_size}, micro_batch_sizes="
                f"{config.micro_batch_sizes}, min_gpus={config.min_gpus}, max_gpus={config.max_gpus}; run at one "
                "of those counts or change the section.")
        return batch, valid, _largest_micro_batch(batch, world_size, config.micro_batch_sizes)
    if return_microbatch:
        if version == 0.2:
            return batch, valid, micro_batch_for_env
        raise ElasticityConfigError(f"{SECTION}.version: 0.1 gives a micro batch only for a world size; pass "
                                    "world_size > 0 with return_microbatch=True.")
    return batch, valid
