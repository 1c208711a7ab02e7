"""The early-stopping plugin: watch the loss, say when it has stopped improving.

A class entry point, so microspeed makes one :class:`EarlyStoppingPlugin` per engine; its state
(:class:`EarlyStoppingState`) is attached to that engine with ``engine.set_plugin_state`` and goes
into checkpoints through the checkpoint hooks. The hooks it implements, in the order they fire:

* ``config_sections`` — claims the ``early_stopping`` section (strict schema, defaults);
* ``configure`` — reads it;
* ``conflicts`` — refuses an LR range test, which raises the loss on purpose;
* ``setup`` — attaches the state to the engine, remembers the data-parallel group;
* ``before_backward`` — adds each micro-step's loss to a sum (on the device, no host sync);
* ``after_step`` — notes whether the optimizer step was applied (fp16 overflow skips are not checks);
* ``after_global_step`` — averages the step's loss over its micro-steps and over the data-parallel
  ranks (one all-reduce of one number), then counts one check;
* ``checkpoint_state`` / ``load_checkpoint_state`` — save and restore the counters.

Every data-parallel rank sees the same averaged value, so every rank decides to stop at the same
step — no rank is left waiting in a collective for a peer that already left the training loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from microspeed.plugin_api import Field, Section, StepOutcome, comm, get_logger, hookimpl, non_negative, positive

NAME = "early_stopping"
"""The config section, the plugin-state key and the checkpoint-state key."""

MONITORS = ("loss", "reported")
"""Accepted values of ``early_stopping.monitor``."""

_COUNTERS = ("best", "best_step", "bad_checks", "checks", "last", "stopped_at")


@dataclass
class EarlyStoppingState:
    """Where early stopping stands; ``engine.plugin_state("early_stopping")`` returns it.

    Settings (from the config): ``enabled``, ``patience``, ``min_delta``, ``monitor``.
    Counters (saved in checkpoints): ``best`` (lowest value seen), ``best_step`` (the global step
    it was seen at), ``bad_checks`` (checks since the last improvement), ``checks`` (all checks),
    ``last`` (the latest value) and ``stopped_at`` (the global step at which :attr:`should_stop`
    first became true, else ``None``).

    A check is an improvement when ``value < best - min_delta``; a non-finite value never is.
    """

    enabled: bool = False
    patience: int = 5
    min_delta: float = 0.0
    monitor: str = "loss"
    best: float = math.inf
    best_step: int = 0
    bad_checks: int = 0
    checks: int = 0
    last: float | None = None
    stopped_at: int | None = None
    _average: Any = field(default=None, init=False, repr=False, compare=False)  # set by the plugin at setup
    _step: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def should_stop(self) -> bool:
        """True once ``patience`` checks in a row brought no improvement (always False when disabled)."""
        return self.enabled and self.bad_checks >= self.patience

    def update(self, value: float, step: int) -> bool:
        """Count one check of ``value`` (already agreed across ranks) at global ``step``; return :attr:`should_stop`."""
        self.checks += 1
        self.last = value
        if math.isfinite(value) and value < self.best - self.min_delta:
            self.best, self.best_step, self.bad_checks = value, step, 0
        else:
            self.bad_checks += 1
        if self.should_stop and self.stopped_at is None:
            self.stopped_at = step
        return self.should_stop

    def report(self, value: float | torch.Tensor) -> bool:
        """Check a value the training script computed (``monitor: "reported"``, e.g. a validation loss).

        Every data-parallel rank must call it at the same point (the value is averaged over them
        with one all-reduce); the check is counted at the engine's current global step. Returns
        :attr:`should_stop`. Does nothing (returns ``False``) when early stopping is disabled.
        """
        if not self.enabled:
            return False
        if self._average is None:
            raise RuntimeError("early_stopping.report(): the state is not attached to an engine.")
        return self.update(self._average(value), self._step())

    def state_dict(self) -> dict[str, Any]:
        """The counters, for a checkpoint (settings come from the config of the run that loads it)."""
        return {key: getattr(self, key) for key in _COUNTERS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters saved by :meth:`state_dict`."""
        for key in _COUNTERS:
            if key in state:
                setattr(self, key, state[key])


