"""DeepSpeed's ``tensorboard`` and ``csv_monitor`` sections: training curves, written by rank 0.

Both sections take DeepSpeed's keys (``enabled``, ``output_path``, ``job_name``) and write to
``output_path/job_name/`` (``output_path`` defaults to ``""``, the current directory, as in
DeepSpeed). Every optimizer step, rank 0 writes one value per event, with the number of samples
seen so far (``engine.global_samples``) as the x-axis, under DeepSpeed's event names:

=========================================== ===========================================================
event                                        value
=========================================== ===========================================================
``Train/Samples/train_loss``                 mean of the losses given to ``engine.backward`` during the
                                             step (rank 0's micro-batches)
``Train/Samples/lr``                         ``engine.get_lr()[0]`` after the scheduler stepped
``Train/Samples/loss_scale``                 the fp16 loss scale (only when the engine reports one)
``Train/Samples/grad_norm``                  the global gradient norm before clipping (absent on a
                                             step skipped for an fp16 overflow)
``Train/Samples/samples_per_sec``            ``train_batch_size`` / host seconds since the previous step
``Train/Samples/elapsed_time_ms_forward``    with ``wall_clock_breakdown``: milliseconds spent in
``Train/Samples/elapsed_time_ms_backward``   forward / backward / step during this optimizer step
``Train/Samples/elapsed_time_ms_step``
=========================================== ===========================================================

``csv_monitor`` keeps DeepSpeed's layout: one file per event, named after the event with ``/`` and
spaces turned into ``_`` (``Train_Samples_lr.csv``), a header row ``step,<last part of the name>``
and rows ``<global samples>,<value>``. Files are appended to (a resumed run continues them), flushed
after every step and closed by :meth:`MonitorPlugin.close`, when the plugin is garbage-collected, or
at process exit. ``tensorboard`` writes the same events with ``torch.utils.tensorboard``'s
``SummaryWriter`` (it needs the ``tensorboard`` package).

The loss is accumulated on the device without a host sync per micro-step; the one sync per
optimizer step happens when the step's values are written, on rank 0 only. Other ranks do nothing.
"""

from __future__ import annotations

import csv
import os
import time
import weakref
from typing import Any

from microspeed.builtin.step_metrics import LossMeter, PhaseTimer
from microspeed.config import Field, Section
from microspeed.errors import ConfigError
from microspeed.hookspecs import hookimpl

EVENT_PREFIX = "Train/Samples/"
"""Prefix of every event name, as DeepSpeed's engine writes them (the x-axis is global samples)."""

DEFAULT_JOB_NAME = "DeepSpeedJobName"
"""DeepSpeed's default ``job_name``: the folder created inside ``output_path``."""



def _not_empty(value: Any) -> str | None:
    return None if value.strip() else "a non-empty folder name"


def _monitor_section(what: str) -> Section:
    return Section(
        fields={
            "enabled": Field((bool,), False, f"write {what} on rank 0 every optimizer step"),
            "output_path": Field((str,), "", "where the job folder is made (\"\" = current directory)"),
            "job_name": Field((str,), DEFAULT_JOB_NAME, "job folder created inside output_path", _not_empty),
        },
        doc=f"{what}: loss, lr, loss scale, grad norm, samples/s per step",
    )


def csv_file_name(event: str) -> str:
    """The csv file an event goes to, as DeepSpeed names it (``Train/Samples/lr`` → ``Train_Samples_lr.csv``)."""
    return event.replace("/", "_").replace(" ", "_") + ".csv"


def _summary_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``; a :class:`ConfigError` when it cannot be imported."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs the package)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ConfigError(
            "tensorboard.enabled: true needs the 'tensorboard' package, which cannot be imported "
            f"({type(exc).__name__}: {exc}). Run `pip install tensorboard` (or "
            "`pip install 'microspeed[monitor]'`), or set tensorboard.enabled to false."
        ) from exc
    return SummaryWriter


class CsvEventWriter:
    """DeepSpeed's csv_monitor layout: one ``<event>.csv`` per event under ``log_dir``, rows ``step,value``."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.files: dict[str, Any] = {}
        self.writers: dict[str, Any] = {}

    def write(self, event: str, value: float, step: int) -> None:
        """Append ``step,value`` to the event's file (opened, with its header row, on first use)."""
        writer = self.writers.get(event)
        if writer is None:
            fh = open(os.path.join(self.log_dir, csv_file_name(event)), "a", newline="", encoding="utf-8")
            self.files[event] = fh
            writer = self.writers[event] = csv.writer(fh)
            if fh.tell() == 0:  # a new file: DeepSpeed's header, the last part of the event name
                writer.writerow(["step", event.rsplit("/", 1)[-1]])
        writer.writerow([step, value])

    def flush(self) -> None:
        """Flush every open file."""
        for fh in self.files.values():
            fh.flush()

    def close(self) -> None:
        """Close every open file (a later :meth:`write` reopens in append mode)."""
        _close_files(self.files)
        self.writers.clear()


def _close_files(files: dict[str, Any]) -> None:
    for fh in files.values():
        if not fh.closed:
            fh.close()
    files.clear()


def _close_all(csv_writer: CsvEventWriter | None, tb_writer: Any) -> None:
    # Runs from close(), when the plugin is collected, or at exit (weakref.finalize): never refers to the plugin.
    if csv_writer is not None:
        csv_writer.close()
    if tb_writer is not None:
        tb_writer.close()


