"""The ``flops_profiler`` plugin: DeepSpeed's ds_config section that profiles one training step.

========================= ========= ===================================================================
key                       default   meaning
========================= ========= ===================================================================
``enabled``               false     profile one step
``profile_step``          1         the step profiled: the one that starts when ``engine.global_steps``
                                    (completed optimizer steps) equals it, as in DeepSpeed (1 = the
                                    second step, leaving one warm-up step)
``module_depth``          -1        deepest module level printed (-1: all)
``top_modules``           1         modules per depth in the aggregated table
``detailed``              true      print the module tree with each module's numbers
``output_file``           null      write the profile to this file (overwritten) instead of stdout
``recompute_fwd_factor``  0.0       fraction of the forward recomputed in the backward (activation
                                    checkpointing): the backward is estimated at ``(2 + factor) * fwd``
========================= ========= ===================================================================

On global rank 0 only, the first micro-batch's forward of that step is profiled with
:class:`~microspeed_efficiency.flops_profiler.FlopsProfiler` (``engine.module``: FLOPs, MACs, parameters and
latency per module); the plugin also times that micro-batch's backward, the optimizer step and the whole
step, and writes the profile with DeepSpeed's summary lines: forward FLOPs and FLOPS, estimated backward and
``fwd+bwd`` FLOPs (``(3 + recompute_fwd_factor) * fwd``), per step (``* gradient_accumulation_steps``),
latencies and samples per second. The latencies of the profiled forward include the counting overhead (see
:mod:`microspeed_efficiency.flops_profiler`). Other ranks do nothing. The result stays available as
``engine.plugin_state("flops_profiler").result`` (a :class:`StepProfile`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from microspeed.plugin_api import Field, Section, comm, hookimpl, non_negative
from microspeed_efficiency.flops_profiler import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    number_to_string,
    write_profile_text,
)

SECTION = "flops_profiler"
"""The ds_config section this plugin claims."""


def _at_least(lo: int):
    def check(value: Any) -> str | None:
        return None if value >= lo else f"an integer >= {lo}"

    return check


FLOPS_PROFILER_SECTION = Section(
    fields={
        "enabled": Field((bool,), False, "profile one training step (rank 0)"),
        "recompute_fwd_factor": Field((float,), 0.0, "fraction of the forward recomputed in the backward "
                                      "(activation checkpointing)", non_negative),
        "profile_step": Field((int,), 1, "the step profiled: engine.global_steps when it starts", _at_least(0)),
        "module_depth": Field((int,), -1, "deepest module level printed (-1: all)", _at_least(-1)),
        "top_modules": Field((int,), 1, "modules per depth in the aggregated profile", _at_least(1)),
        "detailed": Field((bool,), True, "print the module tree with each module's numbers"),
        "output_file": Field((str, type(None)), None, "write the profile to this file instead of stdout"),
    },
    doc="DeepSpeed's flops profiler: FLOPs, MACs, params and latency per module at one step",
    # DeepSpeed 0.19.8 reads the section with defaults and ignores other keys; its own unit tests write "step"
    notices={"step": "DeepSpeed ignores it too (its section reads only its documented keys); the step "
                     "profiled is flops_profiler.profile_step"},
)
"""Schema of the ``flops_profiler`` section (DeepSpeed's keys and defaults)."""


@dataclass(frozen=True)
class FlopsProfilerSettings:
    """The parsed ``flops_profiler`` section."""

    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> FlopsProfilerSettings:
        """Settings from the validated section."""
        return cls(**{k: section[k] for k in cls.__dataclass_fields__})


@dataclass
class StepProfile:
    """What the plugin measured at the profiled step (rank 0).

    Attributes:
        step: the profiled step (``engine.global_steps`` when it started).
        fwd_flops: FLOPs of the first micro-batch's forward.
        fwd_macs: its multiply-accumulates.
        params: trainable parameters of ``engine.module``.
        fwd_latency: seconds in that forward (with the counting overhead).
        bwd_latency: seconds in that micro-batch's backward.
        step_latency: seconds in the optimizer step.
        iter_latency: seconds of the whole step (every micro-batch, forward to optimizer step).
        fwd_bwd_flops: estimated forward + backward FLOPs of one micro-batch, ``(3 + recompute_fwd_factor) * fwd``.
        step_flops: ``fwd_bwd_flops * gradient_accumulation_steps``.
        text: the profile as written.
    """

    step: int
    fwd_flops: int
    fwd_macs: int
    params: int
    fwd_latency: float
    bwd_latency: float
    step_latency: float
    iter_latency: float
    fwd_bwd_flops: float
    step_flops: float
    text: str


class FlopsProfilerPlugin:
    """Claims ``flops_profiler`` and profiles one step of training on rank 0 (one instance per engine).

    Per-engine state (``engine.plugin_state("flops_profiler")``): ``settings``, ``result`` (a
    :class:`StepProfile` once the step was profiled, else ``None``).
    """

    def __init__(self) -> None:
        self.settings = FlopsProfilerSettings()
        self.result: StepProfile | None = None
        self.profiler: FlopsProfiler | None = None
        self._state = "idle"  # idle -> forward -> measured -> done
        self._times: dict[str, float] = {}
        self._sync: Any = lambda: None

    @hookimpl
    def microspeed_config_sections(self) -> dict[str, Any]:
        """The ``flops_profiler`` section."""
        return {SECTION: FLOPS_PROFILER_SECTION}

    @hookimpl
    def microspeed_configure(self, config: Any) -> None:
        """Read the section."""
        self.settings = FlopsProfilerSettings.from_section(config[SECTION])

    @hookimpl
    def microspeed_setup(self, engine: Any) -> None:
        """Expose this plugin's state as ``engine.plugin_state("flops_profiler")``."""
        engine.set_plugin_state(SECTION, self)

    def _now(self) -> float:
        self._sync()
        return time.perf_counter()

    @hookimpl
    def microspeed_before_forward(self, engine: Any) -> None:
        """At the profiled step's first forward (rank 0): start counting."""
        s = self.settings
        if not s.enabled or self._state != "idle" or engine.global_steps != s.profile_step or comm.get_rank() != 0:
            return
        param = next(engine.module.parameters(), None)
        self._sync = torch.cuda.synchronize if param is not None and param.device.type == "cuda" else (lambda: None)
        self.profiler = FlopsProfiler(engine.module, ds_engine=engine, recompute_fwd_factor=s.recompute_fwd_factor)
        self._times = {"iter": self._now()}
        self.profiler.start_profile()
        self._state = "forward"

    @hookimpl
    def microspeed_after_forward(self) -> None:
        """Stop counting after the first micro-batch's forward."""
        if self._state == "forward":
            self.profiler.stop_profile()
            self._state = "measured"

    @hookimpl
    def microspeed_before_backward(self) -> None:
        """Time the profiled micro-batch's backward."""
        if self._state == "measured" and "bwd_start" not in self._times:
            self._times["bwd_start"] = self._now()

    @hookimpl
    def microspeed_after_backward(self) -> None:
        """End of the profiled micro-batch's backward."""
        if self._state == "measured" and "bwd" not in self._times and "bwd_start" in self._times:
            self._times["bwd"] = self._now() - self._times["bwd_start"]

    @hookimpl
    def microspeed_before_step(self) -> None:
        """Time the optimizer step."""
        if self._state == "measured":
            self._times["step_start"] = self._now()

    @hookimpl
    def microspeed_after_step(self) -> None:
        """End of the optimizer step."""
        if self._state == "measured" and "step_start" in self._times:
            self._times["step"] = self._now() - self._times["step_start"]

    @hookimpl
    def microspeed_after_global_step(self, engine: Any) -> None:
        """The profiled step is over: write the profile and drop the counters."""
        if self._state != "measured":
            return
        iter_latency = self._now() - self._times["iter"]
        s, prof = self.settings, self.profiler
        fwd_flops, fwd_macs = prof.get_total_flops(), prof.get_total_macs()
        fwd_latency = prof.get_total_duration()
        bwd_latency = self._times.get("bwd", 0.0)
        step_latency = self._times.get("step", 0.0)
        bwd_factor = 2.0 + s.recompute_fwd_factor
        gas = engine.gradient_accumulation_steps()
        fwd_bwd = (bwd_factor + 1.0) * fwd_flops
        step_flops = fwd_bwd * gas

        def rate(flops: float, seconds: float) -> str:
            return flops_to_string(flops / seconds) if seconds > 0 else "n/a"

        extra = [
            ("gradient accumulation steps:", str(gas)),
            ("bwd latency:", duration_to_string(bwd_latency)),
            (f"bwd FLOPS per GPU = {bwd_factor:g} * fwd flops per GPU / bwd latency:",
             rate(bwd_factor * fwd_flops, bwd_latency)),
            (f"fwd+bwd flops per micro-batch = {bwd_factor + 1:g} * fwd flops per GPU:", number_to_string(fwd_bwd)),
            (f"fwd+bwd FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / (fwd+bwd latency):",
             rate(fwd_bwd, fwd_latency + bwd_latency)),
            ("step latency:", duration_to_string(step_latency)),
            (f"iter latency ({gas} micro-batch(es), forward to optimizer step):", duration_to_string(iter_latency)),
            (f"FLOPS per GPU = {bwd_factor + 1:g} * fwd flops * {gas} / iter latency:",
             rate(step_flops, iter_latency)),
            ("samples/second:", f"{engine.train_batch_size() / iter_latency:.2f}" if iter_latency > 0 else "n/a"),
        ]
        text = prof.format_model_profile(profile_step=s.profile_step, module_depth=s.module_depth,
                                         top_modules=s.top_modules, detailed=s.detailed, extra_summary=extra)
        self.result = StepProfile(
            step=s.profile_step, fwd_flops=fwd_flops, fwd_macs=fwd_macs, params=prof.get_total_params(),
            fwd_latency=fwd_latency, bwd_latency=bwd_latency, step_latency=step_latency,
            iter_latency=iter_latency, fwd_bwd_flops=fwd_bwd, step_flops=step_flops, text=text,
        )
        prof.end_profile()
        self.profiler = None
        self._state = "done"
        write_profile_text(text, s.output_file)

    @hookimpl
    def microspeed_on_exception(self) -> None:
        """A step failed while counting: remove the hooks and the counting mode."""
        if self.profiler is not None:
            self.profiler.end_profile()
            self.profiler = None
            self._state = "done"
