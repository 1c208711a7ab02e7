"""Writing a checkpoint of an engine: :func:`save`, the default optimizer-state part, :func:`save_16bit_model`."""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from microspeed import comm
from microspeed.checkpoint.background import pending, saver_for
from microspeed.checkpoint.errors import CheckpointError, CheckpointTagMismatchError, CheckpointWarning
from microspeed.checkpoint.layout import (
    _COUNTERS,
    _TMP,
    _check_tag,
    _publish,
    _short,
    check_folder,
    new_manifest,
    read_latest,
)
from microspeed.checkpoint.manifest import pack, split
from microspeed.checkpoint.names import (
    _aliases,
    _module_tensors,
    _optimizer_fqns,
    _ordered_union,
    optimizer_param_names,
)
from microspeed.checkpoint.rng import _rng_state
from microspeed.checkpoint.sharding import apply_placements, collect_placements, is_on_demand
from microspeed.checkpoint.storage import (
    assign,
    data_file,
    describe,
    finalize,
    local_items,
    mark_failed,
    plan_layout,
    stream_rank_file,
    write_rank_file,
)


def save(engine: Any, save_dir: str, tag: str | None = None, client_state: dict | None = None,
         save_latest: bool = True, exclude_frozen_parameters: bool = False, async_save: bool | None = None) -> bool:
    """Write a checkpoint of ``engine`` to ``save_dir/<tag>`` (every rank calls this); returns ``True``.

    ``exclude_frozen_parameters`` leaves parameters with ``requires_grad=False`` out of the module's
    tensors (as DeepSpeed); loading such a checkpoint then needs ``load_module_strict=False``.
    ``async_save`` (default: the config's ``checkpoint.async_save``): return once this rank's tensors
    are copied to CPU memory and write them in a background thread (:mod:`microspeed.checkpoint.background`);
    ``latest`` names the tag only once every rank finished. A previous save still in flight is waited
    for first, and its error, if any, is raised here on every rank.

    **On-demand items.** A plugin may hand pieces whose values are read only when written
    (:class:`~microspeed.checkpoint.sharding.OnDemandPiece`: state kept in files, say). A rank holding
    any streams its items into its file one by one through a bounded buffer
    (:func:`~microspeed.checkpoint.storage.stream_rank_file`) instead of staging them all, so the save adds
    about that buffer to memory, not the rank's state. Such pieces must be read before training changes them,
    so when any rank holds one the save is synchronous on every rank, ``async_save`` notwithstanding.
    """
    check_folder(save_dir, "save_dir", "save_checkpoint")
    saver = saver_for(engine)
    previous = saver.wait_quietly()
    rank, world = comm.get_rank(), comm.get_world_size()
    if async_save is None:
        async_save = async_enabled(engine.config)
    tag = _check_tag(agree_tag(engine, f"global_step{engine.global_steps}" if tag is None else str(tag)))
    engine.hook.microspeed_before_checkpoint_save(engine=engine, save_dir=save_dir, tag=tag)
    tensors: dict[str, torch.Tensor] = {}

    module_sd = _module_tensors(engine, saving=True)
    if exclude_frozen_parameters:
        frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
        module_sd = {k: v for k, v in module_sd.items() if k not in frozen}
    aliases = _aliases(module_sd)
    extra = {}
    for k, v in module_sd.items():
        if k in aliases:
            continue
        if isinstance(v, torch.Tensor):
            tensors[f"model/{k}"] = v.detach()
        else:  # get_extra_state() values
            extra[k] = split(v, f"model_extra/{k}", tensors)
    optimizer_part = None
    if engine.optimizer is not None:
        optimizer_part = engine.hook.microspeed_save_optimizer_state(engine=engine, tensors=tensors)
    scheduler_part = None
    if engine.lr_scheduler is not None and hasattr(engine.lr_scheduler, "state_dict"):
        scheduler_part = split(engine.lr_scheduler.state_dict(), "lr_scheduler", tensors)
    plugin_states: dict[str, Any] = {}
    for state in engine.hook.microspeed_checkpoint_state(engine=engine):
        plugin_states.update(state or {})
    plugins_part = {name: split(st, f"plugins/{name}", tensors) for name, st in plugin_states.items()}
    client_part = split(dict(client_state or {}), "client", tensors if rank == 0 else {})
    # the manifest holds plain values only (never a pickle): anything else is refused here, on every rank, naming
    # its path, before a file is written
    pack({"model": {"extra": extra}, "optimizer": optimizer_part, "lr_scheduler": scheduler_part,
          "plugin_states": plugins_part, "client_state": client_part})
    apply_placements(tensors, collect_placements(engine), rank)
    items = local_items(tensors)
    on_demand = any(is_on_demand(i.source) for i in items)

    model_part = {"keys": list(module_sd), "aliases": aliases, "extra": extra}
    described = describe(items)
    nonce = secrets.token_hex(6)
    by_rank = None
    if world > 1:  # one small all-gather; objects are exchanged only where fingerprints differ
        digest = pack(plugins_part)
        spread = pack([model_part, optimizer_part])  # do the ranks hold different parameters (pipeline stages)?
        mine = torch.tensor([_fingerprint(repr(described).encode()), _fingerprint(digest), _fingerprint(spread),
                             int(previous is not None), int(nonce, 16) & (2**47 - 1), int(on_demand)],
                            dtype=torch.int64)
        everyone = torch.empty(world * mine.numel(), dtype=torch.int64)
        comm.all_gather_into_tensor(everyone, mine)
        column = everyone.view(world, -1).t().tolist()
        if any(column[3]):
            errors = comm.all_gather_object(previous)
            raise CheckpointError("save_checkpoint: the previous asynchronous save failed and was not published "
                                  "(latest still names the save before it): "
                                  + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
        if len(set(column[1])) > 1:
            by_rank = comm.all_gather_object(plugins_part)
        if len(set(column[2])) > 1:
            parts = comm.all_gather_object([model_part, optimizer_part])
            model_part = merge_model_parts([p[0] for p in parts])
            optimizer_part = merge_optimizer_parts([p[1] for p in parts])
        nonce = f"{column[4][0]:012x}"
        if any(column[5]):  # on-demand pieces are read before returning: synchronous everywhere
            async_save = False
        if saver.plan is None or saver.plan[0] != column[0]:  # the items changed: agree on who writes what
            saver.plan = (column[0], assign(comm.all_gather_object(described), rank))
        mine_idents = saver.plan[1]
    else:
        if previous is not None:
            raise CheckpointError("save_checkpoint: the previous asynchronous save failed and was not published "
                                  f"(latest still names the save before it): rank 0: {previous}")
        mine_idents = assign([described], 0)
        async_save = async_save and not on_demand
    mine_items = [i for i in items if i.ident in mine_idents]
    if on_demand:  # streamed by the write below, never staged whole
        saver.staging.release()
        layout = plan_layout(mine_items)
    else:
        layout = saver.staging.stage(mine_items)
    del mine_items
    del items, tensors  # the staged copy is what gets written; training may change the originals now
    tmp = os.path.join(save_dir, f"{tag}{_TMP}{nonce}")
    os.makedirs(tmp, exist_ok=True)
    manifest: dict[str, Any] = {}
    if rank == 0:
        head = new_manifest(tag, world, engine.config.to_dict(), {k: getattr(engine, k) for k in _COUNTERS},
                            engine.gradient_accumulation_steps())
        head.update({
            "topology": {"data_parallel_size": engine.topology.data_parallel_size,
                         "model_parallel_size": engine.topology.model_parallel_size},
            "plugins": [[i.name, i.version] for i in engine.plugins.infos.values()],
            "model": model_part,
            "optimizer": optimizer_part, "lr_scheduler": scheduler_part, "plugin_states": plugins_part,
            "plugin_states_by_rank": by_rank, "client_state": client_part,  # "rng": every rank's, from its index
        })
        manifest = head  # split() built every container afresh and cloned 0-d tensors: training cannot change it
    buffer, rng = saver.staging.buffer, _rng_state()

    if async_save:
        wait_s, lost = _peers_watched(engine) if rank == 0 and world > 1 else (0.0, None)

        def write() -> None:
            try:
                write_rank_file(tmp, rank, buffer, layout, rng)
            except BaseException as exc:
                mark_failed(tmp, rank, f"{os.path.join(tmp, data_file(rank))}: {type(exc).__name__}: {exc}")
                raise
            if rank == 0:
                try:
                    finalize(tmp, world, manifest, timeout_s=wait_s, lost=lost)
                except CheckpointError as exc:
                    latest = read_latest(save_dir)
                    after = f"latest still names {latest!r}." if latest else "there is no latest yet."
                    error = CheckpointError(f"checkpoint {tag!r} in {save_dir}: {exc} {after}", exc.path)
                    # said now: with a rank gone, the next collective fails before the next save would say it
                    print(f"microspeed: {error}", file=sys.stderr, flush=True)
                    raise error from exc
                _publish(save_dir, tag, tmp, save_latest)

        saver.start(write, os.path.join(tmp, data_file(rank)))
        return True
    error = None
    try:
        if on_demand:
            saver.staging.bounce_bytes = stream_rank_file(tmp, rank, layout, rng)
        else:
            write_rank_file(tmp, rank, buffer, layout, rng)
    except Exception as exc:
        error = f"{os.path.join(tmp, data_file(rank))}: {type(exc).__name__}: {_short(exc)}"
    errors = comm.all_gather_object(error) if world > 1 else [error]
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"save_checkpoint: writing tensors into {tmp} failed: " + "; ".join(failed), tmp)
    if rank == 0:
        finalize(tmp, world, manifest, timeout_s=60.0)
        _publish(save_dir, tag, tmp, save_latest)
    comm.barrier()
    return True


