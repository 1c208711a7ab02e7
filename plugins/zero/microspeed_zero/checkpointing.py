"""ZeRO state in checkpoints: every tensor keyed like the full one, written as this rank's pieces.

A partitioned tensor is saved through :func:`microspeed.checkpoint.flat_shard`: a sharded tensor
of the parameter's full shape whose local pieces are views into this rank's partition. The keys
are the core's (``model/<fqn>``, ``master/<fqn>``, ``optim/<fqn>/<name>``), so a checkpoint written
at stage ``s`` on ``N`` ranks loads at stage ``s'`` on ``M`` ranks, at stage 0, or through
``microspeed checkpoint consolidate``; and loading reads each rank's pieces straight into its
partition, never a whole tensor.

Under tensor parallelism a parameter is itself a shard of a larger tensor: the pieces here are of
that shard (its ``ds_shape`` at stage 3), and the core moves them into the full tensor with the
placement another plugin states for the shard (``microspeed_checkpoint_placements``), so a
checkpoint of pp × tp × dp with any stage holds every tensor whole-shaped and once.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from microspeed.plugin_api import CheckpointError, CheckpointWarning, TensorRef, flat_shard
from microspeed.plugin_api import split_tensor_refs as split


def _sharded(rt: Any, seg: Any, i: int, local: torch.Tensor) -> Any:
    """``params[i]`` of ``seg`` as a sharded tensor whose local piece comes from ``local`` (this rank's slice)."""
    p = seg.params[i]
    shape = getattr(p, "ds_shape", tuple(p.shape))
    world_global = dist.get_world_size() if dist.is_initialized() else 1
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(world_global)]
    for q in range(seg.world):
        rng = seg.param_range(i, q)
        if rng is not None:
            ranges[seg.global_rank(q)] = [rng]
    mine = seg.param_range(i, seg.rank)
    if mine is None:
        piece = local[:0]
    else:
        s = seg.offsets[i] + mine[0] - seg.slice_of(seg.rank)[0]
        piece = local[s:s + mine[1] - mine[0]]
    return flat_shard(piece, shape, ranges, seg.global_rank(seg.rank))


def _params(rt: Any) -> list[tuple[Any, int, torch.nn.Parameter]]:
    return [(seg, i, p) for seg in rt.segments for i, p in enumerate(seg.params)]


def module_tensors(rt: Any) -> dict[str, Any] | None:
    """Stage 3: the module's state dict with each parameter as this rank's shard; stages 1, 2: ``None``."""
    if rt.stage3 is None:
        rt.wait_gathers()
        return None
    rt.stage3.wait_all()
    sharded = {id(p): _sharded(rt, seg, i, rt.stage3.local_shard(seg.index)) for seg, i, p in _params(rt)}
    by_name = dict(rt.engine.module.named_parameters(remove_duplicate=False))
    out = {}
    for k, v in rt.engine.module.state_dict(keep_vars=True).items():
        p = by_name.get(k)
        out[k] = sharded[id(p)] if p is not None and id(p) in sharded else v.detach() if isinstance(v, torch.Tensor) \
            else v
    return out


def _run_of(rt: Any, seg: Any, offset: int) -> tuple[Any, int, torch.Tensor] | None:
    for rseg, _g, start, end, view in rt.optimizer.runs:
        if rseg is seg and start <= offset < end:
            return start, end, view
    return None


def _state_local(rt: Any, seg: Any, i: int, name: str) -> torch.Tensor:
    """A tensor laid out like this rank's slice of ``seg`` whose piece of ``params[i]`` is the live state ``name``."""
    mine = seg.param_range(i, seg.rank)
    base = torch.empty(0)
    if mine is None:
        return base
    s = seg.offsets[i] + mine[0] - seg.slice_of(seg.rank)[0]
    start, _end, view = _run_of(rt, seg, s)
    state = rt.optimizer.inner.state[view][name]
    # present the run's state as if it started at offset `start` of the slice
    return _Offset(state, start)


class _Offset:
    """A run's state tensor addressed by slice offsets (``t[a:b]`` = state[a - start: b - start])."""

    def __init__(self, tensor: torch.Tensor, start: int) -> None:
        self.tensor, self.start = tensor, start

    def __getitem__(self, item: slice) -> torch.Tensor:
        return self.tensor[item.start - self.start:item.stop - self.start]


def _mixed(rt: Any) -> bool:
    return any(m.data_ptr() != rt.local_params(rt.segments[i]).data_ptr() for i, m in rt.masters.items())


