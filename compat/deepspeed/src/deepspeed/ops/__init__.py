"""``deepspeed.ops``: optimizers under DeepSpeed's names (adam, adagrad, lion, lamb) and ``sparse_attention``."""

from __future__ import annotations

from typing import Any

__all__ = ["adagrad", "adam", "lamb", "lion", "sparse_attention"]


def __getattr__(name: str) -> Any:
    import importlib

    if name in __all__:
        return importlib.import_module(f"deepspeed.ops.{name}")
    raise AttributeError(f"module 'deepspeed.ops' (microspeed stand-in) has no attribute {name!r}")