class EarlyStoppingPlugin:
    """microspeed plugin: signals ``should_stop`` when the monitored loss stops improving.

    Registered through the entry point ``early_stopping`` (group ``microspeed.plugins``); one
    instance per engine.
    """

    def __init__(self) -> None:
        self.state = EarlyStoppingState()
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._applied = False
        self._group: Any = None
        self._dp_size = 1
        self._log: Any = None

    # -- setup ---------------------------------------------------------------------------

    @hookimpl
    def microspeed_config_sections(self) -> dict[str, Section]:
        """Claim ``early_stopping``: ``enabled``, ``patience``, ``min_delta``, ``monitor``."""
        return {NAME: Section({
            "enabled": Field((bool,), False, "stop when the monitored loss stops improving"),
            "patience": Field((int,), 5, "checks without improvement before should_stop", positive),
            "min_delta": Field((float,), 0.0, "smallest decrease that counts as an improvement", non_negative),
            "monitor": Field((str,), "loss", "loss: each step's training loss; reported: values passed to "
                             "report()", choices=MONITORS),
        }, doc="early stopping (microspeed-early-stopping)")}

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Read the section into the state's settings."""
        section = config[NAME]
        state = self.state
        state.enabled, state.patience = section["enabled"], section["patience"]
        state.min_delta, state.monitor = float(section["min_delta"]), section["monitor"]

    @hookimpl
    def microspeed_conflicts(self, config) -> list[tuple[str, str]] | None:
        """An LR range test drives the loss up on purpose: refuse it together with loss monitoring."""
        if self.state.enabled and self.state.monitor == "loss" and config.get("scheduler.type") == "LRRangeTest":
            return [("scheduler.type", "an LR range test raises the learning rate until the loss diverges, so "
                     "early stopping on the loss would end it at the first rise; set early_stopping.enabled "
                     "to false for the range test")]
        return None

    @hookimpl
    def microspeed_setup(self, engine) -> None:
        """Attach the state to the engine (``engine.plugin_state("early_stopping")``)."""
        self._group = engine.topology.data_parallel_group
        self._dp_size = engine.topology.data_parallel_size
        self.state._average = lambda value: self._agree(value, engine.device)
        self.state._step = lambda: engine.global_steps
        if engine.topology.rank == 0:
            self._log = get_logger("microspeed.early_stopping")
        engine.set_plugin_state(NAME, self.state)

    # -- every step ----------------------------------------------------------------------

    @hookimpl
    def microspeed_before_backward(self, ctx) -> None:
        """Add this micro-step's (unscaled) loss to the step's sum; no host synchronisation."""
        if not (self.state.enabled and self.state.monitor == "loss"):
            return
        loss = ctx.loss.detach().float()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1

    @hookimpl
    def microspeed_after_step(self, outcome: StepOutcome) -> None:
        """Remember whether the optimizer step was applied (a skipped fp16 step is not a check)."""
        self._applied = outcome.applied

    @hookimpl
    def microspeed_after_global_step(self, engine) -> None:
        """One check per applied optimizer step: the step's loss, averaged over micro-steps and ranks."""
        if self._loss_sum is None:
            return
        mean = self._loss_sum / self._loss_count
        self._loss_sum, self._loss_count = None, 0
        if not self._applied:
            return
        was_stopping = self.state.should_stop
        if self.state.update(self._agree(mean, mean.device), engine.global_steps) and not was_stopping:
            if self._log is not None:
                self._log.info("early_stopping", step=engine.global_steps, monitor=self.state.monitor,
                               best=round(self.state.best, 6), best_step=self.state.best_step,
                               patience=self.state.patience)

    def _agree(self, value: float | torch.Tensor, device: torch.device) -> float:
        """The mean of ``value`` over the data-parallel ranks (one all-reduce; none on one rank)."""
        t = torch.as_tensor(value, dtype=torch.float32, device=device).detach().reshape(1).clone()
        if self._dp_size > 1:
            comm.all_reduce(t, group=self._group)
            t /= self._dp_size
        return float(t)

    # -- checkpoints ---------------------------------------------------------------------

    @hookimpl
    def microspeed_checkpoint_state(self) -> dict[str, Any] | None:
        """The counters, under ``"early_stopping"`` (nothing when disabled)."""
        return {NAME: self.state.state_dict()} if self.state.enabled else None

    @hookimpl
    def microspeed_load_checkpoint_state(self, states: dict[str, Any]) -> None:
        """Restore the counters, if the checkpoint has them."""
        if NAME in states:
            self.state.load_state_dict(states[NAME])
