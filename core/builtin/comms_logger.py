"""The ``comms_logger`` section, as DeepSpeed's: per-collective counts, sizes, latency, bandwidth.

``"comms_logger": {"enabled": true, "verbose": false, "prof_all": true, "prof_ops": [], "debug": false}``
configures :data:`microspeed.comm.comms_logger`; ``microspeed.comm.log_summary()`` prints the
table. A config without the section (or with ``enabled: false``) leaves the logger as it is,
as DeepSpeed does, so that ``microspeed.comm.configure(...)`` from user code is not undone.
"""

from __future__ import annotations

from microspeed import comm
from microspeed.config import Field, Section
from microspeed.hookspecs import hookimpl


class CommsLoggerPlugin:
    """Claims ``comms_logger`` and configures the process's comms logger from it."""

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
        """Configure the comms logger when the section enables it."""
        section = config["comms_logger"]
        if section["enabled"]:
            comm.configure(enabled=True, prof_all=section["prof_all"], prof_ops=section["prof_ops"],
                           verbose=section["verbose"], debug=section["debug"])


def _names(value: list) -> str | None:
    return None if all(isinstance(v, str) for v in value) else "a list of op names (strings)"
