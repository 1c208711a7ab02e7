"""A ds_config read outside ``initialize()``: microspeed's own parsing, for DeepSpeed's config objects.

DeepSpeed code builds its config object by hand (``DeepSpeedConfig(dict_or_path)``,
``DeepSpeedZeroConfig(**section)``) before or without an engine. The ``deepspeed`` stand-in's
versions of those objects read the config here, so a key means the same thing in them as in
:func:`microspeed.initialize`: the schema is the one the installed plugins claim through the plugin
manager (``microspeed_config_sections``), validation and defaults are :func:`microspeed.config.parse`'s,
and the batch triad is :func:`microspeed.config.resolve_batch_triad`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from microspeed.config import Config, Field, Section, load_raw, merge_schema, parse
from microspeed.errors import ConfigError

__all__ = ["default_of", "parse_config", "read_config", "schema", "section_schema"]


def _disabled(raw: Mapping[str, Any]) -> tuple[str, ...]:
    section = raw.get("plugins", {})
    disabled = section.get("disable", []) if isinstance(section, Mapping) else []
    if not isinstance(disabled, list) or not all(isinstance(n, str) for n in disabled):
        raise ConfigError(f"plugins.disable: expected a list of plugin names, got {disabled!r}.")
    return tuple(sorted(disabled))


@lru_cache(maxsize=8)
def schema(disabled: tuple[str, ...] = ()) -> Section:
    """The ds_config schema the installed plugins claim (all but ``disabled``), as ``initialize()`` builds it."""
    from microspeed.plugins import PluginManager

    pm = PluginManager()
    pm.load_all(disabled=disabled)
    return merge_schema(pm.hook.microspeed_config_sections())


def section_schema(name: str) -> Field | Section:
    """The schema of one top-level key (``"zero_optimization"``); :class:`ConfigError` when no plugin claims it."""
    from microspeed.config import PLUGIN_SECTIONS

    found = schema().fields.get(name)
    if found is None:
        owner = PLUGIN_SECTIONS.get(name)
        hint = f" (install the plugin distribution {owner!r})" if owner else ""
        raise ConfigError(f"{name}: no installed microspeed plugin reads this section{hint}.")
    return found


def default_of(dotted: str) -> Any:
    """The default microspeed gives the key at ``dotted`` (``"zero_optimization.stage"``).

    :class:`~microspeed.MissingPluginError` (naming the distribution) when the plugin that owns the section is
    not installed; ``KeyError`` for a key no schema has.
    """
    from microspeed.config import PLUGIN_SECTIONS
    from microspeed.errors import MissingPluginError

    top = dotted.split(".")[0]
    if top not in schema().fields and top in PLUGIN_SECTIONS:
        raise MissingPluginError(f"{top}: read by the plugin distribution {PLUGIN_SECTIONS[top]!r}, which is not "
                                 f"installed (pip install {PLUGIN_SECTIONS[top]})")
    node: Field | Section = schema()
    for part in dotted.split("."):
        if not isinstance(node, Section) or part not in node.fields:
            raise KeyError(f"{dotted}: not in microspeed's ds_config schema")
        node = node.fields[part]
    if isinstance(node, Section):
        raise KeyError(f"{dotted}: a section, not a key")
    return node.default


def read_config(config: Any) -> dict[str, Any]:
    """The user's ds_config as a dict: a dict as given, or a JSON/hjson file, or a base64 string (as DeepSpeed)."""
    return load_raw(config)


def parse_config(raw: Mapping[str, Any]) -> Config:
    """``raw`` validated against the installed plugins' schema, with every default filled (triad unresolved)."""
    return parse(raw, schema(_disabled(raw)))
