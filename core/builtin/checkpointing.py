"""Default answers to the checkpoint hooks (:mod:`microspeed.checkpoint` does the work) and the ``checkpoint`` section.

``checkpoint`` (DeepSpeed's section name; its keys that change nothing here are accepted with a notice):

- ``async_save`` (or DeepSpeed's ``writer.decoupled``): ``save_checkpoint()`` returns once this rank's
  tensors are copied to CPU memory; a background thread writes them, and ``latest`` names the tag only
  after every rank finished. The next save, ``load_checkpoint()``, ``engine.wait_for_checkpoint()`` and
  the end of the process wait for it.
- ``save_dir`` and ``save_interval_steps``: the engine saves itself into ``save_dir`` (tag
  ``global_step<N>``) every ``save_interval_steps`` optimizer steps.
- ``auto_resume_dir`` (microspeed's own key; DeepSpeed has none): the last step of ``initialize()`` loads the
  newest complete checkpoint of that folder, if there is one (:mod:`microspeed.checkpoint.resume`); with
  ``save_interval_steps`` and the ``elasticity`` section, a job torchrun restarts at another world size continues
  with the same global batch. ``engine.resumed_from`` / ``engine.resumed_client_state`` say what was loaded.
- ``tag_validation`` (DeepSpeed's ``Ignore`` / ``Warn`` / ``Fail``, any case; default ``Warn`` as DeepSpeed's):
  what ``save_checkpoint`` does when the ranks pass different tags -- nothing, a warning naming them, or an
  error naming them (an ``AssertionError`` too, as DeepSpeed asserts). Under ``Ignore`` and ``Warn`` the
  checkpoint is saved whole under rank 0's tag (DeepSpeed writes each rank's files under its own tag, a checkpoint
  split across folders; its ``latest`` names rank 0's tag, as ours does).
"""

from __future__ import annotations

from typing import Any

from microspeed.config import Field, Section, positive
from microspeed.errors import ConfigError
from microspeed.hookspecs import hookimpl

_WRITER_NOTICE = ("microspeed writes one contiguous file per rank with its own writer (DeepSpeed's fast-writer "
                  "tuning does not apply); 'decoupled' is honoured")
TAG_VALIDATION_MODES = ("IGNORE", "WARN", "FAIL")
"""``checkpoint.tag_validation``'s values (DeepSpeed's, read case-insensitively as DeepSpeed does)."""


def _tag_validation_mode(value: str) -> str | None:
    """Check: one of DeepSpeed's three ``tag_validation`` modes, in any case (as DeepSpeed reads them)."""
    if value.upper() in TAG_VALIDATION_MODES:
        return None
    return "one of 'Ignore', 'Warn' or 'Fail' (case-insensitive, as in DeepSpeed; the default is 'Warn')"


_SECTION = Section({
    "async_save": Field((bool,), False, "save in a background thread: save_checkpoint() blocks only while the "
                        "tensors are copied to CPU memory; latest is published once every rank finished"),
    "save_dir": Field((str, type(None)), None, "folder the engine saves into every save_interval_steps"),
    "save_interval_steps": Field((int, type(None)), None, "save into save_dir every this many optimizer steps "
                                 "(tag global_step<N>)", positive),
    "auto_resume_dir": Field((str, type(None)), None, "microspeed's own: initialize() ends by loading the newest "
                             "complete checkpoint of this folder, if any (engine.resumed_from, "
                             "engine.resumed_client_state); restarted elastic jobs continue"),
    "tag_validation": Field((str,), "Warn", "DeepSpeed's check that save_checkpoint got the same tag on every rank: "
                            "'Ignore', 'Warn' (default) or 'Fail' (any case); on a mismatch under Ignore/Warn "
                            "the checkpoint is saved under rank 0's tag", _tag_validation_mode),
    "writer": Section({
        "decoupled": Field((bool,), False, "DeepSpeed's name for an asynchronous save (the same as async_save)"),
    }, doc="DeepSpeed's checkpoint writer settings", notices={
        k: _WRITER_NOTICE for k in ("type", "io_buffer_size", "io_buffer_double", "show_statistics",
                                    "data_parallel", "io_multiplier")}),
}, doc="checkpoints: asynchronous and periodic saves", notices={
    "load_universal": "every microspeed checkpoint loads at any world size, ZeRO stage and topology as it is",
    "parallel_write": "every rank always writes its own share of the tensors",
    "use_node_local_storage": "checkpoints go to the save folder you pass, which every rank must see",
})