class MonitorPlugin:
    """Writes per-step training curves to csv files and/or TensorBoard on rank 0 (one instance per engine)."""

    def __init__(self) -> None:
        self.csv_enabled = False
        self.tb_enabled = False
        self.csv_dir: str | None = None
        self.tb_dir: str | None = None
        self.breakdown = False
        self.csv: CsvEventWriter | None = None
        self.tensorboard: Any = None
        self.loss = LossMeter()
        self.window_start: float | None = None
        self.timer = PhaseTimer()
        self._writer_class: Any = None
        self._finalizer: weakref.finalize | None = None

    @property
    def writing(self) -> bool:
        """Whether this instance writes events (a section is enabled and this is rank 0)."""
        return self.csv is not None or self.tensorboard is not None

    # -- setup ----------------------------------------------------------------------------

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``tensorboard`` and ``csv_monitor``, with DeepSpeed's keys and defaults."""
        return {"tensorboard": _monitor_section("TensorBoard events"), "csv_monitor": _monitor_section("csv files")}

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Read both sections; refuse ``tensorboard.enabled`` without the package (on every rank alike)."""
        self.csv_enabled = bool(config.get("csv_monitor.enabled", False))
        self.tb_enabled = bool(config.get("tensorboard.enabled", False))
        if self.csv_enabled:
            self.csv_dir = os.path.join(config.get("csv_monitor.output_path"), config.get("csv_monitor.job_name"))
        if self.tb_enabled:
            self.tb_dir = os.path.join(config.get("tensorboard.output_path"), config.get("tensorboard.job_name"))
            self._writer_class = _summary_writer_class()
        self.breakdown = self.timer.enabled = bool(config.get("wall_clock_breakdown", False))

    @hookimpl
    def microspeed_setup(self, engine) -> None:
        """On rank 0, create the job folders and open the writers."""
        if engine.topology.rank != 0 or not (self.csv_enabled or self.tb_enabled):
            return
        if self.csv_enabled:
            self.csv = CsvEventWriter(self.csv_dir)
        if self.tb_enabled:
            os.makedirs(self.tb_dir, exist_ok=True)
            self.tensorboard = self._writer_class(log_dir=self.tb_dir)
        self._finalizer = weakref.finalize(self, _close_all, self.csv, self.tensorboard)

    def close(self) -> None:
        """Flush and close the csv files and the TensorBoard writer (idempotent; also runs at exit)."""
        if self._finalizer is not None:
            self._finalizer()
        self.csv = self.tensorboard = None

    # -- per micro-step -------------------------------------------------------------------

    @hookimpl
    def microspeed_before_forward(self) -> None:
        """Start the step's clock at the first forward; start the forward timer."""
        if not self.writing:
            return
        if self.window_start is None:
            self.window_start = time.perf_counter()
        self.timer.start()

    @hookimpl
    def microspeed_after_forward(self) -> None:
        """Stop the forward timer."""
        if self.writing:
            self.timer.stop("forward")

    @hookimpl
    def microspeed_before_backward(self, ctx) -> None:
        """Add ``ctx.loss`` to the step's sum, on the device (no host sync)."""
        if not self.writing:
            return
        self.loss.add(ctx.loss)
        self.timer.start()

    @hookimpl
    def microspeed_after_backward(self) -> None:
        """Stop the backward timer."""
        if self.writing:
            self.timer.stop("backward")

    @hookimpl
    def microspeed_before_step(self) -> None:
        """Start the step timer."""
        if self.writing:
            self.timer.start()

    @hookimpl
    def microspeed_after_step(self) -> None:
        """Stop the step timer."""
        if self.writing:
            self.timer.stop("step")

    # -- per optimizer step ---------------------------------------------------------------

    def events(self, engine) -> list[tuple[str, float, int]]:
        """This step's ``(event name, value, global samples)`` triples (and reset the step's sums)."""
        now = time.perf_counter()
        x = engine.global_samples
        out: list[tuple[str, float, int]] = []
        mean_loss = self.loss.take()
        if mean_loss is not None:
            out.append((EVENT_PREFIX + "train_loss", mean_loss, x))
        lrs = engine.get_lr()
        if lrs:
            out.append((EVENT_PREFIX + "lr", float(lrs[0]), x))
        if engine.metrics.get("loss_scale") is not None:
            out.append((EVENT_PREFIX + "loss_scale", float(engine.metrics["loss_scale"]), x))
        norm = engine.get_global_grad_norm()
        if norm is not None:
            out.append((EVENT_PREFIX + "grad_norm", float(norm), x))
        if self.window_start is not None and now > self.window_start:
            out.append((EVENT_PREFIX + "samples_per_sec", engine.train_batch_size() / (now - self.window_start), x))
        if self.breakdown:
            out.extend((f"{EVENT_PREFIX}elapsed_time_ms_{phase}", ms, x) for phase, ms in self.timer.take().items())
        self.window_start = now
        return out

    @hookimpl
    def microspeed_after_global_step(self, engine) -> None:
        """Write this step's events to the enabled writers and flush them (rank 0)."""
        if not self.writing:
            return
        events = self.events(engine)
        if self.csv is not None:
            for name, value, step in events:
                self.csv.write(name, value, step)
            self.csv.flush()
        if self.tensorboard is not None:
            for name, value, step in events:
                self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()
