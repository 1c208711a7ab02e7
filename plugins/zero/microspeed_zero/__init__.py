"""microspeed-zero: ZeRO stages 1, 2, 3 and ZeRO-Offload (CPU, NVMe) as a microspeed plugin.

``import microspeed.zero`` (or ``deepspeed.zero`` under ``import microspeed as deepspeed``)
resolves to this package: :class:`Init`, :func:`GatheredParameters`, the ``safe_get_*`` / ``safe_set_*``
functions (whole values and this rank's partition, :mod:`microspeed_zero.api`), :func:`estimate_memory`,
:func:`predict_peak_rss` / :func:`predict_for_config` (a rank's peak RSS,
:mod:`microspeed_zero.peak_rss`), DeepSpeed's stage-3 helpers :func:`register_external_parameter`,
:func:`unregister_external_parameter`, the z3 leaf-module functions (``set_z3_leaf_modules`` & co.)
:class:`ZeroParamStatus`, :func:`unwrap_model_for_generation` (the whole model gathered once for a
``generate()`` call) and the optimizer classes :class:`ZeroOptimizer` (stages 1, 2) and
:class:`ZeroOptimizerStage3`. The plugin itself is :class:`microspeed_zero.plugin.ZeroPlugin`,
registered through the ``microspeed.plugins`` entry point ``zero``.
"""

from __future__ import annotations

from microspeed_zero.api import (
    ZeroApiError,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from microspeed_zero.estimator import MemoryEstimate, estimate_memory
from microspeed_zero.generation import unwrap_model_for_generation
from microspeed_zero.init import GatheredParameters, Init
from microspeed_zero.leaf import (
    ZeroParamStatus,
    get_z3_leaf_modules,
    register_external_parameter,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unregister_external_parameter,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from microspeed_zero.optimizer import ZeroOptimizer, ZeroOptimizerStage3
from microspeed_zero.peak_rss import RssPrediction, predict_for_config, predict_peak_rss

__version__ = "0.1.0"

__all__ = [
    "GatheredParameters",
    "Init",
    "MemoryEstimate",
    "RssPrediction",
    "ZeroApiError",
    "ZeroOptimizer",
    "ZeroOptimizerStage3",
    "ZeroParamStatus",
    "estimate_memory",
    "get_z3_leaf_modules",
    "memory_breakdown",
    "predict_for_config",
    "predict_peak_rss",
    "register_external_parameter",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unregister_external_parameter",
    "unset_z3_leaf_modules",
    "unwrap_model_for_generation",
    "z3_leaf_module",
    "z3_leaf_parameter",
]


def memory_breakdown(engine) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state under ZeRO (stage >= 1)."""
    rt = engine.plugin_state("zero")
    if rt is None:
        raise ValueError("memory_breakdown(engine): this engine does not run ZeRO (zero_optimization.stage is 0).")
    return rt.memory_breakdown()
