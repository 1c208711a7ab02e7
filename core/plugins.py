"""The plugin manager: built-ins, entry-point discovery, enable/disable, checked hook names, chains.

Discovery follows pytest's rules:

* built-in plugins (:mod:`microspeed.builtin`) are always registered, unless disabled by name;
* every entry point in the group ``microspeed.plugins`` is loaded (entry-point name = plugin
  name), unless ``MICROSPEED_DISABLE_PLUGIN_AUTOLOAD=1``; then only the names listed in
  ``MICROSPEED_PLUGINS=a,b`` are loaded;
* the config section ``"plugins": {"disable": ["name", ...]}`` disables plugins by name.

An entry point names a module, an object, or a class. A class is instantiated once per engine
(the way to keep per-engine state); a module or object is registered as it is.

What pytest enforces, the manager enforces too: a plugin implementing a ``microspeed_*`` hook that
does not exist is refused when it registers (naming the closest hook); a required hook
(:data:`microspeed.hookspecs.REQUIRED`) that no registered plugin implements is refused once all
are loaded (naming the disabled built-in that answered it); and :meth:`PluginManager.answered`
turns an unanswered required call into a :class:`PluginError`. Chain hooks
(:data:`microspeed.hookspecs.CHAINS`) run through pluggy's own call loop (see :meth:`_exec`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
from collections.abc import Iterable
from importlib import metadata
from typing import Any

import pluggy
from pluggy._callers import _multicall

from microspeed import hookspecs
from microspeed.errors import PluginError

ENTRY_POINT_GROUP = "microspeed.plugins"
ENV_DISABLE_AUTOLOAD = "MICROSPEED_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "MICROSPEED_PLUGINS"

#: Built-in plugins, in registration order: ``name -> "module:attribute"``.
BUILTIN_PLUGINS: dict[str, str] = {
    "config_core": "microspeed.builtin.core_config:CoreConfigPlugin",
    "elasticity": "microspeed.elasticity.plugin:ElasticityPlugin",
    "data_parallel": "microspeed.builtin.data_parallel:DataParallelPlugin",
    "gradient_accumulation": "microspeed.builtin.gradient_accumulation:GradientAccumulationPlugin",
    "gradient_clipping": "microspeed.builtin.gradient_clipping:GradientClippingPlugin",
    "batch_loop": "microspeed.builtin.batch_loop:BatchLoopPlugin",
    "optimizers": "microspeed.builtin.optimizer_plugin:OptimizerPlugin",
    "schedulers": "microspeed.builtin.scheduler_plugin:SchedulerPlugin",
    "mixed_precision": "microspeed.builtin.mixed_precision:MixedPrecisionPlugin",
    "dataloader": "microspeed.builtin.dataloader:DataLoaderPlugin",
    "logging": "microspeed.builtin.step_logging:StepLoggingPlugin",
    "tracing": "microspeed.builtin.tracing:TracingPlugin",
    "comms_logger": "microspeed.builtin.comms_logger:CommsLoggerPlugin",
    "watchdog": "microspeed.builtin.watchdog_plugin:WatchdogPlugin",
    "monitor": "microspeed.builtin.monitor:MonitorPlugin",
    "deepspeed_api": "microspeed.builtin.deepspeed_api:DeepSpeedApiPlugin",
    "checkpointing": "microspeed.builtin.checkpointing:CheckpointingPlugin",
}


def _load_object(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def _instantiate(obj: Any) -> Any:
    return obj() if inspect.isclass(obj) else obj


class PluginInfo:
    """What the manager knows about one registered plugin: name, version, where it came from."""

    __slots__ = ("name", "version", "source", "plugin")

    def __init__(self, name: str, version: str, source: str, plugin: Any) -> None:
        self.name, self.version, self.source, self.plugin = name, version, source, plugin

    def as_tuple(self) -> tuple[str, str]:
        """``(name, version)``: what ranks compare at ``initialize()``."""
        return (self.name, self.version)


class _ChainLink:
    """One implementation of a chain hook as pluggy's call loop sees it: it passes its result on.

    pluggy reads an implementation's arguments from the call's keyword mapping just before calling it;
    the link writes a non-``None`` result back into that mapping, so the next implementation receives
    it, and returns ``None`` so that the loop goes on.
    """

    __slots__ = ("impl", "kwargs", "value_arg", "argnames", "kwargnames", "plugin", "plugin_name", "opts",
                 "hookwrapper", "wrapper", "optionalhook", "tryfirst", "trylast")

    def __init__(self, impl: pluggy.HookImpl, kwargs: dict[str, Any], value_arg: str) -> None:
        self.impl, self.kwargs, self.value_arg = impl, kwargs, value_arg
        self.argnames, self.kwargnames = impl.argnames, impl.kwargnames
        self.plugin, self.plugin_name, self.opts = impl.plugin, impl.plugin_name, impl.opts
        self.hookwrapper = self.wrapper = False
        self.optionalhook, self.tryfirst, self.trylast = impl.optionalhook, impl.tryfirst, impl.trylast

    def function(self, *args: Any) -> None:
        """Call the implementation (its current function: tracing may time it) and pass the value on."""
        result = self.impl.function(*args)
        if result is not None:
            self.kwargs[self.value_arg] = result


class _ChainEnd:
    """Called last in a chain: returns the chain's value, which hook wrappers then receive."""

    __slots__ = ("kwargs", "value_arg")
    argnames: tuple[str, ...] = ()
    kwargnames: tuple[str, ...] = ()
    hookwrapper = wrapper = False
    plugin_name = "<chain>"

    def __init__(self, kwargs: dict[str, Any], value_arg: str) -> None:
        self.kwargs, self.value_arg = kwargs, value_arg

    def function(self) -> Any:
        """The value after the last implementation."""
        return self.kwargs[self.value_arg]


