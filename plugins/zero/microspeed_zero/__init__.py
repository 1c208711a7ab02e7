"""microspeed-zero: ZeRO stages 1, 2, 3 and ZeRO-Offload (CPU, NVMe) as a microspeed plugin.

``import microspeed.zero`` (or ``deepspeed.zero`` under ``import microspeed as deepspeed``)
resolves to this package: :class:`Init`, :func:`GatheredParameters`, the ``safe_get_full_*``
functions and :func:`estimate_memory`. The plugin itself is :class:`microspeed_zero.plugin.ZeroPlugin`,
registered through the ``microspeed.plugins`` entry point ``zero``.
"""

from __future__ import annotations

from microspeed_zero.api import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from microspeed_zero.estimator import MemoryEstimate, estimate_memory
from microspeed_zero.init import GatheredParameters, Init

__version__ = "0.1.0"

__all__ = [
    "GatheredParameters",
    "Init",
    "MemoryEstimate",
    "estimate_memory",
    "memory_breakdown",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
]


def memory_breakdown(engine) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state under ZeRO (stage >= 1)."""
    rt = engine.plugin_state("zero")
    if rt is None:
        raise ValueError("memory_breakdown(engine): this engine does not run ZeRO (zero_optimization.stage is 0).")
    return rt.memory_breakdown()
