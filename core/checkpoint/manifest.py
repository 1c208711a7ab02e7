"""The two halves of a checkpoint: tensors (for ``torch.distributed.checkpoint``) and a msgpack manifest.

A state tree (nested dicts, lists, tuples, tensors and small Python values — a plugin's state, an
optimizer's ``state_dict()``, the client state) is *split*: every tensor leaf goes into a flat
``{key: tensor}`` dict under a ``/``-joined key built from its path (``optim/fc1.weight/exp_avg``),
and is replaced in the tree by a :class:`TensorRef` naming that key. The tree left over holds only
small values and is packed with msgpack into the manifest. :func:`join` puts loaded tensors back.
Zero-dimensional tensors (Adam's ``step``) are small values: they stay in the manifest, with their
dtype, because every DCP item costs a ``torch.save``/``torch.load`` of its own.

msgpack carries ``None``, bools, ints, floats, strings, bytes, lists and dicts natively. Extension
types keep what else a state dict holds: tuples (``betas``), :class:`TensorRef`, ``torch.dtype``;
any other object (a ``set``, an ``Enum``, a namedtuple) is pickled into the manifest, as
``torch.save`` would have done — a checkpoint is trusted input, as with DCP's own ``.metadata``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

__all__ = ["TensorRef", "join", "pack", "split", "unpack"]

_EXT_TUPLE = 1
_EXT_TENSOR_REF = 2
_EXT_DTYPE = 3
_EXT_PICKLE = 4
_EXT_SCALAR = 5


@dataclass(frozen=True)
class TensorRef:
    """Stands in the manifest for a tensor stored by DCP under ``key``."""

    key: str


def split(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Move every tensor of ``tree`` into ``tensors`` (keys under ``prefix``); return the small rest.

    Dict keys become path components (``str(key)``); list and tuple items their index. Two leaves
    that would get the same key (a dict key containing ``/``, say) raise :class:`ValueError`.
    """
    if type(tree) is torch.Tensor and tree.dim() == 0:
        return tree.detach().cpu().clone()
    if isinstance(tree, torch.Tensor):
        if prefix in tensors:
            raise ValueError(f"checkpoint key {prefix!r} is produced twice; rename the state entry")
        tensors[prefix] = tree.detach()
        return TensorRef(prefix)
    if isinstance(tree, Mapping):
        return {k: split(v, f"{prefix}/{k}", tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]
    if type(tree) is tuple:
        return tuple(split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree))
    return tree


def tensor_refs(tree: Any) -> list[TensorRef]:
    """Every :class:`TensorRef` in ``tree``, in tree order."""
    found: list[TensorRef] = []
    _walk(tree, found.append)
    return found


def _walk(tree: Any, visit: Callable[[TensorRef], None]) -> None:
    if isinstance(tree, TensorRef):
        visit(tree)
    elif isinstance(tree, Mapping):
        for v in tree.values():
            _walk(v, visit)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _walk(v, visit)


def join(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`split`: ``tree`` with each :class:`TensorRef` replaced by its tensor."""
    if isinstance(tree, TensorRef):
        return tensors[tree.key]
    if isinstance(tree, Mapping):
        return {k: join(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join(v, tensors) for v in tree]
    if type(tree) is tuple:
        return tuple(join(v, tensors) for v in tree)
    return tree


def _default(obj: Any) -> Any:
    if isinstance(obj, TensorRef):
        return msgpack.ExtType(_EXT_TENSOR_REF, obj.key.encode())
    if type(obj) is tuple or type(obj) is torch.Size:
        return msgpack.ExtType(_EXT_TUPLE, pack(list(obj)))
    if isinstance(obj, torch.dtype):
        return msgpack.ExtType(_EXT_DTYPE, str(obj).removeprefix("torch.").encode())
    if isinstance(obj, Mapping) and type(obj).__module__ == "collections":  # OrderedDict, defaultdict
        return dict(obj)
    if type(obj).__module__ == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:
        return obj.item()
    if type(obj) is torch.Tensor and obj.dim() == 0:
        raw = obj.detach().cpu().reshape(1).view(torch.uint8).numpy().tobytes()
        return msgpack.ExtType(_EXT_SCALAR, pack([str(obj.dtype).removeprefix("torch."), raw]))
    if isinstance(obj, torch.Tensor):  # a tensor that was not split out: keep it, but it is no longer small
        return msgpack.ExtType(_EXT_PICKLE, pickle.dumps(obj.detach().cpu(), protocol=pickle.HIGHEST_PROTOCOL))
    return msgpack.ExtType(_EXT_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TENSOR_REF:
        return TensorRef(data.decode())
    if code == _EXT_TUPLE:
        return tuple(unpack(data))
    if code == _EXT_DTYPE:
        return getattr(torch, data.decode())
    if code == _EXT_SCALAR:
        dtype, raw = unpack(data)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(())
    if code == _EXT_PICKLE:
        return pickle.loads(data)
    return msgpack.ExtType(code, data)


def pack(obj: Any) -> bytes:
    """msgpack bytes of a small-value tree (tuples, dtypes and :class:`TensorRef` kept)."""
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """The tree :func:`pack` packed (raises msgpack's errors on foreign or truncated bytes)."""
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True)