def agree_tag(engine: Any, tag: str) -> str:
    """The tag every rank saves under: ``tag`` when the ranks passed the same one, else rank 0's.

    One all-gather of a 47-bit digest per rank; the tags themselves are exchanged only when they differ. Then
    ``checkpoint.tag_validation`` (DeepSpeed's key and modes) decides: ``Fail`` raises
    :class:`CheckpointTagMismatchError` (an ``AssertionError``, as DeepSpeed asserts) naming every rank's tag, on
    every rank; ``Warn`` (the default, as DeepSpeed's) warns naming them; ``Ignore`` says nothing. Where DeepSpeed
    would then write each rank's files under that rank's own tag (a checkpoint split across folders that loads
    under none), microspeed writes one checkpoint under rank 0's tag -- the tag ``latest`` names in both.
    """
    world = comm.get_world_size()
    if world == 1:
        return tag
    everyone = torch.empty(world, dtype=torch.int64)
    comm.all_gather_into_tensor(everyone, torch.tensor([_fingerprint(tag.encode())], dtype=torch.int64))
    if len(set(everyone.tolist())) == 1:
        return tag
    tags = comm.all_gather_object(tag)
    mode = str(engine.config.get("checkpoint.tag_validation", "Warn")).upper()
    named = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    if mode == "FAIL":
        raise CheckpointTagMismatchError(
            f"save_checkpoint: the ranks passed different tags ({named}) and checkpoint.tag_validation is "
            f"'Fail'; pass the same tag on every rank (a tag holding the rank would not load at another world "
            f"size), or set checkpoint.tag_validation to 'Warn' or 'Ignore' to save under rank 0's tag.")
    if mode == "WARN":
        warnings.warn(f"save_checkpoint: the ranks passed different tags ({named}); the checkpoint is saved "
                      f"under rank 0's tag {tags[0]!r}. Pass the same tag on every rank (checkpoint.tag_validation: "
                      f"'Ignore' silences this, 'Fail' refuses it).", CheckpointWarning, stacklevel=2)
    return tags[0]


