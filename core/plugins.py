"""The plugin manager: built-ins, entry-point discovery, enable/disable, chains, cross-rank checks.

Discovery follows pytest's rules:

* built-in plugins (:mod:`microspeed.builtin`) are always registered, unless disabled by name;
* every entry point in the group ``microspeed.plugins`` is loaded (entry-point name = plugin
  name), unless ``MICROSPEED_DISABLE_PLUGIN_AUTOLOAD=1``; then only the names listed in
  ``MICROSPEED_PLUGINS=a,b`` are loaded;
* the config section ``"plugins": {"disable": ["name", ...]}`` disables plugins by name.

An entry point names a module, an object, or a class. A class is instantiated once per engine
(the way to keep per-engine state); a module or object is registered as it is.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterable
from importlib import metadata
from typing import Any

import pluggy

from microspeed import hookspecs
from microspeed.errors import PluginError

ENTRY_POINT_GROUP = "microspeed.plugins"
ENV_DISABLE_AUTOLOAD = "MICROSPEED_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "MICROSPEED_PLUGINS"

#: Built-in plugins, in registration order: ``name -> "module:attribute"``.
BUILTIN_PLUGINS: dict[str, str] = {
    "config_core": "microspeed.builtin.core_config:CoreConfigPlugin",
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


class PluginManager(pluggy.PluginManager):
    """pluggy's manager with microspeed's hookspecs, discovery rules and chain calls."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self._chain_listeners: list[Any] = []

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
        self.infos[name] = PluginInfo(name, version, source, instance)
        return instance

    def load_all(self, disabled: Iterable[str] = (), extra: Iterable[tuple[str, Any]] = ()) -> None:
        """Register the built-ins, the discovered entry points and ``extra`` (name, plugin) pairs.

        ``disabled`` names plugins not to register (from the config's ``plugins.disable``).
        """
        from microspeed import __version__

        disabled = set(disabled)
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

    def names(self) -> list[str]:
        """Names of the registered plugins, in registration order."""
        return list(self.infos)

    def signature(self) -> list[tuple[str, str]]:
        """``[(name, version), ...]`` of registered plugins: what ranks must agree on."""
        return [info.as_tuple() for info in self.infos.values()]

    # -- calling --------------------------------------------------------------------------

    def impls_in_call_order(self, hook_name: str) -> list[pluggy.HookImpl]:
        """The implementations of a hook in the order pluggy calls them (tryfirst first)."""
        caller = getattr(self.hook, hook_name)
        return [impl for impl in reversed(caller.get_hookimpls()) if not impl.hookwrapper and not impl.wrapper]

    def call_chain(self, hook_name: str, value_arg: str, value: Any, **kwargs: Any) -> Any:
        """Call a *chain* hook: each implementation gets the previous result as ``value_arg``.

        An implementation returning ``None`` leaves the value unchanged.
        """
        for impl in self.impls_in_call_order(hook_name):
            args = dict(kwargs)
            args[value_arg] = value
            for listener in self._chain_listeners:
                listener(hook_name, impl.plugin_name, "start")
            result = impl.function(*[args[name] for name in impl.argnames])
            for listener in self._chain_listeners:
                listener(hook_name, impl.plugin_name, "end")
            if result is not None:
                value = result
        return value

    def add_chain_listener(self, listener: Any) -> None:
        """Register ``listener(hook_name, plugin_name, "start"|"end")`` for chain calls (tracing)."""
        self._chain_listeners.append(listener)

    def implementers(self, hook_name: str) -> list[str]:
        """Plugin names implementing ``hook_name``, in call order."""
        caller = getattr(self.hook, hook_name)
        return [impl.plugin_name for impl in reversed(caller.get_hookimpls())]

    def hooks_of(self, name: str) -> list[str]:
        """Hook names implemented by the plugin ``name``."""
        plugin = self.get_plugin(name)
        callers = self.get_hookcallers(plugin) or []
        return sorted(c.name for c in callers)


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
