"""DeepSpeed module paths served by microspeed's own modules (the module objects themselves).

``import deepspeed.moe.layer`` returns ``microspeed_moe.layer``: one module object under both
names, so patches and ``isinstance`` checks agree. A path listed here also covers its submodules
(``deepspeed.runtime.pipe.schedule`` -> ``microspeed.pipe.schedule``). Paths that need more than a
re-export are files of this package instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

#: DeepSpeed module path -> the microspeed module that implements it.
ALIASES: dict[str, str] = {
    "deepspeed.zero": "deepspeed.runtime.zero",
    "deepspeed.pipe": "microspeed.pipe",
    "deepspeed.runtime.pipe.module": "microspeed.pipe.module",
    "deepspeed.runtime.pipe.schedule": "microspeed.pipe.schedule",
    "deepspeed.runtime.pipe.p2p": "microspeed.pipe.p2p",
    "deepspeed.utils.comms_logging": "microspeed.comm",
    "deepspeed.moe": "microspeed.moe",
    "deepspeed.checkpointing": "microspeed.checkpointing",
    "deepspeed.runtime.activation_checkpointing.checkpointing": "microspeed.checkpointing",
    "deepspeed.ops.sparse_attention": "microspeed.ops.sparse_attention",
    "deepspeed.profiling.flops_profiler": "microspeed.profiling.flops_profiler",
    "deepspeed.accelerator.real_accelerator": "microspeed.compat.accelerator",
    "deepspeed.comm.comm": "deepspeed.comm",
    "deepspeed.runtime.dataloader": "microspeed.builtin.dataloader",
    "deepspeed.runtime.fp16.loss_scaler": "microspeed.builtin.loss_scaler",
    "deepspeed.ops.adam.fused_adam": "microspeed.ops.fused_adam",
    "deepspeed.ops.adam.cpu_adam": "deepspeed.ops.adam",
    "deepspeed.utils.tensor_fragment": "microspeed.zero",
}


def target_of(fullname: str) -> str | None:
    """The module that serves ``fullname``, or ``None`` when a file of this package (or nothing) does."""
    for alias in sorted(ALIASES, key=len, reverse=True):
        if fullname == alias or fullname.startswith(alias + "."):
            return ALIASES[alias] + fullname[len(alias):]
    return None


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import deepspeed.<path>`` return the microspeed module listed in :data:`ALIASES`."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        mapped = target_of(fullname)
        if mapped is None:
            return None
        try:
            found = importlib.util.find_spec(mapped)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True, loader_state=mapped)

    def create_module(self, spec):  # noqa: D102 - importlib protocol
        real = importlib.import_module(spec.loader_state)
        spec.loader_state = (spec.loader_state, real.__spec__)
        return real

    def exec_module(self, module):  # noqa: D102 - importlib protocol
        module.__spec__ = module.__spec__.loader_state[1]  # give the module back its own spec


def submodule(package: str, name: str) -> object | None:
    """``package.name`` imported when it is a module of the stand-in (a file or an alias), else ``None``.

    Packages call it from their ``__getattr__``, so ``deepspeed.runtime.lr_schedules.X`` works after a
    plain ``import deepspeed``, as it does with DeepSpeed (which imports its submodules eagerly).
    """
    if name.startswith("__"):
        return None
    full = f"{package}.{name}"
    if full in sys.modules:
        return sys.modules[full]
    if target_of(full) is None and importlib.util.find_spec(full) is None:
        return None
    return importlib.import_module(full)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
