"""``zero.Init`` and ``GatheredParameters``: build partitioned models, look at whole parameters.

:class:`Init` partitions each module's parameters as soon as the module's constructor returns,
so a model larger than one rank's memory never exists whole: a parameter's ``.data`` becomes an
empty placeholder (``p.numel() == 0``; ``p.ds_shape`` / ``p.ds_numel`` give its real size) and
the rank keeps its flat 1/N in ``p._zero_init_shard`` (DeepSpeed's semantics: values are
broadcast from data-parallel rank 0 first, so every rank builds the same model).
``initialize()`` with stage 3 adopts such a model one module at a time.

A constructor may still touch parameters of sub-modules that were already partitioned — e.g. a
model's ``__init__`` that ends with ``self.reset_parameters()`` re-initialising every layer, or
tying weights. Inside the block a torch-function mode watches for that: a partitioned parameter
used by a torch function while a constructor runs is gathered first (collective, so every rank
builds the same model), and partitioned again right after an in-place function (``normal_``,
``nn.init.*_``, ``fill_`` …) or, after any other use (``.data``, ``.shape``), when the
constructor that used it returns. So a model built inside ``Init`` gets exactly the values it
gets outside (the random number generator is drawn in the same order).

:class:`GatheredParameters` makes partitioned parameters whole inside a ``with`` block; with
``modifier_rank`` the values that rank wrote are broadcast and partitioned again on exit (the
fp32 masters too, once an engine trains the model).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from microspeed.plugin_api import ConfigError, comm
from microspeed_zero.host_memory import return_freed_memory
from microspeed_zero.leaf import ZeroParamStatus, assign_ds_id

_local = threading.local()
"""Per thread: ``active`` (open ``Init`` blocks), ``depth`` (module constructors running),
``internal`` (our own collectives: not watched), ``pending`` (parameters gathered by the watch)."""

_METADATA = frozenset({
    "grad_fn", "requires_grad", "is_leaf", "dtype", "device", "grad", "layout", "is_cuda", "is_meta",
    "is_sparse", "is_quantized", "is_mkldnn", "_base", "output_nr", "_version", "_cdata", "names", "__class__",
    "requires_grad_", "is_floating_point", "is_complex", "element_size", "get_device", "_is_view",
    "__reduce_ex__", "__deepcopy__", "__hash__",
})
"""Torch functions whose answer is the same for the placeholder as for the whole parameter."""


@contextlib.contextmanager
def _internal() -> Iterator[None]:
    previous = getattr(_local, "internal", False)
    _local.internal = True
    try:
        yield
    finally:
        _local.internal = previous


def _comm_device(group: Any) -> torch.device:
    """Where collectives on ``group`` need their tensors: the CUDA device for NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and str(dist.get_backend(group)).lower() == "nccl":
        return comm.device()
    return torch.device("cpu")


