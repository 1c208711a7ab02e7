"""microspeed-early-stopping: stop training when the monitored loss stops improving.

Installed, it adds the ds_config section ``early_stopping`` to every microspeed engine::

    {"early_stopping": {"enabled": true, "patience": 5, "min_delta": 0.0, "monitor": "loss"}}

and the training loop asks ``engine.plugin_state("early_stopping").should_stop``.
"""

from __future__ import annotations

from importlib import metadata

from microspeed_early_stopping.plugin import NAME, EarlyStoppingPlugin, EarlyStoppingState

try:
    __version__ = metadata.version("microspeed-early-stopping")
except metadata.PackageNotFoundError:  # pragma: no cover - imported from a source tree
    __version__ = "0.0.0"

__all__ = ["NAME", "EarlyStoppingPlugin", "EarlyStoppingState", "__version__"]
