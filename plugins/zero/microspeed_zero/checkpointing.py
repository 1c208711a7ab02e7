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
from microspeed_zero.aio import aligned_empty


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


class FilePiece:
    """Elements ``[start, end)`` of the tensor ``key`` of an NVMe store, as an on-demand checkpoint piece
    (:class:`~microspeed.plugin_api.OnDemandPiece`); ``piece[a:b]`` is a narrower one."""

    def __init__(self, store: Any, key: str, dtype: torch.dtype, start: int, end: int) -> None:
        self.store, self.key, self.dtype, self.start, self.end = store, key, dtype, int(start), int(end)
        self.numel = self.end - self.start

    def __getitem__(self, item: slice) -> FilePiece:
        a, b, _ = item.indices(self.numel)
        return FilePiece(self.store, self.key, self.dtype, self.start + a, self.start + max(a, b))

    def read_into(self, out: torch.Tensor, offset: int = 0) -> None:
        """Fill ``out`` (1-D, contiguous) with this piece's elements ``[offset, offset + out.numel())``."""
        if offset + out.numel() > self.numel:
            raise ValueError(f"FilePiece.read_into: elements {offset}..{offset + out.numel()} of {self.numel}")
        self.store.read(self.key, out, offset=self.start + int(offset))


def module_tensors(rt: Any, saving: bool = False) -> dict[str, Any] | None:
    """Stage 3: the module's state dict with each parameter as this rank's shard; stages 1, 2: ``None``.

    A shard kept in its file (``offload_param: nvme``) is, when ``saving``, a :class:`FilePiece` read as it is
    written; when loading with an optimizer, a piece of nothing (the core reads nothing into it) and the segment
    is *deferred*: :func:`load_optimizer` fills the deferred shards one at a time (:func:`_load_deferred_shards`).
    Without an optimizer (that hook is not called) such a shard is read in whole, filled, and written back after
    the load (``refresh_persistent``).
    """
    if rt.stage3 is None:
        rt.wait_gathers()
        return None
    s3 = rt.stage3
    s3.wait_all()
    s3.deferred = set()

    def sharded_param(seg: Any, i: int) -> Any:
        if s3.in_file(seg.index):
            if saving:
                return _sharded(rt, seg, i, FilePiece(s3.store, f"shard{seg.index}", seg.dtype, 0, seg.shard_size))
            if rt.optimizer is not None and rt.engine.optimizer is not None:  # load_optimizer will be called
                s3.deferred.add(seg.index)
                p = seg.params[i]
                world = dist.get_world_size() if dist.is_initialized() else 1
                return flat_shard(torch.empty(0, dtype=seg.dtype), getattr(p, "ds_shape", tuple(p.shape)),
                                  [[] for _ in range(world)], seg.global_rank(seg.rank))
        return _sharded(rt, seg, i, s3.local_shard(seg.index))

    sharded = {id(p): sharded_param(seg, i) for seg, i, p in _params(rt)}
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

    With NVMe offload the masters and state tensors are handed as on-demand pieces
    (:class:`~microspeed_zero.swap.SwapPiece`) that the core's writer reads from the swap files item by item
    through its bounded buffer, never the whole partition (the save is then synchronous); the checkpoint is
    the same as one written from memory.
    """
    opt = rt.optimizer
    names = rt.names
    swapper = rt.swapper
    groups = []
    for g, group in enumerate(opt.param_groups):
        hyper = split({k: v for k, v in group.items() if k != "params"}, f"optim_groups/{g}", tensors)
        groups.append({**hyper, "params": [names[id(p)] for p in group["params"]]})
    if swapper is not None:  # what resident() would present, without reading it
        run_names = [swapper.run_tensor_names(r) for r in range(len(opt.runs))]
        run_scalars = [swapper.run_scalars(r) for r in range(len(opt.runs))]
    else:
        run_states = opt.run_states()
        run_names = [tuple(k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
                     for st in run_states]
        run_scalars = [{k: v for k, v in st.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
                       for st in run_states]
    tensor_names = sorted({k for ns in run_names for k in ns})
    scalars: dict[int, dict[str, Any]] = {}
    for (_s, g, *_), sc in zip(opt.runs, run_scalars, strict=True):
        scalars.setdefault(g, sc)
    mixed = swapper is not None or _mixed(rt)  # an offloaded optimizer's masters are never the parameters
    state: dict[str, Any] = {}
    masters = []
    for seg, i, p in _params(rt):
        g = seg.groups[i]
        if g is None or not _has_master(rt, seg):
            continue
        fqn = names[id(p)]
        if mixed:
            local = swapper.piece(seg, 0) if swapper is not None else rt.masters[seg.index]
            tensors[f"master/{fqn}"] = _sharded(rt, seg, i, local)
            masters.append(fqn)
        if not tensor_names and not scalars:
            continue
        entry = {k: split(v, f"optim/{fqn}/{k}", tensors) for k, v in scalars.get(g, {}).items()}
        for name in tensor_names:
            key = f"optim/{fqn}/{name}"
            if seg.param_range(i, seg.rank) is None:
                local = torch.empty(0)
            elif swapper is not None:
                local = swapper.piece(seg, swapper.tensor_names.index(name))
            else:
                local = _state_local(rt, seg, i, name)
            tensors[key] = _sharded(rt, seg, i, local)
            entry[name] = TensorRef(key)
        state[fqn] = entry
    return {"class": opt.base_class.__name__, "param_groups": groups, "state": state, "masters": masters}


def _has_master(rt: Any, seg: Any) -> bool:
    """Whether ``seg`` has fp32 masters (an NVMe optimizer's live in its files, not in ``rt.masters``)."""
    return seg.index in (rt.swapper.keys if rt.swapper is not None else rt.masters)


def load_optimizer(rt: Any, saved: dict[str, Any] | None, reader: Any, load_states: bool, strict: bool,
                   after: list[Any]) -> bool:
    """Read masters (always) and, with ``load_states``, the partitioned optimizer state, into this rank's pieces."""
    opt = rt.optimizer
    if rt.stage3 is not None and rt.stage3.deferred:
        after.append(lambda: _load_deferred_shards(rt, reader))
    if rt.swapper is not None:  # NVMe: a sub-group at a time, in a slot, written back
        return _load_streamed(rt, saved, reader, load_states, strict, after)
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
    _check_groups(rt, saved, reader)
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
    _missing(missing, reader, strict)
    after.append(lambda: _apply_groups(opt, saved))
    return True


def _missing(missing: list[str], reader: Any, strict: bool) -> None:
    """Parameters without saved optimizer state: an error when ``strict``, else a warning."""
    if missing:
        msg = f"load_checkpoint: {reader.tag_dir}: no optimizer state saved for {missing[:10]}"
        if strict:
            raise CheckpointError(msg + "; pass load_module_strict=False to start those from zero, or "
                                  "load_optimizer_states=False.", reader.tag_dir)
        warnings.warn(msg, CheckpointWarning, stacklevel=5)


def _apply_groups(opt: Any, saved: dict[str, Any]) -> None:
    """The saved param groups' hyper-parameters (not tensors) into the optimizer's groups."""
    for group, old in zip(opt.param_groups, saved["param_groups"], strict=True):
        for k, v in old.items():
            if k != "params" and not isinstance(v, TensorRef):
                group[k] = v


def _run_params(seg: Any, rank: int, start: int, end: int) -> list[tuple[int, int]]:
    return [(i, s) for i, _a, s in seg.pieces(rank) if start <= s < end]


def _check_groups(rt: Any, saved: dict[str, Any], reader: Any) -> None:
    if len(saved["param_groups"]) != len(rt.optimizer.param_groups):
        raise CheckpointError(f"load_checkpoint: {reader.tag_dir}: the optimizer has {len(rt.optimizer.param_groups)} "
                              f"param groups, the checkpoint {len(saved['param_groups'])}. Build the optimizer with "
                              f"the same groups, or pass load_optimizer_states=False.", reader.tag_dir)


def _load_streamed(rt: Any, saved: dict[str, Any] | None, reader: Any, load_states: bool, strict: bool,
                   after: list[Any]) -> bool:
    """:func:`load_optimizer` with NVMe offload: masters (always) and, with ``load_states``, the state tensors are
    read a sub-group at a time into one of the swapper's slots (``reader.read_now``) and written back to the files
    (:meth:`~microspeed_zero.swap.OptimizerSwapper.load_subgroups`); scalars (Adam's ``step``) go to the runs.
    Without ``load_states`` the state files are left as they are. Shapes are checked before any file changes.
    A saved piece wider than a sub-group (a parameter spanning several) is read, a window at a time, once per
    sub-group it overlaps (its crc32 checked each time): memory stays bounded, reading grows by that factor."""
    swapper, opt = rt.swapper, rt.optimizer
    load_states = bool(load_states) and saved is not None
    if load_states:
        _check_groups(rt, saved, reader)
    manifest = reader.manifest
    aliases = manifest.get("model", {}).get("aliases", {})
    saved_keys = set(manifest.get("model", {}).get("keys", []))
    world_global = dist.get_world_size() if dist.is_initialized() else 1
    by_seg = {seg.index: seg for seg in rt.segments}
    names = swapper.tensor_names if load_states else swapper.tensor_names[:1]
    trees: dict[str, Any] = saved["state"] if load_states else {}
    missing = [] if not load_states else \
        [rt.names[id(p)] for seg, i, p in _params(rt) if seg.groups[i] is not None and _has_master(rt, seg)
         and rt.names[id(p)] not in trees]

    def source(fqn: str, name: str) -> Any:
        """The checkpoint key for ``name`` of ``fqn`` (``None``: keep the file's values), or a scalar to fill."""
        if name == "master":
            if reader.has(f"master/{fqn}") and rt.cfg.load_from_fp32_weights:
                return f"master/{fqn}"
            return f"model/{aliases.get(fqn, fqn)}" if fqn in saved_keys else None
        value = trees.get(fqn, {}).get(name)
        if isinstance(value, TensorRef):
            return value.key
        if isinstance(value, torch.Tensor) and value.numel() == 1 or \
                isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)  # one value for the whole parameter
        return None

    def plan(sg: Any) -> tuple[list[bool], Any]:
        jobs: list[tuple[int, int, int, Any, tuple[int, ...], tuple[int, int], str]] = []
        covered = [0] * len(names)
        for piece in sg.pieces:
            seg = by_seg[piece.seg]
            base = seg.slice_of(seg.rank)[0]
            for i, p in enumerate(seg.params):
                mine = seg.param_range(i, seg.rank)
                if seg.groups[i] is None or mine is None:
                    continue
                ps = seg.offsets[i] + mine[0] - base  # the parameter's piece in the slice: [ps, ps + len)
                x0, x1 = max(ps, piece.start), min(ps + mine[1] - mine[0], piece.end)
                if x0 >= x1:
                    continue
                fqn = rt.names[id(p)]
                shape = tuple(getattr(p, "ds_shape", tuple(p.shape)))
                flat = (mine[0] + x0 - ps, mine[0] + x1 - ps)
                lo = piece.lo + x0 - piece.start
                for j, name in enumerate(names):
                    src = source(fqn, name)
                    if src is not None:
                        jobs.append((j, lo, lo + x1 - x0, src, shape, flat, f"{name} {fqn}"))
                        covered[j] += x1 - x0

        def fill(bufs: list[torch.Tensor]) -> None:
            targets = []
            grank = dist.get_rank() if dist.is_initialized() else 0
            for j, a, b, src, shape, flat, what in jobs:
                if isinstance(src, float):
                    bufs[j][a:b].fill_(src)
                    continue
                ranges: list[list[tuple[int, int]]] = [[] for _ in range(max(world_global, grank + 1))]
                ranges[grank] = [flat]
                targets.append((src, flat_shard(bufs[j][a:b], shape, ranges, grank), what))
            if targets:
                reader.read_now(targets)
                swapper.note_held(reader.window_bytes)

        return [c == sg.numel for c in covered], fill

    _missing(missing, reader, strict)
    bad = []  # checked before any file changes: a load that fails half-way would leave a mix of states
    for seg, i, p in _params(rt):
        if seg.groups[i] is None or not _has_master(rt, seg) or seg.param_range(i, seg.rank) is None:
            continue
        fqn = rt.names[id(p)]
        shape = tuple(getattr(p, "ds_shape", tuple(p.shape)))
        for name in names:
            key = source(fqn, name)
            if isinstance(key, str) and not (reader.has(key) and reader.fits(key, shape)):
                bad.append(f"{name} {fqn}: checkpoint {list(reader.meta(key).size) if reader.has(key) else 'none'}"
                           f" vs {list(shape)}")
    if bad:
        raise CheckpointError(f"{reader.tag_dir}: shapes differ from the checkpoint's: " + "; ".join(bad[:10]),
                              reader.tag_dir)

    def stream() -> None:  # after the core's reads succeeded, as the files are overwritten
        swapper.load_subgroups(plan, len(names))
        for r, (seg, _g, start, end, _view) in enumerate(opt.runs if load_states else ()):
            first = next((rt.names[id(seg.params[i])] for i, _s in _run_params(seg, seg.rank, start, end)), None)
            tree = trees.get(first, {}) if first else {}
            swapper.set_run_scalars(r, {k: v for k, v in tree.items()
                                        if not isinstance(v, TensorRef) and k not in swapper.initial})

    after.append(stream)
    if rt.stage3 is not None:
        after.append(rt.stage3.refresh_persistent)
    if load_states:
        after.append(lambda: _apply_groups(opt, saved))
    return True


