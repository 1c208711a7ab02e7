"""``deepspeed.runtime.zero.config``: DeepSpeed's ``DeepSpeedZeroConfig`` over microspeed's ZeRO schema.

The model has DeepSpeed's field names, aliases (``stage3_prefetch_bucket_size`` for
``prefetch_bucket_size``, ...) and deprecated keys (``cpu_offload``, ``cpu_offload_param``,
``stage3_gather_fp16_weights_on_model_save``), which forward to their replacements as in DeepSpeed.
What a key may hold is decided by microspeed: the section is first validated by
:func:`microspeed.config.parse` against the schema the installed ZeRO plugin claims (an unknown key or
a bad value raises ``pydantic.ValidationError`` carrying microspeed's message), and every default is
the plugin's. Where microspeed differs from DeepSpeed on purpose the object says what microspeed does:
``overlap_comm`` defaults to true at every stage (microspeed overlaps reduction with backward by
default; DeepSpeed only at stage 3).
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Any

from pydantic import Field, model_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel, pp_int
from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
from deepspeed.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)
from microspeed.compat.deepspeed_config import default_of, parse_config
from microspeed.config import AUTO

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroLeafModuleConfig", "DeepSpeedZeroOffloadOptimizerConfig",
           "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum", "ZERO_OPTIMIZATION", "ZeroStageEnum",
           "get_zero_config", "read_zero_config_deprecated"]

ZERO_OPTIMIZATION = "zero_optimization"


def _d(key: str) -> Any:
    """microspeed's default for ``zero_optimization.<key>``."""
    return default_of(f"{ZERO_OPTIMIZATION}.{key}")


class ZeroStageEnum(int, Enum):
    """ZeRO stages: what is partitioned over the data-parallel ranks."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def _plain(value: Any) -> Any:
    """Models inside a section given as objects, as plain dicts (for microspeed's parser)."""
    if isinstance(value, DeepSpeedConfigModel):
        return {k: _plain(v) for k, v in value.model_dump(exclude_unset=True).items()}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "__fspath__"):
        return str(value)
    return value


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    """The ``zero_optimization`` section (see the module docstring for how it is read)."""

    stage: ZeroStageEnum = ZeroStageEnum(_d("stage"))
    contiguous_gradients: bool = _d("contiguous_gradients")
    reduce_scatter: bool = _d("reduce_scatter")
    reduce_bucket_size: int = Field(pp_int(_d("reduce_bucket_size")), gt=0)
    use_multi_rank_bucket_allreduce: bool = _d("use_multi_rank_bucket_allreduce")
    allgather_partitions: bool = _d("allgather_partitions")
    allgather_bucket_size: int = Field(pp_int(_d("allgather_bucket_size")), ge=0)
    overlap_comm: bool = _d("overlap_comm")
    compute_grad_norm: bool = _d("compute_grad_norm")
    load_from_fp32_weights: bool = _d("load_from_fp32_weights")
    elastic_checkpoint: bool = _d("elastic_checkpoint")
    offload_param: DeepSpeedZeroOffloadParamConfig | None = None
    offload_optimizer: DeepSpeedZeroOffloadOptimizerConfig | None = None
    zenflow: dict[str, Any] | None = None
    sub_group_size: int = Field(pp_int(_d("sub_group_size")), ge=0)
    cpu_offload_param: bool | None = Field(None, json_schema_extra={
        "deprecated": True, "new_param": "offload_param",
        "new_param_fn": lambda v: DeepSpeedZeroOffloadParamConfig(device=OffloadDeviceEnum.cpu) if v else None})
    cpu_offload_use_pin_memory: bool | None = Field(None, json_schema_extra={
        "deprecated": True, "new_param": "offload_param or offload_optimizer", "set_new_param": False})
    cpu_offload: bool | None = Field(None, json_schema_extra={
        "deprecated": True, "new_param": "offload_optimizer",
        "new_param_fn": lambda v: DeepSpeedZeroOffloadOptimizerConfig(device=OffloadDeviceEnum.cpu) if v else None})
    prefetch_bucket_size: int = Field(pp_int(_d("stage3_prefetch_bucket_size")), ge=0,
                                      alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(pp_int(_d("stage3_param_persistence_threshold")), ge=0,
                                             alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(pp_int(sys.maxsize, "sys.maxsize"), ge=0,
                                             alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(pp_int(_d("stage3_max_live_parameters")), ge=0,
                                     alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(pp_int(_d("stage3_max_reuse_distance")), ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(_d("stage3_gather_16bit_weights_on_model_save"),
                                                     alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = Field(pp_int(_d("stage3_module_granularity_threshold")),
                                              alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(_d("stage3_use_all_reduce_for_fetch_params"),
                                                  alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(_d("stage3_allgather_sequential"), alias="stage3_allgather_sequential")
    stage3_gather_fp16_weights_on_model_save: bool = Field(False, json_schema_extra={
        "deprecated": True, "new_param": "gather_16bit_weights_on_model_save"})
    ignore_unused_parameters: bool = _d("ignore_unused_parameters")
    legacy_stage1: bool = _d("legacy_stage1")
    round_robin_gradients: bool = _d("round_robin_gradients")
    parameter_alignment: bool = _d("parameter_alignment")
    zero_hpz_partition_size: int = Field(_d("zero_hpz_partition_size"), ge=0)
    zero_quantized_weights: bool = _d("zero_quantized_weights")
    zero_quantized_nontrainable_weights: bool = _d("zero_quantized_nontrainable_weights")
    zero_quantized_gradients: bool = _d("zero_quantized_gradients")
    memory_efficient_linear: bool = _d("memory_efficient_linear")
    pipeline_loading_checkpoint: bool = _d("pipeline_loading_checkpoint")
    override_module_apply: bool = _d("override_module_apply")
    log_trace_cache_warnings: bool = _d("log_trace_cache_warnings")
    enable_sanity_checks: bool = _d("enable_sanity_checks")
    save_muon_momentum_buffer_in_memory: bool = _d("save_muon_momentum_buffer_in_memory")
    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(default_factory=DeepSpeedZeroLeafModuleConfig)

    @model_validator(mode="before")
    @classmethod
    def _microspeed_reads_it(cls, data: Any) -> Any:
        """Validate the section with microspeed's own parser first (its keys, types and ranges).

        ``None`` means "not given" (DeepSpeed's ``offload_param: null``), as does ``"auto"``.
        """
        if isinstance(data, dict):
            given = {k: _plain(v) for k, v in data.items() if v is not None and not (isinstance(v, str) and v == AUTO)}
            parse_config({ZERO_OPTIMIZATION: given})  # raises microspeed.ConfigError (a ValueError)
        return data


def get_zero_config(param_dict: dict[str, Any]) -> DeepSpeedZeroConfig:
    """The :class:`DeepSpeedZeroConfig` of a whole ds_config dict (its ``zero_optimization`` section).

    DeepSpeed's old form ``"zero_optimization": true`` (or a stage number) means stage 1 (or that stage).
    """
    section = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(section, bool):
        section = read_zero_config_deprecated(param_dict)
    elif isinstance(section, int):
        section = {"stage": section}
    return DeepSpeedZeroConfig(**(section or {}))


def read_zero_config_deprecated(param_dict: dict[str, Any]) -> dict[str, Any]:
    """``"zero_optimization": true`` (DeepSpeed's oldest form) as a section: stage 1 when true, else 0."""
    return {"stage": 1 if param_dict.get(ZERO_OPTIMIZATION) else 0}
