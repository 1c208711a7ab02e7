"""The plugin API: everything a plugin may import from microspeed, in one declared place.

A plugin (in this repository or a third party's) imports from this module and from ``microspeed``'s
top-level names — as pytest plugins import ``pytest`` and never ``_pytest`` — so the kernel can move
its internals without breaking plugins. ``tests/test_layering.py`` checks that every plugin does.

What is here, by concern:

* **hooks**: :data:`hookimpl` (the marker), :class:`StepOutcome`, :class:`StepContext`;
* **errors**: :class:`ConfigError`, :class:`EngineUsageError`, :class:`PluginError`;
* **config**: :class:`Section` / :class:`Field` and their validators, :class:`Config`,
  :func:`load_raw`, :func:`parse`;
* **cooperation**: :class:`Role`, :class:`Capability` and the kinds plugins state
  (:class:`GradientPartitioning`, :class:`GradientCompression`, :class:`LossScaling`), :class:`Capabilities`;
  optimizer protocols :class:`ElementwiseState` / :class:`ParameterSums` (state a partitioner may stream);
* **compositions**: :class:`Feature` and :class:`Refusal` (hooks ``microspeed_features`` / ``microspeed_refusals``),
  :class:`Matrix`, :func:`composition_matrix` and :func:`refuse_pairs`;
* **gradients**: :class:`ReplicaGroup` / :func:`replica_group` / :func:`reduced_over_data_parallel`,
  :func:`has_inf_or_nan`, :class:`NormRule`, :func:`square_sum`, :func:`clip_`, :class:`GradientSum` /
  :func:`summed_over`;
* **topology**: :class:`Topology`;
* **communication**: :data:`comm` (microspeed's wrappers over ``torch.distributed``, observed by tracing,
  the watchdog and the comms logger — use them instead of ``torch.distributed`` for collectives);
* **checkpoints**: :class:`Placement`, :func:`flat_shard`, :class:`OnDemandPiece` (a piece ``flat_shard`` takes
  whose values are read only when the checkpoint is written), :class:`TensorRef`, :func:`split_tensor_refs`,
  :class:`CheckpointError`, :class:`CheckpointWarning`;
* **optimizers**: :data:`ZERO_ELEMENTWISE` (DeepSpeed's optimizers a partitioner may step on slices) and
  :data:`ZERO_OFFLOAD_CLIENT` (the CPU optimizers ZeRO-Offload takes from a client as DeepSpeed does);
* **kernels**: :func:`kernel_backend` / :func:`env_choice` (Triton or the PyTorch reference);
* **logging**: :func:`get_logger`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from microspeed import comm
from microspeed.capabilities import (
    Capabilities,
    Capability,
    ElementwiseState,
    GradientCompression,
    GradientPartitioning,
    LossScaling,
    ParameterSums,
    Role,
)
from microspeed.compositions import Feature, Matrix, Refusal, composition_matrix, refuse_pairs
from microspeed.config import Config, Field, Section, load_raw, non_negative, parse, positive
from microspeed.engine import StepContext
from microspeed.errors import ConfigError, EngineUsageError, PluginError
from microspeed.gradients import (
    GradientSum,
    NormRule,
    ReplicaGroup,
    clip_,
    has_inf_or_nan,
    reduced_over_data_parallel,
    replica_group,
    square_sum,
    summed_over,
)
from microspeed.hookspecs import StepOutcome, hookimpl
from microspeed.log import get_logger
from microspeed.ops.backend import env_choice, kernel_backend
from microspeed.topology import Topology

if TYPE_CHECKING:
    from microspeed.checkpoint import CheckpointError, CheckpointWarning, OnDemandPiece, Placement, flat_shard
    from microspeed.checkpoint.manifest import TensorRef
    from microspeed.checkpoint.manifest import split as split_tensor_refs
    from microspeed.ops.cpu_optimizers import ZERO_ELEMENTWISE, ZERO_OFFLOAD_CLIENT

#: Checkpoint names, imported on first use: ``torch.distributed.checkpoint`` (DTensor, sympy) costs seconds
#: to import, and most plugins need it only when a checkpoint is written.
_LAZY = {
    "CheckpointError": ("microspeed.checkpoint", "CheckpointError"),
    "CheckpointWarning": ("microspeed.checkpoint", "CheckpointWarning"),
    "OnDemandPiece": ("microspeed.checkpoint", "OnDemandPiece"),
    "Placement": ("microspeed.checkpoint", "Placement"),
    "flat_shard": ("microspeed.checkpoint", "flat_shard"),
    "TensorRef": ("microspeed.checkpoint.manifest", "TensorRef"),
    "split_tensor_refs": ("microspeed.checkpoint.manifest", "split"),
    "ZERO_ELEMENTWISE": ("microspeed.ops.cpu_optimizers", "ZERO_ELEMENTWISE"),
    "ZERO_OFFLOAD_CLIENT": ("microspeed.ops.cpu_optimizers", "ZERO_OFFLOAD_CLIENT"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'microspeed.plugin_api' has no attribute {name!r}")


__all__ = [
    "ZERO_ELEMENTWISE",
    "ZERO_OFFLOAD_CLIENT",
    "Capabilities",
    "Capability",
    "CheckpointError",
    "CheckpointWarning",
    "Config",
    "ConfigError",
    "ElementwiseState",
    "EngineUsageError",
    "Feature",
    "Field",
    "GradientCompression",
    "GradientPartitioning",
    "GradientSum",
    "LossScaling",
    "Matrix",
    "NormRule",
    "OnDemandPiece",
    "Placement",
    "ParameterSums",
    "PluginError",
    "Refusal",
    "ReplicaGroup",
    "Role",
    "Section",
    "StepContext",
    "StepOutcome",
    "TensorRef",
    "Topology",
    "clip_",
    "comm",
    "composition_matrix",
    "env_choice",
    "flat_shard",
    "get_logger",
    "has_inf_or_nan",
    "hookimpl",
    "kernel_backend",
    "load_raw",
    "non_negative",
    "parse",
    "positive",
    "reduced_over_data_parallel",
    "refuse_pairs",
    "replica_group",
    "split_tensor_refs",
    "square_sum",
    "summed_over",
]