def _load_deferred_shards(rt: Any, reader: Any) -> None:
    """Fill the file-resident stage-3 shards :func:`module_tensors` deferred, one segment at a time: read the shard,
    read the module's tensors into its parameters' pieces (``reader.read_now``, keys chosen as the core's module
    load chooses them), write it back. Holds one shard, not the partition."""
    s3 = rt.stage3
    manifest = reader.manifest.get("model", {})
    saved_keys, aliases = set(manifest.get("keys", [])), manifest.get("aliases", {})
    for index in sorted(s3.deferred):
        seg = s3.segments[index]
        targets = []
        buf = aligned_empty(seg.shard_size, seg.dtype, s3.pin)
        for i, p in enumerate(seg.params):
            fqn = rt.names[id(p)]
            if fqn not in saved_keys or seg.param_range(i, seg.rank) is None:
                continue  # not in the checkpoint (a non-strict load): the file keeps it
            src = aliases.get(fqn, fqn)
            key = f"master/{src}" if seg.dtype == torch.float32 and reader.has(f"master/{src}") else f"model/{src}"
            targets.append((key, _sharded(rt, seg, i, buf), f"parameter {fqn}"))
        if not targets:
            continue
        s3.store.read(f"shard{index}", buf)
        s3.note_loaded(buf.nbytes)
        reader.read_now(targets)
        s3.forget_read(index)
        s3.store.write(f"shard{index}", buf)
        del buf
    s3.deferred = set()
