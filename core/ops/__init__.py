"""``microspeed.ops``: DeepSpeed's ops namespace; its entries (``ops.sparse_attention``) are plugins' aliases."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    from microspeed import namespaces

    if f"ops.{name}" in namespaces.ALIASES:
        import importlib

        return importlib.import_module(f"microspeed.ops.{name}")
    raise AttributeError(f"module 'microspeed.ops' has no attribute {name!r}")
