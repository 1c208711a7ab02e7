"""microspeed: DeepSpeed's training runtime as a microkernel with plugins.

``import microspeed as deepspeed`` works for DeepSpeed training scripts::

    engine, optimizer, loader, scheduler = microspeed.initialize(model=model, config=ds_config,
                                                                 model_parameters=model.parameters())
    loss = engine(batch)
    engine.backward(loss)
    engine.step()
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from microspeed import namespaces as _namespaces
from microspeed.bootstrap import initialize
from microspeed.comm import init_distributed
from microspeed.data import RepeatingLoader
from microspeed.engine import Engine, StepContext
from microspeed.errors import ConfigError, MissingPluginError, PluginError
from microspeed.hookspecs import StepOutcome, hookimpl, hookspec

__version__ = "0.1.0"

DeepSpeedEngine = Engine
"""DeepSpeed's name for the engine class."""

__all__ = [
    "ConfigError",
    "DeepSpeedEngine",
    "Engine",
    "MissingPluginError",
    "PluginError",
    "RepeatingLoader",
    "StepContext",
    "StepOutcome",
    "__version__",
    "add_config_arguments",
    "hookimpl",
    "hookspec",
    "init_distributed",
    "initialize",
]

_namespaces.install()


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` arguments to ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def __getattr__(name: str) -> Any:
    if name in _namespaces.ALIASES:
        return importlib.import_module(f"microspeed.{name}")
    if name == "ops":
        return importlib.import_module("microspeed.ops")
    raise AttributeError(f"module 'microspeed' has no attribute {name!r}")
