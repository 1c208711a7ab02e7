"""Elastic batch sizes: DeepSpeed's ``elasticity`` section and ``compute_elastic_config``.

DeepSpeed's last elastic release (0.16.9) computes, from an ``elasticity`` section, one global
batch size valid for many GPU counts, so a job can be restarted at another world size and keep
its batch (``batch = micro * accumulation * world``). This package reproduces that computation
(versions 0.1 and 0.2) with the same signature, return values and exception names, and the
built-in plugin :class:`~microspeed.elasticity.plugin.ElasticityPlugin` applies it at
``initialize()``: with ``elasticity.enabled`` the batch triad is set for the current data-parallel
world size.
"""

from __future__ import annotations

from microspeed.elasticity.compute import compute_elastic_config, elasticity_enabled, ensure_immutable_elastic_config
from microspeed.elasticity.config import (
    DEEPSPEED_ELASTIC_RELEASE,
    LATEST_VERSION,
    MINIMUM_DEEPSPEED_VERSION,
    ElasticityConfig,
)
from microspeed.elasticity.errors import ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize

__all__ = [
    "DEEPSPEED_ELASTIC_RELEASE",
    "LATEST_VERSION",
    "MINIMUM_DEEPSPEED_VERSION",
    "ElasticityConfig",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "compute_elastic_config",
    "elasticity_enabled",
    "ensure_immutable_elastic_config",
]
