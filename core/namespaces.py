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

from microspeed.errors import MissingPluginError

#: ``alias under microspeed`` -> ``(target package, distribution)``.
ALIASES: dict[str, tuple[str, str]] = {
    "zero": ("microspeed_zero", "microspeed-zero"),
    "pipe": ("microspeed_pipeline", "microspeed-pipeline"),
    "checkpointing": ("microspeed_pipeline.checkpointing", "microspeed-pipeline"),
    "moe": ("microspeed_moe", "microspeed-moe"),
    "ops.sparse_attention": ("microspeed_sparse_attn", "microspeed-sparse-attn"),
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
                f"pip install ./plugins/{dist.removeprefix('microspeed-').replace('-', '_')} (from a "
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
        return _AliasModule(spec.name, importlib.import_module(spec.loader_state))

    def exec_module(self, module):  # noqa: D102 - importlib protocol
        return None


class _AliasModule(types.ModuleType):
    """A module that forwards every attribute to the plugin's real module."""

    def __init__(self, name: str, real: types.ModuleType) -> None:
        super().__init__(name, real.__doc__)
        object.__setattr__(self, "_real", real)
        self.__path__ = list(getattr(real, "__path__", []))

    def __getattr__(self, name: str):
        real = object.__getattribute__(self, "_real")
        try:
            return getattr(real, name)
        except AttributeError:
            return importlib.import_module(f"{real.__name__}.{name}")

    def __dir__(self):
        return dir(object.__getattribute__(self, "_real"))


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
