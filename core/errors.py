"""Errors a user can cause, raised at ``initialize()`` or at the call that received the bad input."""

from __future__ import annotations


class ConfigError(ValueError):
    """A ds_config key, argument or plugin combination is wrong.

    The message names the key path (for example ``fp16.loss_scale_window``), what was given,
    what is accepted, and how to fix it. ``problems`` lists each problem's message when one
    error reports several (a config is checked whole: every problem at once, typos first).
    """

    def __init__(self, message: str = "", problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems) if problems is not None else [message]


class PluginError(RuntimeError):
    """A plugin failed to load, or plugins disagree across ranks or with each other."""


class MissingPluginError(ImportError):
    """A feature was used whose plugin distribution is not installed; names the distribution."""


class EngineUsageError(RuntimeError, AssertionError):
    """An engine method was called where DeepSpeed forbids it (``step()`` inside ``no_sync()``, a nested ``no_sync()``).

    Also an :class:`AssertionError`, because DeepSpeed asserts these rules and callers catch that.
    """


class NonFiniteError(FloatingPointError):
    """Training met ``max_consecutive_nonfinite_steps`` optimizer steps in a row whose loss or gradient norm
    was NaN or inf; each was skipped. The message names the step and the config key."""
