"""microspeed-pipeline: pipeline, tensor and data (3D) parallelism, and activation checkpointing.

``import microspeed as deepspeed`` scripts reach it as ``deepspeed.pipe`` (``PipelineModule``,
``LayerSpec``, ``TiedLayerSpec``, the topologies) and ``deepspeed.checkpointing``.
"""

from __future__ import annotations

from microspeed_pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from microspeed_pipeline.topology import (
    ParallelGrid,
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    get_default_grid,
    initialize_model_parallel,
    set_default_grid,
)

__all__ = [
    "LayerSpec",
    "PipelineModule",
    "TiedLayerSpec",
    "ParallelGrid",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessTopology",
    "get_default_grid",
    "initialize_model_parallel",
    "set_default_grid",
]
