"""``deepspeed.runtime.zero`` (``deepspeed.zero``): :mod:`microspeed.zero`, the ZeRO plugin's public API.

Names are looked up in :mod:`microspeed.zero` when first used, so this module imports even where the
ZeRO plugin lacks a newer name (``set_z3_leaf_modules``, ``register_external_parameter``, ...).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    import importlib

    from deepspeed import _aliases

    found = _aliases.submodule(__name__, name)
    if found is not None:
        return found
    if name.startswith("__"):
        raise AttributeError(name)
    zero = importlib.import_module("microspeed.zero")
    try:
        return getattr(zero, name)
    except AttributeError:
        raise AttributeError(f"deepspeed.zero.{name}: microspeed's ZeRO plugin (microspeed.zero) does not provide "
                             f"{name}") from None


def __dir__() -> list[str]:
    import importlib

    return sorted(set(dir(importlib.import_module("microspeed.zero"))) | {"partition_parameters"})
