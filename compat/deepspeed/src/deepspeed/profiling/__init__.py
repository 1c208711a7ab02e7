"""``deepspeed.profiling``: ``flops_profiler`` is microspeed's (the efficiency plugin's) flops profiler."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    from deepspeed import _aliases

    found = _aliases.submodule(__name__, name)
    if found is None:
        raise AttributeError(f"module {__name__!r} (microspeed stand-in) has no attribute {name!r}")
    return found
