"""``deepspeed.accelerator``: :func:`microspeed.accelerator.get_accelerator` (CPU or CUDA)."""

from microspeed.accelerator import Accelerator, get_accelerator, set_accelerator


def is_current_accelerator_supported() -> bool:
    """Whether the accelerator in use is one microspeed supports (``cuda`` or ``cpu``: always, once chosen)."""
    return get_accelerator().device_name() in ("cuda", "cpu")


__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
