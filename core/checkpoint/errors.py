"""The checkpoint errors and warning: what :mod:`microspeed.checkpoint` raises and warns."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked. ``path`` is the file or folder at fault."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file or folder asked for does not exist: a :class:`CheckpointError` and a ``FileNotFoundError``."""


class CheckpointTagMismatchError(CheckpointError, AssertionError):
    """The ranks passed different tags to ``save_checkpoint`` under ``checkpoint.tag_validation: Fail``.

    Also an :class:`AssertionError`, because DeepSpeed asserts this rule and its users catch that.
    """


class CheckpointWarning(UserWarning):
    """Something was tolerated while loading (non-strict names, no ``latest``, a changed topology)."""
