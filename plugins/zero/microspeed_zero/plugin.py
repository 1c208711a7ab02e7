"""The ``zero`` plugin: answers "who reduces gradients / steps the optimizer / owns parameters".

Active when ``zero_optimization.stage`` >= 1. It claims the :attr:`~microspeed.plugin_api.Role.GRADIENT_REDUCTION`
and :attr:`~microspeed.plugin_api.Role.OPTIMIZER_STEP` roles, so the built-in data-parallel reducer and
the mixed-precision masters stand down; mixed precision still casts the model and scales the
loss, and its loss scaler (the :class:`~microspeed.plugin_api.LossScaling` capability) is used here.
It states :class:`~microspeed.plugin_api.GradientPartitioning` (the stage, and whether parameters
of a :class:`~microspeed.plugin_api.ReplicaGroup` keep their own group: stages 1 and 2), which
other plugins ask instead of reading ``zero_optimization``. All state lives in a
:class:`microspeed_zero.runtime.ZeroRuntime` on the engine (``engine.plugin_state("zero")``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from microspeed.plugin_api import (
    ZERO_OFFLOAD_CLIENT,
    ConfigError,
    EngineUsageError,
    Feature,
    Field,
    GradientCompression,
    GradientPartitioning,
    Refusal,
    Role,
    StepOutcome,
    comm,
    hookimpl,
)
from microspeed_zero.aio import aio_section
from microspeed_zero.compositions import CPU_STEP_IS_ADAM, FEATURES, REFUSALS
from microspeed_zero.config import ZeroConfig, zero_section
from microspeed_zero.optimizer import check_partitionable
from microspeed_zero.runtime import ZeroRuntime
from microspeed_zero.shm import drain_all


def _check_offload_optimizer(optimizer: Any, compressed: bool) -> None:
    """CPU offload while ``zero_force_ds_cpu_optimizer`` is true: refuse a 1-bit optimizer (its declared refusal)
    and, as DeepSpeed does, a client optimizer other than Adam/AdamW and DeepSpeed's CPU optimizers."""
    name = type(optimizer).__name__
    if compressed:
        raise ConfigError(f"zero_optimization.offload_optimizer with the optimizer {name}: "
                          f"{CPU_STEP_IS_ADAM[0].message()}.")
    accepted = (torch.optim.Adam, torch.optim.AdamW, *ZERO_OFFLOAD_CLIENT)
    if not isinstance(optimizer, accepted):
        raise ConfigError(
            f"zero_optimization.offload_optimizer with the optimizer {name}: ZeRO-Offload steps it on the CPU, "
            f"which DeepSpeed refuses while \"zero_force_ds_cpu_optimizer\" is true (the default) for any optimizer "
            f"but {', '.join(c.__name__ for c in accepted)}. Use one of those (an \"optimizer\" of type Adam/AdamW "
            f"in the ds_config, or deepspeed.ops.adam.DeepSpeedCPUAdam), or set \"zero_force_ds_cpu_optimizer\": "
            f"false to step {name} on the CPU as it is.")


