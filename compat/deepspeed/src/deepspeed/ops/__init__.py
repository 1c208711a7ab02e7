"""``deepspeed.ops``: optimizers under DeepSpeed's names (adam, adagrad, lion, lamb) and ``sparse_attention``."""

from __future__ import annotations

from typing import Any

__all__ = ["adagrad", "adam", "lamb", "lion", "sparse_attention"]


def __getattr__(name: str) -> Any:
    from deepspeed import _aliases

    found = _aliases.submodule(__name__, name)
    if found is not None:
        return found
    raise AttributeError(f"module 'deepspeed.ops' (microspeed stand-in) has no attribute {name!r}")
