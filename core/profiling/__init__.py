"""``microspeed.profiling``: DeepSpeed's profiling namespace; ``profiling.flops_profiler`` is a plugin's alias."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    from microspeed import namespaces

    if f"profiling.{name}" in namespaces.ALIASES:
        import importlib

        return importlib.import_module(f"microspeed.profiling.{name}")
    raise AttributeError(f"module 'microspeed.profiling' has no attribute {name!r}")