class ZeroPlugin:
    """ZeRO stages 1–3 and ZeRO-Offload (one instance per engine)."""

    def __init__(self) -> None:
        self.cfg: ZeroConfig | None = None
        self.rt: ZeroRuntime | None = None
        self.config: Any = None
        self.gather_asked = False  # engine._zero3_consolidated_16bit_state_dict(): gather whatever the config says
        self.prediction: Any = None  # the peak RSS predicted at initialize() (host_memory_budget set)
        self.over_budget_warned = False

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``zero_optimization``, DeepSpeed's two top-level ZeRO switches and ``aio`` (the NVMe swap I/O)."""
        return {
            "zero_optimization": zero_section(),
            "aio": aio_section(),
            "zero_allow_untested_optimizer": Field((bool,), False, "allow a ZeRO optimizer not known to be "
                                                   "element-wise (you vouch that it is)"),
            "zero_force_ds_cpu_optimizer": Field((bool,), True, "with offload_optimizer, refuse a 1-bit optimizer "
                                                 "and, as DeepSpeed, any but Adam/AdamW, DeepSpeedCPUAdam/Lion"),
        }

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Parse the section; refuse combinations we cannot serve."""
        self.config = config
        self.cfg = ZeroConfig.from_config(config)
        _show_notices(self.cfg.notices)
        if self.cfg.host_memory_budget is not None and self.cfg.stage >= 1:
            from microspeed_zero.host_memory import return_freed_memory

            return_freed_memory()  # what the prediction assumes: freed blocks leave the process

    @hookimpl
    def microspeed_capabilities(self) -> list[GradientPartitioning] | None:
        """Stage >= 1: state the partitioning, for plugins that must know (MoE, the 1-bit optimizers)."""
        if self.cfg is None or self.cfg.stage == 0:
            return None
        return [partitioning(self.cfg.stage)]

    def _active(self) -> bool:
        return self.rt is not None

    @hookimpl
    def microspeed_setup(self, engine) -> None:
        """Stage >= 1: claim the roles and attach the runtime."""
        if self.cfg is None or self.cfg.stage == 0:
            return
        engine.claim(Role.GRADIENT_REDUCTION, "zero")
        engine.claim(Role.OPTIMIZER_STEP, "zero")
        self.rt = ZeroRuntime(engine, self.cfg)
        engine.set_plugin_state("zero", self.rt)

    @hookimpl(tryfirst=True)
    def microspeed_after_model_ready(self, engine, model: torch.nn.Module) -> None:
        """Stage 3: partition the parameters now, before the optimizer is built; otherwise make
        parameters built under ``zero.Init`` whole (before data parallel broadcasts them)."""
        if self._active() and self.cfg.stage == 3:
            _apply_leaf_config(self.cfg, model)
            self.rt.partition_parameters(model)
            self.rt.tag_parameters()
        else:
            from microspeed_zero.init import materialize

            materialize(model.parameters())

    @hookimpl(tryfirst=True)
    def microspeed_wrap_optimizer(self, engine, optimizer: Any) -> Any:
        """Replace the optimizer by a :class:`ZeroOptimizer` over this rank's partitions."""
        if not self._active():
            return None
        codec = engine.capabilities.get(GradientCompression)  # its provider makes the optimizer step partitions
        compressed = bool(codec and codec.accepts(optimizer))
        check_partitionable(optimizer, self.config["zero_allow_untested_optimizer"] or compressed)
        if self.cfg.offload_optimizer == "cpu" and self.config["zero_force_ds_cpu_optimizer"]:  # NVMe: the swapper's
            _check_offload_optimizer(optimizer, compressed)
        if self.cfg.host_memory_budget is not None:
            self.prediction = _check_host_memory(engine, self.rt, optimizer, self.cfg.host_memory_budget)
        wrapped = self.rt.wrap(optimizer)
        self.rt.tag_parameters()
        if self.cfg.offload_optimizer == "nvme":
            from microspeed_zero.swap import OptimizerSwapper

            self.rt.swapper = OptimizerSwapper(self.rt)
        return wrapped

    @hookimpl
    def microspeed_after_forward(self, engine) -> None:
        """Stage 3: record the module order; release what prefetching left gathered."""
        if self._active() and self.rt.stage3 is not None:
            self.rt.stage3.after_forward()

    @hookimpl
    def microspeed_next_pass(self, current: tuple, upcoming: tuple | None) -> None:
        """A schedule's next compute pass: stage 3 prefetches and keeps across it; stages 2, 3 reduce one chunk."""
        if self._active():
            self.rt.next_pass(current, upcoming)

    @hookimpl
    def microspeed_after_step(self) -> None:
        """``host_memory_budget``: warn (once) when this process's measured peak RSS has passed the budget."""
        if self._active() and self.cfg.host_memory_budget is not None and not self.over_budget_warned:
            from microspeed_zero.peak_rss import measured_peak

            peak = measured_peak()
            if peak is not None and peak > self.cfg.host_memory_budget:
                self.over_budget_warned = True
                logging.getLogger("microspeed.zero").warning(_over_budget(peak, self.cfg.host_memory_budget,
                                                                          self.prediction))

    @hookimpl
    def microspeed_no_sync(self) -> None:
        """Stages 2, 3: refuse ``no_sync()`` on entry, as DeepSpeed asserts."""
        if self._active() and self.rt.stage >= 2:
            raise EngineUsageError(f"no_sync context manager is incompatible with gradient partitioning logic of "
                                   f"ZeRO stage {self.rt.stage}: gradients are reduce-scattered as backward "
                                   f"produces them. Use zero_optimization.stage 1 (or 0), or drop no_sync().")

    @hookimpl
    def microspeed_before_backward(self, ctx) -> None:
        """Stage 1: attach gradient views; stages 2, 3: refuse ``no_sync``."""
        if self._active() and self.rt.optimizer is not None:
            self.rt.before_backward(ctx)

    @hookimpl
    def microspeed_after_backward(self, ctx) -> None:
        """Finish this micro-step's reductions (stages 2, 3) or fp32 accumulation (stage 1)."""
        if self._active() and self.rt.optimizer is not None:
            self.rt.after_backward(ctx)

    @hookimpl(tryfirst=True)
    def microspeed_reduce_gradients(self) -> bool | None:
        """Stage 1 reduces at the boundary; stages 2, 3 already did during backward. Then tied shards are summed."""
        if not self._active() or self.rt.optimizer is None:
            return None
        self.rt.reduce_at_boundary()
        return True

    @hookimpl(tryfirst=True)
    def microspeed_optimizer_step(self) -> StepOutcome | None:
        """Step this rank's partitions."""
        if not self._active():
            return None
        return self.rt.step()

    # -- checkpoints ---------------------------------------------------------------------------

    @hookimpl(tryfirst=True)
    def microspeed_checkpoint_module_tensors(self, saving: bool) -> dict | None:
        """Stage 3: parameters as this rank's shards (a file-resident one, when saving, read as it is written)."""
        from microspeed_zero import checkpointing  # imports torch.distributed.checkpoint: only when used

        return checkpointing.module_tensors(self.rt, saving) if self._active() else None

    @hookimpl(tryfirst=True)
    def microspeed_save_optimizer_state(self, tensors: dict) -> dict | None:
        """Partitioned masters and optimizer state, keyed as stage 0 keys them."""
        if not self._active() or self.rt.optimizer is None:
            return None
        from microspeed_zero import checkpointing

        return checkpointing.save_optimizer(self.rt, tensors)

    @hookimpl(tryfirst=True)
    def microspeed_load_optimizer_state(self, saved, reader, load_states: bool, strict: bool, after: list) -> Any:
        """Read masters and optimizer state straight into this rank's pieces."""
        if not self._active() or self.rt.optimizer is None:
            return None
        from microspeed_zero import checkpointing

        return checkpointing.load_optimizer(self.rt, saved, reader, load_states, strict, after)

    @hookimpl(tryfirst=True)
    def microspeed_consolidated_state_dict(self, engine) -> dict | None:
        """Stage 3: gather whole weights for ``save_16bit_model`` if allowed by the config."""
        if not self._active() or self.rt.stage3 is None:
            if self._active():
                self.rt.wait_gathers()
            return None
        if not (self.cfg.gather_16bit_weights_on_model_save or self.gather_asked):
            return {"__skip__": "zero_optimization.stage3_gather_16bit_weights_on_model_save is false, so stage-3 "
                                "weights stay partitioned; set it true, or save a checkpoint and consolidate it "
                                "with `microspeed checkpoint consolidate`."}
        return self.rt.consolidated_state_dict()

    @hookimpl
    def microspeed_optimizer_param_names(self) -> dict[int, str] | None:
        """Nothing extra: the ZeRO optimizer presents the model's own parameters."""
        return None

    @hookimpl
    def microspeed_destroy(self) -> None:
        """``engine.destroy()``: the runtime's hooks removed, collectives in flight finished (the shared-memory
        exchange's too: its worker is idle afterwards), swap files closed."""
        if self.rt is not None:
            self.rt.destroy()
            self.rt = None
            drain_all()

    @hookimpl
    def microspeed_engine_api(self, engine) -> dict[str, Any] | None:
        """DeepSpeed's ``engine.zero_*`` accessors (stage >= 1; at stage 0 the built-in answers)."""
        if not self._active():
            return None
        from microspeed_zero.engine_api import engine_api

        return engine_api(engine, self.rt, self.config, self._gather_whole)

    def _gather_whole(self, engine: Any) -> dict | None:
        """Every plugin's consolidation of the whole state dict (the hook), asked for explicitly: stage 3 gathers
        even when ``stage3_gather_16bit_weights_on_model_save`` is false (as DeepSpeed's call does), and wrappers
        around it (MoE: every rank's experts) complete it. Collective."""
        self.gather_asked = True
        try:
            return engine.hook.microspeed_consolidated_state_dict(engine=engine)
        finally:
            self.gather_asked = False

    @hookimpl
    def microspeed_features(self) -> list[Feature]:
        """ZeRO stages 1-3 and CPU / NVMe offload, for the composition matrix."""
        return list(FEATURES)

    @hookimpl
    def microspeed_refusals(self) -> list[Refusal]:
        """The pairs this plugin refuses at ``initialize()`` (:mod:`microspeed_zero.compositions`)."""
        return list(REFUSALS)


