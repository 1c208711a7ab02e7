"""A checkpoint's tensor index (``.metadata``: DCP's ``Metadata``), read as data, never as an open pickle.

``torch.distributed.checkpoint`` writes its index with ``pickle`` and reads it back with ``pickle.load``, so a
crafted ``.metadata`` runs whatever it names. microspeed keeps DCP's file (the tools that read DCP checkpoints
read ours) but reads it with :class:`IndexUnpickler`, which admits exactly the classes a DCP index holds —
DCP's metadata dataclasses, ``torch.Size``, torch dtypes and layouts, the ``pathlib`` path of the checkpoint
id — and refuses every other global. :func:`read_index_file` then checks the shape of what it read (every
tensor a :class:`~torch.distributed.checkpoint.metadata.TensorStorageMetadata` whose chunks lie inside it, every
storage entry a file name, offset and length), so the readers can trust the types and sizes; where the files
named lie is checked by :func:`~microspeed.checkpoint.read_tensor_index`. :class:`CheckedFileSystemReader` is
DCP's ``FileSystemReader`` that hands DCP the index read this way instead of unpickling the file itself.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from microspeed.checkpoint.errors import CheckpointError
from microspeed.checkpoint.manifest import dtype_named

__all__ = ["CheckedFileSystemReader", "IndexUnpickler", "read_index_file"]

MAX_INDEX_BYTES = 1 << 30
"""The largest ``.metadata`` read (1 GiB: an index holds a few hundred bytes per tensor chunk)."""

_ADMITTED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", cls.__name__): cls for cls in (
        Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex,
        StorageMeta, dcp_metadata._MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): OrderedDict,
}


class _NotAnIndex(pickle.UnpicklingError):
    """A global outside :data:`_ADMITTED` (the pickle would run or build something an index never holds)."""


class IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index: ``find_class`` admits exactly DCP's metadata classes and the torch types they hold."""

    def find_class(self, module: str, name: str) -> Any:
        """The admitted class or function ``module.name``; anything else raises (nothing is imported or called)."""
        found = _ADMITTED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and dtype_named(name) is not None:
            return dtype_named(name)
        raise _NotAnIndex(f"it names {module}.{name}, which a tensor index never holds")

    def persistent_load(self, pid: Any) -> Any:
        """Refused: an index holds no persistent references."""
        raise _NotAnIndex("it holds a persistent reference, which a tensor index never holds")


def _is_size(value: Any, dims: int | None = None) -> bool:
    return (isinstance(value, torch.Size) and (dims is None or len(value) == dims) and len(value) <= 64
            and all(type(n) is int and 0 <= n < 2**62 for n in value))


def _numel(size: torch.Size) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _check(metadata: Any, path: str) -> Metadata:
    """``metadata`` when its parts have the types and bounds a tensor index has; else :class:`CheckpointError`."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path} is not a valid tensor index: {why}.", path)

    if not isinstance(metadata, Metadata):
        raise bad(f"it holds a {type(metadata).__name__}, not torch.distributed.checkpoint's Metadata")
    tensors, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(tensors, dict) or not isinstance(storage, dict):
        raise bad("its state_dict_metadata and storage_data are not dicts")
    # storage.RAW_FORMAT (not imported: storage imports this module through layout)
    raw = isinstance(metadata.planner_data, dict) and metadata.planner_data.get("format") == "microspeed.raw.1"
    chunks: dict[MetadataIndex, tuple[TensorStorageMetadata, ChunkStorageMetadata]] = {}
    for key, meta in tensors.items():
        if isinstance(meta, BytesStorageMetadata):
            raise bad(f"{key!r} is a pickled bytes item (DCP unpickles those on load); microspeed checkpoints hold "
                      f"tensors only")
        if not (isinstance(key, str) and isinstance(meta, TensorStorageMetadata)
                and isinstance(meta.properties, TensorProperties) and isinstance(meta.properties.dtype, torch.dtype)
                and _is_size(meta.size) and isinstance(meta.chunks, list)):
            raise bad(f"entry {str(key)[:80]!r} is not a tensor's description")
        covered = 0
        for chunk in meta.chunks:
            if not (isinstance(chunk, ChunkStorageMetadata) and _is_size(chunk.offsets, len(meta.size))
                    and _is_size(chunk.sizes, len(meta.size))
                    and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, meta.size, strict=True))):
                raise bad(f"a chunk of {key!r} lies outside its shape {list(meta.size)}")
            covered += _numel(chunk.sizes)
            chunks[MetadataIndex(key, chunk.offsets)] = (meta, chunk)
        if covered < _numel(meta.size):
            raise bad(f"the chunks of {key!r} hold {covered} of its {_numel(meta.size)} elements")
    for index, info in storage.items():
        if not (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo)
                and isinstance(info.relative_path, str) and type(info.offset) is int and type(info.length) is int
                and 0 <= info.offset < 2**62 and 0 <= info.length < 2**62):
            raise bad("a storage entry is not (file name, offset, length)")
        found = chunks.get(index) if isinstance(index.fqn, str) and isinstance(index.offset, torch.Size) else None
        if found is None:
            raise bad(f"a storage entry names {str(index.fqn)[:80]!r} at {index.offset}, which no tensor chunk is")
        meta, chunk = found
        if raw and info.length != _numel(chunk.sizes) * meta.properties.dtype.itemsize:
            raise bad(f"the bytes of {index.fqn!r} at {list(index.offset)} ({info.length}) are not its chunk's size")
    missing = next((index for index in chunks if index not in storage), None)
    if missing is not None:
        raise bad(f"the chunk of {missing.fqn!r} at {list(missing.offset or ())} is stored nowhere")
    return metadata


def read_index_file(path: str) -> Metadata:
    """The tensor index at ``path`` (a ``.metadata``), read with :class:`IndexUnpickler` and checked.

    Raises :class:`CheckpointError` naming ``path`` when it holds anything but a tensor index — a global outside
    the admitted classes (never imported nor called: "not data"), truncated or foreign bytes, or parts of the
    wrong type or size.
    """
    try:
        size = os.path.getsize(path)
        if size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{path} is {size} bytes, more than a tensor index ({MAX_INDEX_BYTES}).", path)
        with open(path, "rb") as fh:
            data = fh.read()
        metadata = IndexUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except _NotAnIndex as exc:
        raise CheckpointError(f"{path} is not data: {exc}; microspeed reads a tensor index with an unpickler that "
                              f"admits only torch.distributed.checkpoint's metadata classes, and never runs what a "
                              f"checkpoint file holds. Load a checkpoint from a trusted source.", path) from None
    except Exception as exc:  # UnpicklingError, EOFError, ValueError, TypeError, MemoryError... from foreign bytes
        raise CheckpointError(f"{path} is not a readable torch.distributed.checkpoint index (truncated or foreign "
                              f"file: {type(exc).__name__}: {str(exc)[:200]}).", path) from None
    return _check(metadata, path)


class CheckedFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader over a tag folder whose index was read by :func:`read_index_file` (``metadata``).

    DCP's own ``read_metadata`` unpickles ``.metadata`` with ``pickle.load``; this one returns the checked index.
    """

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked index (a per-rank ``__<r>.metadata`` is not part of a microspeed checkpoint: refused)."""
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: a per-rank DCP index was asked for; microspeed checkpoints have one "
                                  f"index (.metadata).", str(self.path))
        if getattr(self._checked, "storage_meta", None) is None:
            self._checked.storage_meta = StorageMeta()
        self._checked.storage_meta.load_id = self.load_id
        return self._checked
