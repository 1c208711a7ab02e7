"""``deepspeed.utils.logging``: DeepSpeed's standard-library logger ``"DeepSpeed"`` and ``log_dist``.

Client libraries set its level (``deepspeed.utils.logging.logger.setLevel(...)``) and write to it
with ``%``-style messages, so it is a :class:`logging.Logger` (microspeed's own logs are structlog's).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

from microspeed import comm

LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}


def _create_logger(name: str = "DeepSpeed", level: int = logging.INFO) -> logging.Logger:
    made = logging.getLogger(name)
    made.setLevel(level)
    made.propagate = False
    if not made.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                               "%(message)s"))
        made.addHandler(handler)
    return made


logger = _create_logger()


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given ranks (``None`` or ``[-1]``: every rank), prefixed with the rank."""
    rank = comm.get_rank()
    wanted = None if ranks is None else list(ranks)
    if wanted is None or -1 in wanted or rank in wanted:
        logger.log(level, f"[Rank {rank}] {message}")


_logged_once: set[str] = set()


def log_dist_once(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """:func:`log_dist`, but each distinct message only once per process."""
    if message not in _logged_once:
        _logged_once.add(message)
        log_dist(message, ranks, level)


def set_log_level_from_string(log_level: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the level from a name (``"info"``, ``"warning"``, ...)."""
    if log_level.lower() not in LOG_LEVELS:
        raise ValueError(f"log_level={log_level!r}: expected one of {', '.join(LOG_LEVELS)}")
    (custom_logger or logger).setLevel(LOG_LEVELS[log_level.lower()])


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger's level is at or below ``max_log_level_str``."""
    if max_log_level_str.lower() not in LOG_LEVELS:
        raise ValueError(f"{max_log_level_str!r}: expected one of {', '.join(LOG_LEVELS)}")
    return logger.getEffectiveLevel() <= LOG_LEVELS[max_log_level_str.lower()]
