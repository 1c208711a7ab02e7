"""Checkpoints: DeepSpeed's layout and API; tensors sharded through ``torch.distributed.checkpoint``.

Layout (as DeepSpeed's, one folder per tag, ``latest`` naming the newest)::

    <save_dir>/latest                  the newest complete tag; replaced atomically, last
    <save_dir>/<tag>/manifest.msgpack  run metadata and every small value (msgpack)
    <save_dir>/<tag>/.metadata         DCP's index of the tensors
    <save_dir>/<tag>/__<rank>_0.distcp the tensors rank <rank> wrote

Tensors are keyed by parameter name (FQN), never by rank or integer index:

==========================  ======================================================================
``model/<key>``             ``engine.module.state_dict()`` in the training dtype (a tied duplicate
                            is stored once; the manifest lists it as an alias)
``master/<fqn>``            fp32 master weights: optimizer parameters that are not the module's own
                            (fp16/bf16), named through ``microspeed_optimizer_param_names``
``optim/<fqn>/<name>``      optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``, ...)
``lr_scheduler/<path>``     tensors of the scheduler's state (rare)
``plugins/<plugin>/<path>`` tensors of a plugin's checkpoint state
``client/<path>``           tensors of ``client_state`` (rank 0's, as DeepSpeed keeps)
==========================  ======================================================================

The small rest — versions, ds_config, world size, counters, the module's key list, optimizer
param groups (with FQNs), scheduler state, plugin list and each plugin's small state, client
state and every rank's RNG states — is the manifest (:mod:`microspeed.checkpoint.manifest`).

**Who writes what.** Every rank calls :func:`save` with the same state dict of full tensors;
DCP's planner de-duplicates replicated tensors, so in pure data parallelism the ranks split the
writing and each writes only the tensors it was assigned. A plugin that shards state (ZeRO,
tensor parallel) contributes DTensors or rank-unique keys and DCP writes each shard once.

**Safety.** Everything goes into ``<tag>.tmp-<nonce>``; after DCP finished on all ranks, rank 0
writes the manifest, all ranks meet at a barrier, rank 0 renames the folder to ``<tag>`` and then
replaces ``latest`` with ``os.replace``. A save interrupted anywhere (a rank killed) leaves
``latest`` naming the previous tag. Unreadable, truncated or foreign files raise
:class:`CheckpointError` naming the file.

**Other topologies.** Tensors are full and named, so a checkpoint written by N ranks loads on M.
The data loader continues from the same *global* sample count
(:meth:`microspeed.builtin.dataloader.MicroBatchLoader.load_state_dict`). RNG states
are restored only when asked (``load_checkpoint(load_rng_state=True)``; DeepSpeed never restores
them): rank ``r`` restores what rank ``r`` saved when ``r < N``; a rank ``r >= N`` seeds Python, numpy and torch
with a number derived from rank 0's saved torch state and ``r`` (deterministic, distinct per
rank). With another gradient-accumulation count, ``micro_steps`` becomes ``global_steps * GAS``.

**Other precisions.** Loading into an fp32 module prefers ``master/<fqn>`` (exact fp32 weights of
an fp16/bf16 run); fp32 masters of an fp16/bf16 engine come from ``master/<fqn>`` when saved,
else from ``model/<fqn>`` (an fp32 checkpoint), at full precision.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import secrets
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from microspeed import comm
from microspeed.checkpoint.manifest import TensorRef, join, pack, split, tensor_refs, unpack

__all__ = [
    "LATEST",
    "MANIFEST",
    "Placement",
    "CheckpointError",
    "CheckpointWarning",
    "Reader",
    "TensorRef",
    "flat_range_boxes",
    "flat_shard",
    "get_fp32_state_dict",
    "load",
    "load_optimizer_state",
    "new_manifest",
    "optimizer_param_names",
    "read_latest",
    "read_manifest",
    "read_tensor_index",
    "resolve_tag_dir",
    "save",
    "save_16bit_model",
    "save_optimizer_state",
    "save_state_dict_file",
    "write_checkpoint",
]

MANIFEST = "manifest.msgpack"
"""Name of the manifest file inside a tag folder."""

LATEST = "latest"
"""Name of the file (in the save folder) that holds the newest complete tag."""

FORMAT = "microspeed.checkpoint"
"""The manifest's ``format`` field: what tells our manifest from any other msgpack file."""

