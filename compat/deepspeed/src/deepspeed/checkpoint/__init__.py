"""``deepspeed.checkpoint``: checkpoint helpers (``utils.clone_tensors_for_torch_save``) and microspeed's readers."""

from __future__ import annotations

from typing import Any

from deepspeed.checkpoint import utils
from microspeed.checkpoint import get_fp32_state_dict
from microspeed.checkpoint.deepspeed_format import read_deepspeed

__all__ = ["get_fp32_state_dict", "read_deepspeed", "utils"]


def __getattr__(name: str) -> Any:
    from deepspeed import _aliases

    found = _aliases.submodule(__name__, name)
    if found is None:
        raise AttributeError(f"module {__name__!r} (microspeed stand-in) has no attribute {name!r}")
    return found
