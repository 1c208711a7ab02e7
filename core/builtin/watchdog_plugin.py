"""The ``watchdog`` section: stop a hung job with a report naming the stragglers (:mod:`microspeed.observe.watchdog`).

On by default when there is more than one rank: every rank runs a thread that fails the job when it
has waited in one collective or one hook longer than the timeout (default
:data:`microspeed.observe.watchdog.DEFAULT_TIMEOUT_S`, 10 minutes). ``"watchdog": {"timeout_s": 120}``
sets it (and turns it on for one rank too), ``"watchdog": {"enabled": false}`` turns it off, and the
environment variable ``MICROSPEED_WATCHDOG_TIMEOUT`` (seconds, ``0``/``off``) wins over both. The same
timeout bounds how long ``initialize()``'s rank agreement waits for a rank that never comes.
``answer_timeout_s`` is how long a rank waits for the others' answers through the store: in a hang
report, and when a collective failed and the error must name the ranks that are gone. When off,
this plugin implements no per-step hook and attaches nothing.
"""

from __future__ import annotations

from typing import Any

from microspeed import comm
from microspeed.config import Field, Section, positive
from microspeed.errors import ConfigError
from microspeed.hookspecs import hookimpl
from microspeed.observe import trace, watchdog


class WatchdogPlugin:
    """Starts its engine's watchdog and instruments the engine's plugin manager when on."""

    def __init__(self) -> None:
        self.plugins: Any = None

    @hookimpl
    def microspeed_plugins_loaded(self, plugins: Any) -> None:
        """Remember the plugin manager; bound the first rank agreement by the environment's or default timeout."""
        self.plugins = plugins
        comm.context_for(plugins).ranks_timeout_s = _resolve(True, None, comm.get_world_size())

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``watchdog``: ``enabled``, ``timeout_s``, ``answer_timeout_s``."""
        return {
            "watchdog": Section({
                "enabled": Field((bool,), True, "watch for hangs (on by default with more than one rank; "
                                 f"{watchdog.ENV_VAR}=0 turns it off too)"),
                "timeout_s": Field((float, type(None)), None, "fail the job with a report when a rank waits "
                                   "longer than this in one collective or hook (null: "
                                   f"{watchdog.DEFAULT_TIMEOUT_S:g} s with more than one rank; "
                                   f"{watchdog.ENV_VAR} wins)", positive),
                "answer_timeout_s": Field((float, type(None)), None, "how long a rank waits for the others' "
                                          "answers through the c10d store (a hang report; a failed collective, "
                                          "whose error then names the ranks that did not answer as lost); "
                                          "null: 1-5 s, from timeout_s", positive),
            }, doc="microspeed: hang diagnosis"),
        }

    @hookimpl
    def microspeed_configure(self, config, world_size: int) -> None:
        """Start the watchdog unless it is off."""
        section = config["watchdog"]
        timeout_s = _resolve(section["enabled"], section["timeout_s"], world_size)
        context = comm.context_for(self.plugins) if self.plugins is not None else comm.current()
        context.ranks_timeout_s = timeout_s
        if timeout_s is None:
            return
        watchdog.start(timeout_s, context=context, gather_s=section["answer_timeout_s"])
        if self.plugins is not None:
            trace.instrument(self.plugins, context=context)


    @hookimpl
    def microspeed_destroy(self) -> None:
        """``engine.destroy()``: stop this engine's watchdog thread and detach its probe (unless tracing uses it)."""
        if self.plugins is not None:
            context = comm.context_for(self.plugins)
            if context.watchdog is not None:
                watchdog.stop(context)


def _resolve(enabled: bool, timeout_s: float | None, world_size: int) -> float | None:
    try:
        return watchdog.resolve_timeout(enabled, timeout_s, world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