def partitioning(stage: int) -> GradientPartitioning:
    """What ZeRO at ``stage`` (>= 1) states about itself: every stage keeps replica groups (a parameter carrying a
    ``ReplicaGroup`` is partitioned, reduced and, at stage 3, gathered over that group)."""
    return GradientPartitioning(stage=stage, keeps_replica_groups=True, config_key="zero_optimization.stage",
                                disable_hint="set zero_optimization.stage to 0", sums_marked_gradients=True,
                                honours_norm_rules=True)


def _show_notices(lines: tuple[str, ...]) -> None:
    """Log each "has no effect here" line of this engine's config, on rank 0 only."""
    if lines and comm.get_rank() == 0:
        log = logging.getLogger("microspeed.zero")
        for line in lines:
            log.warning(line)


def _check_host_memory(engine: Any, rt: ZeroRuntime, optimizer: Any, budget: int) -> Any:
    """``zero_optimization.host_memory_budget`` at ``initialize()``: predict this rank's peak RSS from the model, the
    config and the optimizer; :class:`ConfigError` with the breakdown when it exceeds ``budget``; the prediction."""
    from microspeed_zero.peak_rss import check_budget, predict_peak_rss

    model = engine.module
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtypes.pop(), "fp32") if len(dtypes) == 1 \
        else "fp32"
    momentum = any(g.get("momentum", 0) for g in getattr(optimizer, "param_groups", []))
    kind = {"Adam": "adam", "AdamW": "adamw", "Adagrad": "adagrad",
            "SGD": "sgd_momentum" if momentum else "sgd"}.get(type(optimizer).__name__, "adam")
    cfg = rt.cfg
    pred = predict_peak_rss(
        model, rt.world, cfg.stage, cfg.offload_optimizer, cfg.offload_param, precision, kind,
        micro_batch=engine.train_micro_batch_size_per_gpu(), grad_accum=engine.gradient_accumulation_steps(),
        sub_group_size=cfg.sub_group_size, buffer_count=cfg.buffer_count, reduce_bucket_size=cfg.reduce_bucket_size,
        max_live_parameters=cfg.max_live_parameters, prefetch_bucket_size=cfg.prefetch_bucket_size,
        max_in_cpu=cfg.max_in_cpu, grad_accum_fp32=rt.accumulate_fp32)
    key = "zero_optimization.host_memory_budget"
    if cfg.host_memory_budget_auto:
        from microspeed_zero.peak_rss import default_budget_origin

        key += f' ("auto": {default_budget_origin()})'
    refusal = check_budget(pred, budget, key)
    if refusal is not None:
        raise ConfigError(refusal)
    return pred


