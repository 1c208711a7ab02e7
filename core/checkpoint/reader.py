"""Reading checkpoint tensors: :class:`Reader` collects targets, then one ``dcp.load`` per round fills them."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from microspeed.checkpoint import storage
from microspeed.checkpoint.errors import CheckpointError
from microspeed.checkpoint.layout import (
    _DCP_INDEX,
    MANIFEST,
    _find_unreadable_file,
    _quiet_dcp,
    _short,
    read_manifest,
    resolve_inside,
)
from microspeed.checkpoint.sharding import Pieces, Placement, _is_sharded, box_shard, place_pieces, placement_of
from microspeed.checkpoint.tensor_index import CheckedFileSystemReader

NO_VERIFY_HINT = ("If you trust these files, load them with verify=False (engine.load_checkpoint(..., verify=False), "
                  "microspeed.checkpoint.get_fp32_state_dict(..., verify=False)) or `microspeed checkpoint ... "
                  "--no-verify`; saving the loaded engine again writes a checkpoint with checksums.")
"""How to load a checkpoint :func:`check_verifiable` refuses: the switch, in every entry point's spelling."""


def check_verifiable(tag_dir: str, manifest: dict[str, Any], metadata: Metadata, verify: bool = True) -> None:
    """Refuse (:class:`CheckpointError` naming the manifest and the switch) tensors that cannot be verified.

    Verifiable: the index is this module's raw layout (:mod:`~microspeed.checkpoint.storage`) and the manifest's
    ``tensor_files`` holds a crc32 list for every file the index names. Checkpoints written by DCP's own writer
    (microspeed's layout before checksums) or stripped of ``tensor_files`` load only with ``verify=False``.
    """
    if not verify:
        return
    path = os.path.join(tag_dir, MANIFEST)
    files = manifest.get("tensor_files")
    if not storage.is_raw(metadata) or not isinstance(files, dict):
        raise CheckpointError(f"{path} carries no checksums for the tensors of {tag_dir} (no 'tensor_files'; "
                              f"written by torch.distributed.checkpoint's own writer, by a microspeed before "
                              f"checksums, or stripped), so what they hold cannot be verified. {NO_VERIFY_HINT}", path)
    named = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    unlisted = [rel for rel in named if not isinstance(files.get(rel), dict)
                or files[rel].get("checksum") != storage.CHECKSUM or not isinstance(files[rel].get("items"), list)]
    if unlisted:
        raise CheckpointError(f"{path} has no {storage.CHECKSUM} checksums for {unlisted[:4]}, which "
                              f"{os.path.join(tag_dir, _DCP_INDEX)} names, so what they hold cannot be verified. "
                              f"{NO_VERIFY_HINT}", path)


