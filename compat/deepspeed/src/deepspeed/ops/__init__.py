"""``deepspeed.ops``: optimizers under DeepSpeed's names (adam, adagrad, lion, lamb) and ``sparse_attention``."""

from __future__ import annotations

from typing import Any

__all__ = ["__compatible_ops__", "adagrad", "adam", "lamb", "lion", "op_builder", "sparse_attention"]


def __getattr__(name: str) -> Any:
    from deepspeed import _aliases

    if name == "__compatible_ops__":  # which of DeepSpeed's ops work here (see deepspeed.ops.op_builder)
        from deepspeed.ops.op_builder import COMPATIBLE_OPS

        return dict(COMPATIBLE_OPS)
    found = _aliases.submodule(__name__, name)
    if found is not None:
        return found
    raise AttributeError(f"module 'deepspeed.ops' (microspeed stand-in) has no attribute {name!r}")
