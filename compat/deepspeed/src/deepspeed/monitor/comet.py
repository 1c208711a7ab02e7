"""``deepspeed.monitor.comet``: the ``comet`` section's monitor. microspeed does not log to Comet: a disabled one
writes nothing (as DeepSpeed's), an enabled one is refused naming what to do instead."""

from __future__ import annotations

from typing import Any

from deepspeed.monitor.monitor import Monitor
from microspeed.errors import ConfigError

__all__ = ["CometMonitor"]


class CometMonitor(Monitor):
    """Holds the ``comet`` settings; ``enabled: true`` raises :class:`microspeed.ConfigError`."""

    def __init__(self, comet_config: Any) -> None:
        super().__init__(comet_config)
        self.enabled = bool(comet_config.enabled)
        self.samples_log_interval = comet_config.samples_log_interval
        self.experiment = None
        if self.enabled:
            raise ConfigError("comet.enabled: true — microspeed does not log to Comet; log engine.metrics from "
                              "your script (or use tensorboard / csv_monitor), and set comet.enabled to false.")

    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        """Nothing is written: only a disabled Comet monitor exists here."""
