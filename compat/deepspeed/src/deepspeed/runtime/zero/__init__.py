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


def absent_name(module: str, name: str, reasons: dict[str, str]) -> Any:
    """The ``AttributeError`` for ``module.name`` when microspeed does not provide it.

    A name listed in ``reasons`` (a DeepSpeed internal that tests and libraries import) gets the reason in the
    message; any other name is looked up in :mod:`microspeed.zero` (:func:`zero_name`). Either way
    ``from module import name`` is Python's plain ``ImportError`` naming the name and the module, and
    ``hasattr`` answers ``False`` (libraries probe DeepSpeed's versions with it).
    """
    if name in reasons:
        raise AttributeError(f"{module}.{name} is not provided by microspeed's DeepSpeed stand-in: {reasons[name]}")
    return zero_name(module, name)


ABSENT: dict[str, str] = {
    "ZeroParamType": "microspeed marks a ZeRO-3 parameter's state (ds_status, ZeroParamStatus), not a parameter type",
    "DeepSpeedZeRoOffload": "DeepSpeed's ZeRO-3 hook manager; microspeed's is internal to its ZeRO plugin (the "
                            "stage-3 optimizer's forward_hooks lists its hooks)",
    "DeepSpeedTensorOverride": "DeepSpeed's zero.Init tensor-constructor override; microspeed's Init casts "
                               "parameters instead",
    "TiledLinear": "DeepSpeed's tiled linear layer for ZeRO-3 is not offered (ZeRO-3 gathers per module; split a "
                   "huge layer into modules yourself)",
    "TiledLinearReturnBias": "DeepSpeed's tiled linear layer for ZeRO-3 is not offered",
    "MiCS_Init": "MiCS (sharding within sub-groups) is not offered",
}
"""DeepSpeed names of ``deepspeed.runtime.zero`` microspeed does not provide, with the reason."""


def __getattr__(name: str) -> Any:
    from deepspeed import _aliases

    found = _aliases.submodule(__name__, name)
    if found is not None:
        return found
    return absent_name("deepspeed.zero", name, ABSENT)


def __dir__() -> list[str]:
    import importlib

    return sorted(set(dir(importlib.import_module("microspeed.zero"))) | {"partition_parameters"})
