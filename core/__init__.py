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
import importlib.util
from typing import TYPE_CHECKING, Any

from microspeed import namespaces as _namespaces
from microspeed.errors import ConfigError, MissingPluginError, PluginError
from microspeed.hookspecs import StepOutcome, hookimpl, hookspec

if TYPE_CHECKING:
    from microspeed.bootstrap import initialize
    from microspeed.comm import init_distributed
    from microspeed.data import RepeatingLoader
    from microspeed.engine import Engine, StepContext

__version__ = "0.1.0"

_LAZY: dict[str, tuple[str, str]] = {
    "initialize": ("microspeed.bootstrap", "initialize"),
    "init_distributed": ("microspeed.comm", "init_distributed"),
    "RepeatingLoader": ("microspeed.data", "RepeatingLoader"),
    "Engine": ("microspeed.engine", "Engine"),
    "StepContext": ("microspeed.engine", "StepContext"),
    "DeepSpeedEngine": ("microspeed.engine", "Engine"),  # DeepSpeed's name for the engine class
}
"""Top-level names that need torch, imported on first use (PEP 562) so that ``import microspeed`` (and the
``microspeed`` command's ``--help``) stays light; ``microspeed.initialize`` etc. behave as plain attributes."""

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
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    if name in _namespaces.ALIASES:
        return importlib.import_module(f"microspeed.{name}")
    if not name.startswith("_") and importlib.util.find_spec(f"microspeed.{name}") is not None:
        # a submodule not imported yet: ``import microspeed; microspeed.comm.get_rank()`` keeps working
        return importlib.import_module(f"microspeed.{name}")
    raise AttributeError(f"module 'microspeed' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
