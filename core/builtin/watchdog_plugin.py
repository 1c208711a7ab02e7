"""The ``watchdog`` section: stop a hung job with a report naming the stragglers (:mod:`microspeed.observe.watchdog`).

``"watchdog": {"timeout_s": 300}`` starts, on every rank, a thread that fails the job when the
rank has waited in one collective or one hook longer than that. Off (``null``) by default; when
off this plugin implements no per-step hook and attaches nothing.
"""

from __future__ import annotations

from typing import Any

from microspeed.config import Field, Section, positive
from microspeed.hookspecs import hookimpl
from microspeed.observe import trace, watchdog


class WatchdogPlugin:
    """Starts the process's watchdog and instruments this engine's plugin manager when asked to."""

    def __init__(self) -> None:
        self.plugins: Any = None

    @hookimpl
    def microspeed_plugins_loaded(self, plugins: Any) -> None:
        """Remember the plugin manager (instrumented at ``configure`` if the watchdog is on)."""
        self.plugins = plugins

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``watchdog``: ``timeout_s``."""
        return {
            "watchdog": Section({
                "timeout_s": Field((float, type(None)), None, "fail the job with a report when a rank waits "
                                   "longer than this in one collective or hook (null: off)", positive),
            }, doc="microspeed: hang diagnosis"),
        }

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Start the watchdog when ``timeout_s`` is set."""
        timeout_s = config["watchdog"]["timeout_s"]
        if timeout_s is None:
            return
        watchdog.start(timeout_s)
        if self.plugins is not None:
            trace.instrument(self.plugins)
