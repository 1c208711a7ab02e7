"""The two halves of a checkpoint: tensors (for ``torch.distributed.checkpoint``) and a msgpack manifest.

A state tree (nested dicts, lists, tuples, tensors and small Python values — a plugin's state, an
optimizer's ``state_dict()``, the client state) is *split*: every tensor leaf goes into a flat
``{key: tensor}`` dict under a ``/``-joined key built from its path (``optim/fc1.weight/exp_avg``),
and is replaced in the tree by a :class:`TensorRef` naming that key. The tree left over holds only
small values and is packed with msgpack into the manifest. :func:`join` puts loaded tensors back.
Zero-dimensional tensors (Adam's ``step``) are small values: they stay in the manifest, with their
dtype, because every DCP item costs a ``torch.save``/``torch.load`` of its own.

**The manifest is data.** msgpack carries ``None``, bools, ints, floats, strings, bytes, lists and dicts
natively. Extension types keep what else a state dict holds, each as plain bytes: tuples (``betas``),
:class:`TensorRef`, ``torch.dtype``, tensors (dtype, shape, raw bytes) and numpy arrays of numbers. Nothing
is ever pickled: any other object (a ``set``, an ``Enum``, a class instance) is refused at save with a
:class:`~microspeed.checkpoint.errors.CheckpointError` naming its path in the state, and a manifest that holds
a pickle (extension type 4, written by microspeed before this rule) or an unknown extension is refused at
load, never unpickled. The one pickle older manifests always held, ``torch.__version__``, is recognised
by its exact opcodes and read back as a string without running the pickle machine.
"""

from __future__ import annotations

import functools
import pickletools
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from torch.torch_version import TorchVersion

from microspeed.checkpoint.errors import CheckpointError

__all__ = ["TensorRef", "dtype_named", "join", "pack", "split", "unpack"]

_EXT_TUPLE = 1
_EXT_TENSOR_REF = 2
_EXT_DTYPE = 3
_EXT_PICKLE = 4  # written by microspeed before manifests were data-only: refused on load (see _legacy_pickle)
_EXT_SCALAR = 5
_EXT_TENSOR = 6
_EXT_NDARRAY = 7
_MAX_DEPTH = 64  # nested extension payloads (tuples in tuples...) a manifest may hold


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


class _NotData(TypeError):
    """Raised inside :func:`pack` for a value that has no data-only encoding (carries the value)."""

    def __init__(self, obj: Any, why: str = "") -> None:
        super().__init__(type(obj).__name__)
        self.obj, self.why = obj, why


def _dtype_name(dtype: torch.dtype) -> bytes:
    return str(dtype).removeprefix("torch.").encode()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _default(obj: Any) -> Any:
    if isinstance(obj, TensorRef):
        return msgpack.ExtType(_EXT_TENSOR_REF, obj.key.encode())
    if type(obj) is tuple or type(obj) is torch.Size:
        return msgpack.ExtType(_EXT_TUPLE, _packb(list(obj)))
    if isinstance(obj, torch.dtype):
        return msgpack.ExtType(_EXT_DTYPE, _dtype_name(obj))
    if type(obj) is TorchVersion:  # torch.__version__ (a str subclass): its text
        return str(obj)
    if type(obj) in (dict, OrderedDict, defaultdict):
        return dict(obj)
    if type(obj).__module__ == "numpy":
        return _numpy(obj)
    if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided and not obj.is_quantized:
        if obj.dim() == 0:
            return msgpack.ExtType(_EXT_SCALAR, _packb([_dtype_name(obj.dtype).decode(), _tensor_bytes(obj)]))
        # a tensor that was not split out (inside a value split() does not enter): kept, as data
        return msgpack.ExtType(_EXT_TENSOR, _packb([_dtype_name(obj.dtype).decode(), list(obj.shape),
                                                  _tensor_bytes(obj)]))
    raise _NotData(obj)


