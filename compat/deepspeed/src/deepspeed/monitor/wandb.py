"""``deepspeed.monitor.wandb``: the ``wandb`` section's monitor. microspeed does not log to Weights & Biases:
a disabled one writes nothing (as DeepSpeed's), an enabled one is refused naming what to do instead."""

from __future__ import annotations

from typing import Any

from deepspeed.monitor.monitor import Monitor
from microspeed.errors import ConfigError

__all__ = ["WandbMonitor"]


class WandbMonitor(Monitor):
    """Holds the ``wandb`` settings; ``enabled: true`` raises :class:`microspeed.ConfigError`."""

    def __init__(self, wandb_config: Any) -> None:
        super().__init__(wandb_config)
        self.enabled = bool(wandb_config.enabled)
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        if self.enabled:
            raise ConfigError("wandb.enabled: true — microspeed does not log to Weights & Biases; log "
                              "engine.metrics from your script (or use tensorboard / csv_monitor), and set "
                              "wandb.enabled to false.")

    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        """Nothing is written: only a disabled W&B monitor exists here."""
