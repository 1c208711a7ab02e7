"""``deepspeed.accelerator``: :func:`microspeed.compat.accelerator.get_accelerator` (CPU or CUDA)."""

from __future__ import annotations

from typing import Any

from microspeed.compat.accelerator import Accelerator, get_accelerator, set_accelerator


def is_current_accelerator_supported() -> bool:
    """Whether the accelerator in use is one microspeed supports (``cuda`` or ``cpu``: always, once chosen)."""
    return get_accelerator().device_name() in ("cuda", "cpu")


__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]


def __getattr__(name: str) -> Any:
    from deepspeed import _aliases

    found = _aliases.submodule(__name__, name)
    if found is None:
        raise AttributeError(f"module {__name__!r} (microspeed stand-in) has no attribute {name!r}")
    return found
