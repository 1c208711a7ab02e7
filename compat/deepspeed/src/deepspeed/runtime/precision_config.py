"""``deepspeed.runtime.precision_config``: the ``fp16`` and ``bf16`` sections as DeepSpeed's config models.

The models are built from the sections microspeed's mixed-precision built-in claims (same keys, same
defaults, validated by microspeed's parser). DeepSpeed 0.19.8 also reads the old top-level name
``bfloat16``; microspeed accepts that key with a notice and does not act on it, so
:func:`get_bfloat16_config` reads ``bf16`` only and says so when ``bfloat16`` is given.
"""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.config_utils import schema_model

__all__ = ["BFLOAT16", "BFLOAT16_OLD", "DeepSpeedBF16Config", "DeepSpeedFP16Config", "FP16", "get_bfloat16_config",
           "get_float16_config"]

FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"

DeepSpeedFP16Config = schema_model(FP16, "DeepSpeedFP16Config", "The ``fp16`` section: fp16 training and loss scaling.")
DeepSpeedBF16Config = schema_model(BFLOAT16, "DeepSpeedBF16Config", "The ``bf16`` section: bf16 training.")


def get_float16_config(param_dict: dict[str, Any]) -> Any:
    """The ``fp16`` section of a ds_config dict as :class:`DeepSpeedFP16Config`."""
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))


def get_bfloat16_config(param_dict: dict[str, Any]) -> Any:
    """The ``bf16`` section of a ds_config dict as :class:`DeepSpeedBF16Config` (the old ``bfloat16`` when absent).

    microspeed's own parser reads the old name the same way (``microspeed.config.RENAMED_SECTIONS``).
    """
    return DeepSpeedBF16Config(**param_dict.get(BFLOAT16, param_dict.get(BFLOAT16_OLD, {})))