def _over_budget(peak: int, budget: int, pred: Any) -> str:
    """The warning when the measured peak RSS passed ``host_memory_budget``."""
    from microspeed_zero.estimator import format_bytes

    told = f"; predicted at initialize() {format_bytes(pred.total)}:\n{pred.table()}" if pred is not None else ""
    return (f"zero_optimization.host_memory_budget = {format_bytes(budget)} exceeded: this process's peak RSS "
            f"(VmHWM) is {format_bytes(peak)}{told}\nWhat the prediction leaves out (the model as built before "
            f"initialize(), data held by the script) counts too; lower the settings the breakdown names or raise "
            f"the budget.")


def _apply_leaf_config(cfg: ZeroConfig, model: torch.nn.Module) -> None:
    """``zero_optimization.leaf_module``: flag the named classes, module names and suffixes as leaves."""
    from microspeed_zero.leaf import set_z3_leaf_module, set_z3_leaf_modules

    if cfg.leaf_classes:
        set_z3_leaf_modules(model, list(cfg.leaf_classes), raise_if_not_found=False)
    names = dict(model.named_modules())
    missing = [n for n in cfg.leaf_names if n not in names]
    if missing:
        raise ConfigError(f"zero_optimization.leaf_module.names: no module named {missing} in the model "
                          f"(names as in model.named_modules(), e.g. {list(names)[1:4]}).")
    for name, module in names.items():
        if name in cfg.leaf_names or any(name.endswith(s) for s in cfg.leaf_suffixes):
            set_z3_leaf_module(module, True)