FORMAT_VERSION = 1
"""The manifest layout version this code writes (and the newest it reads)."""
_DCP_INDEX = ".metadata"
_TMP = ".tmp-"
_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")

class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked. ``path`` is the file or folder at fault."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class CheckpointWarning(UserWarning):
    """Something was tolerated while loading (non-strict names, no ``latest``, a changed topology)."""


# ------------------------------------------------------------------------------------ layout


def _check_tag(tag: str) -> str:
    bad = (not tag or tag in (".", "..", LATEST) or "/" in tag or os.sep in tag or _TMP in tag
           or tag.startswith("."))
    if bad:
        raise CheckpointError(f"checkpoint tag {tag!r} is not a plain folder name; use something like "
                              f"'global_step100' (no '/', not 'latest', not starting with '.').")
    return tag


def read_latest(save_dir: str) -> str | None:
    """The tag ``<save_dir>/latest`` names, or ``None`` when there is no such file."""
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        tag = fh.read().strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; it should name a tag folder of {save_dir}.", path)
    return tag


def resolve_tag_dir(ckpt_dir: str, tag: str | None = None) -> str:
    """The tag folder meant by ``ckpt_dir``: itself if it holds a manifest, else ``tag`` or ``latest``."""
    if tag is not None:
        return os.path.join(ckpt_dir, str(tag))
    if os.path.isfile(os.path.join(ckpt_dir, MANIFEST)):
        return ckpt_dir
    latest = read_latest(ckpt_dir)
    if latest is None:
        raise CheckpointError(f"{ckpt_dir}: neither a checkpoint tag folder (no {MANIFEST}) nor a save folder "
                              f"with a '{LATEST}' file; pass the tag folder or a tag.", ckpt_dir)
    return os.path.join(ckpt_dir, latest)


def read_manifest(tag_dir: str) -> dict[str, Any]:
    """The manifest of the tag folder ``tag_dir``; :class:`CheckpointError` if unreadable or foreign."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        hint = ""
        if os.path.isdir(tag_dir) and any(n.endswith("_model_states.pt") for n in os.listdir(tag_dir)):
            hint = (" It holds a DeepSpeed checkpoint: convert it with "
                    "`microspeed checkpoint import-deepspeed DS_DIR OUT_DIR`.")
        raise FileNotFoundError(f"load_checkpoint: {path} does not exist (tag {os.path.basename(tag_dir)!r} in "
                                f"{os.path.dirname(tag_dir) or '.'}).{hint}")
    try:
        with open(path, "rb") as fh:
            manifest = unpack(fh.read())
    except Exception as exc:
        raise CheckpointError(f"{path} is not a readable microspeed manifest (truncated or foreign file: "
                              f"{type(exc).__name__}: {exc}).", path) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a microspeed manifest (no format {FORMAT!r}).", path)
    if manifest.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {manifest['version']} is newer than this "
                              f"microspeed reads ({FORMAT_VERSION}); upgrade microspeed.", path)
    return manifest


def read_tensor_index(tag_dir: str) -> Metadata:
    """DCP's index of the tag folder, after checking every file it names exists and is long enough."""
    path = os.path.join(tag_dir, _DCP_INDEX)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {tag_dir} holds no complete tensor data.", path)
    try:
        metadata = dcp.FileSystemReader(tag_dir).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{path} is not a readable torch.distributed.checkpoint index (truncated or "
                              f"foreign file: {type(exc).__name__}: {exc}).", path) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not a torch.distributed.checkpoint index.", path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(needed.items()):
        full = os.path.join(tag_dir, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"{full} is missing (named by {path}).", full)
        size = os.path.getsize(full)
        if size < end:
            raise CheckpointError(f"{full} is truncated: {size} bytes, the index needs {end}.", full)
    return metadata


