"""Write a microspeed checkpoint in DeepSpeed's layout (ZeRO stage 0, 1 or 2), so DeepSpeed's tools read it.

``microspeed checkpoint export-deepspeed CKPT_DIR DST [--tag T] [--zero-stage S] [--world-size N]``
writes ``DST/<tag>/`` and ``DST/latest`` as DeepSpeed 0.19.8's ``save_checkpoint`` lays them out, so
``zero_to_fp32.py`` (``deepspeed.utils.zero_to_fp32``, from a DeepSpeed install: this module copies
no DeepSpeed file) and code that reads ``mp_rank_00_model_states.pt`` work on what microspeed saved:

* ``mp_rank_00_model_states.pt``: ``module`` (the state dict in the training dtype, tied weights
  sharing one tensor), ``buffer_names``, ``optimizer`` (stage 0: a ``torch.optim`` state dict whose
  integer ids follow the param groups), ``param_shapes`` (ZeRO: per group, names -> ``torch.Size`` in
  flattening order), ``frozen_param_shapes`` / ``frozen_param_fragments`` (``None``: see below),
  ``shared_params``, ``lr_scheduler``, ``global_steps``, ``global_samples``, ``skipped_steps``,
  ``dp_world_size``, ``mp_world_size``, ``ds_config``, ``ds_version`` and the client state's keys.
* ZeRO 1/2, one per data-parallel rank ``r``: ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` with
  ``optimizer_state_dict``: ``single_partition_of_fp32_groups`` (rank r's slice of each group's flat
  fp32 buffer; the buffer is padded to a multiple of ``2 * world_size`` as DeepSpeed pads it and the
  padding removed from the slices), ``base_optimizer_state`` (the torch state over the padded slices),
  ``zero_stage``, ``partition_count``, ``group_paddings``, ``param_alignment_paddings`` (zeros),
  ``loss_scaler`` (pickled under DeepSpeed's class name ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` or
  ``DynamicLossScaler``, with ``cur_scale``, ``cur_iter`` ... as its attributes; written without DeepSpeed
  installed, read by DeepSpeed and by ``import-deepspeed``, which admits only DeepSpeed's classes),
  ``dynamic_loss_scale``, ``overflow``, ``clip_grad``, ``ds_version``; plus ``ds_config`` and ``ds_version``
  beside it.

The layout's world size is the checkpoint's unless ``--world-size`` says otherwise. A stage-3 run is
written in the stage-2 layout (its weights and optimizer state are the same numbers; DeepSpeed's
stage-3 file format is not written). Differences from a file DeepSpeed wrote: parameters the
optimizer does not hold (frozen) are listed in ``buffer_names`` (a microspeed checkpoint does not
tell them from buffers; ``zero_to_fp32`` still returns them, in fp32); the loss scaler carries
only the attributes above, ``ZeroStageEnum`` is a plain int, and ``param_slice_mappings`` (fragment
addresses for ``ds_to_universal``, DeepSpeed objects) is not written, so DeepSpeed's own
``load_checkpoint`` is not a goal — ``zero_to_fp32`` and readers of the module file are. A stage-0
fp16/bf16 run has fp32 masters that DeepSpeed's stage-0 layout keeps inside its ``FP16_Optimizer`` /
``BF16_Optimizer`` files: export it with ``--zero-stage 1`` (the refusal says so).
"""

from __future__ import annotations

import math
import os
import pickle
import types
from collections import OrderedDict
from typing import Any

import torch

from microspeed.checkpoint import (
    LATEST,
    MANIFEST,
    CheckpointError,
    Reader,
    check_verifiable,
    read_manifest,
    read_tensor_index,
    resolve_tag_dir,
)
from microspeed.checkpoint.layout import _TMP, _check_tag, resolve_inside
from microspeed.checkpoint.manifest import join

__all__ = ["DEEPSPEED_VERSION", "export_deepspeed", "read_microspeed"]

DEEPSPEED_VERSION = "0.19.8"
"""The ``ds_version`` written into exported files: the DeepSpeed release whose layout this follows."""


