"""The files of a checkpoint on disk: tags, ``latest``, tag folders, manifest and tensor index, atomic publish.

See :mod:`microspeed.checkpoint` for the layout. Writing goes into ``<tag>.tmp-<nonce>``; :func:`_publish`
renames it to ``<tag>`` and then replaces ``latest``, so an interrupted save never changes what loads."""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import shutil
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from microspeed import comm
from microspeed.checkpoint.errors import CheckpointError
from microspeed.checkpoint.manifest import unpack

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

    ``tensors`` are the tensor keys (``model/...``, ``optim/...``); ``manifest`` as :func:`new_manifest`
    makes it. Returns the tag folder. Same format, checksums and safety as :func:`save`.
    """
    from microspeed.checkpoint import storage

    tag = _check_tag(str(tag))
    os.makedirs(save_dir, exist_ok=True)
    tmp = os.path.join(save_dir, f"{tag}{_TMP}{secrets.token_hex(6)}")
    os.makedirs(tmp)
    staging = storage.Staging()
    layout = staging.stage(storage.local_items(tensors))
    storage.write_rank_file(tmp, 0, staging.buffer, layout)
    storage.finalize(tmp, 1, manifest, timeout_s=60.0)
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
