"""DeepSpeed's feature namespaces (``deepspeed.zero``, ``deepspeed.pipe``, ...), resolved to plugins.

``import microspeed as deepspeed`` must keep DeepSpeed scripts working: ``deepspeed.zero.Init``,
``from deepspeed.pipe import PipelineModule``, ``from deepspeed.moe.layer import MoE``. Each
namespace is an alias of an installed plugin's package, imported only when first used; when the
plugin is missing, using it raises :class:`~microspeed.MissingPluginError` naming the
distribution to install.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

from microspeed.config import plugin_folder
from microspeed.errors import MissingPluginError

#: ``alias under microspeed`` -> ``(target package, distribution)``.
ALIASES: dict[str, tuple[str, str]] = {
    "accelerator": ("microspeed.compat.accelerator", "microspeed"),  # DeepSpeed's deepspeed.accelerator
    "zero": ("microspeed_zero", "microspeed-zero"),
    "pipe": ("microspeed_pipeline", "microspeed-pipeline"),
    "checkpointing": ("microspeed_pipeline.checkpointing", "microspeed-pipeline"),
    "moe": ("microspeed_moe", "microspeed-moe"),
    "ops.sparse_attention": ("microspeed_sparse_attn", "microspeed-sparse-attn"),
    "profiling.flops_profiler": ("microspeed_efficiency.flops_profiler", "microspeed-efficiency"),
}


def resolve(alias: str) -> types.ModuleType:
    """Import the package behind ``microspeed.<alias>``, or raise naming the distribution."""
    target, dist = ALIASES[alias]
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
            raise MissingPluginError(
                f"microspeed.{alias} needs the plugin distribution {dist!r}, which is not installed: "
                f"pip install ./plugins/{plugin_folder(dist)} (from a "
                f"microspeed checkout) or pip install {dist}."
            ) from exc
        raise


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import microspeed.<alias>[.sub]`` return the plugin's own module objects."""

    def _target(self, fullname: str) -> str | None:
        if not fullname.startswith("microspeed."):
            return None
        rest = fullname[len("microspeed."):]
        for alias in sorted(ALIASES, key=len, reverse=True):
            if rest == alias or rest.startswith(alias + "."):
                resolve(alias)
                return ALIASES[alias][0] + rest[len(alias):]
        return None

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        mapped = self._target(fullname)
        if mapped is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True, loader_state=mapped)

    def create_module(self, spec):  # noqa: D102 - importlib protocol
        real = importlib.import_module(spec.loader_state)
        spec.loader_state = (spec.loader_state, real.__spec__)
        return real  # the plugin's own module object: patches and isinstance checks see one module

    def exec_module(self, module):  # noqa: D102 - importlib protocol
        # importlib stamped the alias spec on the real module; give it back its own
        module.__spec__ = module.__spec__.loader_state[1]


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
