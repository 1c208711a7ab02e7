"""``microspeed.ops``: DeepSpeed's ops namespace (``ops.sparse_attention`` is a plugin's)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "sparse_attention":
        import importlib

        return importlib.import_module("microspeed.ops.sparse_attention")
    raise AttributeError(f"module 'microspeed.ops' has no attribute {name!r}")
