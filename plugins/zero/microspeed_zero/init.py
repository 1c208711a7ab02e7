"""``zero.Init`` and ``GatheredParameters``: build partitioned models, look at whole parameters.

:class:`Init` partitions each module's parameters as soon as the module's constructor returns,
so a model larger than one rank's memory never exists whole: a parameter's ``.data`` becomes an
empty placeholder and the rank keeps 1/N of it (DeepSpeed's semantics: values are broadcast
from data-parallel rank 0 first, so every rank builds the same model). ``initialize()`` with
stage 3 adopts such a model one module at a time.

:class:`GatheredParameters` makes partitioned parameters whole inside a ``with`` block; with
``modifier_rank`` the values that rank wrote are broadcast and partitioned again on exit (the
fp32 masters too, once an engine trains the model).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from microspeed import comm
from microspeed.errors import ConfigError

_local = threading.local()


def _dp_group_rank_world(group: Any) -> tuple[int, int, int]:
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0) if group is not None else 0
    return src, comm.get_rank(group), comm.get_world_size(group)


def partition_param(p: torch.nn.Parameter, group: Any) -> None:
    """Keep only this rank's flat slice of ``p`` (after broadcasting rank 0's values)."""
    src, rank, world = _dp_group_rank_world(group)
    with torch.no_grad():
        comm.broadcast(p.data, src=src, group=group)
        flat = p.data.reshape(-1)
        size = -(-flat.numel() // world)
        padded = torch.zeros(size * world, dtype=flat.dtype, device=flat.device)
        padded[:flat.numel()] = flat
        p._zero_init_shard = padded[rank * size:(rank + 1) * size].clone()
    p._zero_init_group = group
    p.ds_shape, p.ds_numel = tuple(p.shape), p.numel()
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def materialize(params: Iterable[torch.nn.Parameter], group: Any = None) -> None:
    """Make parameters partitioned by :class:`Init` whole again (collective; others are left alone)."""
    for p in params:
        shard = getattr(p, "_zero_init_shard", None)
        if shard is None:
            continue
        world = comm.get_world_size(p._zero_init_group)
        full = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
        comm.all_gather_into_tensor(full, shard, group=p._zero_init_group)
        p.data = full[:p.ds_numel].view(p.ds_shape).to(p.dtype).clone()
        del p._zero_init_shard, p._zero_init_group


def _is_init_partitioned(p: torch.Tensor) -> bool:
    return getattr(p, "_zero_init_shard", None) is not None


class Init:
    """Context manager: modules constructed inside have their parameters partitioned at once.

    Arguments follow ``deepspeed.zero.Init``: ``data_parallel_group`` (default: the world),
    ``enabled``, ``dtype`` (parameters are cast on creation), ``remote_device`` (``None``, ``"cpu"``
    or the compute device; ``"nvme"`` is refused: use ``offload_param`` in the config), ``pin_memory``,
    ``config_dict_or_path`` / ``config`` (read for the fp16/bf16 dtype), ``mpu`` (its data-parallel
    group). ``torch.distributed`` must be initialized first (``microspeed.init_distributed()``).
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **unsupported: Any) -> None:
        if unsupported:
            raise TypeError(f"zero.Init: unsupported argument(s) {sorted(unsupported)}; accepted: module, "
                            f"data_parallel_group, remote_device, pin_memory, config_dict_or_path, config, "
                            f"enabled, dtype, mpu.")
        if remote_device not in (None, "cpu", "cuda", "none") and not str(remote_device).startswith("cuda"):
            raise ConfigError(f"zero.Init(remote_device={remote_device!r}): accepted None, 'cpu' or a device; "
                              f"for NVMe set zero_optimization.offload_param.device='nvme' in the config.")
        self.enabled = enabled
        self.group = mpu.get_data_parallel_group() if mpu is not None else data_parallel_group
        self.remote_device = None if remote_device in (None, "none") else torch.device(remote_device)
        self.dtype = dtype or self._dtype_from_config(config_dict_or_path or config)
        self.patched: list[tuple[type, Any]] = []
        if module is not None and enabled:  # an already-built module: partition it now
            comm.init_distributed()
            for m in module.modules():
                self._partition_module(m)

    @staticmethod
    def _dtype_from_config(config: Any) -> torch.dtype | None:
        if config is None:
            return None
        from microspeed.config import load_raw

        raw = load_raw(config)
        if raw.get("bf16", {}).get("enabled"):
            return torch.bfloat16
        if raw.get("fp16", {}).get("enabled"):
            return torch.float16
        return None

    def _partition_module(self, module: torch.nn.Module) -> None:
        for name, p in list(module._parameters.items()):
            if p is None or _is_init_partitioned(p) or getattr(p, "ds_shape", None) is not None:
                continue
            if self.remote_device is not None or (self.dtype is not None and p.is_floating_point()):
                p.data = p.data.to(device=self.remote_device or p.device,
                                   dtype=self.dtype if p.is_floating_point() and self.dtype else p.dtype)
            partition_param(p, self.group)
            module._parameters[name] = p

    def _wrap(self, cls: type) -> None:
        if "__init__" not in cls.__dict__ or getattr(cls.__init__, "_zero_wrapped", False):
            return
        original = cls.__init__

        @functools.wraps(original)
        def init(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            original(module, *args, **kwargs)
            if _outermost_init_class(type(module)) is cls and getattr(_local, "active", 0):
                self._partition_module(module)

        init._zero_wrapped = True  # type: ignore[attr-defined]
        cls.__init__ = init
        self.patched.append((cls, original))

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        comm.init_distributed()
        _local.active = getattr(_local, "active", 0) + 1
        for cls in _all_subclasses(torch.nn.Module):
            self._wrap(cls)
        self._old_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        outer = self

        def init_subclass(cls: type, **kwargs: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            outer._wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        for cls, original in reversed(self.patched):
            cls.__init__ = original
        self.patched.clear()
        if self._old_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._old_init_subclass
        _local.active -= 1


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for sub in c.__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


def _outermost_init_class(cls: type) -> type | None:
    for klass in cls.__mro__:
        if "__init__" in klass.__dict__:
            return klass
    return None


@contextlib.contextmanager
def GatheredParameters(params: Any, modifier_rank: int | None = None, fwd_module: Any = None,  # noqa: N802
                       enabled: bool = True) -> Iterator[None]:
    """Inside the block, the given (stage-3 or ``Init``-partitioned) parameters are whole.

    Every data-parallel rank must enter it (gathering is collective). With ``modifier_rank``,
    that rank's values are broadcast on exit and become the new partitions (and fp32 masters).
    Parameters that are not partitioned are left as they are.
    """
    del fwd_module
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in (params or []) if p is not None]
    if not enabled:
        yield
        return
    init_params = [p for p in params if _is_init_partitioned(p)]
    engine_params = [p for p in params if getattr(p, "_zero", None) is not None]
    groups = {id(p._zero_init_group): p._zero_init_group for p in init_params}
    runtimes = {id(p._zero[0]): p._zero[0] for p in engine_params}
    saved = {id(p): p._zero_init_group for p in init_params}
    materialize(init_params)
    fetched: dict[int, tuple[Any, list[int]]] = {}
    for rt in runtimes.values():
        indices = sorted({p._zero[1] for p in engine_params if p._zero[0] is rt})
        rt.gather_for_user(indices)
        fetched[id(rt)] = (rt, indices)
    try:
        yield
    finally:
        if modifier_rank is not None:
            for p in params:
                if id(p) in saved or getattr(p, "_zero", None) is not None:
                    group = saved.get(id(p)) if id(p) in saved else p._zero[0].group
                    import torch.distributed as dist

                    src = dist.get_global_rank(group, modifier_rank) if group is not None else modifier_rank
                    with torch.no_grad():
                        comm.broadcast(p.data, src=src, group=group)
        for rt, indices in fetched.values():
            rt.release_for_user(indices, modified=modifier_rank is not None)
        for p in init_params:
            partition_param(p, saved[id(p)])
        del groups
