"""The ``comms_logger`` section, as DeepSpeed's, and the engine's communication context.

Each engine has its own :class:`microspeed.comm.CommContext` (byte counts, observers, comms logger);
this plugin makes it current at the start of ``initialize()`` and at each ``forward``, ``backward``,
``step`` and checkpoint of its engine, so that the collectives made then (by the engine, its plugins or
the user's code) are counted for that engine, and two engines in one process never mix their counts.
``engine.plugin_state("comms_logger")`` is the context. With this plugin disabled the engine's
collectives count in whichever context is current (the process default when no other engine ran).

``"comms_logger": {"enabled": true, "verbose": false, "prof_all": true, "prof_ops": [], "debug": false}``
configures the engine's comms logger; ``microspeed.comm.log_summary()`` prints the table of the
current (last active) engine. A config without the section (or with ``enabled: false``) leaves the
logger as ``microspeed.comm.configure(...)`` set it before ``initialize()``, as DeepSpeed does.
"""

from __future__ import annotations

from typing import Any

from microspeed import comm
from microspeed.config import Field, Section
from microspeed.hookspecs import hookimpl


class CommsLoggerPlugin:
    """Owns its engine's communication context: makes it current, configures its comms logger."""

    def __init__(self) -> None:
        self.context: comm.CommContext = comm.default_context()

    @hookimpl(tryfirst=True)
    def microspeed_plugins_loaded(self, plugins: Any) -> None:
        """Make the engine's context (made here) current for the rest of ``initialize()``."""
        self.context = comm.context_for(plugins)
        comm.activate(self.context)

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``comms_logger``: ``enabled``, ``verbose``, ``prof_all``, ``prof_ops``, ``debug``."""
        return {
            "comms_logger": Section({
                "enabled": Field((bool,), False, "record every collective: count, size, latency, bandwidth"),
                "verbose": Field((bool,), False, "log each collective as it completes (rank 0)"),
                "prof_all": Field((bool,), True, "record all ops (else only those in prof_ops)"),
                "prof_ops": Field((list,), [], "op names to record when prof_all is false, e.g. [\"all_reduce\"]",
                                  check=_names),
                "debug": Field((bool,), False, "record the calling function with each op"),
            }, doc="DeepSpeed's communication logger; print with microspeed.comm.log_summary()"),
        }

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Configure the engine's comms logger when the section enables it."""
        section = config["comms_logger"]
        if section["enabled"]:
            self.context.comms_logger.configure(enabled=True, prof_all=section["prof_all"],
                                                prof_ops=section["prof_ops"], verbose=section["verbose"],
                                                debug=section["debug"])

    @hookimpl(tryfirst=True)
    def microspeed_setup(self, engine: Any) -> None:
        """Expose the context as ``engine.plugin_state("comms_logger")``."""
        engine.set_plugin_state("comms_logger", self.context)
        comm.activate(self.context)

    @hookimpl(tryfirst=True)
    def microspeed_before_forward(self) -> None:
        """This engine's collectives from here on are its own (one assignment)."""
        comm.activate(self.context)

    @hookimpl(tryfirst=True)
    def microspeed_before_backward(self) -> None:
        """As ``before_forward``: the backward pass's reductions count for this engine."""
        comm.activate(self.context)

    @hookimpl(tryfirst=True)
    def microspeed_before_step(self) -> None:
        """As ``before_forward``: the step's collectives count for this engine."""
        comm.activate(self.context)

    @hookimpl(tryfirst=True)
    def microspeed_before_checkpoint_save(self) -> None:
        """As ``before_forward``: a checkpoint's collectives count for this engine."""
        comm.activate(self.context)

    @hookimpl(trylast=True)
    def microspeed_destroy(self) -> None:
        """``engine.destroy()``: the context is no longer current (the process-wide pointer to it would keep the
        engine alive through its observers); collectives made from now on count in the default context."""
        comm.deactivate(self.context)

    @hookimpl(tryfirst=True)
    def microspeed_load_checkpoint(self) -> None:
        """Make the context current for a checkpoint load, and let the loader answer."""
        comm.activate(self.context)


def _names(value: list) -> str | None:
    return None if all(isinstance(v, str) for v in value) else "a list of op names (strings)"
