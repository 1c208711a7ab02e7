"""Convert a checkpoint written by DeepSpeed (ZeRO stage 0-3) into a microspeed checkpoint.

``microspeed checkpoint import-deepspeed DS_DIR OUT_DIR`` moves a running job over: module weights
always, fp32 master weights (fp16/bf16 runs) and Adam-style optimizer state where DeepSpeed saved
them, counters, LR-scheduler state, the fp16 loss scale and client state. DeepSpeed need not be
installed: its files are read as data (``torch.load(weights_only=True)``), DeepSpeed's own helper objects (loss
scaler, enums) admitted by name and read as plain attribute bags; any other object in a file is refused.

DeepSpeed's layout (read from DeepSpeed 0.19.8's ``runtime/engine.py`` and ZeRO optimizers):

* ``<tag>/mp_rank_00_model_states.pt`` (stages 0-2): ``module`` (the state dict in the training
  dtype), ``buffer_names``, ``optimizer`` (stage 0 only: a torch optimizer state dict; with fp16
  or bf16 the ``FP16_Optimizer`` dict — ``fp32_groups_flat`` and the state over those flat
  tensors — or ``FP16_UnfusedOptimizer``'s, with ``fp32_groups`` per parameter),
  ``param_shapes`` (ZeRO: per param group, the names in flattening order), ``shared_params``
  (tied names), ``lr_scheduler``, ``global_steps``, ``global_samples``, ``skipped_steps``,
  ``ds_config``, ``ds_version``, and the client state's keys.
* ZeRO 1/2: ``<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank,
  ``optimizer_state_dict`` holding ``single_partition_of_fp32_groups`` (rank r's slice of each
  group's flat fp32 buffer, end padding removed), ``base_optimizer_state`` (the torch state over
  those slices, padding kept; ``group_paddings`` says how much), ``param_alignment_paddings``
  (gaps after each parameter in the flat buffer) and ``loss_scaler``. The flat buffer of a group
  is the ranks' slices in rank order; parameters follow in ``param_shapes`` order.
* ZeRO 3: ``<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (module with empty parameters) and
  ``..._optim_states.pt`` with ``fp32_flat_groups``: each parameter is split in ``ceil(n / world)``
  pieces, rank r's piece of every parameter back to back (padding at the end of the last one).

Not supported: model-parallel (``mp_rank_01``...), pipeline-layer and MoE expert files, NVMe
offload folders, ZeRO's ``elastic_checkpoint`` under stage 3. Parameter groups of a stage-0 fp16
(``FP16_Optimizer``) run must be contiguous runs of the module's parameters.
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from microspeed.checkpoint import CheckpointError, new_manifest, read_latest, write_checkpoint
from microspeed.checkpoint.errors import CheckpointNotFoundError
from microspeed.checkpoint.manifest import split

__all__ = ["import_deepspeed", "read_deepspeed"]

_KNOWN_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "num_experts", "ds_autoep_layers", "universal_checkpoint_info",
}


# ------------------------------------------------------------------------- reading the files


class _Foreign:
    """Stands for a DeepSpeed object in a checkpoint: keeps constructor args and attributes, nothing else."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Foreign:
        obj = super().__new__(cls)
        obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def __int__(self) -> int:  # ZeroStageEnum and other int enums
        return int(self.__dict__["_args"][0])


DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The DeepSpeed classes DeepSpeed 0.19.8's checkpoint files hold (``get_unsafe_globals_in_checkpoint`` over
saves at ZeRO stages 0-3 in fp32, bf16 and fp16): read as attribute bags, DeepSpeed need not be installed."""

_STAND_INS: list[tuple[type, str]] = [
    (type(name.rsplit(".", 1)[1], (_Foreign,), {"__module__": f"deepspeed-stub:{name.rsplit('.', 1)[0]}"}), name)
    for name in DEEPSPEED_GLOBALS]


def _load(path: str) -> dict[str, Any]:
    """One DeepSpeed ``.pt`` file as data: ``torch.load(weights_only=True)``, DeepSpeed's classes as stand-ins.

    A file that names any other global (a class or function torch's weights-only unpickler does not admit, and
    that is not one of :data:`DEEPSPEED_GLOBALS`) is refused with a :class:`CheckpointError` saying it is not
    data; nothing in it is imported or called.
    """
    allowed = {name for _cls, name in _STAND_INS}
    try:
        foreign = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in allowed]
    except Exception:  # not a zip checkpoint (the legacy format, or foreign bytes): torch.load below judges it
        foreign = []
    if foreign:
        raise CheckpointError(f"{path} is not data: it names {', '.join(sorted(foreign)[:4])}, which a DeepSpeed "
                              f"checkpoint never holds; microspeed reads DeepSpeed files with torch.load("
                              f"weights_only=True) and never runs what they hold. Load a checkpoint from a trusted "
                              f"source.", path)
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        text = str(exc)
        refused = "weights_only" in text.lower() or "Weights only load failed" in text
        kind = "is not data (torch's weights-only unpickler refused it)" if refused else \
            "is not a readable DeepSpeed checkpoint file (truncated or foreign file)"
        raise CheckpointError(f"{path} {kind}: {type(exc).__name__}: {text[:600]}", path) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict, found {type(obj).__name__}.", path)
    return obj


def _rank_of(path: str) -> int:
    match = re.search(r"zero_pp_rank_(\d+)_mp_rank_", os.path.basename(path))
    return int(match.group(1)) if match else 0


def _tag_dir(ds_dir: str, tag: str | None) -> str:
    if tag is not None:
        return os.path.join(ds_dir, str(tag))
    if glob.glob(os.path.join(ds_dir, "*_model_states.pt")):
        return ds_dir
    latest = read_latest(ds_dir)
    if latest is None:
        raise CheckpointError(f"{ds_dir}: no 'latest' file and no *_model_states.pt: not a DeepSpeed checkpoint "
                              f"folder (pass the tag folder, or --tag).", ds_dir)
    return os.path.join(ds_dir, latest)


# ------------------------------------------------------------------------- the reconstruction


def _walk(flat: torch.Tensor, shapes: dict[str, Any], paddings: Sequence[int] | None, where: str) -> dict:
    """Cut a group's flat buffer into parameters (in ``shapes`` order, skipping alignment gaps)."""
    out, offset = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = math.prod(shape)
        if offset + n > flat.numel():
            raise CheckpointError(f"{where}: the flat buffer ({flat.numel()} elements) is too short for "
                                  f"{name} at offset {offset}.", where)
        out[name] = flat[offset:offset + n].view(tuple(shape)).clone()
        offset += n + (paddings[i] if paddings is not None else 0)
    return out


def _per_param_state(states: list[dict[str, Any]], lean: list[int], cut: Any) -> dict[str, dict[str, Any]]:
    """Merge the ranks' state of one flat group and cut it per parameter (scalars are shared)."""
    merged: dict[str, dict[str, Any]] = {}
    keys = states[0].keys() if states else []
    for key in keys:
        values = [s[key] for s in states]
        if isinstance(values[0], torch.Tensor) and values[0].dim() > 0:
            flat = torch.cat([v.reshape(-1)[:n] for v, n in zip(values, lean, strict=True)])
            for name, t in cut(flat).items():
                merged.setdefault(name, {})[key] = t
        else:
            for name in cut(None):
                merged.setdefault(name, {})[key] = values[0].clone() if isinstance(values[0], torch.Tensor) \
                    else values[0]
    return merged


def _groups(opt_sd: dict[str, Any], names_per_group: list[list[str]]) -> list[dict[str, Any]]:
    groups = []
    for g, group in enumerate(opt_sd["param_groups"]):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": names_per_group[g] if g < len(names_per_group) else []})
    return groups


def _zero12(model_states: dict, optim: list[dict], where: str) -> tuple[dict, dict, list]:
    """(fp32 masters, per-param optimizer state, param groups) from ZeRO 1/2 (or bf16 optimizer) files."""
    shapes: list[dict[str, Any]] = model_states["param_shapes"]
    osds = [o["optimizer_state_dict"] for o in optim]
    lean_format = "zero_stage" in osds[0]  # ZeRO 1/2 drop the end padding of the fp32 slices; bf16_optimizer keeps it
    masters: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for g, group_shapes in enumerate(shapes):
        paddings = (osds[0].get("param_alignment_paddings") or [None] * len(shapes))[g]
        parts = [o["single_partition_of_fp32_groups"][g] for o in osds]
        pads = [o.get("group_paddings", [0] * len(shapes))[g] for o in osds]
        lean = [p.numel() - (0 if lean_format else pad) for p, pad in zip(parts, pads, strict=True)]
        flat = torch.cat([p[:n] for p, n in zip(parts, lean, strict=True)])

        def cut(buf: torch.Tensor | None, shapes_: dict = group_shapes, pads_: Any = paddings) -> dict:
            return dict.fromkeys(shapes_) if buf is None else _walk(buf, shapes_, pads_, where)

        masters.update(cut(flat))
        base = [o["base_optimizer_state"] for o in osds]
        rank_states = [b[g] if isinstance(b, list) else b["state"].get(g, {}) for b in base]
        state.update(_per_param_state(rank_states, lean, cut))
    base0 = osds[0]["base_optimizer_state"]
    groups = _groups(base0 if isinstance(base0, dict) else {"param_groups": []}, [list(s) for s in shapes])
    return masters, state, groups


