"""``deepspeed``: microspeed's stand-in for DeepSpeed (distribution ``deepspeed==0.19.8+microspeed``).

Libraries that ``import deepspeed`` themselves (Hugging Face transformers and accelerate, Lightning,
DeepSpeed's example scripts) get microspeed here: ``deepspeed.initialize`` is
:func:`microspeed.initialize`, and DeepSpeed's module paths (``deepspeed.zero``, ``deepspeed.utils``,
``deepspeed.ops.adam``, ``deepspeed.accelerator``, ...) map to microspeed's implementation. Nothing of
real DeepSpeed is imported; importing this package beside real DeepSpeed's modules is refused
(:class:`microspeed.compat.standin.StandinConflictError`, naming both paths).
"""

from __future__ import annotations

import os as _os
from typing import Any

from microspeed.compat import standin as _standin

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_standin.check_not_mixed(_HERE)

import microspeed as _microspeed  # noqa: E402
from deepspeed import _aliases  # noqa: E402
from microspeed import (  # noqa: E402
    ConfigError,
    DeepSpeedEngine,
    Engine,
    MissingPluginError,
    PluginError,
    RepeatingLoader,
    add_config_arguments,
    hookimpl,
    init_distributed,
)
from microspeed.compat.accelerator import get_accelerator  # noqa: E402

__version__ = _standin.STANDIN_VERSION
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
__git_hash__: str | None = None
__git_branch__: str | None = None
version = __version__
git_hash = __git_hash__
git_branch = __git_branch__
microspeed_version = _microspeed.__version__
"""The microspeed release behind this stand-in."""

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

DeepSpeedConfigError = ConfigError
"""DeepSpeed's config error (``deepspeed.runtime.config.DeepSpeedConfigError``): microspeed's
:class:`~microspeed.ConfigError` itself, so ``except deepspeed.DeepSpeedConfigError`` catches every config error
microspeed raises."""

__all__ = [
    "ConfigError",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "Engine",
    "MissingPluginError",
    "PluginError",
    "RepeatingLoader",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "__version__",
    "add_config_arguments",
    "get_accelerator",
    "hookimpl",
    "init_distributed",
    "initialize",
]

_aliases.install()
_standin.announce(_HERE, _microspeed.__version__)


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> tuple[Any, Any, Any, Any]:
    """DeepSpeed's ``initialize`` (same arguments, same order), run by :func:`microspeed.initialize`.

    ``distributed_port`` is the port used when this call starts torch.distributed without a
    launcher's ``MASTER_PORT``. ``mesh_param`` (DeepSpeed's device mesh for sequence/data
    parallelism) is refused: microspeed has no sequence parallelism.
    """
    _standin.check_not_mixed(_HERE)
    if model is None:
        hint = (" The first positional argument is args: pass the model as initialize(model=...)."
                if _is_module(args) else "")
        raise InitializeArgumentError(f"deepspeed.initialize(model=None): a torch.nn.Module is required.{hint}")
    if mesh_param is not None:
        raise ConfigError(f"initialize(mesh_param={mesh_param!r}): microspeed has no sequence-parallel device mesh; "
                          "leave mesh_param=None (data, pipeline and expert parallelism come from the config)")
    from microspeed import comm

    if dist_init_required is not False:
        comm.init_distributed(distributed_port=distributed_port)
    return _microspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                  training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                                  dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                                  config_params=config_params)


class InitializeArgumentError(ConfigError, AssertionError):
    """A required argument of :func:`initialize` is missing (an AssertionError as well, as DeepSpeed asserts it)."""


def _is_module(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.nn.Module)


def _parse_version(version_str: str) -> tuple[int, int, int]:
    """``"0.19.8+microspeed"`` -> ``(0, 19, 8)``, as DeepSpeed's helper of the same name."""
    import re

    found = re.search(r"(\d+)\.(\d+)\.(\d+)", version_str)
    if found is None:
        raise ValueError(f"_parse_version({version_str!r}): expected MAJOR.MINOR.PATCH")
    return int(found[1]), int(found[2]), int(found[3])


def __getattr__(name: str) -> Any:
    import importlib

    found = _aliases.submodule("deepspeed", name)
    if found is not None:
        return found
    if name in ("DeepSpeedOptimizer", "ZeROOptimizer"):
        return getattr(importlib.import_module("deepspeed.runtime.base_optimizer"), name)
    if name in ("PipelineModule", "LayerSpec", "TiedLayerSpec"):
        return getattr(importlib.import_module("deepspeed.pipe"), name)
    if name in ("logger", "log_dist", "OnDevice"):
        return getattr(importlib.import_module("deepspeed.utils"), name)
    raise AttributeError(f"module 'deepspeed' (microspeed {_microspeed.__version__} stand-in) has no attribute "
                         f"{name!r}: microspeed does not provide it")
