"""The ``progressive_layer_drop`` plugin: DeepSpeed's PLD section, made to act.

Keys (type, default: meaning):

* ``progressive_layer_drop.enabled`` (bool, false): turn PLD on;
* ``progressive_layer_drop.theta`` (float in [0, 1], 0.5): θ̄, the keep ratio θ decays to;
* ``progressive_layer_drop.gamma`` (float ≥ 0, 0.001): γ, how fast θ decays per optimizer step.

When enabled, every training forward gets ``progressive_layer_drop=True, pld_theta=θ`` as keyword arguments
(the model does the dropping, see :mod:`microspeed_efficiency.pld`), θ is recomputed after every optimizer step,
and θ is saved with checkpoints. A model whose forward cannot take those keywords is refused at
``initialize()``. In a pipeline, a ``PipelineModule`` hands the keywords to each of its layers whose forward
names them (on every stage, in every micro-batch of a step, the same θ: it changes only at the optimizer step,
which all stages take together); a pipeline none of whose layers names them gets a notice that PLD has no effect.
``engine.plugin_state("progressive_layer_drop")`` is the
:class:`~microspeed_efficiency.pld.ProgressiveLayerDrop` (``get_theta()``), and ``engine.metrics["pld_theta"]``
carries θ for the step log.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from microspeed.plugin_api import ConfigError, Feature, Field, Refusal, Section, get_logger, hookimpl, non_negative
from microspeed_efficiency.compositions import PLD_FEATURES, PLD_REFUSALS
from microspeed_efficiency.pld import PLD_KWARGS, ProgressiveLayerDrop, accepts_pld_kwargs

NAME = "progressive_layer_drop"

logger = get_logger("microspeed.pld")


def _unit_interval(v: Any) -> str | None:
    return None if 0.0 <= v <= 1.0 else "a number in [0, 1]"


class ProgressiveLayerDropPlugin:
    """Drives progressive layer drop from the ``progressive_layer_drop`` section (see the module docstring)."""

    def __init__(self) -> None:
        self.pld: ProgressiveLayerDrop | None = None

    @hookimpl
    def microspeed_config_sections(self) -> dict[str, Section]:
        """Claim ``progressive_layer_drop``: ``enabled``, ``theta``, ``gamma``."""
        return {NAME: Section({
            "enabled": Field((bool,), False, "turn progressive layer drop on"),
            "theta": Field((float,), 0.5, "θ̄: the keep ratio θ(t) = (1 − θ̄)·exp(−γ·t) + θ̄ decays to",
                           _unit_interval),
            "gamma": Field((float,), 0.001, "γ: how fast θ decays per optimizer step", non_negative),
        }, doc="progressive layer drop: the model skips layers at random, more as training goes on")}

    @hookimpl
    def microspeed_configure(self, config: Any) -> None:
        """Build the schedule when the section is enabled."""
        section = config[NAME]
        self.pld = ProgressiveLayerDrop(section["theta"], section["gamma"]) if section["enabled"] else None

    @hookimpl
    def microspeed_setup(self, engine: Any) -> None:
        """Expose the schedule as ``engine.plugin_state("progressive_layer_drop")``."""
        if self.pld is not None:
            engine.set_plugin_state(NAME, self.pld)

    @hookimpl
    def microspeed_after_model_ready(self, engine: Any, model: nn.Module) -> None:
        """Refuse a model whose forward cannot take ``progressive_layer_drop=`` and ``pld_theta=``.

        A pipeline's module (it has ``layers_accepting``) takes them and hands them to the layers whose forward
        names them; when none does, a one-line notice says that PLD has no effect.
        """
        if self.pld is None:
            return
        layers_accepting = getattr(model, "layers_accepting", None)  # a pipeline's module routes keywords to layers
        if callable(layers_accepting):
            if not layers_accepting(PLD_KWARGS):
                logger.warning(f"{NAME}.enabled has no effect: no layer of this {type(model).__name__} names the "
                               f"keyword arguments {' and '.join(PLD_KWARGS)} in its forward, so none drops itself "
                               "(give the layers that may be skipped those parameters).")
            return
        if not accepts_pld_kwargs(model.forward):
            raise ConfigError(
                f"{NAME}.enabled: the model's forward ({type(model).__name__}.forward) does not accept the keyword "
                f"arguments {' and '.join(PLD_KWARGS)} that progressive layer drop passes to it. Give it those "
                "parameters (progressive_layer_drop: bool = False, pld_theta: float = 1.0) and drop layers with "
                "them, as microspeed.models.GPT does, or set progressive_layer_drop.enabled to false."
            )

    @hookimpl
    def microspeed_before_forward(self, engine: Any, ctx: Any) -> None:
        """In training, add ``progressive_layer_drop=True, pld_theta=θ`` to the model's keyword arguments."""
        if self.pld is not None and engine.module.training:
            ctx.kwargs = {**ctx.kwargs, **self.pld.get_state()}

    @hookimpl
    def microspeed_after_step(self, engine: Any) -> None:
        """Recompute θ from the step counter (before it advances, as DeepSpeed does)."""
        if self.pld is not None:
            self.pld.update_state(engine.global_steps)

    @hookimpl
    def microspeed_after_global_step(self, engine: Any) -> None:
        """Report θ in ``engine.metrics["pld_theta"]``."""
        if self.pld is not None:
            engine.metrics["pld_theta"] = self.pld.get_theta()

    @hookimpl
    def microspeed_checkpoint_state(self) -> dict[str, Any] | None:
        """Save θ."""
        return {NAME: self.pld.state_dict()} if self.pld is not None else None

    @hookimpl
    def microspeed_load_checkpoint_state(self, states: dict[str, Any]) -> None:
        """Restore θ (a checkpoint written without PLD leaves θ as it is)."""
        if self.pld is not None and NAME in states:
            self.pld.load_state_dict(states[NAME])

    @hookimpl
    def microspeed_features(self) -> list[Feature]:
        """Progressive layer drop, for the composition matrix."""
        return list(PLD_FEATURES)

    @hookimpl
    def microspeed_refusals(self) -> list[Refusal]:
        """The pairs this plugin refuses at ``initialize()`` (:mod:`microspeed_efficiency.compositions`)."""
        return list(PLD_REFUSALS)
