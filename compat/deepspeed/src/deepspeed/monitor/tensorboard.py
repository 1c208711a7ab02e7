"""``deepspeed.monitor.tensorboard``: TensorBoard events under ``output_path/job_name`` (rank 0), as microspeed's
built-in monitor writes them."""

from __future__ import annotations

import os
from typing import Any

from deepspeed.monitor.monitor import Monitor

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor(Monitor):
    """Writes events with ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package)."""

    def __init__(self, tensorboard_config: Any) -> None:
        from microspeed import comm

        super().__init__(tensorboard_config)
        self.summary_writer: Any = None
        self.enabled = bool(tensorboard_config.enabled)
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        if self.enabled and comm.get_rank() == 0:
            self.get_summary_writer()

    def get_summary_writer(self, base: str | None = None) -> Any:
        """The writer for ``output_path/job_name`` (created on first call; ``base`` overrides ``output_path``)."""
        if self.summary_writer is None:
            from microspeed.builtin.monitor import _summary_writer_class

            log_dir = os.path.join(base if base is not None else self.output_path, self.job_name)
            os.makedirs(log_dir, exist_ok=True)
            self.summary_writer = _summary_writer_class()(log_dir=log_dir)
        return self.summary_writer

    def write_events(self, event_list: list[tuple[str, float, int]], flush: bool = True) -> None:
        """Add each ``(name, value, step)`` as a scalar; flush after the list unless ``flush=False``."""
        if not self.enabled or self.summary_writer is None:
            return
        for name, value, step in event_list:
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        """Flush pending events."""
        if self.summary_writer is not None:
            self.summary_writer.flush()