class Reader:
    """Collects ``key -> target tensors`` for one checkpoint load, then fills the targets.

    Targets are plain tensors or DTensors made by :func:`flat_shard` or :func:`box_shard` (filled in place,
    each rank reading only its pieces). Plugins get one in ``microspeed_load_optimizer_state``.
    """

    def __init__(self, tag_dir: str, metadata: Metadata, manifest: dict[str, Any] | None = None,
                 placements: dict[str, Placement] | None = None, rank: int = 0) -> None:
        self.tag_dir, self.metadata, self.manifest = tag_dir, metadata, manifest or {}
        self.placements, self.rank = placements or {}, rank
        self.targets: dict[str, list[torch.Tensor]] = {}
        self.sharded: list[tuple[str, torch.Tensor]] = []
        self.mismatches: list[str] = []
        self.window_bytes = 0
        """The largest read buffer (bytes) this reader's reads held so far, beside the targets."""

    def _placed(self, key: str, shape: tuple[int, ...]) -> Placement | None:
        """The placement when ``key`` is a piece of shape ``shape`` of a tensor saved whole (any split)."""
        where = placement_of(key, self.placements)
        if where is not None and not where.whole and tuple(shape) == where.local \
                and tuple(self.meta(key).size) == where.shape:
            return where
        return None

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds the tensor ``key``."""
        return isinstance(self.metadata.state_dict_metadata.get(key), TensorStorageMetadata)

    def meta(self, key: str) -> TensorStorageMetadata:
        """DCP's description (size, dtype) of the saved tensor ``key``."""
        return self.metadata.state_dict_metadata[key]  # type: ignore[return-value]

    def fits(self, key: str, shape: tuple[int, ...]) -> bool:
        """Whether :meth:`into` takes a target of ``shape`` for ``key`` (the saved shape, or its placed piece)."""
        return self._placed(key, tuple(shape)) is not None or tuple(self.meta(key).size) == tuple(shape)

    def into(self, key: str, target: torch.Tensor, name: str) -> None:
        """Read ``key`` into ``target`` (cast to its dtype); shapes must agree, or ``target`` be its placed piece."""
        where = self._placed(key, tuple(target.shape))
        if where is not None:  # a piece of the saved tensor; pieces of that piece when another plugin split it too
            placed = place_pieces(target, where, self.rank) if _is_sharded(target) \
                else box_shard(target, where.shape, where.pieces, self.rank)
            self.sharded.append((key, placed))
            return
        saved = tuple(self.meta(key).size)
        if saved != tuple(target.shape):
            self.mismatches.append(f"{name}: checkpoint {list(saved)} vs {list(target.shape)}")
            return
        if _is_sharded(target):
            self.sharded.append((key, target))
            return
        self.targets.setdefault(key, []).append(target)

    def read_now(self, targets: list[tuple[str, torch.Tensor, str]]) -> None:
        """Read each ``(key, target, name)`` at once (as :meth:`into` then :meth:`run`), apart from what is collected.

        For a caller that fills its state a part at a time, each part in a buffer it reuses (state kept in
        files, say): only this rank's files are read, no collective runs, so ranks may call it different
        numbers of times. Raises :class:`CheckpointError` on a shape mismatch, as :meth:`run` does.
        """
        part = Reader(self.tag_dir, self.metadata, self.manifest, self.placements, self.rank)
        for key, target, name in targets:
            part.into(key, target, name)
        part.run(no_dist=True)
        self.window_bytes = max(self.window_bytes, part.window_bytes)

    def fresh(self, key: str) -> torch.Tensor:
        """A new CPU tensor that will hold ``key`` as saved (dtype and shape; this rank's piece when placed)."""
        meta = self.meta(key)
        where = placement_of(key, self.placements)
        if where is not None and not where.whole and tuple(meta.size) == where.shape:
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
        if storage.is_raw(self.metadata):
            self._run_raw()
            return
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
        index = os.path.join(self.tag_dir, _DCP_INDEX)
        for rel in {info.relative_path for info in (self.metadata.storage_data or {}).values()}:
            resolve_inside(self.tag_dir, rel, index)  # DCP's reader would open whatever the index names
        for r in rounds:
            self._load(r, no_dist)
        with torch.no_grad():
            for target, buf in copies:
                target.copy_(buf)

    def _run_raw(self) -> None:
        """Read a checkpoint of :mod:`~microspeed.checkpoint.storage` (one file per rank, checksummed)."""
        requests: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
        for key, targets in self.targets.items():
            requests.extend((key, (0,) * t.dim(), t) for t in targets)
        for key, target in self.sharded:
            local = target._local_tensor
            if not isinstance(local, Pieces):
                raise CheckpointError(f"{self.tag_dir}: {key!r}: cannot read into a {type(local).__name__} "
                                      f"(expected microspeed.checkpoint pieces)", self.tag_dir)
            requests.extend((key, tuple(c.offsets), p) for p, c in zip(local._pieces, local._chunks, strict=True))
        files = self.manifest.get("tensor_files")
        if files is None and os.path.isfile(os.path.join(self.tag_dir, MANIFEST)):
            files = read_manifest(self.tag_dir).get("tensor_files")
        window = storage.read_boxes(self.tag_dir, self.metadata, files, requests)
        self.window_bytes = max(self.window_bytes, window)

    def _load(self, plan: dict[str, torch.Tensor], no_dist: bool) -> None:
        try:
            with _quiet_dcp():
                dcp.load(plan, storage_reader=CheckedFileSystemReader(self.tag_dir, self.metadata),  # not pickle.load
                         no_dist=no_dist)
        except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
            bad = _find_unreadable_file(self.tag_dir, self.metadata)
            where = bad or self.tag_dir
            raise CheckpointError(f"{where}: reading checkpoint tensors failed (truncated or foreign file?): "
                                  f"{type(exc).__name__}: {_short(exc)}", where) from exc
