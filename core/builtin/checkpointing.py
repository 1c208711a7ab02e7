"""Default answers to the checkpoint hooks: :mod:`microspeed.checkpoint` does the work."""

from __future__ import annotations

from typing import Any

from microspeed.hookspecs import hookimpl


class CheckpointingPlugin:
    """Saves and loads checkpoints through ``torch.distributed.checkpoint`` (:mod:`microspeed.checkpoint`)."""

    @hookimpl(trylast=True)
    def microspeed_save_checkpoint(self, engine: Any, save_dir: str, tag: str | None, client_state: dict | None,
                                   save_latest: bool, exclude_frozen_parameters: bool) -> bool:
        """:func:`microspeed.checkpoint.save`."""
        from microspeed import checkpoint

        return checkpoint.save(engine, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters)

    @hookimpl(trylast=True)
    def microspeed_load_checkpoint(self, engine: Any, load_dir: str, tag: str | None, load_module_strict: bool,
                                   load_optimizer_states: bool, load_lr_scheduler_states: bool,
                                   load_module_only: bool, load_rng_state: bool) -> tuple[str | None, dict]:
        """:func:`microspeed.checkpoint.load`."""
        from microspeed import checkpoint

        return checkpoint.load(engine, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               load_rng_state=load_rng_state)

    @hookimpl(trylast=True)
    def microspeed_save_16bit_model(self, engine: Any, save_dir: str, save_filename: str,
                                    exclude_frozen_parameters: bool) -> bool:
        """:func:`microspeed.checkpoint.save_16bit_model`."""
        from microspeed import checkpoint

        return checkpoint.save_16bit_model(engine, save_dir, save_filename=save_filename,
                                           exclude_frozen_parameters=exclude_frozen_parameters)