def _find_unreadable_file(tag_dir: str, metadata: Metadata) -> str | None:
    """After DCP failed to read: the first data file with an item ``torch.load`` cannot read."""
    for info in sorted((metadata.storage_data or {}).values(), key=lambda i: (i.relative_path, i.offset)):
        full = os.path.join(tag_dir, info.relative_path)
        try:
            with open(full, "rb") as fh:
                fh.seek(info.offset)
                torch.load(io.BytesIO(fh.read(info.length)), weights_only=True)
        except Exception:
            return full
    return None


# -------------------------------------------------------------------------------- tensor I/O


class Reader:
    """Collects ``key -> target tensors`` for one checkpoint load, then fills the targets.

    Targets are plain tensors or sharded tensors made by :func:`flat_shard` (filled in place,
    each rank reading only its pieces). Plugins get one in ``microspeed_load_optimizer_state``.
    """

    def __init__(self, tag_dir: str, metadata: Metadata, manifest: dict[str, Any] | None = None,
                 placements: dict[str, Placement] | None = None, rank: int = 0) -> None:
        self.tag_dir, self.metadata, self.manifest = tag_dir, metadata, manifest or {}
        self.placements, self.rank = placements or {}, rank
        self.targets: dict[str, list[torch.Tensor]] = {}
        self.sharded: list[tuple[str, torch.Tensor]] = []
        self.mismatches: list[str] = []

    def _placed(self, key: str, shape: tuple[int, ...]) -> Placement | None:
        """The placement when ``key`` is a piece of shape ``shape`` of a tensor saved whole (any split)."""
        where = placement_of(key, self.placements)
        if where is not None and tuple(shape) == where.local and tuple(self.meta(key).size) == where.shape:
            return where
        return None

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds the tensor ``key``."""
        return isinstance(self.metadata.state_dict_metadata.get(key), TensorStorageMetadata)

    def meta(self, key: str) -> TensorStorageMetadata:
        """DCP's description (size, dtype) of the saved tensor ``key``."""
        return self.metadata.state_dict_metadata[key]  # type: ignore[return-value]

    def into(self, key: str, target: torch.Tensor, name: str) -> None:
        """Read ``key`` into ``target`` (cast to its dtype); shapes must agree, or ``target`` be its placed piece."""
        where = self._placed(key, tuple(target.shape))
        if where is not None:
            self.sharded.append((key, box_shard(target, where.shape, where.pieces, self.rank)))
            return
        saved = tuple(self.meta(key).size)
        if saved != tuple(target.shape):
            self.mismatches.append(f"{name}: checkpoint {list(saved)} vs {list(target.shape)}")
            return
        if _is_sharded(target):
            self.sharded.append((key, target))
            return
        self.targets.setdefault(key, []).append(target)

    def fresh(self, key: str) -> torch.Tensor:
        """A new CPU tensor that will hold ``key`` as saved (dtype and shape; this rank's piece when placed)."""
        meta = self.meta(key)
        where = placement_of(key, self.placements)
        if where is not None and tuple(meta.size) == where.shape:
            local = torch.empty(where.local, dtype=meta.properties.dtype)
            self.sharded.append((key, box_shard(local, where.shape, where.pieces, self.rank)))
            return local
        tensor = self._empty(key)
        self.targets.setdefault(key, []).insert(0, tensor)
        return tensor

    def _empty(self, key: str) -> torch.Tensor:
        meta = self.meta(key)
        return torch.empty(tuple(meta.size), dtype=meta.properties.dtype)

    def run(self, no_dist: bool) -> None:
        """Read every registered target (one ``dcp.load`` per round of distinct keys)."""
        if self.mismatches:
            raise CheckpointError(f"{self.tag_dir}: shapes differ from the checkpoint's: "
                                  + "; ".join(self.mismatches), self.tag_dir)
        plan: dict[str, torch.Tensor] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, targets in self.targets.items():
            first = targets[0]
            if len(targets) == 1 and first.dtype == self.meta(key).properties.dtype:
                plan[key] = first
            else:  # read once at saved precision, then copy into each target (casting)
                buf = first if first.dtype == self.meta(key).properties.dtype else self._empty(key)
                plan[key] = buf
                copies.extend((t, buf) for t in targets if t is not buf)
        rounds = [plan] if plan else []
        for key, target in self.sharded:  # DCP casts into sharded targets; one key per round
            for r in rounds:
                if key not in r:
                    r[key] = target
                    break
            else:
                rounds.append({key: target})
        for r in rounds:
            self._load(r, no_dist)
        with torch.no_grad():
            for target, buf in copies:
                target.copy_(buf)

    def _load(self, plan: dict[str, torch.Tensor], no_dist: bool) -> None:
        try:
            with _quiet_dcp():
                dcp.load(plan, storage_reader=dcp.FileSystemReader(self.tag_dir), no_dist=no_dist)
        except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
            bad = _find_unreadable_file(self.tag_dir, self.metadata)
            where = bad or self.tag_dir
            raise CheckpointError(f"{where}: reading checkpoint tensors failed (truncated or foreign file?): "
                                  f"{type(exc).__name__}: {_short(exc)}", where) from exc



