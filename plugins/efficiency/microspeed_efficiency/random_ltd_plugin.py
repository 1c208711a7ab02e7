"""The ``random_ltd`` plugin: DeepSpeed's ``data_efficiency.data_routing.random_ltd``, made to act.

The ``data_efficiency`` section belongs to the data-efficiency plugin of this distribution, which leaves
``data_routing`` open; this plugin validates ``data_routing`` and its ``random_ltd`` sub-section strictly in
``microspeed_configure`` (unknown keys, types, ranges; see
:meth:`~microspeed_efficiency.random_ltd.RandomLTDConfig.from_section`).

Keys under ``data_efficiency.data_routing.random_ltd`` (type, default: meaning):

* ``enabled`` (bool, false): turn random-LTD on;
* ``total_layer_num`` (int, required): layers of the model; the ``nn.ModuleList`` of that length holds them;
* ``random_ltd_layer_num`` (int, required): how many layers drop tokens;
* ``random_ltd_layer_id`` (list of int, required): their indices in that list (0-based);
* ``model_mask_name`` (str or null, null): the layers' attention-mask keyword argument;
* ``model_type`` (``"decoder"`` or ``"encoder"``, ``"decoder"``): how the mask is cut;
* ``hidden_state_order`` (``"batch_seq_dim"`` or ``"seq_batch_dim"``, ``"batch_seq_dim"``): [B, S, H] or
  [S, B, H];
* ``random_ltd_schedule.min_value`` / ``.max_value`` (int, required): tokens kept at step 0 / from
  ``require_steps`` on; ``.schedule_type`` (``"fixed_linear"``, the only one);
  ``.schedule_config.require_steps`` (int, required): steps from min to max;
  ``.schedule_config.seq_per_step`` (int, required): the kept count is a multiple of it;
* ``layer_token_lr_schedule.enabled`` (bool, false): accepted only false (not implemented, as in DeepSpeed).

``data_routing.enabled`` (bool) is accepted too; ``data_routing`` has no other keys.

When enabled: after the model is final, the layers ``random_ltd_layer_id`` of the model's layer list get
random-LTD's hooks (:func:`~microspeed_efficiency.random_ltd.convert_to_random_ltd`: their parameter names do
not change); before every training forward the schedule is set from ``engine.global_steps``; the schedule's
state goes into checkpoints. ``engine.plugin_state("random_ltd")`` is the
:class:`~microspeed_efficiency.random_ltd.RandomLTD` handle (``reserved_length``, ``layers``, ``scheduler``),
and ``engine.metrics`` gets ``random_ltd_tokens`` and ``random_ltd_consumed_layer_tokens``.

Following DeepSpeed, ``random_ltd.enabled`` is the switch; a ``data_efficiency.enabled`` or
``data_routing.enabled`` the user set to false contradicts it and is refused.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from microspeed.plugin_api import ConfigError, Feature, Refusal, hookimpl
from microspeed_efficiency.compositions import RANDOM_LTD_FEATURES, RANDOM_LTD_REFUSALS, RANDOM_LTD_WITH_PIPELINE
from microspeed_efficiency.random_ltd import (
    CONFIG_PATH,
    RandomLTD,
    RandomLTDConfig,
    RandomLTDScheduler,
    convert_to_random_ltd,
    find_layer_list,
)

NAME = "random_ltd"
ROUTING_PATH = "data_efficiency.data_routing"


class RandomLTDPlugin:
    """Installs random-LTD on the configured layers and drives its schedule (see the module docstring)."""

    def __init__(self) -> None:
        self.config: RandomLTDConfig | None = None
        self.scheduler: RandomLTDScheduler | None = None
        self.handle: RandomLTD | None = None

    @hookimpl
    def microspeed_configure(self, config: Any) -> None:
        """Validate ``data_efficiency.data_routing`` (and its ``random_ltd``) strictly; build the schedule."""
        routing = config.get(ROUTING_PATH)
        if routing is None:
            routing = {}
        if not isinstance(routing, dict):
            raise ConfigError(f"{ROUTING_PATH}: expected an object (section), got {routing!r}.")
        for key in routing:
            if key not in ("enabled", "random_ltd"):
                raise ConfigError(f"{ROUTING_PATH}.{key}: unknown key. Valid keys here: enabled, random_ltd.")
        if not isinstance(routing.get("enabled", False), bool):
            raise ConfigError(f"{ROUTING_PATH}.enabled: expected true/false, got {routing['enabled']!r}.")
        parsed = RandomLTDConfig.from_section(routing.get("random_ltd"), CONFIG_PATH)
        if not parsed.enabled:
            self.config = None
            return
        for key in ("data_efficiency.enabled", f"{ROUTING_PATH}.enabled"):
            if config.is_set(key) and config.get(key) is False:
                raise ConfigError(f"{key}: false, but {CONFIG_PATH}.enabled is true; set {key} to true to use "
                                  f"random-LTD, or {CONFIG_PATH}.enabled to false.")
        self.config = parsed
        assert parsed.schedule is not None
        batch = config.get("train_batch_size")
        self.scheduler = RandomLTDScheduler(parsed.schedule, parsed.total_layer_num, parsed.random_ltd_layer_num,
                                            batch if isinstance(batch, int) and batch > 0 else 1)

    @hookimpl
    def microspeed_after_model_ready(self, engine: Any, model: nn.Module) -> None:
        """Install random-LTD on the layers ``random_ltd_layer_id`` of the model's layer list."""
        if self.config is None:
            return
        c = self.config
        stages = getattr(model, "num_stages", 1)  # a pipeline's module states its stages
        if isinstance(stages, int) and stages > 1:
            raise RANDOM_LTD_WITH_PIPELINE[0].error(f"{CONFIG_PATH}.enabled with a pipeline of {stages} stages "
                                                    f"({type(model).__name__})")
        try:
            list_name, _ = find_layer_list(model, c.total_layer_num)
        except ValueError as exc:
            raise ConfigError(f"{CONFIG_PATH}.total_layer_num: {c.total_layer_num}, but {exc}. Set total_layer_num "
                              "to the number of layers in the model's layer list.") from None
        try:
            self.handle = convert_to_random_ltd(model, list(c.random_ltd_layer_id), self.scheduler,
                                                layer_list=list_name, model_type=c.model_type,
                                                hidden_state_order=c.hidden_state_order, mask_name=c.model_mask_name)
        except ValueError as exc:
            raise ConfigError(f"{CONFIG_PATH}.random_ltd_layer_id: {exc}") from None
        engine.set_plugin_state(NAME, self.handle)

    @hookimpl
    def microspeed_before_forward(self, engine: Any) -> None:
        """Set the number of kept tokens for this step (training forwards only)."""
        if self.scheduler is not None and self.config is not None and engine.module.training:
            self.scheduler.update(engine.global_steps)

    @hookimpl
    def microspeed_after_global_step(self, engine: Any) -> None:
        """Report the kept tokens and DeepSpeed's consumed-layer-tokens counter in ``engine.metrics``."""
        if self.scheduler is not None and self.config is not None:
            engine.metrics["random_ltd_tokens"] = self.scheduler.current_value
            engine.metrics["random_ltd_consumed_layer_tokens"] = self.scheduler.consumed_layer_tokens

    @hookimpl
    def microspeed_checkpoint_state(self) -> dict[str, Any] | None:
        """Save the schedule's state."""
        if self.scheduler is None or self.config is None:
            return None
        return {NAME: self.scheduler.state_dict()}

    @hookimpl
    def microspeed_load_checkpoint_state(self, states: dict[str, Any]) -> None:
        """Restore the schedule's state (a checkpoint written without random-LTD leaves it as it is)."""
        if self.scheduler is not None and self.config is not None and NAME in states:
            self.scheduler.load_state_dict(states[NAME])

    @hookimpl
    def microspeed_features(self) -> list[Feature]:
        """Random-LTD, for the composition matrix."""
        return list(RANDOM_LTD_FEATURES)

    @hookimpl
    def microspeed_refusals(self) -> list[Refusal]:
        """The pairs this plugin refuses at ``initialize()`` (:mod:`microspeed_efficiency.compositions`)."""
        return list(RANDOM_LTD_REFUSALS)