UNWATCHED_WAIT_S = 1800.0
"""How long rank 0 waits for the other ranks to finish writing an asynchronous save when no watchdog runs."""


def _peers_watched(engine: Any) -> tuple[float, Callable[[list[int]], dict[int, str]] | None]:
    """Rank 0's wait for the other ranks' files: ``(seconds at most, lost)``.

    With the engine's watchdog running: its ``timeout_s``, and its heartbeats say which ranks are gone
    (:meth:`~microspeed.observe.watchdog.Watchdog.peer_watch`), so a rank that died ends the wait at once.
    Without: :data:`UNWATCHED_WAIT_S` and nobody to ask.
    """
    from microspeed.observe import watchdog

    wd = watchdog.current(comm.context_for(engine.plugins))
    if wd is None or wd.store is None:
        return UNWATCHED_WAIT_S, None
    return wd.timeout_s, wd.peer_watch().lost


def _fingerprint(data: bytes) -> int:
    """A 47-bit digest of ``data`` (fits an int64 tensor element)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & (2**47 - 1)


def async_enabled(config: Any) -> bool:
    """Whether ``config`` asks for asynchronous saves: ``checkpoint.async_save`` or ``checkpoint.writer.decoupled``."""
    try:
        section = config["checkpoint"]
    except (KeyError, TypeError):
        return False
    if not isinstance(section, dict):
        return False
    writer = section.get("writer") or {}
    return bool(section.get("async_save")) or bool(isinstance(writer, dict) and writer.get("decoupled"))


def wait(engine: Any) -> None:
    """Wait for ``engine``'s asynchronous save in flight (if any); raise its error here (this rank only)."""
    saver = pending(engine)
    if saver is not None:
        saver.wait()