def _is_sharded(t: Any) -> bool:
    return type(t).__name__ == "ShardedTensor"


def flat_range_boxes(shape: tuple[int, ...] | list[int], start: int, end: int) -> list[tuple[list[int], list[int]]]:
    """Split the row-major flat range ``[start, end)`` of a tensor of ``shape`` into boxes.

    Returns ``[(offsets, sizes), ...]`` in flat order; each box is contiguous in the flat
    order, so its data is ``flat[a:a + prod(sizes)].view(sizes)``. At most ``2 * ndim - 1`` boxes.
    """
    shape = list(shape)
    if not shape:
        return [([], [])] if start < end else []
    boxes: list[tuple[list[int], list[int]]] = []

    def rec(prefix: list[int], dims: list[int], s: int, e: int) -> None:
        if s >= e:
            return
        inner = 1
        for d in dims[1:]:
            inner *= d
        i0, r0 = divmod(s, inner)
        i1, r1 = divmod(e, inner)
        if i0 == i1:
            rec(prefix + [i0], dims[1:], r0, r1)
            return
        if r0:
            rec(prefix + [i0], dims[1:], r0, inner)
            i0 += 1
        if i1 > i0:
            boxes.append((prefix + [i0] + [0] * (len(dims) - 1), [1] * len(prefix) + [i1 - i0] + dims[1:]))
        if r1:
            rec(prefix + [i1], dims[1:], 0, r1)

    rec([], shape, start, end)
    return boxes


def flat_shard(local: torch.Tensor, shape: tuple[int, ...] | list[int], ranges_by_rank: list[list[tuple[int, int]]],
               rank: int) -> Any:
    """A sharded tensor of global ``shape`` whose pieces are flat ranges of its row-major order.

    ``ranges_by_rank[q]`` lists the flat ranges rank ``q`` (global rank) holds, together covering
    the tensor exactly once; ``local`` is this ``rank``'s pieces concatenated (1-D, a view into
    the caller's storage: saving reads it, loading writes it in place). Checkpoints key it like
    the full tensor, so it reloads under any other partition, or as a plain tensor.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    shape = list(shape)
    device = local.device
    metas, shards = [], []
    for q, ranges in enumerate(ranges_by_rank):
        offset = 0
        for start, end in ranges:
            for offs, sizes in flat_range_boxes(shape, start, end):
                n = 1
                for x in sizes:
                    n *= x
                meta = ShardMetadata(list(offs), list(sizes), f"rank:{q}/{device}")
                metas.append(meta)
                if q == rank:
                    shards.append(Shard(local[offset:offset + n].view(sizes), meta))
                offset += n
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(metas, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


@dataclass(frozen=True)
class Placement:
    """Where this rank's piece of a parameter sits in the full tensor (see ``microspeed_checkpoint_placements``).

    ``shape``: the full tensor's; ``offsets``/``local``: this rank's box; ``pieces``: ``(global rank,
    offsets, sizes)`` of one complete copy that includes this rank's piece (its replica's ranks);
    ``write``: whether this rank's replica writes the tensor (exactly one replica should).
    """

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local: tuple[int, ...]
    pieces: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]
    write: bool = True


def box_shard(local: torch.Tensor, shape: tuple[int, ...] | list[int],
              pieces: Sequence[tuple[int, Sequence[int], Sequence[int]]], rank: int) -> Any:
    """A sharded tensor of global ``shape`` made of boxes ``(global rank, offsets, sizes)``; ``local`` is ``rank``'s.

    Like :func:`flat_shard`, but each piece is a rectangular box (a tensor-parallel split along any
    dimension). Saving reads ``local``; loading writes it in place.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    metas, shards = [], []
    for q, offsets, sizes in pieces:
        meta = ShardMetadata(list(offsets), list(sizes), f"rank:{q}/{local.device}")
        metas.append(meta)
        if q == rank:
            shards.append(Shard(local.view(list(sizes)), meta))
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(metas, torch.Size(list(shape)), props))