def _numpy(obj: Any) -> Any:
    """A numpy scalar as its Python value; an array of numbers as (dtype, shape, bytes)."""
    ndim = getattr(obj, "ndim", None)
    kind = getattr(getattr(obj, "dtype", None), "kind", "")
    if ndim == 0 and hasattr(obj, "item") and kind in "biufc":
        return obj.item()
    if ndim is not None and kind and kind in "biufc" and hasattr(obj, "tobytes"):
        return msgpack.ExtType(_EXT_NDARRAY, _packb([obj.dtype.str, list(obj.shape), obj.tobytes()]))
    raise _NotData(obj, "only numpy numbers and arrays of numbers are data")


class _Refused(ValueError):
    """What the extension hook raises for bytes that are not data (turned into a CheckpointError by unpack)."""


def _legacy_pickle(data: bytes) -> str:
    """The one pickle manifests of older microspeed always held: ``torch.__version__``, read by its opcodes.

    The bytes are parsed (``pickletools.genops`` runs nothing) and accepted only when they are exactly a
    ``torch.torch_version.TorchVersion`` of one string; anything else is refused.
    """
    try:
        ops = [(op.name, arg) for op, arg, _pos in pickletools.genops(data)
               if op.name not in ("PROTO", "FRAME", "MEMOIZE")]
    except Exception as exc:
        raise _Refused(f"a malformed pickle ({type(exc).__name__})") from None
    if (len(ops) == 7 and ops[0] == ("SHORT_BINUNICODE", "torch.torch_version")
            and ops[1] == ("SHORT_BINUNICODE", "TorchVersion") and ops[2][0] == "STACK_GLOBAL"
            and ops[3][0] in ("SHORT_BINUNICODE", "BINUNICODE")
            and [name for name, _arg in ops[4:]] == ["TUPLE1", "NEWOBJ", "STOP"]):
        return str(ops[3][1])
    raise _Refused("msgpack extension type 4 holds a pickled Python object")


_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


def dtype_named(name: Any) -> torch.dtype | None:
    """The torch dtype called ``name`` (``"float32"``, ``"bfloat16"``), or ``None``: looked up in a table, so a
    name from a file never reaches ``getattr(torch, ...)`` (which imports submodules)."""
    return _DTYPES.get(name) if isinstance(name, str) else None


def _dtype(name: Any) -> torch.dtype:
    dtype = dtype_named(name)
    if dtype is None:
        raise _Refused(f"{str(name)[:40]!r} is not a torch dtype")
    return dtype


def _shape(shape: Any) -> tuple[int, ...]:
    if not (isinstance(shape, list) and len(shape) <= 64
            and all(type(n) is int and 0 <= n < 2**62 for n in shape)):
        raise _Refused(f"{str(shape)[:80]} is not a tensor shape")
    return tuple(shape)


def _sized(raw: Any, shape: tuple[int, ...], itemsize: int, what: str) -> None:
    numel = 1
    for n in shape:
        numel *= n
    if not isinstance(raw, bytes) or len(raw) != numel * itemsize:
        raise _Refused(f"a {what} of shape {list(shape)} needs {numel * itemsize} bytes, the manifest has "
                       f"{len(raw) if isinstance(raw, bytes) else type(raw).__name__}")