def read_microspeed(ckpt_dir: str, tag: str | None = None, verify: bool = True) -> dict[str, Any]:
    """Every tensor and the manifest of a microspeed checkpoint, without a process group.

    Returns ``{"tag_dir", "manifest", "module", "masters", "optimizer", "lr_scheduler", "client_state"}``:
    ``module`` is the state dict in the training dtype (tied keys share one tensor), ``masters`` the
    fp32 masters by name (empty for an fp32 run), ``optimizer`` the manifest's optimizer section with
    tensors filled in (``None`` when none was saved). ``verify=False`` reads a checkpoint without checksums
    (:func:`~microspeed.checkpoint.reader.check_verifiable`).
    """
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    manifest = read_manifest(tag_dir)
    metadata = read_tensor_index(tag_dir)
    check_verifiable(tag_dir, manifest, metadata, verify)
    reader = Reader(tag_dir, metadata, manifest)
    tensors = {key: reader.fresh(key) for key in metadata.state_dict_metadata if reader.has(key)}
    reader.run(no_dist=True)
    model = manifest["model"]
    aliases, extra = model.get("aliases", {}), model.get("extra", {})
    module: dict[str, Any] = OrderedDict()
    for key in model["keys"]:
        if key in extra:
            module[key] = join(extra[key], tensors)
        elif key not in aliases:
            module[key] = tensors[f"model/{key}"]
    for key in model["keys"]:
        if key in aliases:
            module[key] = module[aliases[key]]
    module = OrderedDict((k, module[k]) for k in model["keys"])
    masters = {k[len("master/"):]: t for k, t in tensors.items() if k.startswith("master/")}
    optimizer = join(manifest["optimizer"], tensors) if manifest.get("optimizer") else None
    lr_scheduler = join(manifest["lr_scheduler"], tensors) if manifest.get("lr_scheduler") is not None else None
    return {"tag_dir": tag_dir, "manifest": manifest, "module": module, "masters": masters, "optimizer": optimizer,
            "lr_scheduler": lr_scheduler, "client_state": join(manifest.get("client_state") or {}, tensors)}


def _zero_stage(config: dict[str, Any]) -> int:
    zero = config.get("zero_optimization") or {}
    return int(zero.get("stage", 0) or 0) if isinstance(zero, dict) else 0


class _DeepSpeedObject:
    """An object written under the DeepSpeed class name :attr:`deepspeed_global` (as DeepSpeed's own files hold
    its ``LossScaler``), its attributes as the pickled state: DeepSpeed need not be installed to write it, and
    readers that admit exactly DeepSpeed's classes (microspeed's ``import-deepspeed``) read it back."""

    deepspeed_global = ""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


class _LossScaler(_DeepSpeedObject):
    deepspeed_global = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class _DynamicLossScaler(_DeepSpeedObject):
    deepspeed_global = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class _Pickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    """``torch.save``'s pickler, writing a :class:`_DeepSpeedObject` class as the DeepSpeed global it stands for."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        """DeepSpeed's module and class name for our stand-ins; everything else as pickle does."""
        if isinstance(obj, type) and issubclass(obj, _DeepSpeedObject):
            module, _, qualname = obj.deepspeed_global.rpartition(".")
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


_PICKLE_MODULE = types.ModuleType("microspeed_export_pickle", "torch.save's pickle_module, with :class:`_Pickler`.")
_PICKLE_MODULE.Pickler = _Pickler  # type: ignore[attr-defined]


def _loss_scaler(manifest: dict[str, Any]) -> _DeepSpeedObject:
    scaler = ((manifest.get("plugin_states") or {}).get("mixed_precision") or {}).get("scaler") or {}
    dynamic = "cur_iter" in scaler
    return (_DynamicLossScaler if dynamic else _LossScaler)(
        cur_scale=float(scaler.get("cur_scale", 1.0)), cur_iter=int(scaler.get("cur_iter", 0)),
        last_overflow_iter=int(scaler.get("last_overflow_iter", -1)),
        cur_hysteresis=int(scaler.get("cur_hysteresis", 2)), dynamic=dynamic)


def _groups(ck: dict[str, Any]) -> list[dict[str, Any]]:
    optimizer = ck["optimizer"]
    if not optimizer or not optimizer.get("param_groups"):
        raise CheckpointError(f"{ck['tag_dir']}: the checkpoint holds no optimizer state (saved without an optimizer, "
                              f"or a module-only save); DeepSpeed's ZeRO layout needs the fp32 weights per param "
                              f"group: export it with --zero-stage 0.", ck["tag_dir"])
    return optimizer["param_groups"]


def _fp32(ck: dict[str, Any], name: str) -> torch.Tensor:
    if name in ck["masters"]:
        return ck["masters"][name].float()
    if name not in ck["module"]:
        raise CheckpointError(f"{ck['tag_dir']}: optimizer parameter {name!r} is not a key of the saved module; "
                              f"cannot name its weights in DeepSpeed's layout.", ck["tag_dir"])
    return ck["module"][name].detach().float()