def placement_of(key: str, placements: dict[str, Placement]) -> Placement | None:
    """The placement of the parameter a checkpoint key belongs to (``model/``, ``master/``, ``optim/<fqn>/``)."""
    if not placements:
        return None
    head, _, rest = key.partition("/")
    if head in ("model", "master"):
        return placements.get(rest)
    if head == "optim":
        return placements.get(rest.rpartition("/")[0])
    return None


def apply_placements(tensors: dict[str, Any], placements: dict[str, Placement], rank: int) -> None:
    """Replace each placed piece in ``tensors`` by its sharded view; drop it where another replica writes it."""
    for key in list(tensors):
        where = placement_of(key, placements)
        t = tensors[key]
        if where is None or not isinstance(t, torch.Tensor) or tuple(t.shape) != where.local:
            continue
        if where.write:
            tensors[key] = box_shard(t.contiguous(), where.shape, where.pieces, rank)
        else:
            del tensors[key]


def collect_placements(engine: Any) -> dict[str, Placement]:
    """Every plugin's ``microspeed_checkpoint_placements`` answer, merged."""
    out: dict[str, Placement] = {}
    for part in engine.hook.microspeed_checkpoint_placements(engine=engine):
        out.update(part or {})
    return out


def _short(exc: BaseException, limit: int = 800) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + " ..."


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" (we chose no_dist on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or comm.get_world_size() == 1


def _write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}{_TMP}{secrets.token_hex(4)}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _publish(save_dir: str, tag: str, tmp: str, save_latest: bool) -> None:
    """Rank 0, after every rank finished: ``tmp`` becomes ``<tag>``, then ``latest`` names it."""
    final = os.path.join(save_dir, tag)
    old = None
    if os.path.exists(final):
        old = f"{final}.old{_TMP}{secrets.token_hex(4)}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    if save_latest:
        _write_bytes(os.path.join(save_dir, LATEST), tag.encode())
        _fsync_dir(save_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for name in os.listdir(save_dir):  # leftovers of earlier interrupted saves of this tag
        if name.startswith(f"{tag}{_TMP}"):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def write_checkpoint(save_dir: str, tag: str, tensors: dict[str, torch.Tensor], manifest: dict[str, Any],
                     save_latest: bool = True) -> str:
    """Write a checkpoint from one process, without a process group (converters use this).

    ``tensors`` are the DCP keys (``model/...``, ``optim/...``); ``manifest`` as :func:`new_manifest`
    makes it. Returns the tag folder. Same safety as :func:`save`.
    """
    tag = _check_tag(str(tag))
    os.makedirs(save_dir, exist_ok=True)
    tmp = os.path.join(save_dir, f"{tag}{_TMP}{secrets.token_hex(6)}")
    os.makedirs(tmp)
    with _quiet_dcp():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    _write_bytes(os.path.join(tmp, MANIFEST), pack(manifest))
    _publish(save_dir, tag, tmp, save_latest)
    return os.path.join(save_dir, tag)


def new_manifest(tag: str, world_size: int, config: dict[str, Any], counters: dict[str, int],
                 gradient_accumulation_steps: int) -> dict[str, Any]:
    """A manifest skeleton with versions and counters; callers fill the other sections."""
    from microspeed import __version__

    return {
        "format": FORMAT, "version": FORMAT_VERSION, "microspeed_version": __version__,
        "torch_version": torch.__version__, "tag": tag, "time": time.time(), "world_size": world_size,
        "config": config, "counters": dict(counters), "gradient_accumulation_steps": gradient_accumulation_steps,
        "plugins": [], "model": {"keys": [], "aliases": {}, "extra": {}}, "optimizer": None,
        "lr_scheduler": None, "plugin_states": {}, "plugin_states_by_rank": None, "client_state": {}, "rng": [],
    }


# ------------------------------------------------------------------------------------- names


def optimizer_param_names(engine: Any) -> dict[int, str]:
    """``{id(tensor): fqn}`` for the module's parameters and what plugins name (fp32 masters)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for extra in engine.hook.microspeed_optimizer_param_names(engine=engine):
        names.update(extra or {})
    return names


def _optimizer_fqns(optimizer: Any, names: dict[int, str]) -> list[str]:
    fqns = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            fqns.append(names.get(id(p), f"_unnamed.group{g}.{i}"))
    unnamed = [f for f in fqns if f.startswith("_unnamed.")]
    if unnamed:
        warnings.warn(f"checkpoint: {len(unnamed)} optimizer parameter(s) are not parameters of engine.module and "
                      f"no plugin named them; their state is keyed by position ({', '.join(unnamed[:5])}) and "
                      f"only reloads into the same optimizer layout.", CheckpointWarning, stacklevel=3)
    return fqns


def _identity(t: torch.Tensor) -> tuple | None:
    try:
        if t.numel() == 0 or type(t) is not torch.Tensor:
            return None
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
    except Exception:
        return None


def _aliases(sd: dict[str, Any]) -> dict[str, str]:
    """Keys of ``sd`` whose tensor is the very same as an earlier key's (tied weights)."""
    seen: dict[tuple, str] = {}
    aliases = {}
    for k, t in sd.items():
        ident = _identity(t) if isinstance(t, torch.Tensor) else None
        if ident is None:
            continue
        if ident in seen:
            aliases[k] = seen[ident]
        else:
            seen[ident] = k
    return aliases


# ---------------------------------------------------------------------------------------- RNG


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, keys.tobytes(), int(pos), int(has_gauss), float(cached))
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in state["cuda"]])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))


