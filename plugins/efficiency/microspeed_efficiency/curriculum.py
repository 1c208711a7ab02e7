"""Curriculum schedules: how hard the training data may be at each step.

:class:`CurriculumScheduler` is DeepSpeed's ``CurriculumScheduler`` (same config keys, same values
at every step) for the legacy ``curriculum_learning`` section and for each metric of
``data_efficiency.data_sampling.curriculum_learning.curriculum_metrics``. A config has
``min_difficulty``, ``max_difficulty``, ``schedule_type`` and ``schedule_config``:

* ``fixed_discrete`` — ``schedule_config: {"difficulty": [d0, ..., dk], "max_step": [m0, ..., m(k-1)]}``:
  the difficulty at step ``s`` is ``d_i`` for the first ``i`` with ``s <= m_i``, and ``dk`` after ``m(k-1)``.
* ``fixed_root`` — ``{"total_curriculum_step": T, "difficulty_step": q, "root_degree": r}``:
  ``floor((s / T) ** (1 / r) * (max - min) + min)``, rounded down to a multiple of ``q``, then
  clamped to ``[ceil(min / q) * q, max]``.
* ``fixed_linear`` — ``{"total_curriculum_step": T, "difficulty_step": q}``: ``fixed_root`` with ``r = 1``.
* ``custom`` — no ``schedule_config``: ``fn(s)``, given with :meth:`CurriculumScheduler.set_custom_get_difficulty`.

The current difficulty starts at ``min_difficulty``; :meth:`update_difficulty` moves it to the
schedule's value until it has reached ``max_difficulty``, after which it stays there. Difficulty
values are whatever the metric measures (tokens of sequence length, a percentile, ...).

Unlike DeepSpeed, a bad config is refused with a :class:`microspeed.ConfigError` naming the key,
and no warning is printed for a ``difficulty_step`` that is not a multiple of 8 (that advice is
about fp16 Tensor Cores on GPUs with the sequence-length metric).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from microspeed.plugin_api import ConfigError

SCHEDULE_TYPES = ("fixed_discrete", "fixed_root", "fixed_linear", "custom")
"""Accepted values of ``schedule_type``."""

SCHEDULE_CONFIG_KEYS = ("difficulty", "max_step", "total_curriculum_step", "difficulty_step", "root_degree")
"""Every key ``schedule_config`` may hold (which ones are needed depends on the schedule type)."""

_NEEDED = {
    "fixed_discrete": ("difficulty", "max_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "custom": (),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CurriculumScheduler:
    """The difficulty of the data at each training step, as DeepSpeed schedules it.

    Args:
        config: ``{"min_difficulty", "max_difficulty", "schedule_type", "schedule_config"}``
            (other keys are ignored, so a whole ``curriculum_learning`` section or metric entry
            may be passed). ``schedule_config`` may be omitted for ``custom``.
        name: the config path of ``config``, used in error messages
            (``"curriculum_learning"``, ``"...curriculum_metrics.seqlen"``).

    Raises:
        ConfigError: a key is missing, has the wrong type or an impossible value; the message
            names the key path and what is accepted.

    Example::

        sched = CurriculumScheduler({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
                                     "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8}})
        sched.update_difficulty(engine.global_steps + 1)   # 8, ..., 64
    """

    def __init__(self, config: Mapping[str, Any], name: str = "curriculum_learning") -> None:
        if not isinstance(config, Mapping):
            raise ConfigError(f"{name}: expected an object with min_difficulty, max_difficulty, schedule_type and "
                              f"schedule_config, got {type(config).__name__}.")
        self.name = name
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if config.get(key) is None:
                raise ConfigError(f"{name}.{key}: required for curriculum learning; see the README's "
                                  f"curriculum table (e.g. \"min_difficulty\": 8, \"max_difficulty\": 1024, "
                                  f"\"schedule_type\": \"fixed_linear\").")
        lo, hi, kind = config["min_difficulty"], config["max_difficulty"], config["schedule_type"]
        for key, value in (("min_difficulty", lo), ("max_difficulty", hi)):
            if not _is_number(value):
                raise ConfigError(f"{name}.{key}: expected a number, got {value!r}.")
        if lo > hi:
            raise ConfigError(f"{name}.min_difficulty: {lo!r} is above max_difficulty {hi!r}; "
                              f"min_difficulty must be <= max_difficulty.")
        if kind not in SCHEDULE_TYPES:
            raise ConfigError(f"{name}.schedule_type: got {kind!r}; accepted values: "
                              f"{', '.join(map(repr, SCHEDULE_TYPES))}.")
        self.min_difficulty, self.max_difficulty, self.schedule_type = lo, hi, kind
        self.schedule_config = self._check_schedule_config(config.get("schedule_config") or {})
        self.current_difficulty = lo
        self.custom_get_difficulty: Callable[[int], Any] | None = None

    def _check_schedule_config(self, sc: Any) -> dict[str, Any]:
        where = f"{self.name}.schedule_config"
        if not isinstance(sc, Mapping):
            raise ConfigError(f"{where}: expected an object, got {sc!r}.")
        unknown = [k for k in sc if k not in SCHEDULE_CONFIG_KEYS]
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown key. Valid keys here: "
                              f"{', '.join(SCHEDULE_CONFIG_KEYS)}.")
        given = {k: v for k, v in sc.items() if v is not None}
        for key in _NEEDED[self.schedule_type]:
            if key not in given:
                raise ConfigError(f"{where}.{key}: required by schedule_type {self.schedule_type!r} "
                                  f"(needs {', '.join(_NEEDED[self.schedule_type])}).")
        if self.schedule_type == "fixed_discrete":
            diffs, steps = given["difficulty"], given["max_step"]
            if not isinstance(diffs, list) or not diffs or not all(_is_number(d) for d in diffs):
                raise ConfigError(f"{where}.difficulty: expected a non-empty list of numbers, got {diffs!r}.")
            if not isinstance(steps, list) or not steps or not all(_is_int(s) for s in steps):
                raise ConfigError(f"{where}.max_step: expected a non-empty list of integers, got {steps!r}.")
            if len(diffs) != len(steps) + 1:
                raise ConfigError(f"{where}.max_step: needs exactly one entry fewer than difficulty (the last "
                                  f"difficulty holds for all later steps); got {len(steps)} max_step entries "
                                  f"for {len(diffs)} difficulties.")
            if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
                raise ConfigError(f"{where}.max_step: must be strictly increasing, got {steps!r}.")
        elif self.schedule_type in ("fixed_root", "fixed_linear"):
            for key in ("total_curriculum_step", "difficulty_step"):
                value = given[key]
                if not _is_int(value) or value <= 0:
                    raise ConfigError(f"{where}.{key}: expected an integer > 0, got {value!r}.")
            if self.schedule_type == "fixed_root":
                degree = given["root_degree"]
                if not _is_number(degree) or degree <= 0:
                    raise ConfigError(f"{where}.root_degree: expected a number > 0 (2: square root), got {degree!r}.")
        return dict(given)

    # -- the schedule ------------------------------------------------------------------------

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        """Use ``schedule_function(global_step) -> difficulty`` (``schedule_type: "custom"``)."""
        if not callable(schedule_function):
            raise TypeError(f"set_custom_get_difficulty(schedule_function): expected a callable step -> difficulty, "
                            f"got {type(schedule_function).__name__}.")
        self.custom_get_difficulty = schedule_function

    def get_difficulty(self, global_steps: int) -> Any:
        """The schedule's difficulty at ``global_steps`` (does not change the current difficulty)."""
        kind = self.schedule_type
        if kind == "fixed_discrete":
            return self._discrete(global_steps)
        if kind == "fixed_linear":
            return self._root(global_steps, 1)
        if kind == "fixed_root":
            return self._root(global_steps, self.schedule_config["root_degree"])
        if self.custom_get_difficulty is None:
            raise RuntimeError(f"{self.name}.schedule_type is 'custom' but no schedule function was given: call "
                               f"set_custom_get_difficulty(fn) (engine: set_custom_curriculum_learning_schedule) "
                               f"before training.")
        return self.custom_get_difficulty(global_steps)

    def _discrete(self, step: int) -> Any:
        diffs, steps = self.schedule_config["difficulty"], self.schedule_config["max_step"]
        for difficulty, last in zip(diffs, steps, strict=False):
            if step <= last:
                return difficulty
        return diffs[-1]

    def _root(self, step: int, degree: float) -> Any:
        total = self.schedule_config["total_curriculum_step"]
        quantum = self.schedule_config["difficulty_step"]
        lo, hi = self.min_difficulty, self.max_difficulty
        value = math.floor((float(step) / total) ** (1.0 / degree) * (hi - lo) + lo)
        value -= value % quantum
        # Rounding down to a multiple of difficulty_step may fall below min_difficulty (min 8, step
        # 16 gives 0): the floor is the first multiple of the step at or above min_difficulty.
        value = max(value, -(-lo // quantum) * quantum)
        return min(value, hi)

    def update_difficulty(self, global_steps: int) -> Any:
        """Move the current difficulty to the schedule's value at ``global_steps``; return it.

        Once the current difficulty has reached ``max_difficulty`` it no longer changes.
        """
        if self.current_difficulty < self.max_difficulty:
            self.current_difficulty = self.get_difficulty(global_steps)
        return self.current_difficulty

    def get_current_difficulty(self) -> Any:
        """The difficulty set by the last :meth:`update_difficulty` (``min_difficulty`` before any)."""
        return self.current_difficulty

    def set_current_difficulty(self, difficulty: Any) -> None:
        """Force the current difficulty (DeepSpeed's ``set_current_difficulty``)."""
        self.current_difficulty = difficulty

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The current difficulty (the schedule itself comes from the config of the run that loads it)."""
        return {"current_difficulty": self.current_difficulty}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if "current_difficulty" not in state:
            raise KeyError(f"{self.name}: curriculum state without 'current_difficulty': {dict(state)!r}")
        self.current_difficulty = state["current_difficulty"]
