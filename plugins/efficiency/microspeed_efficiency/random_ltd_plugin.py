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
state goes into checkpoints. In a pipeline (a module with ``layer_names()``/``layer_range()``, as
``PipelineModule``), the layer list is :func:`pipeline_layer_list` of its layers, each stage hooks the chosen
layers it runs, and their tokens come from a :class:`~microspeed_efficiency.random_ltd.KeyedTokenSampler` seeded
with ``data_efficiency.seed``, so every stage draws what one process would. ``engine.plugin_state("random_ltd")`` is the
:class:`~microspeed_efficiency.random_ltd.RandomLTD` handle (``reserved_length``, ``layers``, ``scheduler``),
and ``engine.metrics`` gets ``random_ltd_tokens`` and ``random_ltd_consumed_layer_tokens``.

Following DeepSpeed, ``random_ltd.enabled`` is the switch; a ``data_efficiency.enabled`` or
``data_routing.enabled`` the user set to false contradicts it and is refused.
"""

from __future__ import annotations

import itertools
from typing import Any

from torch import nn

from microspeed.plugin_api import ConfigError, Feature, Refusal, hookimpl
from microspeed_efficiency.compositions import RANDOM_LTD_FEATURES, RANDOM_LTD_REFUSALS
from microspeed_efficiency.random_ltd import (
    CONFIG_PATH,
    KeyedTokenSampler,
    RandomLTD,
    RandomLTDConfig,
    RandomLTDScheduler,
    convert_to_random_ltd,
    find_layer_list,
)

NAME = "random_ltd"
ROUTING_PATH = "data_efficiency.data_routing"


def pipeline_layer_list(names: list[str], total: int) -> list[int]:
    """Which of a pipeline's layers ``random_ltd_layer_id`` indexes: their global indices.

    ``names`` are the class names of the pipeline's layers (``PipelineModule.layer_names()``). The candidates
    are every maximal run of ``total`` consecutive layers of one class (the transformer blocks between an
    embedding and a head, so a single-process config's ``total_layer_num`` carries over) and the whole list
    when it holds ``total`` layers; exactly one candidate must exist (a ``ValueError`` lists them otherwise).
    """
    runs, start = [], 0
    for i in range(1, len(names) + 1):
        if i == len(names) or names[i] != names[start]:
            if i - start == total:
                runs.append(list(range(start, i)))
            start = i
    whole = list(range(len(names)))
    found = runs + ([whole] if len(names) == total and whole not in runs else [])
    if len(found) == 1:
        return found[0]
    have = ", ".join(f"{n} x{len(list(g))}" for n, g in itertools.groupby(names))
    raise ValueError(f"{'several' if found else 'no'} run(s) of {total} consecutive layers of one class, nor a "
                     f"pipeline of {total} layers, among the pipeline's layers [{have}]")


class RandomLTDPlugin:
    """Installs random-LTD on the configured layers and drives its schedule (see the module docstring)."""

    def __init__(self) -> None:
        self.config: RandomLTDConfig | None = None
        self.scheduler: RandomLTDScheduler | None = None
        self.handle: RandomLTD | None = None
        self.sampler: KeyedTokenSampler | None = None
        self.seed = 0

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
        self.seed = config.get("data_efficiency.seed")
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
        if callable(getattr(model, "layer_names", None)) and callable(getattr(model, "layer_range", None)):
            self.handle = self._install_in_pipeline(engine, model)
        else:
            try:
                list_name, _ = find_layer_list(model, c.total_layer_num)
            except ValueError as exc:
                raise ConfigError(f"{CONFIG_PATH}.total_layer_num: {c.total_layer_num}, but {exc}. Set "
                                  "total_layer_num to the number of layers in the model's layer list.") from None
            try:
                self.handle = convert_to_random_ltd(model, list(c.random_ltd_layer_id), self.scheduler,
                                                    layer_list=list_name, model_type=c.model_type,
                                                    hidden_state_order=c.hidden_state_order,
                                                    mask_name=c.model_mask_name)
            except ValueError as exc:
                raise ConfigError(f"{CONFIG_PATH}.random_ltd_layer_id: {exc}") from None
        engine.set_plugin_state(NAME, self.handle)

    def _install_in_pipeline(self, engine: Any, model: nn.Module) -> RandomLTD:
        """Hook this stage's random-LTD layers of a pipeline's module; draw their tokens alike on every stage.

        The layer list is :func:`pipeline_layer_list` of the module's layers; each stage hooks the chosen layers
        it runs (possibly none) and draws their tokens from a :class:`KeyedTokenSampler` seeded with
        ``data_efficiency.seed`` (the same on every rank).
        """
        c = self.config
        assert c is not None and self.scheduler is not None
        try:
            layers = pipeline_layer_list(model.layer_names(), c.total_layer_num)
        except ValueError as exc:
            raise ConfigError(f"{CONFIG_PATH}.total_layer_num: {c.total_layer_num}, but {exc}. Set total_layer_num "
                              "to the number of layers random_ltd_layer_id indexes.") from None
        chosen = [layers[i] for i in c.random_ltd_layer_id]
        mine = {i for chunk in range(getattr(model, "num_chunks", 1)) for i in model.layer_range(chunk)}
        children = dict(model.named_children())
        local = [i for i in chosen if i in mine]
        bad = [i for i in local if not isinstance(children.get(str(i)), nn.Module)]
        if bad:
            raise ConfigError(f"{CONFIG_PATH}.random_ltd_layer_id: the pipeline's layers {bad} are not modules of "
                              "their own (a tied layer or a function); random-LTD hooks modules. Choose other layers.")
        self.sampler = KeyedTokenSampler(self.seed)
        self.sampler.start_step(engine.global_steps)
        if not local:
            return RandomLTD([], self.scheduler)
        try:
            handle = convert_to_random_ltd(model, [str(i) for i in local], self.scheduler, model_type=c.model_type,
                                           hidden_state_order=c.hidden_state_order, mask_name=c.model_mask_name,
                                           sampler=self.sampler)
        except ValueError as exc:
            raise ConfigError(f"{CONFIG_PATH}.random_ltd_layer_id: {exc}") from None
        position = {index: i for i, index in enumerate(layers)}
        for layer in handle.layers:  # keyed by its random_ltd_layer_id: the same on whichever stage runs it
            layer.key = position[int(layer.name)]
        return handle

    @hookimpl
    def microspeed_before_forward(self, engine: Any) -> None:
        """Set the number of kept tokens for this step (training forwards only)."""
        if self.scheduler is not None and self.config is not None and engine.module.training:
            self.scheduler.update(engine.global_steps)
            if self.sampler is not None and self.sampler.step != engine.global_steps:
                self.sampler.start_step(engine.global_steps)

    @hookimpl
    def microspeed_after_step(self, engine: Any) -> None:
        """A new batch begins: the keyed sampler counts micro-batches from 0 again."""
        if self.sampler is not None:
            self.sampler.start_step(engine.global_steps)

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