def _restore_rng(saved: list[dict[str, Any]], rank: int) -> None:
    if not saved:
        return
    if rank < len(saved):
        _set_rng_state(saved[rank])
        return
    digest = hashlib.sha256(saved[0]["torch"] + rank.to_bytes(4, "little")).digest()
    seed = int.from_bytes(digest[:8], "little") & (2**63 - 1)
    random.seed(seed)
    torch.manual_seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)


# --------------------------------------------------------------------------------------- save


def save(engine: Any, save_dir: str, tag: str | None = None, client_state: dict | None = None,
         save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """Write a checkpoint of ``engine`` to ``save_dir/<tag>`` (every rank calls this); returns ``True``.

    ``exclude_frozen_parameters`` leaves parameters with ``requires_grad=False`` out of the module's
    tensors (as DeepSpeed); loading such a checkpoint then needs ``load_module_strict=False``.
    """
    rank, world = comm.get_rank(), comm.get_world_size()
    tag = _check_tag(f"global_step{engine.global_steps}" if tag is None else str(tag))
    engine.hook.microspeed_before_checkpoint_save(engine=engine, save_dir=save_dir, tag=tag)
    tensors: dict[str, torch.Tensor] = {}

    module_sd = _module_tensors(engine)
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

    digest = hashlib.sha256(pack(plugins_part)).hexdigest()
    model_part = {"keys": list(module_sd), "aliases": aliases, "extra": extra}
    spread = hashlib.sha256(pack([model_part, optimizer_part])).hexdigest()
    everyone = comm.all_gather_object({"tag": tag, "nonce": secrets.token_hex(6), "rng": _rng_state(),
                                       "plugins": digest, "spread": spread})
    tags = sorted({e["tag"] for e in everyone})
    if len(tags) > 1:
        raise CheckpointError(f"save_checkpoint: the ranks passed different tags {tags}; pass the same tag "
                              f"on every rank.")
    by_rank = None
    if len({e["plugins"] for e in everyone}) > 1:
        by_rank = comm.all_gather_object(plugins_part)
    if len({e["spread"] for e in everyone}) > 1:  # ranks hold different parameters (pipeline stages)
        parts = comm.all_gather_object([model_part, optimizer_part])
        model_part = merge_model_parts([p[0] for p in parts])
        optimizer_part = merge_optimizer_parts([p[1] for p in parts])
    apply_placements(tensors, collect_placements(engine), rank)
    tmp = os.path.join(save_dir, f"{tag}{_TMP}{everyone[0]['nonce']}")
    os.makedirs(tmp, exist_ok=True)
    try:
        with _quiet_dcp():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), no_dist=_no_dist())
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"save_checkpoint: writing tensors into {tmp} failed: {type(exc).__name__}: "
                              f"{_short(exc)}", tmp) from exc
    if rank == 0:
        manifest = new_manifest(tag, world, engine.config.to_dict(), {k: getattr(engine, k) for k in _COUNTERS},
                                engine.gradient_accumulation_steps())
        manifest.update({
            "topology": {"data_parallel_size": engine.topology.data_parallel_size,
                         "model_parallel_size": engine.topology.model_parallel_size},
            "plugins": [[i.name, i.version] for i in engine.plugins.infos.values()],
            "model": model_part,
            "optimizer": optimizer_part, "lr_scheduler": scheduler_part, "plugin_states": plugins_part,
            "plugin_states_by_rank": by_rank, "client_state": client_part, "rng": [e["rng"] for e in everyone],
        })
        _write_bytes(os.path.join(tmp, MANIFEST), pack(manifest))
    comm.barrier()
    if rank == 0:
        _publish(save_dir, tag, tmp, save_latest)
    comm.barrier()
    return True


