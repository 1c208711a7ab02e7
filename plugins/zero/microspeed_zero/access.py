"""Parameters that act when they are used: gather a released stage-3 parameter, wait for a pending gather.

While a parameter is not ready (stage 3: released or in flight; stages 1, 2: its updated values
are still being all-gathered behind the step), its class is switched to a subclass of its own
class whose ``__torch_function__`` first asks its ZeRO runtime to make it ready, then runs the
function as the plain class would. Once ready the class is switched back, so a ready parameter
costs nothing: only the first use after a step (stages 1, 2) or an unplanned use of a released
parameter (stage 3) pays the Python dispatch.

The runtime is found from ``p._zero = (runtime, segment index, position)`` and answers
``on_access(params, name)`` (``name``: the torch function or property used).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

_SUBCLASSES: dict[type, type] = {}


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # a property: Tensor.data, Tensor.grad, ...
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _collect(obj: Any, out: list) -> None:
    if isinstance(obj, _AccessHook):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _collect(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _collect(o, out)


class _AccessHook:
    """Mixin of the "not ready" parameter classes (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        found: list[Any] = []
        _collect(args, found)
        _collect(kwargs, found)
        if found:
            name = _func_name(func)
            by_rt: dict[int, tuple[Any, list]] = {}
            for p in found:
                z = p.__dict__.get("_zero")
                if z is not None:
                    by_rt.setdefault(id(z[0]), (z[0], []))[1].append(p)
            for rt, params in by_rt.values():
                rt.on_access(params, name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        """A copy of the plain class (``copy.deepcopy(engine.module)`` for an EMA model), after the wait."""
        z = self.__dict__.get("_zero")
        if z is not None:
            z[0].on_access([self], "__deepcopy__")
        cls = type(self)
        if not issubclass(cls, _AccessHook):  # the access made it ready
            return copy.deepcopy(self, memo)
        self.__class__ = cls._zero_base
        try:
            return copy.deepcopy(self, memo)
        finally:
            self.__class__ = cls


def watched_class(cls: type) -> type:
    """The "not ready" subclass of parameter class ``cls``."""
    if issubclass(cls, _AccessHook):
        return cls
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"Zero{cls.__name__}", (_AccessHook, cls), {"_zero_base": cls, "__module__": __name__})
        _SUBCLASSES[cls] = sub
    return sub


def watch(p: torch.Tensor) -> None:
    """Make ``p``'s next use call its runtime's ``on_access`` first."""
    cls = type(p)
    if not issubclass(cls, _AccessHook):
        p.__class__ = watched_class(cls)


def unwatch(p: torch.Tensor) -> None:
    """``p`` is ready: back to its own class (no cost on use)."""
    cls = type(p)
    if issubclass(cls, _AccessHook):
        p.__class__ = cls._zero_base


def is_watched(p: torch.Tensor) -> bool:
    """Whether ``p`` currently calls its runtime on use."""
    return isinstance(p, _AccessHook)
