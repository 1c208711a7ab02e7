"""The files of a checkpoint on disk: tags, ``latest``, tag folders, manifest and tensor index, atomic publish.

See :mod:`microspeed.checkpoint` for the layout. Writing goes into ``<tag>.tmp-<nonce>``; :func:`_publish`
puts it under ``<tag>`` and only then replaces ``latest``, so an interrupted save never changes what loads.

**Publishing over an existing tag.** A folder that is not empty cannot be replaced by ``rename(2)``, and the
obvious two renames (the old folder away, the new one in) leave an instant with no ``<tag>`` at all while
``latest`` already names it: a crash there made the load fail and auto-resume start from step 0. So a re-save
*exchanges* the two folders with Linux's ``renameat2(RENAME_EXCHANGE)`` (called through ``ctypes``: one
atomic step, a complete folder under ``<tag>`` at every instant, the old one left under the temporary name
and deleted after ``latest`` is written). Why this and not the other ways: a symlink per tag (``<tag>`` ->
``<tag>.v<n>``) would also swap atomically, but it changes the layout DeepSpeed's tools and users' scripts
read, and every reader would have to follow a link we then have to check stays inside the folder; writing
``latest`` to a new, unique tag name each time would change the tag the user asked for. Where the exchange
is not available (another OS, a kernel before 3.15, a file system that refuses it such as NFS:
``EINVAL``/``ENOSYS``/``EOPNOTSUPP``), :func:`_publish` falls back to the two renames, the old folder moved
to ``<tag>.tmp-old-<nonce>``, and the readers recover the one window that leaves: when ``latest`` names a
tag whose folder is missing, :func:`microspeed.checkpoint.load`, :func:`resolve_tag_dir` and auto-resume
(:mod:`microspeed.checkpoint.resume`) take the newest complete ``<tag>.tmp-*`` folder instead, with a
warning. Every such leftover (``<tag>.tmp-*``, and ``<tag>.old.tmp-*`` of earlier versions) is removed by
the next publish of that tag and never counts as a tag otherwise.

**Paths from files stay inside their folder.** A tag read from ``latest`` and every ``relative_path`` of the
tensor index are names inside their checkpoint folder: :func:`resolve_inside` refuses an absolute path, a
``..``, and anything whose real path (symlinks followed) leaves the folder, with a :class:`CheckpointError`
naming the file that holds the path and the path. :func:`_check_tag` refuses, at save, tags that would not
load back (surrounding whitespace, control characters, separators, over :data:`TAG_MAX_BYTES` bytes), and
:func:`check_folder` a save or load folder that is ``None`` or empty (never the current directory).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import os
import secrets
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from microspeed import comm
from microspeed.checkpoint.errors import CheckpointError, CheckpointNotFoundError, CheckpointWarning
from microspeed.checkpoint.manifest import unpack
from microspeed.checkpoint.tensor_index import read_index_file

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


TAG_MAX_BYTES = 200
"""The longest tag :func:`_check_tag` accepts, in UTF-8 bytes (a folder name is at most 255, and the temporary
``<tag>.tmp-<nonce>`` folders need the rest)."""
_LATEST_MAX_CHARS = 4096


def _check_tag(tag: str) -> str:
    """``tag`` when it is a plain folder name that loads back as written; else :class:`CheckpointError` saying why."""
    try:
        size = len(tag.encode("utf-8"))
    except UnicodeEncodeError:
        size = -1
    if tag != tag.strip():
        why = (f"has whitespace around it: `latest` is read back stripped, so it would name {tag.strip()!r} "
               f"and the load fails; pass tag={tag.strip()!r}")
    elif size < 0 or not tag.isprintable():
        why = "holds a control or unencodable character; use letters, digits, '_', '-' and '.'"
    elif size > TAG_MAX_BYTES:
        why = f"is {size} bytes long; a tag is at most {TAG_MAX_BYTES}"
    elif (not tag or tag in (".", "..", LATEST) or "/" in tag or os.sep in tag or _TMP in tag
          or tag.startswith(".")):
        why = "would not be one folder of the save folder (no '/', not 'latest', not starting with '.', no '.tmp-')"
    else:
        return tag
    raise CheckpointError(f"checkpoint tag {tag!r} is not a plain folder name that loads back: it {why}. Use "
                          f"something like 'global_step100'.")


def check_folder(folder: Any, argument: str, call: str) -> None:
    """Refuse a checkpoint folder argument that names no folder: ``None``, ``''``, or not a path at all.

    Each rank checks its own argument before any collective, so a rank never waits for one that
    refused it. DeepSpeed raises ``ValueError`` for an empty ``save_dir``; :class:`CheckpointError` is one.
    An empty path would otherwise write into (or read from) the current directory.
    """
    if isinstance(folder, (str, os.PathLike)) and not isinstance(os.fspath(folder), bytes) and os.fspath(folder):
        return
    raise CheckpointError(f"{call}: {argument} must name a folder (a non-empty str or path), got {folder!r}; "
                          f"pass the checkpoint folder, e.g. engine.{call}('checkpoints').")


def resolve_inside(folder: str, rel: str, holder: str) -> str:
    """``folder/rel``, when ``rel`` (a path read from the file ``holder``) names something inside ``folder``.

    Refused with a :class:`CheckpointError` naming ``holder`` and ``rel``: an absolute path, a ``..`` part, an
    empty name or a NUL, and any path whose real path (every symlink followed) is not strictly inside
    ``folder``'s real path. What does not exist yet is resolved as far as it exists.
    """
    why = None
    if not isinstance(rel, str) or not rel or "\0" in rel:
        why = "is not a file name"
    elif os.path.isabs(rel) or rel.startswith(("/", os.sep)):
        why = "is an absolute path"
    elif ".." in rel.replace(os.sep, "/").split("/"):
        why = "climbs out with '..'"
    else:
        base = os.path.realpath(folder)
        real = os.path.realpath(os.path.join(folder, rel))
        if real == base or os.path.commonpath([base, real]) != base:
            why = f"resolves to {real}, outside {base} (a symlink leading out?)"
    if why is not None:
        raise CheckpointError(f"{holder} names the path {rel!r}, which {why}: every path a checkpoint file names "
                              f"must stay inside {folder}. The file is damaged or was crafted; refusing to follow "
                              f"it.", holder)
    return os.path.join(folder, rel)


def read_latest(save_dir: str) -> str | None:
    """The tag ``<save_dir>/latest`` names, or ``None`` when there is no such file.

    The tag must be a folder name inside ``save_dir`` (:func:`resolve_inside`): ``../other/tag``, an
    absolute path or a symlink leading out is a :class:`CheckpointError` naming the ``latest`` file.
    """
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            tag = fh.read(_LATEST_MAX_CHARS + 1).strip()
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text ({exc}); it should name a tag folder of {save_dir}.",
                              path) from exc
    if not tag:
        raise CheckpointError(f"{path} is empty; it should name a tag folder of {save_dir}.", path)
    if len(tag) > _LATEST_MAX_CHARS or not tag.isprintable():
        raise CheckpointError(f"{path} holds more than one line or unprintable characters; it should name one tag "
                              f"folder of {save_dir}.", path)
    resolve_inside(save_dir, tag, path)
    return tag


def leftovers(save_dir: str, tag: str | None = None) -> list[str]:
    """Folders of ``save_dir`` an interrupted save or publish left (of ``tag``, or of any tag), sorted.

    ``<tag>.tmp-<nonce>`` (a save being written, or the previous folder a publish moved out of the way) and
    ``<tag>.old.tmp-<nonce>`` (the name earlier versions moved it to). Never a tag of their own: the next
    publish of ``tag`` deletes them.
    """
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    prefixes = (f"{tag}{_TMP}", f"{tag}.old{_TMP}") if tag is not None else None
    return sorted(n for n in names if (_TMP in n if prefixes is None else n.startswith(prefixes))
                  and os.path.isdir(os.path.join(save_dir, n)))


def latest_tag_dir(save_dir: str, tag: str, warn: Callable[[str], None]) -> str:
    """The folder to load for the tag ``latest`` names: ``save_dir/tag``, or, when a publish was interrupted
    between its two renames (see the module docstring) and that folder is missing, the newest complete
    leftover of ``tag`` (``warn`` is told which, and why)."""
    tag_dir = os.path.join(save_dir, tag)
    if os.path.lexists(tag_dir):
        return tag_dir
    from microspeed.checkpoint.resume import newest_complete

    found = newest_complete(save_dir, leftovers(save_dir, tag))
    if found is None:
        return tag_dir
    warn(f"{os.path.join(save_dir, LATEST)} names {tag!r}, whose folder is missing (a save of it was interrupted "
         f"while publishing); loading {os.path.join(save_dir, found)}, the newest complete folder that save left")
    return os.path.join(save_dir, found)


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
    return latest_tag_dir(ckpt_dir, latest, _warn)


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)


def read_manifest(tag_dir: str) -> dict[str, Any]:
    """The manifest of the tag folder ``tag_dir``; :class:`CheckpointError` if unreadable or foreign."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        hint = ""
        if os.path.isdir(tag_dir) and any(n.endswith("_model_states.pt") for n in os.listdir(tag_dir)):
            hint = (" It holds a DeepSpeed checkpoint: convert it with "
                    "`microspeed checkpoint import-deepspeed DS_DIR OUT_DIR`.")
        raise CheckpointNotFoundError(f"load_checkpoint: {path} does not exist (tag {os.path.basename(tag_dir)!r} in "
                                      f"{os.path.dirname(tag_dir) or '.'}).{hint}", path)
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
    metadata = read_index_file(path)  # restricted unpickler: never runs what the file holds
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(needed.items()):
        full = resolve_inside(tag_dir, rel, path)
        if not os.path.isfile(full):
            raise CheckpointError(f"{full} is missing (named by {path}).", full)
        size = os.path.getsize(full)
        if size < end:
            raise CheckpointError(f"{full} is truncated: {size} bytes, the index needs {end}.", full)
    return metadata


