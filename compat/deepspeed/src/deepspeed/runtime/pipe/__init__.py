"""``deepspeed.runtime.pipe``: ``PipelineModule``, the layer specs and topologies of :mod:`microspeed.pipe`."""

from __future__ import annotations

from typing import Any

from microspeed.pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]


def __getattr__(name: str) -> Any:
    from deepspeed import _aliases

    found = _aliases.submodule(__name__, name)
    if found is None:
        raise AttributeError(f"module {__name__!r} (microspeed stand-in) has no attribute {name!r}")
    return found
