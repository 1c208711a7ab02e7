"""``deepspeed.runtime.zero.leaf_module_config``: the ``zero_optimization.leaf_module`` section and its defaults.

The defaults are microspeed's (:func:`microspeed.compat.deepspeed_config.default_of`), which are DeepSpeed 0.19.8's:
Hugging Face's Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks are leaves, no names, no suffixes.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from microspeed.compat.deepspeed_config import default_of

_SECTION = "zero_optimization.leaf_module"
DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(default_of(f"{_SECTION}.classes"))
"""Classes (qualified names) flagged as leaves when the config names none."""
DEFAULT_LEAF_MODULE_NAMES: list[str] = list(default_of(f"{_SECTION}.names"))
"""Module names flagged as leaves by default (none)."""
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = list(default_of(f"{_SECTION}.name_suffixes"))
"""Module-name suffixes flagged as leaves by default (none)."""


class DeepSpeedZeroLeafModuleConfig(DeepSpeedConfigModel):
    """``zero_optimization.leaf_module``: modules stage 3 gathers whole when they run (a single string stands for a
    list of one; repeated entries are dropped)."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, values: Any) -> Any:
        if values is None:
            return {}
        if not isinstance(values, dict):
            raise TypeError(f"zero_optimization.leaf_module must be a mapping of classes / names / name_suffixes, "
                            f"got {type(values).__name__}")
        return {k: [v] if k in ("classes", "names", "name_suffixes") and isinstance(v, str) else v
                for k, v in values.items()}

    @model_validator(mode="after")
    def _unique(self) -> DeepSpeedZeroLeafModuleConfig:
        for key in ("classes", "names", "name_suffixes"):
            object.__setattr__(self, key, list(dict.fromkeys(str(v) for v in getattr(self, key))))
        return self