def _ext_hook(code: int, data: bytes, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise _Refused(f"extension values nested more than {_MAX_DEPTH} deep")
    if code == _EXT_TENSOR_REF:
        return TensorRef(data.decode())
    if code == _EXT_TUPLE:
        items = _unpack(data, depth + 1)
        if not isinstance(items, list):
            raise _Refused("a tuple that is not a list of values")
        return tuple(items)
    if code == _EXT_DTYPE:
        return _dtype(data.decode())
    if code in (_EXT_SCALAR, _EXT_TENSOR):
        fields = _unpack(data, depth + 1)
        if not isinstance(fields, list) or len(fields) != (2 if code == _EXT_SCALAR else 3):
            raise _Refused("a tensor that is not (dtype, [shape,] bytes)")
        dtype, raw = _dtype(fields[0]), fields[-1]
        shape = () if code == _EXT_SCALAR else _shape(fields[1])
        _sized(raw, shape, dtype.itemsize, "tensor")
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if code == _EXT_NDARRAY:
        import numpy as np

        fields = _unpack(data, depth + 1)
        if not isinstance(fields, list) or len(fields) != 3 or not isinstance(fields[0], str):
            raise _Refused("a numpy array that is not (dtype, shape, bytes)")
        try:
            dtype = np.dtype(fields[0])
        except TypeError:
            raise _Refused(f"{fields[0][:40]!r} is not a numpy dtype") from None
        if dtype.kind not in "biufc" or dtype.hasobject:
            raise _Refused(f"numpy dtype {fields[0][:40]!r} is not a number type")
        shape = _shape(fields[1])
        _sized(fields[2], shape, dtype.itemsize, "numpy array")
        return np.frombuffer(fields[2], dtype=dtype).reshape(shape).copy()
    if code == _EXT_PICKLE:
        return _legacy_pickle(data)
    raise _Refused(f"msgpack extension type {code} is not one microspeed writes")


def pack(obj: Any) -> bytes:
    """msgpack bytes of a small-value tree (tuples, dtypes, tensors and :class:`TensorRef` kept, as data).

    A value with no data-only encoding raises :class:`CheckpointError` naming its path in ``obj`` and its type.
    """
    try:
        return _packb(obj)
    except _NotData as exc:
        path = _path_of(obj, exc.obj)
        kind = f"{type(exc.obj).__module__}.{type(exc.obj).__qualname__}"
        raise CheckpointError(
            f"save_checkpoint: the state at {path or '?'!r} is a {kind} ({exc.why or 'not plain data'}); a "
            f"checkpoint stores plain values only (None, bool, int, float, str, bytes, lists, tuples, dicts with "
            f"str/int keys, tensors, torch dtypes, numpy numbers): store it as plain values (its fields, "
            f"a str or an int) and rebuild the object when the state is loaded.") from None


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


def _path_of(tree: Any, target: Any, prefix: str = "") -> str | None:
    """The ``/``-joined path of ``target`` (by identity) in ``tree``, or ``None``."""
    if tree is target:
        return prefix
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            if k is target:
                return f"{prefix}/{k!r} (a key)".lstrip("/")
            found = _path_of(v, target, f"{prefix}/{k}".lstrip("/"))
            if found is not None:
                return found
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            found = _path_of(v, target, f"{prefix}/{i}".lstrip("/"))
            if found is not None:
                return found
    return None


def _unpack(data: bytes, depth: int) -> Any:
    return msgpack.unpackb(data, ext_hook=functools.partial(_ext_hook, depth=depth), raw=False,
                           strict_map_key=False, use_list=True)


def unpack(data: bytes, where: str = "the manifest") -> Any:
    """The tree :func:`pack` packed, read as data only.

    Raises :class:`CheckpointError` naming ``where`` (the file) on foreign, truncated or malformed bytes, and
    on anything that is not data: a pickle (extension type 4) or an unknown extension is refused, never run.
    """
    try:
        return _unpack(data, 0)
    except _Refused as exc:
        raise CheckpointError(f"{where} is not data: {exc}; microspeed never unpickles or runs what a checkpoint "
                              f"file holds. Load a checkpoint from a trusted source, or re-save it with plain "
                              f"values.", where) from None
    except Exception as exc:  # msgpack raises many kinds (ExtraData, FormatError, StackError, ValueError...)
        raise CheckpointError(f"{where} is not readable msgpack (truncated, corrupted or foreign file: "
                              f"{type(exc).__name__}: {str(exc)[:200]}).", where) from None
