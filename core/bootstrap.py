"""``initialize()``: load plugins, parse the config, agree across ranks, build the engine.

The order is fixed and short, in the style of torchtitan's train loop set-up: each step is a
hook call, and every error a user can cause surfaces here, as a :class:`ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from microspeed import comm
from microspeed.capabilities import Capabilities
from microspeed.config import Config, load_raw, merge_schema, parse, resolve_batch_triad
from microspeed.engine import Engine
from microspeed.errors import ConfigError, PluginError
from microspeed.plugins import PluginManager
from microspeed.topology import Topology


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
    plugins: Iterable[tuple[str, Any]] = (),
) -> tuple[Engine, Any, Any, Any]:
    """Build a training engine, as ``deepspeed.initialize`` does.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``. ``config`` is a dict or
    a path to a JSON file (or ``args.deepspeed_config``); ``config_params`` is DeepSpeed's older
    name for it. The positional order is DeepSpeed 0.19.8's; ``distributed_port`` is used when
    ``initialize`` starts ``torch.distributed`` itself. ``optimizer`` and ``lr_scheduler`` may be
    objects or callables (params -> optimizer, optimizer -> scheduler). ``plugins`` registers
    extra ``(name, plugin)`` pairs for this engine only (tests, notebooks).
    """
    if model is None:
        raise ConfigError("initialize(model=...): a torch.nn.Module is required.")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"initialize(model=...): expected a torch.nn.Module, got {type(model).__name__}.")
    if config is not None and config_params is not None:
        raise ConfigError("initialize(): give the ds_config as config= or config_params=, not both.")
    if mesh_param is not None:
        raise ConfigError("initialize(mesh_param=...): DeepSpeed's device mesh for Ulysses sequence parallelism is "
                          "not supported by microspeed; leave it None.")
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)

    pm = PluginManager()
    cfg: Config | None = None
    error: Exception | None = None
    try:  # an error on one rank must reach every rank, never leave the others in a collective
        raw = load_raw(config if config is not None else config_params, args)
        pm.load_all(disabled=_disabled_plugins(raw), extra=plugins)
        pm.hook.microspeed_plugins_loaded(plugins=pm)
        cfg = parse(raw, merge_schema(pm.hook.microspeed_config_sections()),
                    _argument_problems(raw, model, optimizer, lr_scheduler))
    except Exception as exc:  # noqa: BLE001 - any error, re-raised on this rank and reported on the others
        error = exc
    _check_ranks_agree(pm, cfg, error)
    _log_notices(cfg)

    # Each phase below may run collectives (groups, broadcasts, partitioning): the ranks agree
    # after every phase, so an error raised on one rank is raised on all before the next one.
    world_size = comm.get_world_size()

    capabilities = Capabilities()

    def configure() -> Topology:
        topology = pm.answered("microspeed_make_topology", pm.hook.microspeed_make_topology(
            config=cfg, world_size=world_size, mpu=mpu, model=model))
        pm.hook.microspeed_adjust_batch(config=cfg, dp_world_size=topology.data_parallel_size)
        resolve_batch_triad(cfg, topology.data_parallel_size)
        pm.hook.microspeed_configure(config=cfg, world_size=world_size)
        for name, answers in pm.call_each("microspeed_capabilities", config=cfg):
            for capability in (c for answer in answers for c in answer or []):
                capabilities.provide(capability, name)
        _check_conflicts(pm, cfg, capabilities)
        return topology

    engine = Engine(pm, cfg, _agreed(configure), model, capabilities)

    def setup() -> None:
        pm.hook.microspeed_setup(engine=engine)
        engine.install_api(pm.hook.microspeed_engine_api(engine=engine))

    _agreed(setup)
    engine.module = _agreed(lambda: pm.hook.microspeed_transform_model(engine=engine, model=model))
    _agreed(lambda: pm.hook.microspeed_after_model_ready(engine=engine, model=engine.module))

    def optimize() -> None:
        params = list(model_parameters) if model_parameters is not None else [
            p for p in engine.module.parameters() if p.requires_grad
        ]
        engine.optimizer = _build_optimizer(pm, engine, cfg, optimizer, params)
        if engine.optimizer is not None:
            engine.optimizer = pm.hook.microspeed_wrap_optimizer(engine=engine, optimizer=engine.optimizer)
        engine.lr_scheduler = _build_scheduler(pm, engine, cfg, lr_scheduler)
        if training_data is not None:
            engine.training_dataloader = pm.answered("microspeed_make_dataloader", pm.hook.microspeed_make_dataloader(
                engine=engine, dataset=training_data, collate_fn=collate_fn))
            _check_training_data(engine, training_data, engine.training_dataloader)

    _agreed(optimize)
    engine.grad_norm.prepare()
    pm.hook.microspeed_initialized(engine=engine)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


T = TypeVar("T")


def _length(obj: Any) -> int | None:
    """``len(obj)``, or ``None`` for an object without a length (an iterable dataset, a repeating loader)."""
    try:
        return len(obj)
    except TypeError:
        return None


def _check_training_data(engine: Engine, dataset: Any, loader: Any) -> None:
    """Refuse training data no step can be drawn from, naming the keys and the numbers.

    An empty dataset; a micro-batch larger than one data-parallel rank's share (``ceil(len / ranks)`` samples,
    as ``DistributedSampler`` pads it; with ``dataloader_drop_last`` a loader that yields no micro-batch at all);
    ``gradient_accumulation_steps`` larger than the micro-batches of one epoch (no epoch reaches a step).
    Datasets and loaders without a length are not checked.
    """
    n = _length(dataset)
    if n is None:
        return
    ranks = engine.topology.data_parallel_size
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    if n == 0:
        raise ConfigError("initialize(training_data=...): the dataset is empty (len 0); training would take no "
                          "step. Pass a dataset with samples.")
    share = -(-n // ranks)
    batches = _length(loader)
    if mbs > share or batches == 0:
        each = f"{share}" if n % ranks == 0 else f"{n // ranks} or {share}"
        raise ConfigError(
            f"train_micro_batch_size_per_gpu={mbs} is larger than the dataset can fill: {n} samples over {ranks} "
            f"data-parallel rank(s) give each rank {each} samples"
            f"{', and with dataloader_drop_last no micro-batch is left' if batches == 0 else ''}. Lower "
            f"train_micro_batch_size_per_gpu (and train_batch_size) to at most {max(n // ranks, 1)}, or give more "
            f"data.")
    if batches is not None and gas > batches:
        raise ConfigError(
            f"gradient_accumulation_steps={gas} is more than the {batches} micro-batches of "
            f"train_micro_batch_size_per_gpu={mbs} one epoch gives each rank ({n} samples over {ranks} data-parallel "
            f"rank(s)): no epoch reaches an optimizer step. Lower gradient_accumulation_steps (train_batch_size="
            f"{engine.train_batch_size()}) to at most {batches}, or give more data.")


def _agreed(phase: Callable[[], T]) -> T:
    """Run one phase of ``initialize()``, then agree across ranks on whether it failed anywhere."""
    try:
        result = phase()
    except Exception as exc:
        _agree_on_outcome(exc)
        raise
    _agree_on_outcome(None)
    return result


def _argument_problems(raw: dict[str, Any], model: torch.nn.Module, optimizer: Any, lr_scheduler: Any) -> list[str]:
    """Problems between ``initialize()``'s arguments and the config, reported with the config's own.

    A model with no trainable parameter is refused when an optimizer is asked for (it would step nothing);
    without one it is an evaluation engine, which DeepSpeed allows too.
    """
    problems = []
    if (optimizer is not None or "optimizer" in raw) and not any(p.requires_grad for p in model.parameters()):
        count = sum(1 for _ in model.parameters())
        problems.append(f"initialize(model=...): the model {type(model).__name__} has no trainable parameters "
                        f"({count} parameters, none with requires_grad=True), but an optimizer is configured: it "
                        f"would train nothing. Unfreeze the parameters to train, or drop the 'optimizer' section "
                        f"(and initialize(optimizer=...)) for an evaluation-only engine.")
    if optimizer is not None and "optimizer" in raw:
        problems.append("optimizer: given both in the config's 'optimizer' section and as "
                        "initialize(optimizer=...); keep one of them.")
    if lr_scheduler is not None and "scheduler" in raw:
        problems.append("scheduler: given both in the config's 'scheduler' section and as "
                        "initialize(lr_scheduler=...); keep one of them.")
    if lr_scheduler is None and "scheduler" in raw and optimizer is None and "optimizer" not in raw:
        problems.append("scheduler: a scheduler needs an optimizer; add an 'optimizer' section "
                        "or pass initialize(optimizer=...).")
    return problems


_NOTICES_LOGGED: set[str] = set()


def _log_notices(cfg: Config) -> None:
    """Log each config notice once per process, on rank 0 (keys DeepSpeed knows that have no effect here)."""
    fresh = [n for n in cfg.notices if n not in _NOTICES_LOGGED]
    _NOTICES_LOGGED.update(fresh)
    if fresh and comm.get_rank() == 0:
        from microspeed.log import get_logger

        log = get_logger("microspeed.config")
        for notice in fresh:
            log.info(notice)


def _agree_on_outcome(error: Exception | None) -> None:
    """One small collective after a phase of ``initialize()``: an error raised on one rank is raised on all.

    The failing rank re-raises its own error (the caller does); the others raise a
    :class:`PluginError` naming the rank and the error, instead of waiting in a later collective.
    """
    if comm.get_world_size() == 1:
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    # a rank that never comes ends the wait in a MissingRanksError naming it, within the watchdog's timeout
    comm.wait_for_ranks("initialize()", comm.current().ranks_timeout_s)
    everyone = comm.all_gather_object(mine)
    if error is not None:
        return
    failed = [(rank, msg) for rank, msg in enumerate(everyone) if msg]
    if failed:
        raise PluginError("initialize() failed on other ranks: "
                          + "; ".join(f"rank {rank}: {msg}" for rank, msg in failed))


def _disabled_plugins(raw: dict[str, Any]) -> list[str]:
    section = raw.get("plugins", {})
    disabled = section.get("disable", []) if isinstance(section, dict) else []
    if not isinstance(disabled, list) or not all(isinstance(n, str) for n in disabled):
        raise ConfigError(f"plugins.disable: expected a list of plugin names, got {disabled!r}.")
    return disabled


def _check_ranks_agree(pm: PluginManager, cfg: Config | None, error: Exception | None) -> None:
    mine = {"plugins": pm.signature(), "config": cfg.digest() if cfg is not None else None,
            "error": None if error is None else f"{type(error).__name__}: {error}"}
    # a rank that never reaches initialize() ends the wait in a MissingRanksError naming it (watchdog timeout)
    comm.wait_for_ranks("initialize() rank agreement", comm.context_for(pm).ranks_timeout_s)
    everyone = comm.all_gather_object(mine)
    if error is not None:
        raise error
    failed = [(rank, theirs["error"]) for rank, theirs in enumerate(everyone) if theirs["error"]]
    if failed:
        raise PluginError("initialize() failed on other ranks: "
                          + "; ".join(f"rank {rank}: {msg}" for rank, msg in failed))
    problems = []
    for rank, theirs in enumerate(everyone):
        if theirs["plugins"] != everyone[0]["plugins"]:
            a, b = set(everyone[0]["plugins"]), set(theirs["plugins"])
            problems.append(f"rank {rank} loaded different plugins than rank 0: only on rank 0: "
                            f"{sorted(a - b)}, only on rank {rank}: {sorted(b - a)}")
        if theirs["config"] != everyone[0]["config"]:
            problems.append(f"rank {rank} has a different ds_config than rank 0 "
                            f"(digest {theirs['config']} vs {everyone[0]['config']})")
    if problems:
        raise PluginError("ranks disagree at initialize(): " + "; ".join(problems)
                          + ". Install the same plugins and pass the same config on every rank.")


def _check_conflicts(pm: PluginManager, cfg: Config, capabilities: Capabilities) -> None:
    for name, answers in pm.call_each("microspeed_conflicts", config=cfg, capabilities=capabilities):
        for answer in answers:
            for key, reason in answer or []:
                if cfg.is_set(key):
                    raise ConfigError(f"{key}: cannot be combined with the plugin {name!r}: {reason}")


def _build_optimizer(pm: PluginManager, engine: Engine, cfg: Config, client: Any, params: list[Any]) -> Any:
    if client is not None and cfg.is_set("optimizer"):
        raise ConfigError("optimizer: given both in the config's 'optimizer' section and as "
                          "initialize(optimizer=...); keep one of them.")
    if client is None:
        if not cfg.is_set("optimizer"):
            return None
        return pm.answered("microspeed_make_optimizer",
                           pm.hook.microspeed_make_optimizer(engine=engine, params=params, config=cfg))
    if isinstance(client, torch.optim.Optimizer):
        return client
    if callable(client):
        return client(params)
    raise ConfigError(f"initialize(optimizer=...): expected a torch.optim.Optimizer or a callable "
                      f"params -> optimizer, got {type(client).__name__}.")


def _build_scheduler(pm: PluginManager, engine: Engine, cfg: Config, client: Any) -> Any:
    if client is not None and cfg.is_set("scheduler"):
        raise ConfigError("scheduler: given both in the config's 'scheduler' section and as "
                          "initialize(lr_scheduler=...); keep one of them.")
    if client is None:
        if not cfg.is_set("scheduler"):
            return None
        if engine.optimizer is None:
            raise ConfigError("scheduler: a scheduler needs an optimizer; add an 'optimizer' section.")
        return pm.answered("microspeed_make_scheduler",
                           pm.hook.microspeed_make_scheduler(engine=engine, optimizer=engine.optimizer, config=cfg))
    if hasattr(client, "step") and not isinstance(client, type):
        return client
    if callable(client):
        return client(engine.optimizer)
    raise ConfigError(f"initialize(lr_scheduler=...): expected a scheduler or a callable optimizer -> "
                      f"scheduler, got {type(client).__name__}.")