def merge_model_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One manifest ``model`` entry from every rank's, when ranks hold different parameters.

    A pipeline stage holds only its own layers, so each rank names a different subset of the
    module's keys; the checkpoint names their union (in rank order), which is what any other
    partition of the same model asks for.
    """
    merged: dict[str, Any] = {"keys": _ordered_union([p["keys"] for p in parts]), "aliases": {}, "extra": {}}
    for p in parts:
        merged["aliases"].update(p.get("aliases", {}))
        merged["extra"].update(p.get("extra", {}))
    return merged


def merge_optimizer_parts(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One manifest ``optimizer`` entry from every rank's (see :func:`merge_model_parts`).

    Param groups are matched by index; each group's parameter names, the per-parameter state and the
    master list are united. Ranks must agree on the optimizer class and the number of groups.
    """
    present = [p for p in parts if p is not None]
    if not present:
        return None
    first = present[0]
    if any(p.get("class") != first.get("class") or len(p["param_groups"]) != len(first["param_groups"])
           for p in present):
        raise CheckpointError("save_checkpoint: the ranks' optimizers differ in class or number of param groups; "
                              "build the same optimizer on every rank.")
    groups = []
    for g, group in enumerate(first["param_groups"]):
        groups.append({**group, "params": _ordered_union([p["param_groups"][g]["params"] for p in present])})
    state: dict[str, Any] = {}
    for p in present:
        state.update(p["state"])
    return {**first, "param_groups": groups, "state": state,
            "masters": _ordered_union([p.get("masters", []) for p in present])}


def save_optimizer_state(engine: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The default ``microspeed_save_optimizer_state``: ``optimizer.state_dict()`` keyed by FQN."""
    optimizer = engine.optimizer
    sd = optimizer.state_dict()
    fqns = _optimizer_fqns(optimizer, optimizer_param_names(engine))
    groups = []
    for g, group in enumerate(sd["param_groups"]):
        hyper = split({k: v for k, v in group.items() if k != "params"}, f"optim_groups/{g}", tensors)
        groups.append({**hyper, "params": [fqns[i] for i in group["params"]]})
    state = {fqns[i]: split(st, f"optim/{fqns[i]}", tensors) for i, st in sd["state"].items()}
    model_ids = {id(p) for p in engine.module.parameters()}
    masters = []
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    for p, fqn in zip(flat, fqns, strict=True):
        if id(p) not in model_ids:
            tensors[f"master/{fqn}"] = p.detach()
            masters.append(fqn)
    return {"class": type(optimizer).__name__, "param_groups": groups, "state": state, "masters": masters}


def save_16bit_model(engine: Any, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Rank 0 writes the module's state dict in the training dtype to ``save_dir/save_filename``.

    As DeepSpeed's ``save_16bit_model``: a plain ``torch.save`` file (``.safetensors`` when the
    name ends so and the package is installed). Every rank calls it; returns ``True``.
    ``exclude_frozen_parameters`` leaves out parameters with ``requires_grad=False``.
    """
    check_folder(save_dir, "save_dir", "save_16bit_model")
    full = engine.hook.microspeed_consolidated_state_dict(engine=engine)
    if full is None:
        full = engine.module.state_dict()
    if "__skip__" in full:
        warnings.warn(f"save_16bit_model: nothing saved: {full['__skip__']}", CheckpointWarning, stacklevel=3)
        comm.barrier()
        return False
    if comm.get_rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
        state = {k: v.detach().cpu() for k, v in full.items()
                 if isinstance(v, torch.Tensor) and not (exclude_frozen_parameters and k in frozen)}
        path = os.path.join(save_dir, save_filename)
        save_state_dict_file(state, path)
    comm.barrier()
    return True


def save_state_dict_file(state: dict[str, torch.Tensor], path: str) -> None:
    """Write ``state`` to ``path`` atomically: safetensors for ``*.safetensors``, else ``torch.save``."""
    tmp = f"{path}{_TMP}{secrets.token_hex(4)}"
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError as exc:
            raise CheckpointError(f"{path}: writing .safetensors needs the 'safetensors' package "
                                  f"(pip install safetensors), or use a .pt file name.", path) from exc
        save_file({k: v.contiguous().clone() for k, v in state.items()}, tmp)
    else:
        torch.save(state, tmp)
    os.replace(tmp, path)
