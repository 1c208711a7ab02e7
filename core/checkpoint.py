"""Checkpoints in DeepSpeed's layout: ``<dir>/<tag>/...`` and ``<dir>/latest`` naming the newest tag.

Rank 0 writes the model (keyed by parameter name), optimizer, scheduler, counters, client state
and every plugin's state; each rank writes its RNG states. ``latest`` is published atomically
after every rank has finished, so an interrupted save never leaves it pointing at a partial tag.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch

from microspeed import comm

MODEL_FILE = "mp_rank_00_model_states.pt"


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine: Any, save_dir: str, tag: str | None, client_state: dict, save_latest: bool) -> bool:
    """Write a checkpoint of ``engine`` (every rank calls this)."""
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    path = os.path.join(save_dir, tag)
    rank = comm.get_rank()
    os.makedirs(path, exist_ok=True)
    plugin_states: dict[str, Any] = {}
    for state in engine.hook.microspeed_checkpoint_state(engine=engine):
        plugin_states.update(state or {})
    if rank == 0:
        blob = {
            "module": engine.module.state_dict(),
            "optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "counters": {k: getattr(engine, k) for k in ("global_steps", "global_samples", "micro_steps",
                                                          "skipped_steps")},
            "plugins": plugin_states,
            "client_state": client_state,
            "ds_config": engine.config.to_dict(),
        }
        _atomic_save(blob, os.path.join(path, MODEL_FILE))
    _atomic_save(_rng_state(), os.path.join(path, f"rng_rank{rank}.pt"))
    comm.barrier()
    if rank == 0 and save_latest:
        tmp = os.path.join(save_dir, "latest.tmp")
        with open(tmp, "w") as fh:
            fh.write(tag)
        os.replace(tmp, os.path.join(save_dir, "latest"))
    comm.barrier()
    return True


def _atomic_save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load(engine: Any, load_dir: str, tag: str | None, strict: bool, load_optimizer_states: bool,
         load_lr_scheduler_states: bool) -> tuple[str | None, dict]:
    """Restore ``engine`` from ``load_dir`` (``tag`` or the one ``latest`` names)."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None, {}
        with open(latest) as fh:
            tag = fh.read().strip()
    path = os.path.join(load_dir, str(tag))
    model_file = os.path.join(path, MODEL_FILE)
    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"load_checkpoint: {model_file} does not exist (tag {tag!r} in {load_dir}).")
    try:
        blob = torch.load(model_file, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise ValueError(f"load_checkpoint: {model_file} is not a readable checkpoint: {exc}") from exc
    engine.module.load_state_dict(blob["module"], strict=strict)
    if load_optimizer_states and blob["optimizer"] is not None and engine.optimizer is not None:
        engine.optimizer.load_state_dict(blob["optimizer"])
    if load_lr_scheduler_states and blob["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(blob["lr_scheduler"])
    for key, value in blob["counters"].items():
        setattr(engine, key, value)
    engine.hook.microspeed_load_checkpoint_state(engine=engine, states=blob["plugins"])
    rng_file = os.path.join(path, f"rng_rank{comm.get_rank()}.pt")
    if os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return path, blob["client_state"]
