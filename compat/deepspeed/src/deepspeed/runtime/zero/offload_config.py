"""``deepspeed.runtime.zero.offload_config``: the ``offload_param`` / ``offload_optimizer`` models of ZeRO.

Field names, types and bounds are DeepSpeed's; defaults are the ones microspeed's ZeRO plugin gives the
same keys (read from its ds_config schema), so the object says what microspeed does with the section.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import Field

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from microspeed.compat.deepspeed_config import default_of

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]


def _default(section: str, key: str) -> Any:
    return default_of(f"zero_optimization.{section}.{key}")


class OffloadDeviceEnum(StrEnum):
    """Where offloaded state lives."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(StrEnum):
    """Kinds of state ``engine.offload_states`` may move (DeepSpeed's names)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class DeepSpeedZeroOffloadParamConfig(DeepSpeedConfigModel):
    """``zero_optimization.offload_param``: stage 3 parameter partitions off the device."""

    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    nvme_path: Path | None = None
    buffer_count: int = Field(_default("offload_param", "buffer_count"), ge=0)
    buffer_size: int = Field(_default("offload_param", "buffer_size"), ge=0)
    max_in_cpu: int = Field(_default("offload_param", "max_in_cpu"), ge=0)
    pin_memory: bool = _default("offload_param", "pin_memory")


class DeepSpeedZeroOffloadOptimizerConfig(DeepSpeedConfigModel):
    """``zero_optimization.offload_optimizer``: optimizer state (and its step) off the device."""

    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    nvme_path: Path | None = None
    buffer_count: int = Field(_default("offload_optimizer", "buffer_count"), ge=0)
    pin_memory: bool = _default("offload_optimizer", "pin_memory")
    pipeline_read: bool = _default("offload_optimizer", "pipeline_read")
    pipeline_write: bool = _default("offload_optimizer", "pipeline_write")
    fast_init: bool = _default("offload_optimizer", "fast_init")
    ratio: float = Field(_default("offload_optimizer", "ratio"), ge=0.0, le=1.0)
    super_offload: bool = _default("offload_optimizer", "super_offload")
    cpuadam_cores_perc: float = Field(_default("offload_optimizer", "cpuadam_cores_perc"), ge=0.0, le=1.0)

    @property
    def pipeline(self) -> bool:
        """Whether NVMe reads or writes of optimizer sub-groups are pipelined (``pipeline_read or pipeline_write``)."""
        return bool(self.pipeline_read or self.pipeline_write)
