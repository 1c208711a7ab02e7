"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed's ZeRO-1/2 optimizer module, mapped to microspeed's ZeRO plugin.

``DeepSpeedZeroOptimizer`` is the class of the optimizer ``initialize()`` returns at stages 1 and 2
(:class:`microspeed.zero.ZeroOptimizer`), so ``isinstance`` checks hold. One difference: microspeed's stage-3
optimizer derives from it, so a stage-3 optimizer is an instance too (DeepSpeed's classes are siblings): test
``DeepSpeedZeroOptimizer_Stage3`` first. DeepSpeed's internals are not mapped (see :data:`ABSENT`).
"""

from __future__ import annotations

from typing import Any

from microspeed.zero import ZeroOptimizer as DeepSpeedZeroOptimizer

__all__ = ["DeepSpeedZeroOptimizer"]

ABSENT: dict[str, str] = {
    "estimate_zero2_model_states_mem_needs": "use microspeed.zero.estimate_memory (or `microspeed estimate-memory`), "
                                             "which counts the same bytes with its own arguments",
    "estimate_zero2_model_states_mem_needs_all_live": "use microspeed.zero.estimate_memory (or `microspeed "
                                                      "estimate-memory`)",
    "estimate_zero2_model_states_mem_needs_all_cold": "use microspeed.zero.estimate_memory (or `microspeed "
                                                      "estimate-memory`)",
    "IPGBucket": "DeepSpeed's internal gradient bucket; microspeed's ZeRO reduces through its own buckets",
    "dist": "DeepSpeed's module-level alias of deepspeed.comm inside its optimizer; import deepspeed.comm instead",
}
"""DeepSpeed names of this module microspeed does not provide, with the reason."""


def __getattr__(name: str) -> Any:
    from deepspeed.runtime.zero import absent_name

    return absent_name(__name__, name, ABSENT)
