"""``checkpoint.auto_resume_dir``: at the end of ``initialize()``, load the newest complete checkpoint of a folder.

microspeed's own key (DeepSpeed has none): an elastic job restarted by torchrun's agent — at the same or another
world size, with the batch triad the ``elasticity`` section picks for it — runs the same script again, and
``initialize()`` continues from where the last complete save left off instead of step 0.

Which checkpoint: the tag ``<dir>/latest`` names when that folder is complete (it holds a readable manifest and
tensor index whose files all exist at full length: what :func:`microspeed.checkpoint.save` publishes last);
otherwise, with a warning naming what was skipped and why, the complete folder written last (by the manifest's
time) — a tag folder, or the ``<tag>.tmp-*`` folder an interrupted save or publish left when it is complete (a
publish interrupted between its two renames, where the atomic exchange is not available, leaves the previous
and the new folder only under such names: see :mod:`microspeed.checkpoint.layout`). A run starts fresh only when
no complete checkpoint is left at all. Rank 0 chooses and every rank loads the same tag
(``engine.load_checkpoint``: model, optimizer, scheduler, counters, plugin state such as the data loader's
position; not the RNG streams, as DeepSpeed's default).

What the client sees: ``engine.global_steps`` and the other counters continue, one log line names the folder
and step, ``engine.resumed_from`` is the tag folder loaded and ``engine.resumed_client_state`` the
``client_state`` saved with it (both ``None`` when the run started fresh).
"""

from __future__ import annotations

import os
from typing import Any

from microspeed import comm
from microspeed.checkpoint.errors import CheckpointError
from microspeed.checkpoint.layout import (
    _TMP,
    LATEST,
    leftovers,
    read_latest,
    read_manifest,
    read_tensor_index,
    resolve_inside,
)

KEY = "checkpoint.auto_resume_dir"


def incomplete_reason(tag_dir: str) -> str | None:
    """Why ``tag_dir`` is not a complete checkpoint (``None`` when it is one)."""
    if not os.path.isdir(tag_dir):
        return "the folder does not exist"
    try:
        manifest = read_manifest(tag_dir)
        read_tensor_index(tag_dir)
    except (CheckpointError, FileNotFoundError, OSError) as exc:
        return str(exc)
    if not isinstance(manifest.get("counters"), dict):
        return "its manifest has no counters"
    return None


def _write_time(tag_dir: str) -> float:
    try:
        manifest = read_manifest(tag_dir)
        return float(manifest.get("time") or os.path.getmtime(tag_dir))
    except (CheckpointError, FileNotFoundError, OSError, TypeError, ValueError):
        return os.path.getmtime(tag_dir)


def newest_complete(save_dir: str, names: list[str]) -> str | None:
    """The one of the folders ``names`` of ``save_dir`` that is complete and was written last (``None``: none)."""
    complete = [(_write_time(os.path.join(save_dir, n)), n) for n in names
                if incomplete_reason(os.path.join(save_dir, n)) is None]
    return max(complete)[1] if complete else None


def find_resume_tag(save_dir: str) -> tuple[str | None, list[str]]:
    """``(tag, notes)``: the tag to resume from in ``save_dir`` (``None``: none complete) and what was skipped."""
    notes: list[str] = []
    if not os.path.isdir(save_dir):
        return None, notes
    try:
        latest = read_latest(save_dir)
    except CheckpointError as exc:
        latest = None
        notes.append(f"{exc}; it is skipped")
    if latest is not None:
        reason = incomplete_reason(os.path.join(save_dir, latest))
        if reason is None:
            return latest, notes
        notes.append(f"{os.path.join(save_dir, LATEST)} names {latest!r}, which is incomplete ({reason}); "
                     f"it is skipped")
    tags = [n for n in sorted(os.listdir(save_dir)) if not n.startswith(".") and _TMP not in n and n != latest
            and os.path.isdir(os.path.join(save_dir, n))]
    left = leftovers(save_dir)
    for name in list(tags + left):  # a symlink leading out of the folder is not one of its checkpoints
        try:
            resolve_inside(save_dir, name, save_dir)
        except CheckpointError:
            (tags if name in tags else left).remove(name)
            notes.append(f"{os.path.join(save_dir, name)} leads outside {save_dir} (a symlink); it is skipped")
    best = newest_complete(save_dir, tags + left)
    if best in left:
        notes.append(f"the newest complete checkpoint is {os.path.join(save_dir, best)}, left by a save of "
                     f"{best.split(_TMP)[0]!r} that was interrupted before or while publishing; resuming from it")
    return best, notes


def auto_resume(engine: Any, save_dir: str) -> str | None:
    """Load the newest complete checkpoint of ``save_dir`` into ``engine`` (every rank calls this); the tag folder
    loaded, or ``None`` when there is none (the run starts fresh). Sets ``engine.resumed_from`` and
    ``engine.resumed_client_state``."""
    from microspeed.log import get_logger

    log = get_logger("microspeed.checkpoint")
    rank0 = comm.get_rank() == 0
    choice: Any = None
    if rank0:
        try:
            choice = find_resume_tag(save_dir)
        except OSError as exc:  # an unreadable folder: every rank raises it, none waits for rank 0
            choice = f"{KEY}: cannot read {save_dir}: {exc}"
    if comm.get_world_size() > 1:
        choice = comm.all_gather_object(choice)[0]
    if isinstance(choice, str):
        raise CheckpointError(choice, save_dir)
    tag, notes = choice
    if rank0:
        for note in notes:
            log.warning(f"{KEY}: {note}")
    engine.resumed_from, engine.resumed_client_state = None, None
    if tag is None:
        if rank0:
            log.info(f"{KEY}: no complete checkpoint in {save_dir}; starting fresh")
        return None
    error: Exception | None = None
    try:
        tag_dir, client_state = engine.load_checkpoint(save_dir, tag=tag)
    except Exception as exc:  # noqa: BLE001 - re-raised here, reported on the other ranks
        error = exc
    if comm.get_world_size() > 1:  # a rank that failed to load must not leave the others in training's collectives
        everyone = comm.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
        failed = [f"rank {r}: {e}" for r, e in enumerate(everyone) if e]
        if failed and error is None:
            raise CheckpointError(f"{KEY}: loading {os.path.join(save_dir, tag)} failed on other ranks: "
                                  + "; ".join(failed), os.path.join(save_dir, tag))
    if error is not None:
        raise error
    engine.resumed_from, engine.resumed_client_state = tag_dir, client_state
    if rank0:
        log.info(f"{KEY}: resumed from {tag_dir} (tag {tag}) at global step {engine.global_steps}, "
                 f"{comm.get_world_size()} rank(s)")
    return tag_dir
