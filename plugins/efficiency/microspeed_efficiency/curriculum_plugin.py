"""The legacy ``curriculum_learning`` section: a sequence-length curriculum applied at each forward.

DeepSpeed's engine (before its data-efficiency library) read a top-level section::

    "curriculum_learning": {
        "enabled": true, "curriculum_type": "seqlen",
        "min_difficulty": 8, "max_difficulty": 1024,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 40000, "difficulty_step": 8}
    }

and, at every training forward, set the difficulty for step ``global_steps + 1`` and passed it to
the model as the keyword argument ``curriculum_seqlen``; the model (Megatron's GPT) cut its
sequences itself. :class:`CurriculumPlugin` does the same when the model's ``forward`` names a
``curriculum_seqlen`` parameter. For any other model it cuts the batch instead: **every tensor
in the forward's arguments with at least two dimensions whose dimension 1 is longer than the
difficulty is sliced to its first ``difficulty`` positions** (``t[:, :difficulty]``) — inputs,
targets and masks of shape ``(B, T, ...)`` alike, inside tuples, lists and dicts too. Tensors of
one dimension, and those already short enough, pass unchanged. Only a model in training mode is
touched (evaluation sees full sequences), as in DeepSpeed.

In a pipeline (a ``PipelineModule``) every stage loads every micro-batch; the plugin cuts it there, inputs
and labels alike, through the core's ``micro_batch`` chain (so the first stage's inputs and the last
stage's labels agree on the length), and leaves the stages' activations alone. The length may change from
one step to the next: the pipeline agrees on the activations' shapes once per batch.

The current difficulty is ``engine.plugin_state("curriculum_learning").difficulty`` and
``engine.metrics["curriculum_seqlen"]``; it is saved in checkpoints.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from microspeed.plugin_api import ConfigError, Feature, Field, Refusal, Section, hookimpl
from microspeed_efficiency.compositions import CURRICULUM_FEATURES, CURRICULUM_REFUSALS
from microspeed_efficiency.curriculum import SCHEDULE_TYPES, CurriculumScheduler

NAME = "curriculum_learning"
"""The config section, plugin-state key and checkpoint-state key."""

CURRICULUM_TYPES = ("seqlen",)
"""Accepted values of ``curriculum_learning.curriculum_type``."""


def schedule_config_section(doc: str = "parameters of the schedule (which keys depend on schedule_type)") -> Section:
    """The strict schema of a ``schedule_config`` object (all keys optional; the scheduler checks which it needs)."""
    return Section({
        "difficulty": Field((list,), None, "fixed_discrete: the difficulties, in order"),
        "max_step": Field((list,), None, "fixed_discrete: last step of each difficulty but the last (one entry fewer)"),
        "total_curriculum_step": Field((int,), None, "fixed_root/fixed_linear: steps from min to max difficulty"),
        "difficulty_step": Field((int,), None, "fixed_root/fixed_linear: difficulties are multiples of this"),
        "root_degree": Field((float,), None, "fixed_root: degree of the root (2: square root)"),
    }, doc=doc)


def truncate_batch(value: Any, length: int) -> Any:
    """``value`` with every tensor of >= 2 dims cut to ``length`` along dimension 1 (recursing into containers).

    Tuples (named tuples too), lists and dicts are rebuilt with the cut tensors; any other object is
    returned unchanged.
    """
    if isinstance(value, torch.Tensor):
        return value[:, :length] if value.dim() >= 2 and value.size(1) > length else value
    if isinstance(value, tuple):
        items = [truncate_batch(v, length) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [truncate_batch(v, length) for v in value]
    if isinstance(value, Mapping):
        return {k: truncate_batch(v, length) for k, v in value.items()}
    return value


def accepts_curriculum_seqlen(module: torch.nn.Module) -> bool:
    """Whether ``module.forward`` has a parameter named ``curriculum_seqlen`` (``**kwargs`` does not count)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    param = params.get("curriculum_seqlen")
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class CurriculumPlugin:
    """microspeed plugin for DeepSpeed's legacy ``curriculum_learning`` section (``curriculum_type: "seqlen"``).

    One instance per engine (entry point ``curriculum``). Attributes: ``enabled``, ``scheduler`` (a
    :class:`~microspeed_efficiency.curriculum.CurriculumScheduler`, ``None`` when disabled) and
    ``difficulty`` (the sequence length of the latest training forward).
    """

    def __init__(self) -> None:
        self.enabled = False
        self.scheduler: CurriculumScheduler | None = None
        self.difficulty: Any = None
        self._accepts: tuple[torch.nn.Module, bool] | None = None
        self._cut_at_load = False

    @hookimpl
    def microspeed_config_sections(self) -> dict[str, Section]:
        """Claim ``curriculum_learning``."""
        return {NAME: Section({
            "enabled": Field((bool,), False, "legacy sequence-length curriculum applied at each training forward"),
            "curriculum_type": Field((str,), "seqlen", "what the difficulty measures", choices=CURRICULUM_TYPES),
            "min_difficulty": Field((int, float), None, "first difficulty (sequence length); required when enabled"),
            "max_difficulty": Field((int, float), None, "last difficulty (sequence length); required when enabled"),
            "schedule_type": Field((str,), None, "how the difficulty grows; required when enabled",
                                   choices=SCHEDULE_TYPES),
            "schedule_config": schedule_config_section(),
        }, doc="legacy curriculum learning (microspeed-efficiency)")}

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Build the scheduler when enabled (a bad schedule is refused here, naming the key)."""
        section = config[NAME]
        self.enabled = bool(section["enabled"])
        self.scheduler = CurriculumScheduler(section, name=NAME) if self.enabled else None
        if self.enabled:
            self.difficulty = self.scheduler.get_current_difficulty()
            if not isinstance(self.scheduler.min_difficulty, int) or not isinstance(self.scheduler.max_difficulty, int):
                raise ConfigError(f"{NAME}.min_difficulty/max_difficulty: curriculum_type 'seqlen' needs integer "
                                  f"sequence lengths, got {self.scheduler.min_difficulty!r} and "
                                  f"{self.scheduler.max_difficulty!r}.")
            if self.scheduler.min_difficulty < 1:
                raise ConfigError(f"{NAME}.min_difficulty: got {self.scheduler.min_difficulty!r}; a sequence length "
                                  f"must be >= 1.")

    @hookimpl
    def microspeed_setup(self, engine) -> None:
        """Expose this plugin as ``engine.plugin_state("curriculum_learning")``."""
        engine.set_plugin_state(NAME, self)

    def _model_accepts(self, module: torch.nn.Module) -> bool:
        if self._accepts is None or self._accepts[0] is not module:
            self._accepts = (module, accepts_curriculum_seqlen(module))
        return self._accepts[1]

    def _update(self, engine) -> int:
        """Set the difficulty for step ``global_steps + 1`` and report it; the sequence length."""
        self.difficulty = self.scheduler.update_difficulty(engine.global_steps + 1)
        length = int(self.difficulty)
        engine.metrics["curriculum_seqlen"] = length
        return length

    @hookimpl
    def microspeed_micro_batch(self, engine, batch: Any) -> Any:
        """In a pipeline's training schedule, cut the loaded micro-batch (inputs and labels, on every stage)."""
        if not self.enabled or not engine.module.training:
            return None
        self._cut_at_load = True
        return truncate_batch(batch, self._update(engine))

    @hookimpl
    def microspeed_before_forward(self, engine, ctx) -> None:
        """Set the difficulty for step ``global_steps + 1``; pass it as ``curriculum_seqlen`` or cut the batch.

        Under a schedule that loads its own micro-batches (a pipeline), :meth:`microspeed_micro_batch` already cut
        them; a stage's forward then receives activations, which are left alone.
        """
        if not self.enabled or not engine.module.training or self._cut_at_load:
            return
        length = self._update(engine)
        if self._model_accepts(engine.module):
            ctx.kwargs = {**ctx.kwargs, "curriculum_seqlen": length}
        else:
            ctx.args = truncate_batch(tuple(ctx.args), length)
            ctx.kwargs = truncate_batch(dict(ctx.kwargs), length)

    @hookimpl
    def microspeed_checkpoint_state(self) -> dict[str, Any] | None:
        """The current difficulty."""
        return {NAME: self.scheduler.state_dict()} if self.enabled else None

    @hookimpl
    def microspeed_load_checkpoint_state(self, states: dict[str, Any]) -> None:
        """Restore the current difficulty (a checkpoint without it leaves the schedule's start)."""
        if self.enabled and NAME in states:
            self.scheduler.load_state_dict(states[NAME])
            self.difficulty = self.scheduler.get_current_difficulty()

    @hookimpl
    def microspeed_features(self) -> list[Feature]:
        """Curriculum learning, for the composition matrix."""
        return list(CURRICULUM_FEATURES)

    @hookimpl
    def microspeed_refusals(self) -> list[Refusal]:
        """The pairs this plugin refuses at ``initialize()`` (:mod:`microspeed_efficiency.compositions`)."""
        return list(CURRICULUM_REFUSALS)