class PluginManager(pluggy.PluginManager):
    """pluggy's manager with microspeed's hookspecs, discovery rules, checked names and chains."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.disabled: set[str] = set()
        self._inner_hookexec = self._exec  # monitoring (tracing) wraps this, so it sees chains too

    @staticmethod
    def _exec(hook_name: str, hook_impls: Any, kwargs: Any, firstresult: bool) -> Any:
        """pluggy's call loop; a chain hook runs in it with its implementations linked (see :class:`_ChainLink`)."""
        value_arg = hookspecs.CHAINS.get(hook_name)
        if value_arg is None:
            return _multicall(hook_name, hook_impls, kwargs, firstresult)
        live = dict(kwargs)
        impls = [impl if impl.wrapper or impl.hookwrapper else _ChainLink(impl, live, value_arg)
                 for impl in hook_impls]
        impls.insert(0, _ChainEnd(live, value_arg))  # pluggy calls the list backwards: this one comes last
        return _multicall(hook_name, impls, live, True)

    # -- registration ---------------------------------------------------------------------

    def register_plugin(self, plugin: Any, name: str, version: str = "", source: str = "") -> Any:
        """Register ``plugin`` (instantiating a class) under ``name``; return the instance."""
        if name in self.infos:
            raise PluginError(f"two plugins are named {name!r} ({self.infos[name].source} and {source})")
        instance = _instantiate(plugin)
        try:
            self.register(instance, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name!r} ({source}) does not fit the hook specs: {exc}") from exc
        unknown = sorted(c.name for c in self.get_hookcallers(instance) or [] if c.spec is None)
        if unknown:
            self.unregister(instance)
            known = all_hook_names()
            hints = []
            for hook in unknown:
                close = difflib.get_close_matches(hook, known, n=1, cutoff=0.6)
                hints.append(f"{hook} (did you mean {close[0]}?)" if close else f"{hook} (no hook is close)")
            raise PluginError(f"plugin {name!r} ({source}) implements hooks that do not exist: {'; '.join(hints)}. "
                              f"Rename them; every hook is listed in microspeed.hookspecs (and by "
                              f"`microspeed plugins --hooks`).")
        self.infos[name] = PluginInfo(name, version, source, instance)
        return instance

    def load_all(self, disabled: Iterable[str] = (), extra: Iterable[tuple[str, Any]] = ()) -> None:
        """Register the built-ins, the discovered entry points and ``extra`` (name, plugin) pairs.

        ``disabled`` names plugins not to register (from the config's ``plugins.disable``).
        """
        from microspeed import __version__

        disabled = set(disabled)
        self.disabled = disabled
        for name, target in BUILTIN_PLUGINS.items():
            if name not in disabled:
                self.register_plugin(_load_object(target), name, __version__, f"builtin {target}")
        for ep in discover_entry_points():
            if ep.name in disabled:
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # an installed plugin that cannot import is a user problem
                dist = ep.dist.name if ep.dist else "?"
                raise PluginError(
                    f"plugin {ep.name!r} from distribution {dist!r} failed to load ({ep.value}): "
                    f"{type(exc).__name__}: {exc}. Reinstall it, or disable it with "
                    f'"plugins": {{"disable": ["{ep.name}"]}} or {ENV_DISABLE_AUTOLOAD}=1.'
                ) from exc
            version = ep.dist.version if ep.dist else ""
            self.register_plugin(obj, ep.name, version, f"entry point {ep.value}")
        for name, plugin in extra:
            if name not in disabled:
                self.register_plugin(plugin, name, "", "passed to initialize(plugins=...)")
        self.check_required()

    def check_required(self) -> None:
        """Refuse disabling an essential built-in, and a plugin set that leaves a required hook unimplemented.

        As pytest refuses to disable its essential plugins: a built-in that is the only default answer
        of a required hook (:func:`essential_builtins`) cannot be disabled — a plugin replaces it by
        answering that hook first (the built-in's answer is ``trylast``). The error names the hook,
        the built-in and the fix.
        """
        problems, covered = [], set()
        for name, hooks in essential_builtins().items():
            if name in self.disabled:
                covered.update(hooks)
                problems.append(f"the built-in {name!r} is essential and cannot be disabled (plugins.disable): it is "
                                f"the default answer of {', '.join(hooks)}; remove it from \"plugins\": "
                                f"{{\"disable\": [...]}} — to replace it, register a plugin that answers "
                                f"{' and '.join(hooks)} (it is asked before the built-in's trylast default)")
        problems += [self._no_answer(hook, asked=[]) for hook in hookspecs.REQUIRED
                     if hook not in covered and not self._answerers(hook)]
        if problems:
            raise PluginError("; ".join(problems))

    def _answerers(self, hook_name: str) -> list[str]:
        caller = getattr(self.hook, hook_name)
        return [i.plugin_name for i in reversed(caller.get_hookimpls()) if not (i.wrapper or i.hookwrapper)]

    def _no_answer(self, hook_name: str, asked: list[str]) -> str:
        defaults = [name for name, target in BUILTIN_PLUGINS.items()
                    if hasattr(_load_object(target), hook_name)]
        off = [name for name in defaults if name in self.disabled]
        why = (f"the built-in {' and '.join(map(repr, off))} was disabled (plugins.disable) and it is the only "
               f"plugin that answers {hook_name}: remove it from \"plugins\": {{\"disable\": [...]}} or register "
               f"a plugin that answers {hook_name}") if off else (
               f"register a plugin that answers it (the built-in {' or '.join(map(repr, defaults))} does)"
               if defaults else "register a plugin that answers it")
        asked_text = f"asked: {', '.join(asked)}" if asked else "no plugin implements it"
        return (f"no plugin answered {hook_name}, which is required ({hookspecs.REQUIRED[hook_name]}; "
                f"{asked_text}); {why}.")

    def answered(self, hook_name: str, result: Any) -> Any:
        """``result`` of a required hook call, or a :class:`PluginError` when no plugin answered (``None``)."""
        if result is None:
            raise PluginError(self._no_answer(hook_name, self._answerers(hook_name)))
        return result

    def names(self) -> list[str]:
        """Names of the registered plugins, in registration order."""
        return list(self.infos)

    def signature(self) -> list[tuple[str, str]]:
        """``[(name, version), ...]`` of registered plugins: what ranks must agree on."""
        return [info.as_tuple() for info in self.infos.values()]

    # -- calling --------------------------------------------------------------------------

    def impls_in_call_order(self, hook_name: str) -> list[pluggy.HookImpl]:
        """The implementations of a hook in the order pluggy calls them (tryfirst first), wrappers left out."""
        caller = getattr(self.hook, hook_name)
        return [impl for impl in reversed(caller.get_hookimpls()) if not impl.hookwrapper and not impl.wrapper]

    def call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call ``hook_name`` on each implementing plugin alone, through pluggy: ``[(plugin, result), ...]``.

        For answers that must be attributed to their plugin (conflict declarations, config-section
        listings); wrappers and tracing see each call.
        """
        answers = []
        for name in self._answerers(hook_name):
            others = [info.plugin for other, info in self.infos.items() if other != name]
            caller = self.subset_hook_caller(hook_name, remove_plugins=others)
            answers.append((name, caller(**kwargs)))
        return answers

    def implementers(self, hook_name: str) -> list[str]:
        """Plugin names implementing ``hook_name``, in call order."""
        caller = getattr(self.hook, hook_name)
        return [impl.plugin_name for impl in reversed(caller.get_hookimpls())]

    def hooks_of(self, name: str) -> list[str]:
        """Hook names implemented by the plugin ``name``."""
        plugin = self.get_plugin(name)
        callers = self.get_hookcallers(plugin) or []
        return sorted(c.name for c in callers)


def essential_builtins() -> dict[str, list[str]]:
    """Built-ins that cannot be disabled: ``name -> the required hooks only it answers among the built-ins``."""
    essential: dict[str, list[str]] = {}
    for hook in hookspecs.REQUIRED:
        answering = [name for name, target in BUILTIN_PLUGINS.items() if hasattr(_load_object(target), hook)]
        if len(answering) == 1:
            essential.setdefault(answering[0], []).append(hook)
    return essential


def discover_entry_points() -> list[metadata.EntryPoint]:
    """Entry points to load, honouring the autoload switch and ``MICROSPEED_PLUGINS``."""
    eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    if os.environ.get(ENV_DISABLE_AUTOLOAD, "").strip() not in ("", "0"):
        wanted = [n.strip() for n in os.environ.get(ENV_PLUGINS, "").split(",") if n.strip()]
        by_name = {ep.name: ep for ep in eps}
        missing = [n for n in wanted if n not in by_name]
        if missing:
            raise PluginError(
                f"{ENV_PLUGINS} names {missing}, but no entry point in group {ENTRY_POINT_GROUP!r} "
                f"has that name; installed: {sorted(by_name) or 'none'}"
            )
        return [by_name[n] for n in wanted]
    return eps


def all_hook_names() -> list[str]:
    """Every hook name in :mod:`microspeed.hookspecs`, in definition order."""
    return [n for n in vars(hookspecs) if n.startswith("microspeed_")]
