"""Checkpoint tensor files: one contiguous file per rank, a merged index, and a crc32 per item.

**Why not one DCP item per tensor.** ``torch.distributed.checkpoint``'s file writer ``torch.save``-s every
tensor separately (about 1 ms each, 156 items for the demo GPT) and plans with collectives, which a
background writer cannot run while training runs its own. Here each rank copies the items it writes
into one contiguous staging buffer (:class:`Staging`: that copy is all a save blocks training for when
it is asynchronous), then writes the buffer as one raw byte item through DCP's own
``FileSystemWriter.write_data`` (its file naming ``__<rank>_0.distcp`` and its ``fsync``), so the
write is one sequential stream at the disk's speed.

**Topology-agnostic, as before.** An *item* is a box of a tensor of full shape (a whole tensor, a ZeRO
flat range's box, a tensor-parallel shard): key, dtype, full shape, offsets, sizes. Replicated items
(every data-parallel rank holds the whole tensor) are written once, by the holder with the fewest
bytes so far (:func:`assign`); every rank computes the same assignment from one gather. The merged
index is a DCP :class:`~torch.distributed.checkpoint.metadata.Metadata` (keys, full sizes, chunks, and
``storage_data`` naming file, offset and length), so :func:`~microspeed.checkpoint.read_tensor_index`
and the tools that read it are unchanged; :func:`read_boxes` reads any box of any tensor (another
world size, stage or tensor split) by intersecting it with the saved chunks.

**Checksums.** Every item's bytes, as written, get a ``zlib.crc32`` (the fastest checksum in the
standard library here: 1.3 GB/s on one core, against 0.2 GB/s for ``hashlib.blake2b``; ``xxhash`` is not
installed). They live in the manifest (``tensor_files``) and are verified on every read; a mismatch is
a :class:`CheckpointError` naming the file. Checkpoints written before (DCP's per-tensor files, no
``tensor_files``) still load, unverified, through DCP's reader.

**Completion marker.** After its data file is written and synced, each rank writes
``__<rank>_0.index`` (its items, offsets, checksums); rank 0 merges them once all are there
(:func:`finalize`), writes ``.metadata`` and the manifest, and only then may ``latest`` name the tag.
A rank whose writer failed leaves ``__<rank>_0.failed`` (the error, naming the file) instead. A rank
that dies while writing leaves nothing: rank 0's wait also asks whether the missing ranks are still
alive (``lost``: the watchdog's heartbeats, :meth:`microspeed.observe.watchdog.Watchdog.peer_watch`) and
ends as soon as one is gone, publishing nothing.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from microspeed.checkpoint.direct_io import open_stream
from microspeed.checkpoint.errors import CheckpointError
from microspeed.checkpoint.layout import _DCP_INDEX, MANIFEST, _fsync_dir, _write_bytes, resolve_inside
from microspeed.checkpoint.manifest import dtype_named, pack, unpack
from microspeed.checkpoint.sharding import Pieces, is_on_demand

RAW_FORMAT = "microspeed.raw.1"
"""``Metadata.planner_data["format"]`` of a checkpoint written by this module (raw bytes, one file per rank)."""

CHECKSUM = "crc32"
"""The checksum algorithm named in the manifest's ``tensor_files``."""

_ALIGN = 64
STREAM_CHUNK_BYTES = 64 << 20
"""The bounce buffer of a streamed save (:func:`stream_rank_file`): at most this many bytes, read at a time."""
_POLL_S = 0.02
_LIVENESS_S = 0.5  # how often rank 0's wait asks whether the ranks it waits for are alive


def data_file(rank: int) -> str:
    """The name of the tensor file rank ``rank`` writes (DCP's ``single_file_per_rank`` name)."""
    return f"__{rank}_0.distcp"


def index_file(rank: int) -> str:
    """The per-rank completion marker: the items rank ``rank`` wrote, with offsets and checksums."""
    return f"__{rank}_0.index"


def failed_file(rank: int) -> str:
    """The marker a rank leaves when its background writer failed (holds the error)."""
    return f"__{rank}_0.failed"