def _zero3(model_states: dict, optim: list[dict], where: str) -> tuple[dict, dict, list]:
    shapes: list[dict[str, Any]] = model_states["param_shapes"]
    osds = [o["optimizer_state_dict"] for o in optim]
    world = len(osds)
    order = {name: shape for group in shapes for name, shape in group.items()}

    def gather(per_rank: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape in order.items():
            n = math.prod(shape)
            piece = math.ceil(n / world)
            full = torch.cat([flat[offset:offset + piece] for flat in per_rank])[:n]
            out[name] = full.view(tuple(shape)).clone()
            offset += piece
        return out

    masters = gather([torch.cat([t.reshape(-1) for t in o["fp32_flat_groups"]]) for o in osds])
    states = [o["optimizer_state_dict"]["state"] for o in osds]
    state: dict[str, dict[str, Any]] = {}
    for key, value in (states[0].get(0) or {}).items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            per_rank = [torch.cat([s[i][key].reshape(-1) for i in sorted(s)]) for s in states]
            for name, t in gather(per_rank).items():
                state.setdefault(name, {})[key] = t
        else:
            for name in order:
                state.setdefault(name, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
    groups = _groups(osds[0]["optimizer_state_dict"], [list(s) for s in shapes])
    return masters, state, groups


def _stage0(model_states: dict, names: list[str], where: str) -> tuple[dict, dict, list]:
    opt = model_states.get("optimizer")
    if not opt:
        return {}, {}, []
    module = model_states["module"]
    if "optimizer_state_dict" not in opt:  # a plain torch optimizer over the module's parameters
        return {}, *_by_index(opt, names, module, where)
    inner = opt["optimizer_state_dict"]
    if "fp32_groups" in opt:  # FP16_UnfusedOptimizer: fp32 copies per parameter
        flat_names = names[:sum(len(g) for g in opt["fp32_groups"])]
        masters = dict(zip(flat_names, [t for g in opt["fp32_groups"] for t in g], strict=True))
        state, groups = _by_index(inner, names, module, where)
        return masters, state, groups
    if "fp32_groups_flat" in opt:  # FP16_Optimizer: one flat fp32 buffer per group
        masters, state, per_group, start = {}, {}, [], 0
        for g, flat in enumerate(opt["fp32_groups_flat"]):
            shapes, total = {}, 0
            while total < flat.numel() and start < len(names):
                shapes[names[start]] = tuple(module[names[start]].shape)
                total += module[names[start]].numel()
                start += 1
            if total != flat.numel():
                raise CheckpointError(f"{where}: fp16 param group {g} ({flat.numel()} elements) is not a contiguous "
                                      f"run of the module's parameters; cannot name its values.", where)

            def cut(buf: torch.Tensor | None, shapes_: dict = shapes) -> dict:
                return dict.fromkeys(shapes_) if buf is None else _walk(buf, shapes_, None, where)

            masters.update(cut(flat))
            state.update(_per_param_state([inner["state"].get(g, {})] if inner["state"].get(g) else [],
                                          [flat.numel()], cut))
            per_group.append(list(shapes))
        return masters, state, _groups(inner, per_group)
    raise CheckpointError(f"{where}: unknown stage-0 optimizer layout (keys {sorted(opt)}).", where)


def _by_index(opt_sd: dict, names: list[str], module: dict, where: str) -> tuple[dict, list]:
    """A torch optimizer state dict whose integer ids follow the module's parameter order."""
    state: dict[str, dict[str, Any]] = {}
    for idx, st in opt_sd["state"].items():
        if idx >= len(names):
            raise CheckpointError(f"{where}: optimizer state for parameter #{idx}, but the module has {len(names)} "
                                  f"parameters.", where)
        name = names[idx]
        for key, value in st.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != module[name].shape:
                raise CheckpointError(f"{where}: optimizer state #{idx} {key} has shape {tuple(value.shape)}, "
                                      f"parameter {name} {tuple(module[name].shape)}: the param groups do not "
                                      f"follow the module's parameter order.", where)
        state[name] = dict(st)
    return state, _groups(opt_sd, [[names[i] for i in g["params"]] for g in opt_sd["param_groups"]])


def _torch_step(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``step`` as ``torch.optim`` keeps it (a float32 scalar tensor); DeepSpeed's CPU Adam saves a Python int."""
    for st in state.values():
        step = st.get("step")
        if step is not None and not isinstance(step, torch.Tensor):
            st["step"] = torch.tensor(float(step), dtype=torch.float32)
    return state


def _scaler_state(model_states: dict, optim: list[dict], ds_config: dict) -> dict | None:
    fp16 = ds_config.get("fp16") or {}
    if not fp16.get("enabled"):
        return None
    source: dict[str, Any] = {}
    if optim:
        scaler = optim[0]["optimizer_state_dict"].get("loss_scaler")
        source = dict(getattr(scaler, "__dict__", {}) or {})
        source["dynamic"] = optim[0]["optimizer_state_dict"].get("dynamic_loss_scale", source.get("dynamic"))
    elif isinstance(model_states.get("optimizer"), dict):
        source = dict(model_states["optimizer"])
        source["dynamic"] = source.get("dynamic_loss_scale")
    if "cur_scale" not in source:
        return None
    if not (fp16.get("loss_scale", 0) == 0 and source.get("dynamic", True)):
        return {"cur_scale": float(source["cur_scale"])}
    return {"cur_scale": float(source["cur_scale"]), "cur_iter": int(source.get("cur_iter", 0)),
            "last_overflow_iter": int(source.get("last_overflow_iter", -1)),
            "cur_hysteresis": int(source.get("cur_hysteresis", fp16.get("hysteresis", 2)))}


def read_deepspeed(ds_dir: str, tag: str | None = None) -> dict[str, Any]:
    """Read a DeepSpeed checkpoint into names: ``module``, ``masters``, ``optimizer_state``, ``param_groups``...

    Returns a dict with ``tag_dir``, ``tag``, ``stage``, ``world_size``, ``module`` (state dict in the
    training dtype, tied names aliased), ``aliases``, ``masters`` (fp32, by name; empty for fp32
    runs without ZeRO), ``optimizer_state`` (by name), ``param_groups`` (with names),
    ``lr_scheduler``, ``counters``, ``ds_config``, ``ds_version``, ``scaler`` and ``client_state``.
    """
    tag_dir = _tag_dir(ds_dir, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointNotFoundError(f"import-deepspeed: {tag_dir} does not exist.", tag_dir)
    others = [p for p in glob.glob(os.path.join(tag_dir, "*mp_rank_*")) if not re.search(r"mp_rank_00_", p)]
    if others:
        raise CheckpointError(f"{tag_dir}: model-parallel checkpoints ({os.path.basename(others[0])}) are not "
                              f"supported by import-deepspeed.", tag_dir)
    plain = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    zero3_models = sorted(glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_00_model_states.pt")), key=_rank_of)
    if os.path.isfile(plain):
        model_states, where = _load(plain), plain
    elif zero3_models:
        model_states, where = _load(zero3_models[0]), zero3_models[0]
    else:
        raise CheckpointError(f"{tag_dir}: no mp_rank_00_model_states.pt nor zero_pp_rank_*_model_states.pt: "
                              f"not a DeepSpeed checkpoint tag folder.", tag_dir)
    optim_files = sorted(glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*_mp_rank_00_optim_states.pt")), key=_rank_of)
    optim = [_load(p) for p in optim_files]
    ds_config = model_states.get("ds_config") or (optim[0].get("ds_config") if optim else None) or {}
    if not isinstance(ds_config, dict):
        ds_config = dict(getattr(ds_config, "__dict__", {}))
    module: dict[str, Any] = dict(model_states["module"])
    buffers = set(model_states.get("buffer_names") or [])
    aliases: dict[str, str] = dict(model_states.get("shared_params") or {})
    seen: dict[tuple, str] = {}
    for k, t in module.items():
        if isinstance(t, torch.Tensor) and t.numel() and k not in aliases:
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
            if ident in seen:
                aliases[k] = seen[ident]
            else:
                seen[ident] = k
    names = [k for k in module if k not in buffers and k not in aliases]

    stage = 0
    if optim:
        osd = optim[0]["optimizer_state_dict"]
        stage = int(osd["zero_stage"]) if "zero_stage" in osd else 1
        expected = osd.get("partition_count", len(optim))
        expected = max(expected) if isinstance(expected, list) else int(expected)
        if expected != len(optim):
            raise CheckpointError(f"{tag_dir}: {len(optim)} optimizer files, the checkpoint was written by "
                                  f"{expected} ranks (a file is missing?).", tag_dir)
        masters, state, groups = (_zero3 if stage == 3 else _zero12)(model_states, optim, where)
    else:
        masters, state, groups = _stage0(model_states, names, where)
    state = _torch_step(state)

    if stage == 3:  # parameters are empty placeholders in the module: the fp32 values are the weights
        frozen = model_states.get("frozen_param_shapes") or {}
        for name, shape in frozen.items():
            frags = [_load(p)["frozen_param_fragments"][name] for p in zero3_models]
            masters[name] = torch.cat([f.reshape(-1) for f in frags])[:math.prod(shape)].view(tuple(shape))
        for name, value in masters.items():
            if name in module:
                module[name] = value.to(module[name].dtype)
    float_dtypes = {t.dtype for k, t in module.items() if k in masters and isinstance(t, torch.Tensor)}
    if float_dtypes <= {torch.float32}:
        masters = {}  # fp32 training: the module's weights are the masters
    counters = {k: int(model_states.get(k, 0) or 0) for k in ("global_steps", "global_samples", "skipped_steps")}
    gas = int(ds_config.get("gradient_accumulation_steps", 1) or 1)
    counters["micro_steps"] = counters["global_steps"] * gas
    return {
        "tag_dir": tag_dir, "tag": os.path.basename(os.path.normpath(tag_dir)), "stage": stage,
        "world_size": int(model_states.get("dp_world_size") or len(optim) or 1), "module": module,
        "aliases": aliases, "masters": masters, "optimizer_state": state, "param_groups": groups,
        "lr_scheduler": model_states.get("lr_scheduler"), "counters": counters, "ds_config": ds_config,
        "gradient_accumulation_steps": gas, "ds_version": model_states.get("ds_version"),
        "scaler": _scaler_state(model_states, optim, ds_config),
        "client_state": {k: v for k, v in model_states.items() if k not in _KNOWN_KEYS},
    }


def import_deepspeed(ds_dir: str, out_dir: str, tag: str | None = None) -> str:
    """Convert the DeepSpeed checkpoint in ``ds_dir`` (``tag`` or its ``latest``) into ``out_dir``.

    Writes ``out_dir/<same tag>`` and ``out_dir/latest``, without a process group; returns a
    one-paragraph report of what was carried over.
    """
    ds = read_deepspeed(ds_dir, tag)
    tensors: dict[str, torch.Tensor] = {}
    extra = {}
    for k, v in ds["module"].items():
        if k in ds["aliases"]:
            continue
        if isinstance(v, torch.Tensor):
            tensors[f"model/{k}"] = v.contiguous()
        else:
            extra[k] = split(v, f"model_extra/{k}", tensors)
    for name, t in ds["masters"].items():
        tensors[f"master/{name}"] = t.float().contiguous()
    optimizer = None
    if ds["param_groups"]:
        state = {name: split(st, f"optim/{name}", tensors) for name, st in ds["optimizer_state"].items()}
        groups = [{**split({k: v for k, v in g.items() if k != "params"}, f"optim_groups/{i}", tensors),
                   "params": g["params"]} for i, g in enumerate(ds["param_groups"])]
        optimizer = {"class": None, "param_groups": groups, "state": state, "masters": list(ds["masters"])}
    config = ds["ds_config"] if isinstance(ds["ds_config"], dict) else {}
    manifest = new_manifest(ds["tag"], ds["world_size"], config, ds["counters"], ds["gradient_accumulation_steps"])
    manifest.update({
        "source": {"kind": "deepspeed", "version": ds["ds_version"], "zero_stage": ds["stage"],
                   "path": os.path.abspath(ds["tag_dir"])},
        "model": {"keys": list(ds["module"]), "aliases": ds["aliases"], "extra": extra},
        "optimizer": optimizer,
        "lr_scheduler": split(ds["lr_scheduler"], "lr_scheduler", tensors) if ds["lr_scheduler"] else None,
        "plugin_states": {"mixed_precision": {"scaler": ds["scaler"]}} if ds["scaler"] else {},
        "client_state": split(ds["client_state"], "client", tensors),
    })
    path = write_checkpoint(out_dir, ds["tag"], tensors, manifest)
    n_state = len(ds["optimizer_state"])
    return (f"imported DeepSpeed {ds['ds_version']} ZeRO stage {ds['stage']} checkpoint {ds['tag_dir']} "
            f"({ds['world_size']} rank(s)) into {path}: {len(ds['module'])} module tensors, "
            f"{len(ds['masters'])} fp32 masters, optimizer state for {n_state} parameters, "
            f"step {ds['counters']['global_steps']}.")
