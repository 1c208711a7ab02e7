"""``deepspeed.monitor``: DeepSpeed's monitor classes over microspeed's built-in monitor (tensorboard, csv files).

microspeed writes ``tensorboard`` and ``csv_monitor``; ``wandb`` and ``comet`` are accepted in a config
but microspeed does not log to them (their monitors refuse ``enabled: true``, saying so).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    from deepspeed import _aliases

    found = _aliases.submodule(__name__, name)
    if found is None:
        raise AttributeError(f"module {__name__!r} (microspeed stand-in) has no attribute {name!r}")
    return found