@dataclass
class Item:
    """One box of a tensor that a rank holds: ``sizes`` at ``offsets`` of a tensor of ``shape``."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    source: Any
    """A tensor (a view of the holder's memory), or an :class:`~microspeed.checkpoint.sharding.OnDemandPiece`'s box."""

    @property
    def nbytes(self) -> int:
        """Bytes of the box."""
        n = self.dtype.itemsize
        for s in self.sizes:
            n *= s
        return n

    @property
    def ident(self) -> tuple[str, tuple[int, ...]]:
        """What identifies the box across ranks (two ranks holding the same ident hold the same values)."""
        return self.key, self.offsets


def local_items(tensors: dict[str, Any]) -> list[Item]:
    """The boxes of ``tensors`` (plain tensors whole; sharded tensors as their :class:`Pieces`)."""
    items: list[Item] = []
    for key, t in tensors.items():
        if isinstance(t, DTensor):
            local = t._local_tensor
            if not isinstance(local, Pieces):
                raise CheckpointError(f"save_checkpoint: {key!r} is a DTensor over {type(local).__name__}; "
                                      f"checkpoints take plain tensors or microspeed.checkpoint.flat_shard/"
                                      f"box_shard pieces.")
            for piece, chunk in zip(local._pieces, local._chunks, strict=True):
                if (piece.numel if is_on_demand(piece) else piece.numel()):
                    items.append(Item(key, t.dtype, tuple(t.shape), tuple(chunk.offsets), tuple(chunk.sizes), piece))
        elif isinstance(t, torch.Tensor):
            items.append(Item(key, t.dtype, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t.detach()))
    return items


def describe(items: list[Item]) -> list[tuple[str, tuple[int, ...], int]]:
    """What a rank tells the others about its items (for :func:`assign`)."""
    return [(i.key, i.offsets, i.nbytes) for i in items]


def assign(everyone: list[list[tuple[str, tuple[int, ...], int]]], rank: int) -> set[tuple[str, tuple[int, ...]]]:
    """The idents ``rank`` writes: each box once, replicated ones to the holder with the fewest bytes so far.

    ``everyone[r]`` is rank ``r``'s :func:`describe`. Deterministic: every rank gets the same answer.
    """
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    size: dict[tuple[str, tuple[int, ...]], int] = {}
    for r, described in enumerate(everyone):
        for key, offsets, nbytes in described:
            ident = (key, tuple(offsets))
            holders.setdefault(ident, []).append(r)
            size[ident] = nbytes
    load = [0] * len(everyone)
    owner: dict[tuple[str, tuple[int, ...]], int] = {}
    for ident, ranks in holders.items():
        if len(ranks) == 1:
            owner[ident] = ranks[0]
            load[ranks[0]] += size[ident]
    for ident in sorted((i for i, rs in holders.items() if len(rs) > 1), key=lambda i: (-size[i], i)):
        best = min(holders[ident], key=lambda r: (load[r], r))
        owner[ident] = best
        load[best] += size[ident]
    return {ident for ident, r in owner.items() if r == rank}


@dataclass
class Layout:
    """Where each item sits in the staging buffer (and so in the file): ``(item, offset)``, and the total."""

    entries: list[tuple[Item, int]]
    nbytes: int


def plan_layout(items: Iterable[Item]) -> Layout:
    """Where each item goes in the rank's file: one after the other, each at a multiple of 64 bytes."""
    entries, offset = [], 0
    for item in items:
        entries.append((item, offset))
        offset += -(-item.nbytes // _ALIGN) * _ALIGN
    return Layout(entries, offset)


class Staging:
    """A reusable CPU buffer (pinned when CUDA is available) holding one rank's items, contiguous.

    :meth:`stage` copies the items in (the only part of an asynchronous save that blocks training);
    the buffer is reused by the next save, which waits for the previous write first. A save holding
    on-demand items streams them instead (:func:`stream_rank_file`) and leaves the buffer empty;
    :attr:`bounce_bytes` is the size of the bounce buffer its last streamed save used.
    """

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.bounce_bytes = 0

    def release(self) -> None:
        """Drop the staging buffer (a streamed save holds no staged copy)."""
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def stage(self, items: Iterable[Item]) -> Layout:
        """Copy ``items`` into the buffer (growing it if needed); returns their layout."""
        layout = plan_layout(items)
        entries, offset = layout.entries, layout.nbytes
        if self.buffer.numel() < offset:
            pin = torch.cuda.is_available()
            self.buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
        sync = False
        with torch.no_grad():
            for item, at in entries:
                if not item.nbytes:
                    continue
                dst = self.buffer[at:at + item.nbytes].view(item.dtype).view(item.sizes)
                src = item.source
                if is_on_demand(src):
                    src.read_into(dst.view(-1))
                    continue
                sync |= src.device.type != "cpu"
                dst.copy_(src, non_blocking=src.device.type == "cuda")
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        return layout


class _Prefix:
    """What DCP's ``FileSystemWriter.write_data`` reads from ``plan.storage_data``: the file-name prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix


class _BufferIO(io.BytesIO):
    """A BYTE_IO payload over an existing buffer (DCP writes ``getbuffer()``; no copy is made)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view

    def getbuffer(self) -> memoryview:  # type: ignore[override]
        """The staged bytes."""
        return self._view


class _OneBlob:
    """The minimal save planner ``write_data`` needs: it resolves the single item to the staged bytes."""

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def resolve_data(self, write_item: WriteItem) -> io.BytesIO:
        """The staged bytes as a BYTE_IO payload."""
        return _BufferIO(self.view)


def write_rank_file(tmp: str, rank: int, buffer: torch.Tensor, layout: Layout, rng: Any = None) -> None:
    """Write this rank's staged bytes to ``tmp/__<rank>_0.distcp`` (synced), then its index file.

    Runs in the background thread of an asynchronous save. The index (items, offsets, crc32 of the
    bytes as written, and ``rng``: this rank's random-number states for the manifest) is this rank's
    completion marker.
    """
    raw = buffer[:layout.nbytes].numpy()
    view = memoryview(raw).cast("B") if layout.nbytes else memoryview(b"")
    crcs: list[int] = []
    # the checksums are computed beside the write (zlib and the file write both release the GIL)
    summing = threading.Thread(target=lambda: crcs.extend(zlib.crc32(view[at:at + item.nbytes])
                                                          for item, at in layout.entries), daemon=True)
    summing.start()
    try:
        plan = SavePlan(items=[WriteItem(index=MetadataIndex("microspeed/rank_blob"), type=WriteItemType.BYTE_IO)],
                        storage_data=_Prefix(f"__{rank}_"))
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
        writer.write_data(plan, _OneBlob(view)).wait()  # type: ignore[arg-type]
    finally:
        summing.join()
    if len(crcs) != len(layout.entries):
        raise CheckpointError(f"{os.path.join(tmp, data_file(rank))}: computing the checksums failed.", tmp)
    _write_index(tmp, rank, layout, crcs, rng)


def _write_index(tmp: str, rank: int, layout: Layout, crcs: list[int], rng: Any) -> None:
    """Check the data file's size, then write this rank's completion marker (items, offsets, crc32s, ``rng``)."""
    path = os.path.join(tmp, data_file(rank))
    if os.path.getsize(path) != layout.nbytes:
        raise CheckpointError(f"{path}: wrote {os.path.getsize(path)} bytes, expected {layout.nbytes}.", path)
    entries = [[item.key, str(item.dtype).removeprefix("torch."), list(item.shape), list(item.offsets),
                list(item.sizes), at, item.nbytes, crc] for (item, at), crc in zip(layout.entries, crcs, strict=True)]
    # the completion marker: renamed into place whole; not fsync-ed (rank 0 reads it, merges it into the
    # synced index and manifest, and deletes it), the data file above is.
    marker = os.path.join(tmp, index_file(rank))
    with open(marker + ".part", "wb") as fh:
        fh.write(pack({"file": data_file(rank), "bytes": layout.nbytes, "items": entries, "rng": rng}))
    os.replace(marker + ".part", marker)


def stream_rank_file(tmp: str, rank: int, layout: Layout, rng: Any = None,
                     chunk_bytes: int | None = None) -> int:
    """Write this rank's items to ``tmp/__<rank>_0.distcp`` item by item, without staging them; returns the bounce
    buffers' bytes.

    The file, its index and checksums are those :func:`write_rank_file` writes for the same ``layout``
    (:func:`plan_layout`). A contiguous CPU tensor is written from its own memory; an on-demand piece, or any
    other tensor, goes through a bounce buffer of at most ``chunk_bytes`` (default
    :data:`STREAM_CHUNK_BYTES`; never more than the largest such item), a window at a time, the crc32 computed
    as it goes. An on-demand piece larger than the buffer gets a second one: a helper thread reads its next
    window (from the swap files) while this one is checksummed and written. Synchronous: the caller must not
    change the items until it returns.
    """
    cap = max(16, int(STREAM_CHUNK_BYTES if chunk_bytes is None else chunk_bytes))  # >= one element
    bounced = [item.nbytes for item, _at in layout.entries
               if is_on_demand(item.source) or item.source.device.type != "cpu" or not item.source.is_contiguous()]
    bounce = torch.empty(min(cap, max(bounced, default=0)), dtype=torch.uint8)
    # an on-demand piece larger than the buffer (state in swap files) is read a window ahead by a helper thread,
    # into a second buffer, while the window before it is checksummed and written: the two files' I/O overlap
    ahead = any(is_on_demand(item.source) and item.nbytes > bounce.numel() for item, _at in layout.entries)
    spare = torch.empty_like(bounce) if ahead else None
    reader = ThreadPoolExecutor(1, thread_name_prefix="microspeed-ckpt-read") if ahead else None
    path = os.path.join(tmp, data_file(rank))
    crcs: list[int] = []
    out = open_stream(path)  # past the page cache where the file system allows (microspeed.checkpoint.direct_io)
    try:
        _stream_items(out, layout, bounce, spare, reader, crcs)
        out.close(layout.nbytes)
    except BaseException:
        out.abort()
        raise
    finally:
        if reader is not None:
            reader.shutdown(wait=True)
    _write_index(tmp, rank, layout, crcs, rng)
    return bounce.numel() + (spare.numel() if spare is not None else 0)


def _stream_items(out: Any, layout: Layout, bounce: torch.Tensor, spare: torch.Tensor | None,
                  reader: ThreadPoolExecutor | None, crcs: list[int]) -> None:
    """:func:`stream_rank_file`'s loop: every item at its offset through ``out`` (``write_at``), its crc32 appended
    to ``crcs``."""
    for item, at in layout.entries:
        crc = 0
        src = item.source
        if not is_on_demand(src) and src.device.type == "cpu" and src.is_contiguous():
            if item.nbytes:
                view = memoryview(src.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
                out.write_at(at, view)
                crc = zlib.crc32(view)
            crcs.append(crc)
            continue
        per = max(1, bounce.numel() // item.dtype.itemsize)
        total = item.nbytes // item.dtype.itemsize
        flat = None if is_on_demand(src) else src.detach().reshape(-1)
        windows = [(a, min(per, total - a)) for a in range(0, total, per)]
        bufs = (bounce, spare if spare is not None else bounce)

        def fetch(i: int, src: Any = src, flat: Any = flat, windows: list = windows, bufs: tuple = bufs,
                  item: Any = item) -> torch.Tensor:
            a, n = windows[i]
            got = bufs[i % 2][:n * item.dtype.itemsize].view(item.dtype)
            if flat is None:
                src.read_into(got, a)
            else:
                got.copy_(flat[a:a + n])
            return got

        overlap = reader is not None and flat is None and len(windows) > 1
        pending = reader.submit(fetch, 0) if overlap else None
        for i in range(len(windows)):
            if pending is not None:
                window = pending.result()
                pending = reader.submit(fetch, i + 1) if i + 1 < len(windows) else None
            else:
                window = fetch(i)
            view = memoryview(window.view(torch.uint8).numpy()).cast("B")
            out.write_at(at, view)  # (copies and checksums release the GIL: the read ahead runs meanwhile)
            at += len(view)
            crc = zlib.crc32(view, crc)
        crcs.append(crc)


def mark_failed(tmp: str, rank: int, message: str) -> None:
    """Leave ``__<rank>_0.failed`` (best effort) so rank 0 stops waiting for this rank and publishes nothing."""
    try:
        _write_bytes(os.path.join(tmp, failed_file(rank)), message.encode())
    except OSError:
        pass


def _is_ints(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= 64 and all(type(n) is int and 0 <= n < 2**62 for n in value)


def _check_index(index: Any, path: str, rank: int) -> dict[str, Any]:
    """``index`` (rank ``rank``'s ``__<r>_0.index``, unpacked) when it has the fields :func:`_write_index` writes."""
    items = index.get("items") if isinstance(index, dict) else None
    good = (isinstance(index, dict) and index.get("file") == data_file(rank) and _is_ints([index.get("bytes")])
            and isinstance(items, list))
    for item in items if good else []:
        good = (isinstance(item, list) and len(item) == 8 and isinstance(item[0], str) and isinstance(item[1], str)
                and dtype_named(item[1]) is not None and _is_ints(item[2])
                and _is_ints(item[3]) and _is_ints(item[4]) and _is_ints(item[5:8]))
        if not good:
            break
    if not good:
        raise CheckpointError(f"{path} is not a rank's checkpoint index (expected file {data_file(rank)!r}, its "
                              f"size and items of key, dtype, shape, offsets, sizes, offset, length, crc32).", path)
    return index


def _wait_for_indexes(tmp: str, world: int, timeout_s: float,
                      lost: Callable[[list[int]], dict[int, str]] | None = None) -> list[dict[str, Any]]:
    """Every rank's index (rank 0 polls for them); a failed marker, a rank ``lost`` names, or the timeout raise.

    ``lost(ranks)`` returns ``{rank: why}`` for those of ``ranks`` that are gone (it may raise
    ``ConnectionError`` when it cannot tell); asked every :data:`_LIVENESS_S` about the ranks not yet done.
    """
    deadline = time.monotonic() + timeout_s
    found: dict[int, dict[str, Any]] = {}
    next_look = time.monotonic() + _LIVENESS_S
    while True:
        for r in range(world):
            if r in found:
                continue
            failed = os.path.join(tmp, failed_file(r))
            if os.path.exists(failed):
                with open(failed, "rb") as fh:
                    raise CheckpointError(f"rank {r} failed to write its checkpoint files: "
                                          f"{fh.read().decode(errors='replace')}", failed)
            path = os.path.join(tmp, index_file(r))
            if os.path.exists(path):
                with open(path, "rb") as fh:
                    found[r] = _check_index(unpack(fh.read(), where=path), path, r)  # data only
        if len(found) == world:
            return [found[r] for r in range(world)]
        if lost is not None and time.monotonic() >= next_look:
            missing = [r for r in range(world) if r not in found]
            try:
                gone = lost(missing)
            except ConnectionError as exc:
                raise CheckpointError(f"save_checkpoint: cannot tell whether ranks {missing} are still writing: {exc}; "
                                      f"the save is not published.", tmp) from exc
            if gone:
                whys = "; ".join(f"rank {r}: {why}" for r, why in sorted(gone.items()))
                first = os.path.join(tmp, index_file(min(gone)))
                raise CheckpointError(f"save_checkpoint: rank{'s' if len(gone) > 1 else ''} "
                                      f"{', '.join(map(str, sorted(gone)))} died before finishing "
                                      f"{'their' if len(gone) > 1 else 'its'} checkpoint files ({whys}; missing "
                                      f"{first}); the save is not published.", first)
            next_look = time.monotonic() + _LIVENESS_S
        if time.monotonic() > deadline:
            missing = [os.path.join(tmp, index_file(r)) for r in range(world) if r not in found]
            raise CheckpointError(f"save_checkpoint: ranks {[r for r in range(world) if r not in found]} did not "
                                  f"finish writing within {timeout_s:g} s (missing {missing[:4]}); the save is "
                                  f"not published.", missing[0])
        time.sleep(_POLL_S)


def finalize(tmp: str, world: int, manifest: dict[str, Any], timeout_s: float = 1800.0,
             lost: Callable[[list[int]], dict[int, str]] | None = None) -> None:
    """Rank 0: wait for every rank's index, then write ``.metadata`` and the manifest (with the checksums).

    The wait ends with a :class:`CheckpointError` after ``timeout_s``, or as soon as ``lost`` (see
    :func:`_wait_for_indexes`) names a rank that is gone. The caller publishes the tag afterwards; until
    then nothing names it.
    """
    indexes = _wait_for_indexes(tmp, world, timeout_s, lost)
    state: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    files: dict[str, Any] = {}
    for index in indexes:
        files[index["file"]] = {"bytes": index["bytes"], "checksum": CHECKSUM,
                                "items": [[at, n, crc] for *_rest, at, n, crc in index["items"]]}
        for key, dtype, shape, offsets, sizes, at, n, _crc in index["items"]:
            meta = state.get(key)
            if meta is None:
                props = TensorProperties(dtype=getattr(torch, dtype))
                meta = state[key] = TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=[])
            meta.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(index["file"], at, n)
    metadata = Metadata(state_dict_metadata=dict(state), planner_data={"format": RAW_FORMAT}, storage_data=storage)
    _write_bytes(os.path.join(tmp, _DCP_INDEX), pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))
    rng = [index.get("rng") for index in indexes]
    extra = {"rng": rng} if any(r is not None for r in rng) else {}
    _write_bytes(os.path.join(tmp, MANIFEST), pack({**manifest, **extra, "tensor_files": files}))
    for r in range(world):
        try:
            os.remove(os.path.join(tmp, index_file(r)))
        except OSError:
            pass
    _fsync_dir(tmp)


def is_raw(metadata: Metadata) -> bool:
    """Whether the index was written by this module (else by DCP's own writer: the older layout)."""
    return isinstance(metadata.planner_data, dict) and metadata.planner_data.get("format") == RAW_FORMAT


def read_boxes(tag_dir: str, metadata: Metadata, files: dict[str, Any] | None,
               requests: list[tuple[str, tuple[int, ...], torch.Tensor]]) -> int:
    """Fill each ``(key, offsets, target)``: the box of ``key`` at ``offsets`` of ``target``'s shape.

    Each saved chunk that overlaps a request is read once (file order), its crc32 checked against
    ``files`` (the manifest's ``tensor_files``), and the overlap copied (cast to the target's dtype). A chunk
    is read a window of whole rows (its first dimension) at a time, at most :data:`STREAM_CHUNK_BYTES` or one
    row, so reading holds no more than that beside the targets: returns the largest window's bytes.
    """
    needs: dict[MetadataIndex, list[tuple[tuple[slice, ...], torch.Tensor]]] = {}
    for key, offsets, target in requests:
        meta = metadata.state_dict_metadata[key]
        want = 1
        for s in target.shape:
            want *= s
        got = 0
        for chunk in meta.chunks:
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets, strict=True)]
            hi = [min(o + s, c + z) for o, s, c, z in zip(offsets, target.shape, chunk.offsets, chunk.sizes,
                                                           strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            src = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk.offsets, strict=True))
            dst = target.detach()[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))]
            needs.setdefault(MetadataIndex(key, chunk.offsets), []).append((src, dst))
            n = 1
            for a, b in zip(lo, hi, strict=True):
                n *= b - a
            got += n
        if got != want:
            raise CheckpointError(f"{tag_dir}: the checkpoint holds {got} of the {want} elements of {key!r} at "
                                  f"{list(offsets)} (an incomplete index?).", tag_dir)
    by_file: dict[str, list[tuple[int, int, MetadataIndex]]] = {}
    largest = 0
    for index in needs:
        info = metadata.storage_data[index]
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index))
    for rel, chunks in sorted(by_file.items()):
        path = resolve_inside(tag_dir, rel, os.path.join(tag_dir, _DCP_INDEX))
        crcs = {at: crc for at, _n, crc in (files or {}).get(rel, {}).get("items", [])} if files is not None else None
        with open(path, "rb") as fh:
            for at, length, index in sorted(chunks, key=lambda c: c[0]):
                meta = metadata.state_dict_metadata[index.fqn]
                chunk = next(c for c in meta.chunks if c.offsets == index.offset)
                rows = chunk.sizes[0] if len(chunk.sizes) else 1
                row_bytes = length // rows if rows else length
                per = max(1, STREAM_CHUNK_BYTES // max(1, row_bytes)) if len(chunk.sizes) else 1
                raw = torch.empty(min(length, per * row_bytes), dtype=torch.uint8)
                largest = max(largest, raw.numel())
                actual = 0
                fh.seek(at)
                for r0 in range(0, max(rows, 1), per):  # a window of whole rows at a time: bounded memory
                    r1 = min(rows, r0 + per) if len(chunk.sizes) else 1
                    n = (r1 - r0) * row_bytes
                    window = raw[:n]
                    got = fh.readinto(memoryview(window.numpy()).cast("B")) if n else 0
                    if got != n:
                        raise CheckpointError(f"{path} is truncated: {index.fqn!r} needs bytes {at}..{at + length}, "
                                              f"the file ends at {at + r0 * row_bytes + got}.", path)
                    if crcs is not None:
                        actual = zlib.crc32(memoryview(window.numpy()).cast("B"), actual)
                    if not len(chunk.sizes):
                        saved = window.view(meta.properties.dtype).view(())
                        with torch.no_grad():
                            for src, dst in needs[index]:
                                dst.copy_(saved[src])
                        continue
                    saved = window.view(meta.properties.dtype).view((r1 - r0, *chunk.sizes[1:]))
                    with torch.no_grad():
                        for src, dst in needs[index]:
                            a, b = max(src[0].start, r0), min(src[0].stop, r1)
                            if a < b:
                                dst[a - src[0].start:b - src[0].start].copy_(saved[(slice(a - r0, b - r0), *src[1:])])
                if crcs is not None:
                    expected = crcs.get(at)
                    if expected is None or actual != expected:
                        raise CheckpointError(
                            f"{path}: reading checkpoint tensors failed: checksum mismatch in bytes "
                            f"{at}..{at + length} ({index.fqn!r}): {CHECKSUM} {actual:#010x}, the manifest says "
                            f"{'nothing' if expected is None else f'{expected:#010x}'}. The file is corrupted; "
                            f"load another tag.", path)
    return largest
