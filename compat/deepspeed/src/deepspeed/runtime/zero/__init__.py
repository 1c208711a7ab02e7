"""``deepspeed.runtime.zero`` (``deepspeed.zero``): :mod:`microspeed.zero`, the ZeRO plugin's public API.

Names are looked up in :mod:`microspeed.zero` when first used, so this module imports even where the
ZeRO plugin lacks a newer name (``set_z3_leaf_modules``, ``register_external_parameter``, ...).
"""

from __future__ import annotations

from typing import Any


def zero_name(module: str, name: str) -> Any:
    """``name`` from :mod:`microspeed.zero`, or an ``AttributeError`` naming ``module.name`` and the plugin."""
    import importlib

    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return getattr(importlib.import_module("microspeed.zero"), name)
    except AttributeError:
        raise AttributeError(f"{module}.{name}: microspeed's ZeRO plugin (microspeed.zero) does not provide "
                             f"{name}") from None


def __getattr__(name: str) -> Any:
    from deepspeed import _aliases

    found = _aliases.submodule(__name__, name)
    if found is not None:
        return found
    return zero_name("deepspeed.zero", name)


def __dir__() -> list[str]:
    import importlib

    return sorted(set(dir(importlib.import_module("microspeed.zero"))) | {"partition_parameters"})