def _ordered_union(lists: list[list[Any]]) -> list[Any]:
    seen, out = set(), []
    for items in lists:
        for x in items:
            if x not in seen:
                seen.add(x)
                out.append(x)
    return out


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


def _module_tensors(engine: Any) -> dict[str, Any]:
    tensors = engine.hook.microspeed_checkpoint_module_tensors(engine=engine)
    return tensors if tensors is not None else engine.module.state_dict()


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


# --------------------------------------------------------------------------------------- load


def load(engine: Any, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
         load_module_only: bool = False, load_rng_state: bool = False) -> tuple[str | None, dict]:
    """Restore ``engine`` from ``load_dir`` (``tag``, or the one ``latest`` names); every rank calls this.

    Returns ``(tag_dir, client_state)``, or ``(None, {})`` with a warning when ``load_dir`` has no
    ``latest`` and no tag was given. ``load_module_strict``: the module's parameter names must
    equal the checkpoint's (else :class:`CheckpointError` listing the missing and unexpected
    ones); when false, the names both have are loaded and the others listed in a warning.
    ``load_module_only``: only the weights (fp32 masters included); no optimizer, scheduler,
    counters, plugin state or RNG. ``load_rng_state``: restore every rank's Python, numpy and torch
    random-number state as saved (DeepSpeed's ``load_checkpoint`` never does; off by default).
    """
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            warnings.warn(f"load_checkpoint: {os.path.join(load_dir, LATEST)} not found; nothing was loaded. "
                          f"Pass tag=... to load a specific checkpoint.", CheckpointWarning, stacklevel=3)
            return None, {}
    tag_dir = os.path.join(load_dir, str(tag))
    manifest = read_manifest(tag_dir)
    rank = comm.get_rank()
    reader = Reader(tag_dir, read_tensor_index(tag_dir), manifest, collect_placements(engine), rank)
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


# ------------------------------------------------------------------------- consolidated views


def get_fp32_state_dict(ckpt_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The module's full state dict with floating-point tensors in fp32, read without a process group.

    ``ckpt_dir`` is a save folder (``tag`` or ``latest`` picks the tag) or a tag folder. fp32
    master weights are preferred where the run was fp16/bf16; tied duplicates are the same tensor
    object, as in ``module.state_dict()``. Keys come in the module's order.
    """
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    manifest = read_manifest(tag_dir)
    reader = Reader(tag_dir, read_tensor_index(tag_dir))
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


def save_16bit_model(engine: Any, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Rank 0 writes the module's state dict in the training dtype to ``save_dir/save_filename``.

    As DeepSpeed's ``save_16bit_model``: a plain ``torch.save`` file (``.safetensors`` when the
    name ends so and the package is installed). Every rank calls it; returns ``True``.
    ``exclude_frozen_parameters`` leaves out parameters with ``requires_grad=False``.
    """
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

