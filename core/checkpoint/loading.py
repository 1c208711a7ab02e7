"""Restoring an engine from a checkpoint (:func:`load`), the default optimizer-state part, and fp32 weights."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from microspeed import comm
from microspeed.checkpoint.background import pending
from microspeed.checkpoint.errors import CheckpointError, CheckpointWarning
from microspeed.checkpoint.layout import (
    _COUNTERS,
    LATEST,
    _no_dist,
    check_folder,
    latest_tag_dir,
    read_latest,
    read_manifest,
    read_tensor_index,
    resolve_tag_dir,
)
from microspeed.checkpoint.manifest import join, tensor_refs
from microspeed.checkpoint.names import (
    _aliases,
    _module_tensors,
    _optimizer_fqns,
    _ordered_union,
    optimizer_param_names,
)
from microspeed.checkpoint.reader import Reader, check_verifiable
from microspeed.checkpoint.rng import _restore_rng
from microspeed.checkpoint.sharding import collect_placements


def load(engine: Any, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
         load_module_only: bool = False, load_rng_state: bool = False, verify: bool = True) -> tuple[str | None, dict]:
    """Restore ``engine`` from ``load_dir`` (``tag``, or the one ``latest`` names); every rank calls this.

    Returns ``(tag_dir, client_state)``, or ``(None, {})`` with a warning when ``load_dir`` has no
    ``latest`` and no tag was given. ``load_module_strict``: the module's parameter names must
    equal the checkpoint's (else :class:`CheckpointError` listing the missing and unexpected
    ones); when false, the names both have are loaded and the others listed in a warning.
    ``load_module_only``: only the weights (fp32 masters included); no optimizer, scheduler,
    counters, plugin state or RNG. ``load_rng_state``: restore every rank's Python, numpy and torch
    random-number state as saved (DeepSpeed's ``load_checkpoint`` never does; off by default). ``verify``: a
    checkpoint whose manifest carries no checksums for its tensor files (the layout before checksums, or
    stripped) is refused unless this is ``False``
    (:func:`~microspeed.checkpoint.reader.check_verifiable`). When ``latest`` names a folder a
    publish left missing, the newest complete leftover of that tag is loaded, with a warning.
    """
    check_folder(load_dir, "load_dir", "load_checkpoint")
    _wait_for_saves(engine)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            warnings.warn(f"load_checkpoint: {os.path.join(load_dir, LATEST)} not found; nothing was loaded. "
                          f"Pass tag=... to load a specific checkpoint.", CheckpointWarning, stacklevel=3)
            return None, {}
        tag_dir = latest_tag_dir(load_dir, tag, lambda msg: warnings.warn(msg, CheckpointWarning, stacklevel=5))
    else:
        tag_dir = os.path.join(load_dir, str(tag))
    manifest = read_manifest(tag_dir)
    metadata = read_tensor_index(tag_dir)
    check_verifiable(tag_dir, manifest, metadata, verify)
    rank = comm.get_rank()
    reader = Reader(tag_dir, metadata, manifest, collect_placements(engine), rank)
    after: list[Callable[[], None]] = []

    _load_module(engine, manifest, reader, tag_dir, load_module_strict, after)
    load_opt = load_optimizer_states and not load_module_only and manifest.get("optimizer") is not None
    if engine.optimizer is not None:
        engine.hook.microspeed_load_optimizer_state(engine=engine, saved=manifest.get("optimizer"), reader=reader,
                                                    load_states=load_opt, strict=load_module_strict, after=after)
    if (load_lr_scheduler_states and not load_module_only and engine.lr_scheduler is not None
            and manifest.get("lr_scheduler") is not None):
        tree = _fresh_refs(manifest["lr_scheduler"], reader)
        after.append(lambda: engine.lr_scheduler.load_state_dict(tree()))
    plugin_tree = None
    if not load_module_only:
        by_rank = manifest.get("plugin_states_by_rank")
        plugin_tree = _fresh_refs(by_rank[min(rank, len(by_rank) - 1)] if by_rank else
                                  manifest.get("plugin_states", {}), reader)
    client_tree = _fresh_refs(manifest.get("client_state", {}), reader)

    reader.run(no_dist=_no_dist())
    for step in after:
        step()
    if not load_module_only:
        _load_counters(engine, manifest)
        engine.hook.microspeed_load_checkpoint_state(engine=engine, states=plugin_tree())
        if load_rng_state:
            _restore_rng(manifest.get("rng") or [], rank)
    return tag_dir, client_tree()


def _wait_for_saves(engine: Any) -> None:
    """Finish this engine's asynchronous save in flight on every rank; raise everywhere if one failed."""
    saver = pending(engine)
    error = saver.wait_quietly() if saver is not None else None
    errors = comm.all_gather_object(error) if comm.get_world_size() > 1 else [error]
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError("load_checkpoint: the asynchronous save before it failed and was not published: "
                              + "; ".join(failed))


def _fresh_refs(tree: Any, reader: Reader) -> Callable[[], Any]:
    """Allocate a tensor for each :class:`TensorRef` of ``tree``; returns the joiner to call after reading."""
    loaded = {ref.key: reader.fresh(ref.key) for ref in tensor_refs(tree) if reader.has(ref.key)}
    missing = [ref.key for ref in tensor_refs(tree) if ref.key not in loaded]
    if missing:
        raise CheckpointError(f"{reader.tag_dir}: the manifest names tensors the index lacks: {missing[:10]}",
                              reader.tag_dir)
    return lambda: join(tree, loaded)


def _load_module(engine: Any, manifest: dict, reader: Reader, tag_dir: str, strict: bool,
                 after: list[Callable[[], None]]) -> None:
    """Plan reading the module's tensors (into what ``microspeed_checkpoint_module_tensors`` presents)."""
    model = manifest["model"]
    saved_aliases: dict[str, str] = model.get("aliases", {})
    saved = set(model["keys"])
    current = _module_tensors(engine)
    everywhere = set(_ordered_union(comm.all_gather_object(list(current))))  # every rank's names
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in model["keys"] if k not in everywhere]
    if missing or unexpected:
        msg = (f"load_checkpoint: {tag_dir}: the module's state names differ from the checkpoint's. "
               f"Missing in the checkpoint ({len(missing)}): {missing}. Unexpected, only in the checkpoint "
               f"({len(unexpected)}): {unexpected}.")
        if strict:
            raise CheckpointError(msg + " Pass load_module_strict=False to load the names both have.", tag_dir)
        warnings.warn(msg, CheckpointWarning, stacklevel=4)
    current_aliases = _aliases(current)
    extra = {}
    for k, t in current.items():
        if k not in saved or k in current_aliases:
            continue
        if k in model.get("extra", {}):
            extra[k] = _fresh_refs(model["extra"][k], reader)
            continue
        src = saved_aliases.get(k, k)
        key = f"master/{src}" if t.dtype == torch.float32 and reader.has(f"master/{src}") else f"model/{src}"
        reader.into(key, t, k)
    if extra:
        after.append(lambda: engine.module.load_state_dict({k: f() for k, f in extra.items()}, strict=False))