class CheckpointingPlugin:
    """Saves and loads checkpoints (:mod:`microspeed.checkpoint`); owns the ``checkpoint`` section."""

    @hookimpl
    def microspeed_config_sections(self) -> dict[str, Section]:
        """``checkpoint``: ``async_save``, ``save_dir``, ``save_interval_steps``, ``auto_resume_dir``,
        ``tag_validation``, ``writer.decoupled``."""
        return {"checkpoint": _SECTION}

    @hookimpl
    def microspeed_configure(self, config: Any, world_size: int) -> None:
        """Refuse ``save_interval_steps`` without ``save_dir``."""
        section = config["checkpoint"]
        if section["save_interval_steps"] is not None and not section["save_dir"]:
            raise ConfigError(f"checkpoint.save_interval_steps: got {section['save_interval_steps']} but no "
                              f"checkpoint.save_dir; give the folder to save into (or remove the interval).")

    @hookimpl
    def microspeed_after_global_step(self, engine: Any) -> None:
        """Save into ``checkpoint.save_dir`` every ``checkpoint.save_interval_steps`` steps."""
        section = engine.config["checkpoint"]
        every = section["save_interval_steps"]
        if every and engine.global_steps % every == 0:
            engine.save_checkpoint(section["save_dir"])

    @hookimpl
    def microspeed_initialized(self, engine: Any) -> None:
        """``checkpoint.auto_resume_dir``: load the newest complete checkpoint of that folder, if any."""
        folder = engine.config["checkpoint"]["auto_resume_dir"]
        if folder:
            from microspeed.checkpoint.resume import auto_resume

            auto_resume(engine, folder)

    @hookimpl(trylast=True)
    def microspeed_engine_api(self, engine: Any) -> dict[str, Any]:
        """``engine.wait_for_checkpoint()``: finish this rank's asynchronous save in flight, raising its error;
        ``engine.resumed_from`` / ``engine.resumed_client_state``: ``None`` until ``auto_resume_dir`` loads one;
        DeepSpeed's ``engine.checkpoint_tag_validation_enabled()`` / ``checkpoint_tag_validation_fail()``."""
        from microspeed.checkpoint.saving import wait

        mode = engine.config["checkpoint"]["tag_validation"].upper()
        return {"wait_for_checkpoint": lambda: wait(engine), "resumed_from": None, "resumed_client_state": None,
                "checkpoint_tag_validation_enabled": lambda: mode != "IGNORE",
                "checkpoint_tag_validation_fail": lambda: mode == "FAIL"}

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
                                   load_module_only: bool, load_rng_state: bool,
                                   verify: bool) -> tuple[str | None, dict]:
        """:func:`microspeed.checkpoint.load`."""
        from microspeed import checkpoint

        return checkpoint.load(engine, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               load_rng_state=load_rng_state, verify=verify)

    @hookimpl(trylast=True)
    def microspeed_save_16bit_model(self, engine: Any, save_dir: str, save_filename: str,
                                    exclude_frozen_parameters: bool) -> bool:
        """:func:`microspeed.checkpoint.save_16bit_model`."""
        from microspeed import checkpoint

        return checkpoint.save_16bit_model(engine, save_dir, save_filename=save_filename,
                                           exclude_frozen_parameters=exclude_frozen_parameters)
