"""The ``trace`` section: this engine's hook-level tracing, one JSON-lines file per rank (see trace.py).

``MICROSPEED_TRACE=<dir>`` turns tracing on when the plugins are loaded (so ``initialize()`` is
traced too) and wins over the config; ``"trace": {"enabled": true, "output_path": "<dir>"}``
turns it on at ``configure``. When off, this plugin implements no per-step hook and attaches
nothing: tracing costs nothing.
"""

from __future__ import annotations

from typing import Any

from microspeed import comm
from microspeed.config import Field, Section
from microspeed.hookspecs import hookimpl
from microspeed.observe import trace


class TracingPlugin:
    """Starts its engine's tracer and instruments the engine's plugin manager when asked to."""

    def __init__(self) -> None:
        self.plugins: Any = None
        self.directory: str | None = None

    @hookimpl
    def microspeed_plugins_loaded(self, plugins: Any) -> None:
        """With ``MICROSPEED_TRACE`` set, start tracing now (the config is not parsed yet)."""
        self.plugins = plugins
        directory = trace.env_directory()
        if directory is not None:
            self.directory = directory
            context = comm.context_for(plugins)
            trace.start(directory, context=context)
            trace.instrument(plugins, context=context)

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``trace``: ``enabled`` and ``output_path``."""
        return {
            "trace": Section({
                "enabled": Field((bool,), False, "record every hook call, collective and step per rank "
                                 f"(or set {trace.ENV_VAR}=<dir>)"),
                "output_path": Field((str, type(None)), None, "directory of the rank<N>.jsonl files "
                                     f"(default ./{trace.DEFAULT_DIR})"),
            }, doc="microspeed: hook-level tracing"),
        }

    @hookimpl
    def microspeed_destroy(self) -> None:
        """``engine.destroy()``: close this engine's trace (its files complete) and detach its probe."""
        if self.directory is not None and self.plugins is not None:
            trace.stop(context=comm.context_for(self.plugins))
            self.directory = None

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Start tracing if the config asks for it (and the environment did not already)."""
        section = config["trace"]
        if self.directory is not None or not section["enabled"]:
            return
        self.directory = section["output_path"] or trace.DEFAULT_DIR
        context = comm.context_for(self.plugins) if self.plugins is not None else comm.current()
        trace.start(self.directory, context=context)
        if self.plugins is not None:
            trace.instrument(self.plugins, context=context)