def load_optimizer_state(engine: Any, saved: dict | None, reader: Reader, load_states: bool, strict: bool,
                         after: list[Callable[[], None]]) -> bool:
    """The default ``microspeed_load_optimizer_state``: masters, then ``optimizer.load_state_dict``."""
    manifest, tag_dir, load_opt = reader.manifest, reader.tag_dir, load_states and saved is not None
    optimizer = engine.optimizer
    fqns = _optimizer_fqns(optimizer, optimizer_param_names(engine))
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    model_ids = {id(p) for p in engine.module.parameters()}
    saved_keys = set(manifest["model"]["keys"])
    for p, fqn in zip(flat, fqns, strict=True):  # fp32 masters: the best weights the checkpoint has
        if id(p) in model_ids:
            continue
        if reader.has(f"master/{fqn}"):
            reader.into(f"master/{fqn}", p.data, f"master {fqn}")
        elif fqn in saved_keys:
            src = manifest["model"].get("aliases", {}).get(fqn, fqn)
            reader.into(f"model/{src}", p.data, f"master {fqn}")
    if not load_opt:
        return True
    current = optimizer.state_dict()
    if len(saved["param_groups"]) != len(current["param_groups"]):
        raise CheckpointError(f"load_checkpoint: {tag_dir}: the optimizer has {len(current['param_groups'])} "
                              f"param groups, the checkpoint {len(saved['param_groups'])}. Build the optimizer "
                              f"with the same groups, or pass load_optimizer_states=False.", tag_dir)
    problems = []
    mine_by_group = [[fqns[i] for i in cur["params"]] for cur in current["param_groups"]]
    everyone = comm.all_gather_object(mine_by_group)  # a pipeline stage holds only its own parameters
    for g, (mine, old) in enumerate(zip(mine_by_group, saved["param_groups"], strict=True)):
        everywhere = set(_ordered_union([theirs[g] for theirs in everyone]))
        missing, unexpected = set(mine) - set(old["params"]), set(old["params"]) - everywhere
        if missing or unexpected:
            problems.append(f"group {g}: missing in the checkpoint {sorted(missing)}, unexpected {sorted(unexpected)}")
    if problems:
        msg = f"load_checkpoint: {tag_dir}: optimizer parameters differ from the checkpoint's: " + "; ".join(problems)
        if strict:
            raise CheckpointError(msg + ". Pass load_module_strict=False to load the state of the names both have, "
                                  "or load_optimizer_states=False.", tag_dir)
        warnings.warn(msg, CheckpointWarning, stacklevel=4)
    if saved.get("class") not in (None, type(optimizer).__name__):
        warnings.warn(f"load_checkpoint: {tag_dir}: the optimizer state was saved from {saved['class']}, "
                      f"loading into {type(optimizer).__name__}.", CheckpointWarning, stacklevel=4)
    state_trees = {i: _fresh_refs(saved["state"][fqn], reader)
                   for i, fqn in enumerate(fqns) if fqn in saved["state"]}
    group_trees = [_fresh_refs({k: v for k, v in old.items() if k != "params"}, reader)
                   for old in saved["param_groups"]]

    def apply() -> None:
        groups = [{**cur, **hyper(), "params": cur["params"]}
                  for cur, hyper in zip(current["param_groups"], group_trees, strict=True)]
        optimizer.load_state_dict({"state": {i: tree() for i, tree in state_trees.items()}, "param_groups": groups})

    after.append(apply)
    return True


