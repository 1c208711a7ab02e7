"""The checkpoint error and warning: what :mod:`microspeed.checkpoint` raises and warns."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked. ``path`` is the file or folder at fault."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class CheckpointWarning(UserWarning):
    """Something was tolerated while loading (non-strict names, no ``latest``, a changed topology)."""
