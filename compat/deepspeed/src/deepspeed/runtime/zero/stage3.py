"""``deepspeed.runtime.zero.stage3``: DeepSpeed's ZeRO-3 optimizer module, mapped to microspeed's ZeRO plugin.

``DeepSpeedZeroOptimizer_Stage3`` is the class of the optimizer ``initialize()`` returns at stage 3
(:class:`microspeed.zero.ZeroOptimizerStage3`), so ``isinstance`` checks hold; ``unwrap_model_for_generation``
is :func:`microspeed.zero.unwrap_model_for_generation`. DeepSpeed's internals are not mapped (see
:data:`ABSENT`): importing one raises an ``ImportError`` giving the reason.
"""

from __future__ import annotations

from typing import Any

from microspeed.zero import ZeroOptimizerStage3 as DeepSpeedZeroOptimizer_Stage3
from microspeed.zero import unwrap_model_for_generation

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "unwrap_model_for_generation"]

ABSENT: dict[str, str] = {
    "estimate_zero3_model_states_mem_needs": "use microspeed.zero.estimate_memory (or `microspeed estimate-memory`), "
                                             "which counts the same bytes with its own arguments",
    "estimate_zero3_model_states_mem_needs_all_live": "use microspeed.zero.estimate_memory (or `microspeed "
                                                      "estimate-memory`)",
    "estimate_zero3_model_states_mem_needs_all_cold": "use microspeed.zero.estimate_memory (or `microspeed "
                                                      "estimate-memory`)",
    "reduce_scatter_coalesced": "DeepSpeed's internal gradient reduction; microspeed's ZeRO reduces through its "
                                "own buckets",
    "dist": "DeepSpeed's module-level alias of deepspeed.comm inside its optimizer; import deepspeed.comm instead",
}
"""DeepSpeed names of this module microspeed does not provide, with the reason."""


def __getattr__(name: str) -> Any:
    from deepspeed.runtime.zero import absent_name

    return absent_name(__name__, name, ABSENT)
