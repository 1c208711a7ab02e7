"""The ``activation_checkpointing`` plugin: DeepSpeed's ds_config section for ``deepspeed.checkpointing``.

It claims the section (DeepSpeed's keys and defaults, see
:data:`~microspeed_pipeline.checkpointing.ACTIVATION_CHECKPOINTING_SECTION`), refuses at
``initialize()`` the combinations DeepSpeed refuses (``contiguous_memory_optimization`` without
``partition_activations`` or without ``number_checkpoints``), and, when the user wrote the section,
calls :func:`microspeed_pipeline.checkpointing.configure` at setup with those values and the
tensor-parallel grid: the default grid (:func:`~microspeed_pipeline.topology.get_default_grid`), else
the ``mpu`` given to ``initialize(mpu=...)``, else none (the one configured before, or a
tensor-parallel size of 1). The model then checkpoints its layers with
``deepspeed.checkpointing.checkpoint(...)`` as in DeepSpeed. Without the section it leaves the
process's checkpointing configuration as the script set it.

The configuration is process wide (see :mod:`microspeed_pipeline.checkpointing` for why): with
two engines in one process, the last one set up with the section wins.
"""

from __future__ import annotations

from typing import Any

from microspeed.hookspecs import hookimpl
from microspeed_pipeline import checkpointing
from microspeed_pipeline.checkpointing import ACTIVATION_CHECKPOINTING_SECTION, SECTION, CheckpointingSettings
from microspeed_pipeline.topology import get_default_grid


class ActivationCheckpointingPlugin:
    """Claims ``activation_checkpointing`` and configures ``deepspeed.checkpointing`` from it.

    Per-engine state (``engine.plugin_state("activation_checkpointing")``): ``settings`` (a
    :class:`~microspeed_pipeline.checkpointing.CheckpointingSettings`) and ``active`` (whether the
    section was given, so this engine configured the process).
    """

    def __init__(self) -> None:
        self.settings = CheckpointingSettings()
        self.active = False
        self.mpu: Any = None

    @hookimpl(wrapper=True)
    def microspeed_make_topology(self, mpu: Any) -> Any:
        """Note the user's ``initialize(mpu=...)``; the topology is whoever answers."""
        self.mpu = mpu
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
        """Configure the process's checkpointing from the section, when the user wrote it."""
        engine.set_plugin_state(SECTION, self)
        if not self.active:
            return
        s = self.settings
        grid = get_default_grid()
        checkpointing.configure(
            grid if grid is not None else self.mpu,
            partition_activations=s.partition_activations,
            contiguous_checkpointing=s.contiguous_memory_optimization,
            num_checkpoints=s.number_checkpoints,
            checkpoint_in_cpu=s.cpu_checkpointing,
            synchronize=s.synchronize_checkpoint_boundary,
            profile=s.profile,
        )