def _model_states(ck: dict[str, Any], stage: int, world: int, param_names: list[list[str]]) -> dict[str, Any]:
    manifest = ck["manifest"]
    model = manifest["model"]
    aliases = dict(model.get("aliases", {}))
    optimized = {n for names in param_names for n in names}
    module = OrderedDict((k, v) for k, v in ck["module"].items() if k not in model.get("extra", {}))
    buffer_names = [k for k in module if k not in optimized and k not in aliases]
    counters = manifest.get("counters") or {}
    state: dict[str, Any] = {
        "module": module,
        "buffer_names": buffer_names,
        "optimizer": None,
        "param_shapes": None,
        "frozen_param_shapes": None,
        "shared_params": None,
        "frozen_param_fragments": None,
        "lr_scheduler": ck["lr_scheduler"],
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(counters.get("skipped_steps", 0)),
        "global_steps": int(counters.get("global_steps", 0)),
        "global_samples": int(counters.get("global_samples", 0)),
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_config": manifest.get("config") or {},
        "ds_version": DEEPSPEED_VERSION,
    }
    if stage > 0:
        state["param_shapes"] = [OrderedDict((n, torch.Size(module[n].shape)) for n in names) for names in param_names]
        state["shared_params"] = aliases
    client = ck["client_state"] if isinstance(ck["client_state"], dict) else {}
    clash = sorted(set(client) & set(state))
    if clash:
        raise CheckpointError(f"{ck['tag_dir']}: client_state keys {clash} collide with DeepSpeed's own checkpoint "
                              f"keys; they cannot be exported.", ck["tag_dir"])
    state.update(client)
    return state


def _stage0_optimizer(ck: dict[str, Any]) -> dict[str, Any] | None:
    optimizer = ck["optimizer"]
    if not optimizer or not optimizer.get("param_groups"):
        return None
    if ck["masters"]:
        raise CheckpointError(f"{ck['tag_dir']}: an fp16/bf16 run keeps fp32 master weights, which DeepSpeed's "
                              f"stage-0 layout stores in its FP16_Optimizer/BF16_Optimizer formats (not written); "
                              f"export with --zero-stage 1 (DeepSpeed's ZeRO-1 layout holds them).", ck["tag_dir"])
    index, groups = 0, []
    state: dict[int, dict[str, Any]] = {}
    for group in optimizer["param_groups"]:
        ids = []
        for name in group["params"]:
            if name in optimizer["state"]:
                state[index] = dict(optimizer["state"][name])
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def _zero_optim_files(ck: dict[str, Any], stage: int, world: int, param_names: list[list[str]]) -> list[dict]:
    """One ``optimizer_state_dict`` per rank, as DeepSpeed 0.19.8's ZeRO-1/2 optimizer writes them."""
    optimizer = ck["optimizer"]
    align = 2 * world
    per_rank: list[dict[str, Any]] = [{"single_partition_of_fp32_groups": [], "group_paddings": [],
                                       "base": {"state": {}, "param_groups": []}} for _ in range(world)]
    for g, (group, names) in enumerate(zip(optimizer["param_groups"], param_names, strict=True)):
        flat = torch.cat([_fp32(ck, n).reshape(-1) for n in names]) if names else torch.zeros(0)
        total = flat.numel()
        padded = align * math.ceil(total / align) if total else align
        part = padded // world
        flat = torch.cat([flat, flat.new_zeros(padded - total)])
        states = [optimizer["state"].get(n) or {} for n in names]
        keys = list(states[0]) if states and all(states) else []
        for r in range(world):
            lo, hi = r * part, (r + 1) * part
            kept = max(0, min(hi, total) - lo)
            rank = per_rank[r]
            rank["single_partition_of_fp32_groups"].append(flat[lo:lo + kept].clone())
            rank["group_paddings"].append(part - kept)
            entry: dict[str, Any] = {}
            for key in keys:
                values = [s[key] for s in states]
                if isinstance(values[0], torch.Tensor) and values[0].dim() > 0:
                    whole = torch.cat([v.reshape(-1).float() for v in values])
                    whole = torch.cat([whole, whole.new_zeros(padded - total)])
                    entry[key] = whole[lo:hi].clone()
                else:
                    v = values[0]
                    entry[key] = v.clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            if entry:
                rank["base"]["state"][g] = entry
            rank["base"]["param_groups"].append({**{k: v for k, v in group.items() if k != "params"}, "params": [g]})
    scaler = _loss_scaler(ck["manifest"])
    clip = float((ck["manifest"].get("config") or {}).get("gradient_clipping", 0.0) or 0.0)
    return [{
        "loss_scaler": scaler,
        "dynamic_loss_scale": scaler.dynamic,
        "overflow": False,
        "clip_grad": clip,
        "base_optimizer_state": rank["base"],
        "single_partition_of_fp32_groups": rank["single_partition_of_fp32_groups"],
        "zero_stage": stage,
        "group_paddings": rank["group_paddings"],
        "param_alignment_paddings": [[0] * len(names) for names in param_names],
        "partition_count": world,
        "ds_version": DEEPSPEED_VERSION,
    } for rank in per_rank]


