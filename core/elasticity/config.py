"""The ``elasticity`` section: its keys, DeepSpeed 0.16's defaults, and :class:`ElasticityConfig`.

Keys (DeepSpeed's ``elasticity`` section, versions 0.1 and 0.2 of its batch computation)::

    "elasticity": {
        "enabled": true,
        "max_train_batch_size": 2000,      # largest global batch acceptable
        "micro_batch_sizes": [2, 4, 6],    # per-GPU micro batches acceptable
        "min_gpus": 1, "max_gpus": 10000,  # range of GPU counts to make valid
        "min_time": 0,                     # minutes before a scheduler may rescale (scheduler only)
        "prefer_larger_batch": true,       # among equally elastic batches, the larger
        "ignore_non_elastic_batch_info": false,
        "model_parallel_size": 1, "num_gpus_per_node": 1,  # version 0.2: node-level elasticity
        "version": 0.2
    }
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from microspeed.elasticity.errors import ElasticityConfigError

SECTION = "elasticity"
#: The newest version of the batch computation (DeepSpeed 0.16's ``LATEST_ELASTICITY_VERSION``).
LATEST_VERSION = 0.2
#: The oldest DeepSpeed release with elasticity; older ``target_deepspeed_version`` values are refused.
MINIMUM_DEEPSPEED_VERSION = "0.3.8"
#: The DeepSpeed release whose elastic batch computation microspeed reproduces (its last elastic line).
DEEPSPEED_ELASTIC_RELEASE = "0.16.9"
#: Environment variable in which a resource scheduler publishes the elastic config it scaled the job with.
SCHEDULER_CONFIG_ENV = "DEEPSPEED_ELASTICITY_CONFIG"

#: Every key of the section and its default (DeepSpeed 0.16's).
DEFAULTS: dict[str, Any] = {
    "enabled": False,
    "max_train_batch_size": 2000,
    "micro_batch_sizes": [2, 4, 6],
    "min_gpus": 1,
    "max_gpus": 10000,
    "min_time": 0,
    "prefer_larger_batch": True,
    "ignore_non_elastic_batch_info": False,
    "model_parallel_size": 1,
    "num_gpus_per_node": 1,
    "version": LATEST_VERSION,
}


def _number(key: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ElasticityConfigError(f"{SECTION}.{key}: expected a number, got {value!r}.")
    return value


class ElasticityConfig:
    """The ``elasticity`` section of a ds_config, checked as DeepSpeed 0.16 checks it.

    When ``enabled``, ``max_train_batch_size`` and ``micro_batch_sizes`` are required; every other
    key takes :data:`DEFAULTS`. Raises :class:`ElasticityConfigError` naming the key.
    """

    def __init__(self, section: Mapping[str, Any]) -> None:
        self.enabled = bool(section.get("enabled", DEFAULTS["enabled"]))
        for key in ("max_train_batch_size", "micro_batch_sizes"):
            if self.enabled and key not in section:
                raise ElasticityConfigError(f"{SECTION}.{key}: required when elasticity is enabled; add it "
                                            f"(e.g. \"{key}\": {json.dumps(DEFAULTS[key])}).")
        self.max_train_batch_size = section.get("max_train_batch_size", DEFAULTS["max_train_batch_size"])
        micro = section.get("micro_batch_sizes", DEFAULTS["micro_batch_sizes"])
        if not isinstance(micro, list):
            raise ElasticityConfigError(f"{SECTION}.micro_batch_sizes: expected a list of micro batch sizes, "
                                        f"got {type(micro).__name__} {micro!r}.")
        if not micro:
            raise ElasticityConfigError(f"{SECTION}.micro_batch_sizes: empty; give at least one micro batch size.")
        if not all(isinstance(m, int) and not isinstance(m, bool) for m in micro):
            raise ElasticityConfigError(f"{SECTION}.micro_batch_sizes: expected integers only, got {micro!r}.")
        if not all(m > 0 for m in micro):
            raise ElasticityConfigError(f"{SECTION}.micro_batch_sizes: expected positive integers only, "
                                        f"got {micro!r}.")
        self.micro_batch_sizes: list[int] = micro
        self.min_gpus = _number("min_gpus", section.get("min_gpus", DEFAULTS["min_gpus"]))
        self.max_gpus = _number("max_gpus", section.get("max_gpus", DEFAULTS["max_gpus"]))
        if self.min_gpus < 1 or self.max_gpus < 1:
            raise ElasticityConfigError(f"{SECTION}.min_gpus / max_gpus: both must be > 0, given min_gpus="
                                        f"{self.min_gpus}, max_gpus={self.max_gpus}.")
        if self.max_gpus < self.min_gpus:
            raise ElasticityConfigError(f"{SECTION}.min_gpus: {self.min_gpus} is greater than max_gpus="
                                        f"{self.max_gpus}; lower min_gpus or raise max_gpus.")
        self.model_parallel_size = _number("model_parallel_size",
                                           section.get("model_parallel_size", DEFAULTS["model_parallel_size"]))
        if self.model_parallel_size < 1:
            raise ElasticityConfigError(f"{SECTION}.model_parallel_size: must be >= 1, given "
                                        f"{self.model_parallel_size}.")
        self.num_gpus_per_node = _number("num_gpus_per_node",
                                         section.get("num_gpus_per_node", DEFAULTS["num_gpus_per_node"]))
        if self.num_gpus_per_node < 1:
            raise ElasticityConfigError(f"{SECTION}.num_gpus_per_node: must be >= 1, given "
                                        f"{self.num_gpus_per_node}.")
        self.min_time = _number("min_time", section.get("min_time", DEFAULTS["min_time"]))
        if self.min_time < 0:
            raise ElasticityConfigError(f"{SECTION}.min_time: must be >= 0 (minutes), given {self.min_time}.")
        self.version = section.get("version", DEFAULTS["version"])
        self.prefer_larger_batch = section.get("prefer_larger_batch", DEFAULTS["prefer_larger_batch"])
        self.ignore_non_elastic_batch_info = section.get("ignore_non_elastic_batch_info",
                                                         DEFAULTS["ignore_non_elastic_batch_info"])

    @property
    def version_number(self) -> float:
        """``version`` as a number (DeepSpeed reads it with ``float()``, so ``"0.2"`` is 0.2)."""
        try:
            return float(self.version)
        except (TypeError, ValueError):
            raise ElasticityConfigError(f"{SECTION}.version: expected 0.1 or 0.2, got {self.version!r}.") from None

    def as_dict(self) -> dict[str, Any]:
        """The checked values, every key present."""
        return {key: getattr(self, key) for key in DEFAULTS}

    def __repr__(self) -> str:
        return f"ElasticityConfig({json.dumps(self.as_dict(), sort_keys=True)})"