def save_optimizer(rt: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """Write masters and partitioned optimizer state; return the manifest part (FQN-keyed, as stage 0's).

    With NVMe offload the state is read into memory for the save (``swapper.resident()``); the
    tensors handed to the writer keep those buffers alive until they are written.
    """
    if rt.swapper is not None:
        with rt.swapper.resident():
            return _save_optimizer(rt, tensors)
    return _save_optimizer(rt, tensors)


def _save_optimizer(rt: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    opt = rt.optimizer
    names = rt.names
    groups = []
    for g, group in enumerate(opt.param_groups):
        hyper = split({k: v for k, v in group.items() if k != "params"}, f"optim_groups/{g}", tensors)
        groups.append({**hyper, "params": [names[id(p)] for p in group["params"]]})
    run_states = opt.run_states()
    tensor_names = sorted({k for st in run_states for k, v in st.items()
                           if isinstance(v, torch.Tensor) and v.dim() > 0})
    scalars: dict[int, dict[str, Any]] = {}
    for (_s, g, *_), st in zip(opt.runs, run_states, strict=True):
        scalars.setdefault(g, {k: v for k, v in st.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)})
    mixed = _mixed(rt)
    state: dict[str, Any] = {}
    masters = []
    for seg, i, p in _params(rt):
        g = seg.groups[i]
        if g is None or seg.index not in rt.masters:
            continue
        fqn = names[id(p)]
        if mixed:
            tensors[f"master/{fqn}"] = _sharded(rt, seg, i, rt.masters[seg.index])
            masters.append(fqn)
        if not tensor_names and not scalars:
            continue
        entry = {k: split(v, f"optim/{fqn}/{k}", tensors) for k, v in scalars.get(g, {}).items()}
        for name in tensor_names:
            key = f"optim/{fqn}/{name}"
            tensors[key] = _sharded(rt, seg, i, _state_local(rt, seg, i, name)) if seg.param_range(i, seg.rank) \
                else _sharded(rt, seg, i, torch.empty(0))
            entry[name] = TensorRef(key)
        state[fqn] = entry
    return {"class": opt.base_class.__name__, "param_groups": groups, "state": state, "masters": masters}


def load_optimizer(rt: Any, saved: dict[str, Any] | None, reader: Any, load_states: bool, strict: bool,
                   after: list[Any]) -> bool:
    """Read masters (always) and, with ``load_states``, the partitioned optimizer state, into this rank's pieces."""
    opt = rt.optimizer
    if rt.swapper is not None:  # NVMe: read into resident buffers, then write them to the files
        rt.swapper.materialize(load_states)
        after.append(rt.swapper.evict)
    manifest = reader.manifest
    aliases = manifest.get("model", {}).get("aliases", {})
    saved_keys = set(manifest.get("model", {}).get("keys", []))
    for seg, i, p in _params(rt):
        if seg.groups[i] is None or seg.index not in rt.masters:
            continue
        master = rt.masters[seg.index]
        if master.data_ptr() == rt.local_params(seg).data_ptr():
            continue  # fp32: the master is the parameter, read with the module
        fqn = rt.names[id(p)]
        target = _sharded(rt, seg, i, master)
        if reader.has(f"master/{fqn}") and rt.cfg.load_from_fp32_weights:
            reader.into(f"master/{fqn}", target, f"master {fqn}")
        elif fqn in saved_keys:
            reader.into(f"model/{aliases.get(fqn, fqn)}", target, f"master {fqn}")
    if rt.stage3 is not None:
        after.append(rt.stage3.refresh_persistent)
    if not load_states or saved is None:
        return True
    if len(saved["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(f"load_checkpoint: {reader.tag_dir}: the optimizer has {len(opt.param_groups)} param "
                              f"groups, the checkpoint {len(saved['param_groups'])}. Build the optimizer with the same "
                              f"groups, or pass load_optimizer_states=False.", reader.tag_dir)
    missing = []
    for (seg, _g, start, end, view) in opt.runs:
        st = opt.inner.state[view]
        first = next((rt.names[id(seg.params[i])] for i, s0 in _run_params(seg, seg.rank, start, end)), None)
        tree = saved["state"].get(first, {}) if first else {}
        for name, value in tree.items():
            if isinstance(value, TensorRef):
                st.setdefault(name, torch.zeros_like(view))
            else:
                st[name] = value.clone() if isinstance(value, torch.Tensor) else value
    for seg, i, p in _params(rt):
        if seg.groups[i] is None or seg.index not in rt.masters:
            continue
        fqn = rt.names[id(p)]
        tree = saved["state"].get(fqn)
        if tree is None:
            missing.append(fqn)
            continue
        for name, value in tree.items():
            if not isinstance(value, TensorRef):
                continue
            if seg.param_range(i, seg.rank) is None:
                local: Any = torch.empty(0)
            else:
                local = _state_local(rt, seg, i, name)
            reader.into(value.key, _sharded(rt, seg, i, local), f"optimizer state {fqn}/{name}")
    if missing:
        msg = f"load_checkpoint: {reader.tag_dir}: no optimizer state saved for {missing[:10]}"
        if strict:
            raise CheckpointError(msg + "; pass load_module_strict=False to start those from zero, or "
                                  "load_optimizer_states=False.", reader.tag_dir)
        warnings.warn(msg, CheckpointWarning, stacklevel=4)

    def apply_groups() -> None:
        for group, old in zip(opt.param_groups, saved["param_groups"], strict=True):
            for k, v in old.items():
                if k != "params" and not isinstance(v, TensorRef):
                    group[k] = v

    after.append(apply_groups)
    return True


def _run_params(seg: Any, rank: int, start: int, end: int) -> list[tuple[int, int]]:
    return [(i, s) for i, _a, s in seg.pieces(rank) if start <= s < end]
