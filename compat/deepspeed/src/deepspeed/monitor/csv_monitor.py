"""``deepspeed.monitor.csv_monitor``: one ``<event>.csv`` per event under ``output_path/job_name`` (rank 0), in
DeepSpeed's layout, written by microspeed's built-in monitor's :class:`~microspeed.builtin.monitor.CsvEventWriter`."""

from __future__ import annotations

import os
from typing import Any

from deepspeed.monitor.monitor import Monitor

__all__ = ["csvMonitor"]


class csvMonitor(Monitor):  # noqa: N801 - DeepSpeed's name
    """Appends ``step,value`` rows to ``<output_path>/<job_name>/<event with / as _>.csv``."""

    def __init__(self, csv_config: Any) -> None:
        super().__init__(csv_config)
        self.filenames: list[str] = []
        self.enabled = bool(csv_config.enabled)
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self._writer: Any = None

    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        """Append each event to its file (rank 0 only) and flush."""
        from microspeed import comm
        from microspeed.builtin.monitor import CsvEventWriter, csv_file_name

        if not self.enabled or comm.get_rank() != 0:
            return
        if self._writer is None:
            self._writer = CsvEventWriter(os.path.join(self.output_path, self.job_name))
        for name, value, step in event_list:
            path = os.path.join(self._writer.log_dir, csv_file_name(name))
            if path not in self.filenames:
                self.filenames.append(path)
            self._writer.write(name, float(value), int(step))
        self._writer.flush()
