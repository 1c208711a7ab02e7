"""Structured logging through structlog, with rank (and step, where known) bound.

microspeed keeps its own structlog logger (``wrap_logger``) so that it never changes the
application's global structlog configuration.
"""

from __future__ import annotations

import sys
from typing import Any

import structlog

from microspeed import comm


def get_logger(name: str = "microspeed", **bound: Any) -> Any:
    """A structlog logger writing ``key=value`` lines to stderr, with ``rank`` bound."""
    logger = structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=False, pad_event_to=0),
        ],
    )
    return logger.bind(logger=name, rank=comm.get_rank(), **bound)
