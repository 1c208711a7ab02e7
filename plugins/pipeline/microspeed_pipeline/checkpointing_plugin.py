"""The ``activation_checkpointing`` plugin: DeepSpeed's ds_config section for ``deepspeed.checkpointing``.

It claims the section (DeepSpeed's keys and defaults, see
:data:`~microspeed_pipeline.checkpointing.ACTIVATION_CHECKPOINTING_SECTION`) and refuses at
``initialize()`` the combinations DeepSpeed refuses (``contiguous_memory_optimization`` without
``partition_activations`` or without ``number_checkpoints``). When the user wrote the section, the
engine gets a :class:`~microspeed_pipeline.checkpointing.CheckpointingState` of its own, configured
with those values and its tensor-parallel grid (a PipelineModule's, else the ``mpu`` given to
``initialize(mpu=...)``, else the script's default grid, else a tensor-parallel size of 1). That
state is in effect while the engine's model runs (``deepspeed.checkpointing.checkpoint(...)``,
``get_settings()``, ``checkpoint_timings()`` called from the model see it), so another engine in the
same process, and code outside any engine, never see it. Without the section the engine uses the
script's (standalone) configuration, as in DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from microspeed.plugin_api import Feature, hookimpl
from microspeed_pipeline import checkpointing
from microspeed_pipeline.checkpointing import (
    ACTIVATION_CHECKPOINTING_SECTION,
    SECTION,
    CheckpointingSettings,
    CheckpointingState,
)
from microspeed_pipeline.compositions import CHECKPOINTING_FEATURES
from microspeed_pipeline.module import PipelineModule
from microspeed_pipeline.topology import get_default_grid


class ActivationCheckpointingPlugin:
    """Claims ``activation_checkpointing`` and gives the engine its own checkpointing configuration.

    Per-engine state (``engine.plugin_state("activation_checkpointing")``): ``settings`` (a
    :class:`~microspeed_pipeline.checkpointing.CheckpointingSettings`), ``active`` (whether the
    section was given) and ``state`` (this engine's
    :class:`~microspeed_pipeline.checkpointing.CheckpointingState`: settings, grid, buffers, timings).
    """

    def __init__(self) -> None:
        self.settings = CheckpointingSettings()
        self.active = False
        self.mpu: Any = None
        self.state = CheckpointingState()
        self._tokens: list[Any] = []
        self._handles: list[Any] = []

    @hookimpl(wrapper=True)
    def microspeed_make_topology(self, mpu: Any, model: Any = None) -> Any:
        """Note the grid: a PipelineModule's own, else the user's ``initialize(mpu=...)``; the topology is whoever
        answers."""
        self.mpu = model.mpu() if isinstance(model, PipelineModule) else mpu
        return (yield)

    @hookimpl
    def microspeed_config_sections(self) -> dict[str, Any]:
        """The ``activation_checkpointing`` section."""
        return {SECTION: ACTIVATION_CHECKPOINTING_SECTION}

    @hookimpl
    def microspeed_configure(self, config: Any) -> None:
        """Read the section; refuse what DeepSpeed refuses, naming the key."""
        self.settings = CheckpointingSettings.from_section(config[SECTION])
        self.settings.validate()
        self.active = config.is_set(SECTION)

    @hookimpl
    def microspeed_setup(self, engine: Any) -> None:
        """Configure this engine's checkpointing state from the section, when the user wrote it."""
        engine.set_plugin_state(SECTION, self)
        if not self.active:
            return
        s = self.settings
        grid = self.mpu if self.mpu is not None else get_default_grid()
        with checkpointing.using(self.state):
            checkpointing.configure(
                grid,
                partition_activations=s.partition_activations,
                contiguous_checkpointing=s.contiguous_memory_optimization,
                num_checkpoints=s.number_checkpoints,
                checkpoint_in_cpu=s.cpu_checkpointing,
                synchronize=s.synchronize_checkpoint_boundary,
                profile=s.profile,
            )

    @hookimpl
    def microspeed_after_model_ready(self, engine: Any, model: nn.Module) -> None:
        """Put this engine's state in effect while its model (or a PipelineModule inside it) runs."""
        if not self.active:
            return
        targets = [model] + [m for m in model.modules() if isinstance(m, PipelineModule) and m is not model]
        for module in targets:
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    @hookimpl
    def microspeed_destroy(self) -> None:
        """``engine.destroy()``: the model no longer runs under this engine's checkpointing settings."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @hookimpl
    def microspeed_features(self) -> list[Feature]:
        """Activation checkpointing, for the composition matrix (it refuses no pair)."""
        return list(CHECKPOINTING_FEATURES)

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._tokens.append(checkpointing._IN_EFFECT.set(self.state))

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._tokens:
            checkpointing._IN_EFFECT.reset(self._tokens.pop())
