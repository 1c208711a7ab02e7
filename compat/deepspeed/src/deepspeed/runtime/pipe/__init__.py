"""``deepspeed.runtime.pipe``: ``PipelineModule``, the layer specs and topologies of :mod:`microspeed.pipe`."""

from microspeed.pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