def _global_rank(group: Any, group_rank: int) -> int:
    import torch.distributed as dist

    if group is None or not dist.is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def partition_param(p: torch.nn.Parameter, group: Any, shard_device: Any = None, src_rank: int = 0) -> None:
    """Keep only this rank's flat slice of ``p`` (after broadcasting group rank ``src_rank``'s values).

    The slice (``ceil(numel / N)`` elements, zero-padded on the last ranks) goes to
    ``p._zero_init_shard`` on ``shard_device`` (default: the parameter's device); ``p.data``
    becomes an empty placeholder of the same dtype and device.
    """
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    cdev = _comm_device(group)
    with _internal(), torch.no_grad():
        numel = p.numel()
        flat = p.data.reshape(-1).to(cdev).contiguous()
        comm.broadcast(flat, src=_global_rank(group, src_rank), group=group)
        size = max(1, -(-numel // world))
        start, end = rank * size, min((rank + 1) * size, numel)
        shard = torch.zeros(size, dtype=p.dtype, device=shard_device or p.device)
        if end > start:
            shard[:end - start].copy_(flat[start:end])
        p.ds_shape, p.ds_numel = tuple(p.shape), numel
        folder = getattr(p, "_zero_init_nvme", None)
        if folder is not None:  # remote_device="nvme": the shard lives in a memory-mapped file
            shard = _file_backed(shard, folder, p)
        p._zero_init_shard = shard
        p._zero_init_group = group
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        assign_ds_id(p)
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE


_FILE_COUNTER = itertools.count()
_FOLDERS_LOCK = threading.Lock()
_FOLDER_FILES: dict[str, set[str]] = {}  # private shard folder -> its files not yet removed
_FOLDERS_OPEN: set[str] = set()  # shard folders whose Init may still add files


def _open_folder(folder: str) -> None:
    with _FOLDERS_LOCK:
        _FOLDERS_OPEN.add(folder)
        _FOLDER_FILES.setdefault(folder, set())


def _release(folder: str, path: str | None) -> None:
    """File ``path`` of ``folder`` removed (``None``: its Init is done); the folder goes once both hold."""
    from microspeed_zero.nvme import remove_private_folder

    with _FOLDERS_LOCK:
        files = _FOLDER_FILES.get(folder)
        if files is None:
            return
        if path is None:
            _FOLDERS_OPEN.discard(folder)
        files.discard(path)
        if files or folder in _FOLDERS_OPEN:
            return
        del _FOLDER_FILES[folder]
    remove_private_folder(folder)


def _file_backed(shard: torch.Tensor, folder: str, p: Any) -> torch.Tensor:
    """A CPU tensor with ``shard``'s values whose storage is a memory-mapped file in ``folder``: the
    operating system keeps its pages on the NVMe (or any) disk, not in this process's memory.

    The values are written with ``write()``, then the file is mapped untouched: a page enters the process's
    resident set only when read (a mapping filled through its pages would hold the whole model resident). The
    file goes with the tensor: a parameter dropped while partitioned (a head replaced by a tied weight) leaves
    none behind."""
    _remove_file(p)
    path = os.path.join(folder, f"param{os.getpid()}_{next(_FILE_COUNTER)}.bin")
    try:  # the folder is private (nvme.private_folder); still, never through a link nor over a file already there
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise OSError(exc.errno, f"zero.Init(remote_device='nvme'): cannot create the shard file {path!r}: "
                                 f"{exc.strerror or exc} (a file or link this process did not create is there?)") \
            from exc
    with _FOLDERS_LOCK:
        _FOLDER_FILES.setdefault(folder, set()).add(path)
    with os.fdopen(fd, "wb") as fh:
        fh.write(memoryview(shard.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
    out = torch.from_file(path, shared=True, size=shard.numel(), dtype=shard.dtype)
    weakref.finalize(out, _unlink, path)
    p._zero_init_file = path
    return out


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
    _release(os.path.dirname(path), path)


def _remove_file(p: Any) -> None:
    path = p.__dict__.pop("_zero_init_file", None)
    if path is not None:
        _unlink(path)


def materialize(params: Iterable[torch.nn.Parameter], group: Any = None) -> None:
    """Make parameters partitioned by :class:`Init` whole again (collective; others are left alone).

    The whole value takes the placeholder's dtype and device (so ``model.to(...)`` and mixed
    precision applied to a partitioned model take effect here). ``group`` is accepted for
    compatibility: each parameter remembers the group it was partitioned over.
    """
    del group
    seen: set[int] = set()
    with _internal(), torch.no_grad():
        for p in params:
            if id(p) in seen or not _is_init_partitioned(p):
                continue
            seen.add(id(p))
            shard, g = p._zero_init_shard, p._zero_init_group
            cdev = _comm_device(g)
            piece = shard.to(cdev).contiguous()
            full = torch.empty(piece.numel() * comm.get_world_size(g), dtype=piece.dtype, device=cdev)
            comm.all_gather_into_tensor(full, piece, group=g)
            p.data = full[:p.ds_numel].view(p.ds_shape).to(device=p.device, dtype=p.dtype, copy=True)
            del p._zero_init_shard, p._zero_init_group
            _remove_file(p)
            p.ds_status = ZeroParamStatus.AVAILABLE


def _is_init_partitioned(p: Any) -> bool:
    return getattr(p, "_zero_init_shard", None) is not None


def _partitioned_in(obj: Any, out: list[torch.nn.Parameter]) -> None:
    if isinstance(obj, torch.nn.Parameter):
        if _is_init_partitioned(obj) and all(obj is not q for q in out):
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _partitioned_in(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _partitioned_in(o, out)


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property: Tensor.data, Tensor.shape, ...
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class _WatchPartitioned(TorchFunctionMode):
    """While a module constructor runs inside ``Init``: gather partitioned parameters it touches."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(_local, "internal", False) or not getattr(_local, "depth", 0):
            return func(*args, **kwargs)
        name = _func_name(func)
        touched: list[torch.nn.Parameter] = []
        if name not in _METADATA:
            _partitioned_in(args, touched)
            _partitioned_in(kwargs, touched)
        if not touched:
            return func(*args, **kwargs)
        saved = [(p, p._zero_init_group, p._zero_init_shard.device) for p in touched]
        materialize(touched)
        result = func(*args, **kwargs)
        if name.endswith("_") and not name.startswith("__"):  # in place and done: partition again now
            for p, group, device in saved:
                partition_param(p, group, device)
        else:  # .data, .shape, ...: the constructor may keep using it; partition when it returns
            _local.pending.extend((p, group, device, _local.depth) for p, group, device in saved)
        return result


def _flush_pending(depth: int) -> None:
    """Partition again what the watch gathered in constructors at ``depth`` or deeper."""
    pending = getattr(_local, "pending", [])
    keep = []
    for p, group, device, d in pending:
        if d < depth:
            keep.append((p, group, device, d))
        elif not _is_init_partitioned(p) and p.numel() > 0:
            partition_param(p, group, device)
    _local.pending = keep


class Init:
    """Context manager: modules constructed inside have their parameters partitioned at once.

    Arguments follow ``deepspeed.zero.Init``: ``module`` (an already-built module: partitioned
    now), ``data_parallel_group`` (default: the world), ``enabled``, ``dtype`` (floating-point
    parameters are cast on creation), ``remote_device`` (where the shards live: ``None`` — the
    parameter's own device —, ``"cpu"``, a CUDA device, or ``"nvme"``: memory-mapped files in a
    folder under ``zero_optimization.offload_param.nvme_path`` of the config, one per rank, removed
    when the parameter is made whole), ``pin_memory``, ``config_dict_or_path`` /
    ``config`` (a ds_config whose ``fp16``/``bf16`` section gives the dtype), ``mpu`` (its
    data-parallel group). ``torch.distributed`` is started if it is not yet
    (``microspeed.init_distributed()``). Nested ``Init`` blocks follow the outermost one.
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **unsupported: Any) -> None:
        del mem_efficient_linear, pin_memory
        if unsupported:
            raise TypeError(f"zero.Init: unsupported argument(s) {sorted(unsupported)}; accepted: module, "
                            f"data_parallel_group, remote_device, pin_memory, config_dict_or_path, config, "
                            f"enabled, dtype, mpu.")
        device = None if remote_device in (None, "none") else str(remote_device)
        self.nvme_folder: str | None = None
        self._nvme_done: Any = None
        if device == "nvme":
            self.nvme_folder = self._nvme_folder(config_dict_or_path if config_dict_or_path is not None else config)
            _open_folder(self.nvme_folder)  # removed once this Init is done and its last shard file is gone
            self._nvme_done = weakref.finalize(self, _release, self.nvme_folder, None)
            device = "cpu"
            return_freed_memory()  # the modules built inside free their whole parameters once partitioned
        if device is not None and device != "cpu" and not device.startswith("cuda"):
            raise ConfigError(f"zero.Init(remote_device={remote_device!r}): accepted None, 'cpu', 'nvme' or a CUDA "
                              f"device.")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(f"zero.Init(dtype={dtype!r}): expected a floating-point torch.dtype.")
        self.enabled = enabled
        self.group = mpu.get_data_parallel_group() if mpu is not None else data_parallel_group
        self.remote_device = None if device is None else torch.device(device)
        self.dtype = dtype or self._dtype_from_config(config_dict_or_path if config_dict_or_path is not None
                                                      else config)
        self.patched: list[tuple[type, Any]] = []
        self._outermost = False
        self._mode: _WatchPartitioned | None = None
        if module is not None and enabled:  # an already-built module: partition it now
            comm.init_distributed()
            self._partition_tree(module)

    @staticmethod
    def _raw(config: Any) -> dict:
        if hasattr(config, "raw") and hasattr(config, "values"):  # a parsed microspeed Config
            return config.raw
        from microspeed.plugin_api import load_raw

        return load_raw(config)

    @classmethod
    def _nvme_folder(cls, config: Any) -> str:
        """``remote_device="nvme"``: a fresh private folder of this rank under the config's
        ``offload_param.nvme_path`` (:func:`microspeed_zero.nvme.private_folder`)."""
        raw = cls._raw(config) if config is not None else {}
        path = ((raw.get("zero_optimization") or {}).get("offload_param") or {}).get("nvme_path")
        if not path:
            raise ConfigError("zero.Init(remote_device='nvme') needs a folder: pass config_dict_or_path with "
                              "zero_optimization.offload_param.nvme_path set (as DeepSpeed), or use "
                              "remote_device='cpu'.")
        from microspeed_zero.nvme import private_folder

        comm.init_distributed()
        return private_folder(str(path), comm.get_rank(), "zero_init")

    @classmethod
    def _dtype_from_config(cls, config: Any) -> torch.dtype | None:
        if config is None:
            return None
        raw = cls._raw(config)
        if (raw.get("bf16") or raw.get("bfloat16") or {}).get("enabled"):
            return torch.bfloat16
        if (raw.get("fp16") or {}).get("enabled"):
            return torch.float16
        return None

    def _partition_module(self, module: torch.nn.Module) -> None:
        for p in module._parameters.values():
            if p is None or _is_init_partitioned(p) or getattr(p, "ds_shape", None) is not None:
                continue
            cast = self.dtype if self.dtype is not None and p.is_floating_point() else None
            if cast is not None and p.dtype != cast:
                with _internal(), torch.no_grad():
                    p.data = p.data.to(dtype=cast)
            if self.nvme_folder is not None:
                p._zero_init_nvme = self.nvme_folder
            partition_param(p, self.group, self.remote_device)

    def _partition_tree(self, module: torch.nn.Module) -> None:
        for m in module.modules():  # sub-modules too: a constructor may add parameters to its children
            self._partition_module(m)

    def _wrap(self, cls: type) -> None:
        if "__init__" not in cls.__dict__ or getattr(cls.__init__, "_zero_wrapped", False):
            return
        original = cls.__init__

        @functools.wraps(original)
        def init(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            if not getattr(_local, "active", 0):
                return original(module, *args, **kwargs)
            _local.depth = getattr(_local, "depth", 0) + 1
            try:
                original(module, *args, **kwargs)
                if _outermost_init_class(type(module)) is cls:  # the object's own constructor is done
                    self._partition_tree(module)
                    _flush_pending(_local.depth)
            finally:
                _local.depth -= 1
            return None

        init._zero_wrapped = True  # type: ignore[attr-defined]
        cls.__init__ = init
        self.patched.append((cls, original))

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        comm.init_distributed()
        self._outermost = not getattr(_local, "active", 0)
        _local.active = getattr(_local, "active", 0) + 1
        if not self._outermost:
            return self
        _local.depth, _local.pending = 0, []
        for cls in _all_subclasses(torch.nn.Module):
            self._wrap(cls)
        self._old_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        outer = self

        def init_subclass(cls: type, **kwargs: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            outer._wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._mode = _WatchPartitioned()
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if not self.enabled:
            return
        _local.active -= 1
        if not self._outermost:
            return
        self._mode.__exit__(None, None, None)
        self._mode = None
        for cls, original in reversed(self.patched):
            cls.__init__ = original
        self.patched.clear()
        if self._old_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._old_init_subclass
        if exc_type is None:
            _flush_pending(0)
        _local.pending = []
        if self._nvme_done is not None:
            self._nvme_done()


def _all_subclasses(cls: type) -> list[type]:
    out, seen, todo = [], set(), [cls]
    while todo:
        c = todo.pop()
        for sub in c.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                out.append(sub)
                todo.append(sub)
    return out


def _outermost_init_class(cls: type) -> type | None:
    for klass in cls.__mro__:
        if "__init__" in klass.__dict__:
            return klass
    return None


def _stage3_runtime(p: Any) -> Any:
    z = getattr(p, "_zero", None)
    return z[0] if z is not None and z[0].stage3 is not None else None


@contextlib.contextmanager
def GatheredParameters(params: Any, modifier_rank: int | None = None, fwd_module: Any = None,  # noqa: N802
                       enabled: bool = True) -> Iterator[None]:
    """Inside the block, the given (stage-3 or ``Init``-partitioned) parameters are whole.

    Every data-parallel rank must enter it (gathering is collective). With ``modifier_rank``
    (a data-parallel rank), that rank's values are broadcast on exit and become the new
    partitions — and the fp32 masters, when an engine trains the parameters. Without it, changes
    made inside the block are discarded. Parameters that are not partitioned (stages 0–2, or
    stage-3 parameters of no engine yet) are left alone and cost no communication: the block is a
    no-op for them, as in DeepSpeed. If the block raises, nothing is broadcast and the previous
    partitions are kept. ``fwd_module`` is accepted for compatibility.
    """
    del fwd_module
    if not enabled:
        yield
        return
    if isinstance(params, torch.Tensor):
        params = [params]
    unique: dict[int, torch.Tensor] = {}
    for p in params or ():
        if p is not None:
            unique.setdefault(id(p), p)
    init_params = [p for p in unique.values() if _is_init_partitioned(p)]
    engine_params = [p for p in unique.values() if _stage3_runtime(p) is not None]
    for p in unique.values():  # stages 1, 2: the parameters are whole once pending all-gathers land
        z = getattr(p, "_zero", None)
        if z is not None and z[0].stage3 is None:
            z[0].wait_gathers([z[1]])
    saved = [(p, p._zero_init_shard, p._zero_init_group) for p in init_params]
    materialize(init_params)
    runtimes: dict[int, tuple[Any, list[int]]] = {}
    for p in engine_params:
        rt, index = p._zero[0], p._zero[1]
        indices = runtimes.setdefault(id(rt), (rt, []))[1]
        if index not in indices:
            indices.append(index)
    for rt, indices in runtimes.values():
        indices.sort()
        rt.gather_for_user(indices)
    ok = False
    try:
        yield
        ok = True
    finally:
        modified = ok and modifier_rank is not None
        for p, shard, group in saved:
            if modified:
                partition_param(p, group, shard.device, src_rank=modifier_rank)
            else:  # keep the partition as it was
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p._zero_init_shard, p._zero_init_group = shard, group
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        if modified:
            with torch.no_grad():
                for p in engine_params:
                    group = p._zero[0].group
                    comm.broadcast(p.data, src=_global_rank(group, modifier_rank), group=group)
        for rt, indices in runtimes.values():
            rt.release_for_user(indices, modified=modified)
