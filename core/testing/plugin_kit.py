"""The plugin-author kit: :func:`tiny_engine` (a small model, a default config, extra plugins),
:func:`train_steps` (optimizer steps, returns the losses) and :class:`HookRecorder` (a plugin recording
every hook call in order).

Import it as ``microspeed.testing``, which re-exports every public name here; the pytest fixtures built on
it live in :mod:`microspeed.testing.fixtures`.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from microspeed.engine import Engine

__all__ = [
    "TINY_CONFIG",
    "HookCall",
    "HookRecorder",
    "TinyModel",
    "tiny_batch",
    "tiny_config",
    "tiny_engine",
    "train_steps",
]

TINY_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
}
"""The config :func:`tiny_engine` starts from: micro-batches of 2, no accumulation, SGD."""

_BATCH_TRIAD = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class TinyModel(torch.nn.Module):
    """Two linear layers (``d -> hidden -> 1``); ``forward(x, y)`` returns the MSE loss.

    ``forward(x)`` without a target returns the predictions. The default batches of
    :func:`tiny_batch` and :func:`train_steps` fit it.
    """

    def __init__(self, d: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d, hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Predictions for ``x``, or the mean squared error against ``y`` when given."""
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out if y is None else torch.nn.functional.mse_loss(out, y)


def tiny_config(config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:data:`TINY_CONFIG` with ``config``'s top-level keys put over it (a new dict).

    A top-level key of ``config`` replaces the default one as a whole (``{"optimizer": {...}}``
    replaces the SGD section). If ``config`` names any key of the batch triad
    (``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``),
    the default triad is dropped, so the three never contradict each other.
    """
    given = dict(config or {})
    out = copy.deepcopy(TINY_CONFIG)
    if any(key in given for key in _BATCH_TRIAD):
        for key in _BATCH_TRIAD:
            out.pop(key, None)
    out.update(copy.deepcopy(given))
    return out


def _plugin_name(plugin: Any) -> str:
    cls = plugin if inspect.isclass(plugin) else type(plugin)
    name = cls.__name__ if not isinstance(plugin, types.ModuleType) else plugin.__name__.rpartition(".")[2]
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def _plugin_pairs(plugins: Iterable[Any] | Mapping[str, Any]) -> list[tuple[str, Any]]:
    if isinstance(plugins, Mapping):
        return list(plugins.items())
    pairs = []
    for item in plugins:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            pairs.append(item)
        else:
            pairs.append((_plugin_name(item), item))
    return pairs


def tiny_engine(
    config: Mapping[str, Any] | None = None,
    plugins: Iterable[Any] | Mapping[str, Any] = (),
    model: torch.nn.Module | None = None,
    training_data: Any = None,
    *,
    seed: int = 0,
    defaults: bool = True,
    **initialize_kwargs: Any,
) -> Engine:
    """A training engine on a tiny model, made by :func:`microspeed.initialize`; returns the engine.

    Args:
        config: ds_config keys put over :data:`TINY_CONFIG` (see :func:`tiny_config`), for example
            your plugin's section: ``tiny_engine({"early_stopping": {"enabled": True}})``.
        plugins: extra plugins for this engine only, as ``(name, plugin)`` pairs, a ``{name:
            plugin}`` dict, or bare plugins (named after their class in snake case:
            ``HookRecorder`` -> ``"hook_recorder"``). A class is instantiated once, as an entry
            point's would be. They are passed as ``initialize(plugins=...)`` and registered after
            the built-ins and the installed entry points.
        model: the model (default: a :class:`TinyModel`, built after ``torch.manual_seed(seed)``
            so that every rank starts from the same weights).
        training_data: a ``torch.utils.data.Dataset``; the engine then has a
            ``training_dataloader`` and :func:`train_steps` draws from it.
        seed: seeds torch before the model is built.
        defaults: ``False`` passes ``config`` as it is, without :data:`TINY_CONFIG`.
        initialize_kwargs: anything else :func:`microspeed.initialize` accepts (``optimizer=``,
            ``lr_scheduler=``, ``collate_fn=``, ...). A client ``optimizer=`` (or ``lr_scheduler=``)
            drops the default config's section of that name.

    Installed plugin distributions load as usual (entry points); set
    ``MICROSPEED_DISABLE_PLUGIN_AUTOLOAD=1`` to test a plugin alone. Works in one process (a
    one-rank process group is started) and inside a :func:`run_distributed` rank body, where the
    engine spans all ranks.
    """
    import microspeed

    cfg = tiny_config(config) if defaults else dict(config or {})
    user_keys = set(config or {})
    for kwarg, section in (("optimizer", "optimizer"), ("lr_scheduler", "scheduler")):
        if initialize_kwargs.get(kwarg) is not None and section not in user_keys:
            cfg.pop(section, None)
    torch.manual_seed(seed)
    if model is None:
        model = TinyModel()
    engine, *_ = microspeed.initialize(
        model=model, config=cfg, training_data=training_data, plugins=_plugin_pairs(plugins), **initialize_kwargs
    )
    return engine


def tiny_batch(
    engine: Engine | None = None, *, batch_size: int | None = None, seed: int = 0, rank: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic ``(x, y)`` regression batch for :class:`TinyModel` (``x``: 8 features).

    ``batch_size`` defaults to the engine's micro-batch size (2 without an engine). The data
    depend on ``seed`` and on ``rank`` (default: the engine's data-parallel rank), so that data
    parallel ranks see different samples, as they would with a sharded dataset.
    """
    if batch_size is None:
        batch_size = engine.train_micro_batch_size_per_gpu() if engine is not None else 2
    if rank is None:
        rank = engine.topology.data_parallel_rank if engine is not None else 0
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(batch_size, 8, generator=gen)
    weights = torch.linspace(-1.0, 1.0, 8).unsqueeze(1)
    y = x @ weights + 0.1 * torch.randn(batch_size, 1, generator=gen)
    return x, y


def _batch_source(engine: Engine, batch: Any) -> Callable[[], Any]:
    """A function returning the next micro-batch, from what :func:`train_steps` was given."""
    if batch is None:
        loader = engine.training_dataloader
        if loader is None:
            fixed = tiny_batch(engine)
            return lambda: fixed
        batch = loader
    if isinstance(batch, (tuple, list, dict, torch.Tensor)):
        return lambda: batch
    if callable(batch) and not hasattr(batch, "__iter__"):
        return lambda: batch(engine.micro_steps)
    if hasattr(batch, "__next__"):
        return lambda: next(batch)
    if hasattr(batch, "__iter__"):
        from microspeed import RepeatingLoader

        repeating = RepeatingLoader(batch)
        return lambda: next(repeating)
    raise TypeError(f"train_steps(batch=...): expected a tuple/list/dict of model inputs, a tensor, a function "
                    f"micro_step -> batch, or an iterable of batches; got {type(batch).__name__}")


def _forward(engine: Engine, batch: Any) -> Any:
    if isinstance(batch, dict):
        return engine(**batch)
    if isinstance(batch, (tuple, list)):
        return engine(*batch)
    return engine(batch)


def train_steps(
    engine: Engine,
    n: int,
    batch: Any = None,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    until: Callable[[Engine], bool] | None = None,
) -> list[float]:
    """Run ``n`` optimizer steps (each ``gradient_accumulation_steps`` micro-steps); return the losses.

    One float per optimizer step: the mean of its micro-steps' losses on this rank. Each
    micro-step is ``loss = engine(*batch)``, ``engine.backward(loss)``, ``engine.step()`` — every
    step hook fires as in a real training loop.

    Args:
        engine: from :func:`tiny_engine` or :func:`microspeed.initialize`.
        n: optimizer steps to run.
        batch: what to feed. ``None``: the engine's ``training_dataloader`` if it has one, else
            the same :func:`tiny_batch` every micro-step. A tuple or list is passed as positional
            inputs, a dict as keyword inputs, a tensor as the one input, all repeated every
            micro-step; a function is called with ``engine.micro_steps`` and returns such a
            batch; an iterable (a ``DataLoader``) is cycled through.
        loss_fn: ``loss_fn(outputs, batch) -> loss`` for a model that does not return its loss.
        until: called with the engine after each optimizer step; ``True`` ends the run early
            (for example ``lambda e: e.plugin_state("early_stopping").should_stop``).
    """
    next_batch = _batch_source(engine, batch)
    gas = engine.gradient_accumulation_steps()
    losses: list[float] = []
    for _ in range(n):
        start, total, micro = engine.global_steps, 0.0, 0
        while engine.global_steps == start and micro < gas:
            inputs = next_batch()
            outputs = _forward(engine, inputs)
            loss = loss_fn(outputs, inputs) if loss_fn is not None else outputs
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(f"train_steps: the model returned {type(loss).__name__}, not a scalar loss; "
                                f"pass loss_fn=(outputs, batch) -> loss")
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
            micro += 1
        losses.append(total / micro)
        if until is not None and until(engine):
            break
    return losses


def _hook_spec_options(name: str) -> dict[str, Any]:
    from microspeed import hookspecs

    return getattr(getattr(hookspecs, name), f"{hookspecs.PROJECT}_spec", {}) or {}


@dataclass
class HookCall:
    """One hook call seen by :class:`HookRecorder`.

    ``name`` is the hook name without the ``microspeed_`` prefix (``"before_step"``), ``kwargs``
    the arguments the hook was called with, and ``result`` the answer of a ``firstresult`` hook
    (``None`` for the other kinds).
    """

    name: str
    kwargs: dict[str, Any]
    result: Any = None


def _recording_impl(hook: str, argnames: tuple[str, ...], firstresult: bool) -> Callable[..., Any]:
    """A hook implementation for ``hook`` that records the call on its :class:`HookRecorder`.

    ``firstresult`` hooks get a wrapper (it sees every call, whoever answers, and the answer);
    the others a ``tryfirst`` implementation returning ``None`` (no effect on notifications,
    collected hooks or chains).
    """
    from microspeed.hookspecs import hookimpl

    short = hook.removeprefix("microspeed_")

    # pluggy reads an implementation's argument names from its code object, so the function is
    # generated with the hook's own parameter names (a *args/**kwargs wrapper would receive none).
    params = ", ".join(argnames)
    record = "{" + ", ".join(f"{n!r}: {n}" for n in argnames) + "}"
    if firstresult:
        source = (f"def impl(self, {params}):\n"
                  f"    call = self._record(short, {record})\n"
                  f"    result = yield\n"
                  f"    if call is not None:\n"
                  f"        call.result = result\n"
                  f"    return result\n")
        marker = hookimpl(wrapper=True)
    else:
        source = f"def impl(self, {params}):\n    self._record(short, {record})\n"
        marker = hookimpl(tryfirst=True)
    namespace: dict[str, Any] = {"short": short}
    exec(compile(source, f"<HookRecorder.{hook}>", "exec"), namespace)  # noqa: S102 - names come from hookspecs
    impl = namespace["impl"]
    impl.__name__ = hook
    impl.__qualname__ = f"HookRecorder.{hook}"
    impl.__doc__ = f"Record a call of ``{hook}``."
    return marker(impl)


class HookRecorder:
    """A plugin that records every hook call, in call order, without changing any result.

    Register it like any plugin — ``tiny_engine(plugins=[recorder])`` or
    ``microspeed.initialize(..., plugins=[("hook_recorder", recorder)])`` — then read
    :attr:`calls` or :meth:`names`::

        rec = HookRecorder()
        engine = tiny_engine(plugins=[rec])
        train_steps(engine, 1)
        assert rec.names("before_step", "after_step") == ["before_step", "after_step"]

    ``hooks`` limits recording to some hooks (names with or without the ``microspeed_``
    prefix). Notification, collected and chain hooks are recorded by a ``tryfirst``
    implementation (so a chain is seen with its input, before the other implementations), and
    ``firstresult`` hooks by a wrapper, which also records the answer in :attr:`HookCall.result`.
    Setup hooks fire inside ``initialize()``: they are recorded too (``clear()`` drops them).
    """

    def __init__(self, hooks: Iterable[str] | None = None) -> None:
        self.calls: list[HookCall] = []
        self.only = None if hooks is None else {h.removeprefix("microspeed_") for h in hooks}

    def _record(self, name: str, kwargs: dict[str, Any]) -> HookCall | None:
        if self.only is not None and name not in self.only:
            return None
        call = HookCall(name, kwargs)
        self.calls.append(call)
        return call

    def names(self, *hooks: str) -> list[str]:
        """Names of the recorded calls in order, optionally only those of the given hooks."""
        wanted = {h.removeprefix("microspeed_") for h in hooks}
        return [c.name for c in self.calls if not wanted or c.name in wanted]

    def of(self, hook: str) -> list[HookCall]:
        """The recorded calls of one hook, in order."""
        name = hook.removeprefix("microspeed_")
        return [c for c in self.calls if c.name == name]

    def clear(self) -> None:
        """Forget everything recorded so far."""
        self.calls.clear()


def _install_recording_impls() -> None:
    from microspeed import hookspecs
    from microspeed.plugins import all_hook_names

    for hook in all_hook_names():
        spec = getattr(hookspecs, hook)
        argnames = tuple(inspect.signature(spec).parameters)
        setattr(HookRecorder, hook, _recording_impl(hook, argnames, bool(_hook_spec_options(hook).get("firstresult"))))


_install_recording_impls()