def _load_counters(engine: Any, manifest: dict) -> None:
    counters = manifest.get("counters", {})
    for key in _COUNTERS:
        if key in counters:
            setattr(engine, key, int(counters[key]))
    saved_gas = manifest.get("gradient_accumulation_steps")
    gas = engine.gradient_accumulation_steps()
    if saved_gas is not None and saved_gas != gas and "global_steps" in counters:
        if counters.get("micro_steps", 0) % saved_gas:
            warnings.warn("load_checkpoint: the checkpoint was saved inside a gradient-accumulation window; its "
                          "partial gradients were not saved and the window restarts.", CheckpointWarning,
                          stacklevel=4)
        engine.micro_steps = engine.global_steps * gas


def get_fp32_state_dict(ckpt_dir: str, tag: str | None = None, verify: bool = True) -> dict[str, torch.Tensor]:
    """The module's full state dict with floating-point tensors in fp32, read without a process group.

    ``ckpt_dir`` is a save folder (``tag`` or ``latest`` picks the tag) or a tag folder. fp32
    master weights are preferred where the run was fp16/bf16; tied duplicates are the same tensor
    object, as in ``module.state_dict()``. Keys come in the module's order. ``verify=False`` reads a
    checkpoint without checksums (refused otherwise, as by :func:`load`).
    """
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    manifest = read_manifest(tag_dir)
    metadata = read_tensor_index(tag_dir)
    check_verifiable(tag_dir, manifest, metadata, verify)
    reader = Reader(tag_dir, metadata, manifest)
    model = manifest["model"]
    aliases = model.get("aliases", {})
    loaded: dict[str, torch.Tensor] = {}
    for k in model["keys"]:
        if k in aliases or k in model.get("extra", {}):
            continue
        key = f"master/{k}" if reader.has(f"master/{k}") else f"model/{k}"
        loaded[k] = reader.fresh(key)
    reader.run(no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for k in model["keys"]:
        if k in model.get("extra", {}):
            continue
        t = loaded[aliases.get(k, k)]
        if t.is_floating_point() and t.dtype != torch.float32:
            t = loaded[aliases.get(k, k)] = t.float()
        out[k] = t
    return out