def _find_unreadable_file(tag_dir: str, metadata: Metadata) -> str | None:
    """After DCP failed to read: the first data file with an item ``torch.load`` cannot read."""
    for info in sorted((metadata.storage_data or {}).values(), key=lambda i: (i.relative_path, i.offset)):
        full = resolve_inside(tag_dir, info.relative_path, os.path.join(tag_dir, _DCP_INDEX))
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


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
_renameat2: list[Any] = []


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` (nothing
    changed) where this system or file system cannot, other failures raise :class:`OSError`."""
    if not _renameat2:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
            except (AttributeError, OSError):  # a libc without the wrapper (glibc < 2.28)
                fn = None
        _renameat2.append(fn)
    fn = _renameat2[0]
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _publish(save_dir: str, tag: str, tmp: str, save_latest: bool) -> None:
    """Rank 0, after every rank finished: ``tmp`` becomes ``<tag>``, then ``latest`` names it.

    A complete folder is under ``<tag>`` at every instant: an existing one is exchanged with ``tmp`` in one step
    (the two renames where the exchange is not available; see the module docstring). The previous folder and
    every leftover of earlier interrupted saves of ``tag`` are deleted once ``latest`` is written.
    """
    final = os.path.join(save_dir, tag)
    if not os.path.lexists(final):
        os.rename(tmp, final)
    elif not _exchange(tmp, final):  # ``tmp`` now holds the previous folder when the exchange happened
        os.rename(final, f"{final}{_TMP}old-{secrets.token_hex(4)}")
        os.rename(tmp, final)
    _fsync_dir(save_dir)
    if save_latest:
        _write_bytes(os.path.join(save_dir, LATEST), tag.encode())
        _fsync_dir(save_dir)
    for name in leftovers(save_dir, tag):  # the previous folder, and leftovers of earlier interrupted saves
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    for name in os.listdir(save_dir):  # ``latest`` files a crash left half-written
        if name.startswith(f"{LATEST}{_TMP}"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(save_dir, name))


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
