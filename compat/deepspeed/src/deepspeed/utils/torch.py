"""``deepspeed.utils.torch``: ``required_torch_version`` (tests and scripts gate features on torch's version)."""

from __future__ import annotations


def required_torch_version(min_version: str | None = None, max_version: str | None = None) -> bool:
    """Whether the installed torch's release is within ``[min_version, max_version]`` (either bound optional)."""
    import torch
    from packaging import version

    installed = version.parse(version.parse(torch.__version__).base_version)
    if min_version is not None and installed < version.parse(str(min_version)):
        return False
    return not (max_version is not None and installed > version.parse(str(max_version)))


__all__ = ["required_torch_version"]
