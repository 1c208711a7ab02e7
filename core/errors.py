"""Errors a user can cause, raised at ``initialize()`` or at the call that received the bad input."""

from __future__ import annotations


class ConfigError(ValueError):
    """A ds_config key, argument or plugin combination is wrong.

    The message names the key path (for example ``fp16.loss_scale_window``), what was given,
    what is accepted, and how to fix it.
    """


class PluginError(RuntimeError):
    """A plugin failed to load, or plugins disagree across ranks or with each other."""


class MissingPluginError(ImportError):
    """A feature was used whose plugin distribution is not installed; names the distribution."""