def _out_tag_dir(ck: dict[str, Any], out_dir: str) -> str:
    """``out_dir/<tag>`` for the manifest's tag, which must be a plain folder name that stays inside ``out_dir``."""
    holder = os.path.join(ck["tag_dir"], MANIFEST)
    out_tag = ck["manifest"].get("tag") or os.path.basename(os.path.normpath(ck["tag_dir"]))
    try:
        if not isinstance(out_tag, str):
            raise CheckpointError(f"a tag is a string, not a {type(out_tag).__name__}.")
        _check_tag(out_tag)
    except CheckpointError as exc:
        raise CheckpointError(f"export-deepspeed: {holder} names the tag {out_tag!r}, which cannot be a folder of "
                              f"{out_dir}: {exc} The manifest is damaged or was crafted; nothing was written.",
                              holder) from exc
    return resolve_inside(out_dir, out_tag, holder)


def _save(obj: Any, path: str) -> None:
    """``torch.save`` into a fresh file renamed over ``path`` (a planted symlink at ``path`` is replaced, not
    followed)."""
    tmp = f"{path}{_TMP}{os.urandom(4).hex()}"
    torch.save(obj, tmp, pickle_module=_PICKLE_MODULE)
    os.replace(tmp, path)


def export_deepspeed(ckpt_dir: str, out_dir: str, tag: str | None = None, zero_stage: int | None = None,
                     world_size: int | None = None, verify: bool = True) -> str:
    """Write the microspeed checkpoint ``ckpt_dir`` (``tag`` or ``latest``) in DeepSpeed's layout under ``out_dir``.

    ``zero_stage`` picks the layout (default: the run's ``zero_optimization.stage``, 3 written as 2);
    ``world_size`` the number of ZeRO partitions (default: the ranks that saved it). Writes
    ``out_dir/<tag>/`` and ``out_dir/latest``; returns a one-line report. The tag is the manifest's: one that
    is not a plain folder name of ``out_dir`` (``../..``, an absolute path, a symlink leading out) is refused
    naming the manifest. ``verify=False`` reads a checkpoint without checksums.
    """
    ck = read_microspeed(ckpt_dir, tag, verify=verify)
    manifest = ck["manifest"]
    config = manifest.get("config") or {}
    source_stage = _zero_stage(config)
    stage = min(source_stage, 2) if zero_stage is None else int(zero_stage)
    if stage not in (0, 1, 2):
        raise CheckpointError(f"export-deepspeed: --zero-stage {zero_stage} is not written (0, 1 or 2; a stage-3 "
                              f"run exports in the stage-2 layout, which DeepSpeed's tools read the same way).")
    world = int(world_size if world_size is not None else manifest.get("world_size") or 1)
    if world < 1:
        raise CheckpointError(f"export-deepspeed: --world-size {world_size} must be at least 1.")
    tag_dir = _out_tag_dir(ck, out_dir)
    out_tag = os.path.basename(tag_dir)
    os.makedirs(tag_dir, exist_ok=True)
    if stage == 0:
        param_names = [list(g["params"]) for g in (ck["optimizer"] or {}).get("param_groups", [])]
        states = _model_states(ck, 0, world, param_names)
        states["optimizer"] = _stage0_optimizer(ck)
        optim_files: list[dict] = []
    else:
        param_names = [list(g["params"]) for g in _groups(ck)]
        states = _model_states(ck, stage, world, param_names)
        optim_files = _zero_optim_files(ck, stage, world, param_names)
    _save(states, os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    for r, osd in enumerate(optim_files):
        _save({"optimizer_state_dict": osd, "ds_config": config, "ds_version": DEEPSPEED_VERSION},
              os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    tmp = os.path.join(out_dir, f".{LATEST}.tmp")
    with open(tmp, "w") as fh:
        fh.write(out_tag)
    os.replace(tmp, os.path.join(out_dir, LATEST))
    note = f" (the run was ZeRO stage {source_stage})" if source_stage != stage else ""
    return (f"exported {ck['tag_dir']} into {tag_dir} in DeepSpeed {DEEPSPEED_VERSION}'s ZeRO stage {stage} "
            f"layout{note}: {len(states['module'])} module tensors, {len(optim_files)} optimizer file(s), "
            f"step {states['global_steps']}; read it with deepspeed.utils.zero_to_fp32 from a DeepSpeed install.")
