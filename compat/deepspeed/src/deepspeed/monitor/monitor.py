"""``deepspeed.monitor.monitor``: DeepSpeed's monitor base class and ``MonitorMaster``, which fans events out.

An event is ``(name, value, step)``, as DeepSpeed's engine writes them (``("Train/Samples/lr", 0.1, 64)``).
Only rank 0 writes, as in DeepSpeed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["Monitor", "MonitorMaster"]


class Monitor(ABC):
    """A writer of training events configured by one monitor section."""

    @abstractmethod
    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        """Write ``(name, value, step)`` events."""


class MonitorMaster(Monitor):
    """Every enabled monitor of a :class:`~deepspeed.monitor.config.DeepSpeedMonitorConfig`, written at once."""

    def __init__(self, monitor_config: Any) -> None:
        from deepspeed.monitor.comet import CometMonitor
        from deepspeed.monitor.csv_monitor import csvMonitor
        from deepspeed.monitor.tensorboard import TensorBoardMonitor
        from deepspeed.monitor.wandb import WandbMonitor
        from microspeed import comm

        super().__init__(monitor_config)
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = self.comet_monitor = None
        self.enabled = bool(monitor_config.enabled)
        if comm.get_rank() != 0:
            return
        if monitor_config.tensorboard.enabled:
            self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard)
        if monitor_config.wandb.enabled:
            self.wandb_monitor = WandbMonitor(monitor_config.wandb)
        if monitor_config.csv_monitor.enabled:
            self.csv_monitor = csvMonitor(monitor_config.csv_monitor)
        if monitor_config.comet.enabled:
            self.comet_monitor = CometMonitor(monitor_config.comet)

    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        """Write the events to every enabled monitor (rank 0 only)."""
        for monitor in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor):
            if monitor is not None:
                monitor.write_events(event_list)
