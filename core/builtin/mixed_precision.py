"""Mixed precision: ``fp16`` (with loss scaling) and ``bf16`` models with fp32 master weights.

As DeepSpeed does it: the model is cast to the low-precision dtype; the optimizer steps fp32
master copies of the parameters (its param groups are swapped to the masters, so its state is
fp32 too); after each applied step the masters are copied back into the model. With fp16 the
loss is multiplied by the loss scale before backward and gradients divided by it before the
step; a gradient overflow on any rank skips the step on all ranks, counts it and lowers the
scale (:mod:`microspeed.builtin.loss_scaler`).

``data_types.grad_accum_dtype = "fp32"`` accumulates each micro-step's low-precision gradient
into the fp32 master gradient (so accumulation does not round), and those fp32 buffers are what
the data-parallel reduction averages. Parameters the built-in reducer leaves alone (``allreduce = False``:
MoE experts) are reduced by the plugin that marked them, which finds their fp32 buffer through the
capability's ``accumulated_grad(param)``.

A plugin that claims the ``optimizer_step`` role (ZeRO) keeps its own, partitioned masters: this
plugin then only casts the model and scales the loss, and states its loss scaler as the
:class:`~microspeed.capabilities.LossScaling` capability (``dtype``, ``scaler``, ``accumulate_fp32``).
"""

from __future__ import annotations

from typing import Any

import torch

from microspeed.builtin.loss_scaler import BaseLossScaler, make_loss_scaler, overflow_across_ranks
from microspeed.capabilities import LossScaling, Role
from microspeed.compositions import Feature
from microspeed.config import Field, Section
from microspeed.errors import ConfigError
from microspeed.gradients import has_inf_or_nan, reduced_over_data_parallel
from microspeed.hookspecs import StepOutcome, hookimpl

_DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


PRECISION = "fp16.enabled / bf16.enabled"

FEATURES = (
    Feature("fp16", "fp16 mixed precision (fp32 masters, dynamic loss scaling)", '"fp16": {"enabled": true}',
            choice=PRECISION),
    Feature("bf16", "bf16 mixed precision (fp32 masters)", '"bf16": {"enabled": true}', choice=PRECISION),
)
"""Mixed precision's features for the composition matrix (alternatives: enabling both is refused)."""


class MixedPrecisionPlugin:
    """fp16/bf16 model, fp32 masters, loss scaling and overflow skipping."""

    def __init__(self) -> None:
        self.dtype: torch.dtype | None = None
        self.auto_cast = False
        self.accumulate_fp32 = False
        self.scaler: BaseLossScaler | None = None
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []  # (model param, master)
        self.names: dict[int, str] = {}
        self.master_of: dict[int, torch.nn.Parameter] = {}  # id(model param) -> its fp32 master
        self.engine: Any = None

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """DeepSpeed's ``fp16``, ``bf16`` and ``data_types`` sections."""
        return {
            "fp16": Section({
                "enabled": Field((bool,), False, "train in fp16 with fp32 masters"),
                "auto_cast": Field((bool,), False, "cast floating-point inputs of forward to fp16"),
                "loss_scale": Field((float,), 0.0, "0 = dynamic loss scaling, else a static scale"),
                "initial_scale_power": Field((int,), 16, "dynamic scale starts at 2**power"),
                "loss_scale_window": Field((int,), 1000, "clean steps before the scale doubles"),
                "hysteresis": Field((int,), 2, "overflows tolerated before the scale halves"),
                "consecutive_hysteresis": Field((bool,), False, "refill hysteresis on every clean step"),
                "min_loss_scale": Field((float,), 1.0, "floor of the dynamic scale"),
            }, doc="fp16 mixed precision", notices={
                "fp16_master_weights_and_grads": "microspeed always keeps fp32 master weights and gradients "
                                                 "(DeepSpeed honours it only with ZeRO-Offload's CPU Adam)",
            }),
            "bf16": Section({"enabled": Field((bool,), False, "train in bf16 with fp32 masters")},
                            doc="bf16 mixed precision", notices={
                "bf16_master_weights_and_grads": "microspeed always keeps fp32 master weights and gradients",
                "bf16_optimizer_states": "optimizer states are always fp32",
                "immediate_grad_update": "a switch of DeepSpeed's BF16_Optimizer, which microspeed does not have; "
                                         "gradients reach the fp32 masters at the accumulation boundary",
                "check_grad_overflow": "bf16 runs without a loss scaler; a step whose loss or gradient norm is not "
                                       "finite is always skipped (see max_consecutive_nonfinite_steps)",
            }),
            "data_types": Section({
                "grad_accum_dtype": Field((str, type(None)), None, "dtype gradients accumulate in",
                                          choices=(None, "fp32", "fp16", "bf16")),
            }, doc="data types"),
        }

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Pick the model dtype; validate ``grad_accum_dtype``; build the loss scaler."""
        fp16, bf16 = config["fp16"]["enabled"], config["bf16"]["enabled"]
        if fp16 and bf16:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable one of them.")
        self.dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else None
        self.auto_cast = fp16 and config["fp16"]["auto_cast"]
        if fp16:
            self.scaler = make_loss_scaler(config["fp16"])
        accum = config["data_types"]["grad_accum_dtype"]
        train_dtype = self.dtype or torch.float32
        if accum is not None and _DTYPE_NAMES[accum] != train_dtype:
            if accum != "fp32":
                raise ConfigError(f"data_types.grad_accum_dtype: got {accum!r} while training in "
                                  f"{train_dtype}; accepted: the training dtype or 'fp32'.")
            self.accumulate_fp32 = True

    @hookimpl
    def microspeed_capabilities(self) -> list[LossScaling]:
        """State the dtype and the loss scaler, for plugins that step the optimizer themselves."""
        return [LossScaling(dtype=self.dtype, scaler=self.scaler, accumulate_fp32=self.accumulate_fp32,
                            accumulated_grad=self.accumulated_grad)]

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The fp32 buffer holding ``param``'s accumulated gradient (zeros if none yet), or ``None`` for ``.grad``.

        A buffer only with fp32 accumulation while this plugin steps the optimizer (a plugin that steps
        it itself keeps its own accumulation).
        """
        if not self.accumulate_fp32 or self._stepped_elsewhere():
            return None
        master = self.master_of.get(id(param))
        return None if master is None else self._master_grad(master)

    @hookimpl
    def microspeed_setup(self, engine) -> None:
        """Keep the engine (to see whether another plugin steps the optimizer)."""
        engine.set_plugin_state("mixed_precision", self)
        self.engine = engine

    @hookimpl
    def microspeed_engine_api(self, engine) -> dict[str, Any]:
        """DeepSpeed's precision accessors: ``fp16_enabled()``, ``bfloat16_enabled()``, ``loss_scale()``, ..."""
        fp16 = engine.config.get("fp16", {})
        static = float(fp16.get("loss_scale") or 0.0)
        return {
            "fp16_enabled": lambda: self.dtype is torch.float16,
            "bfloat16_enabled": lambda: self.dtype is torch.bfloat16,
            "fp16_auto_cast": lambda: self.auto_cast,
            "loss_scale": lambda: static,
            "dynamic_loss_scale": lambda: self.dtype is torch.float16 and static == 0.0,
            "initial_dynamic_scale": lambda: 2.0 ** int(fp16.get("initial_scale_power", 16)),
            "dynamic_loss_scale_args": lambda: None if self.dtype is not torch.float16 or static else {
                "init_scale": 2.0 ** int(fp16.get("initial_scale_power", 16)),
                "scale_window": fp16.get("loss_scale_window"), "delayed_shift": fp16.get("hysteresis"),
                "consecutive_hysteresis": fp16.get("consecutive_hysteresis"), "min_scale": fp16.get("min_loss_scale")},
        }

    def _stepped_elsewhere(self) -> bool:
        return self.engine is not None and self.engine.owner(Role.OPTIMIZER_STEP) is not None

    @hookimpl(tryfirst=True)
    def microspeed_transform_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """Cast the model's parameters and buffers to the low-precision dtype (in place)."""
        if self.dtype is None:
            return None
        self.names = {id(p): n for n, p in model.named_parameters()}
        return model.to(self.dtype)

    @hookimpl
    def microspeed_wrap_optimizer(self, engine, optimizer: Any) -> Any:
        """Swap the optimizer's low-precision parameters for fp32 master copies."""
        if self.dtype is None or self._stepped_elsewhere():
            return None
        self.pairs = []
        self.master_of = {}
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                if p.dtype == self.dtype:
                    master = torch.nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad)
                    self.pairs.append((p, master))
                    self.master_of[id(p)] = master
                    masters.append(master)
                else:
                    masters.append(p)
            group["params"] = masters
        optimizer.state.clear()
        return optimizer

    @hookimpl
    def microspeed_before_forward(self, ctx) -> None:
        """With ``fp16.auto_cast``, cast floating-point inputs to fp16."""
        if self.auto_cast:
            ctx.args = _cast_floats(ctx.args, self.dtype)
            ctx.kwargs = _cast_floats(ctx.kwargs, self.dtype)

    @hookimpl
    def microspeed_scale_loss(self, loss: torch.Tensor) -> torch.Tensor | None:
        """Multiply by the fp16 loss scale."""
        if self.scaler is None:
            return None
        return loss.float() * self.scaler.loss_scale

    @hookimpl
    def microspeed_gradient_buffers(self) -> list[torch.Tensor] | None:
        """With fp32 accumulation, the masters' fp32 gradients are the ones to reduce."""
        if not self.accumulate_fp32 or self._stepped_elsewhere():
            return None

        return [self._master_grad(m) for p, m in self.pairs if reduced_over_data_parallel(p)]

    @staticmethod
    def _master_grad(master: torch.nn.Parameter) -> torch.Tensor:
        if master.grad is None:
            master.grad = torch.zeros_like(master)
        return master.grad

    @hookimpl
    def microspeed_after_backward(self) -> None:
        """With fp32 accumulation, move this micro-step's gradients into the fp32 buffers."""
        if not self.accumulate_fp32:
            return
        for p, m in self.pairs:
            if p.grad is not None:
                self._master_grad(m).add_(p.grad)
                p.grad = None

    @hookimpl(tryfirst=True)
    def microspeed_optimizer_step(self, engine) -> StepOutcome | None:
        """Unscale, skip on overflow, clip, skip a non-finite norm, step the fp32 masters, copy them back."""
        if self.dtype is None or self._stepped_elsewhere():
            return None
        if not self.accumulate_fp32:
            for p, m in self.pairs:
                m.grad = None if p.grad is None else p.grad.float()
        grads = [p.grad for g in engine.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.scaler is not None:
            overflow = self._overflow(grads)
            self.scaler.update_scale(overflow)
            engine.metrics["loss_scale"] = self.scaler.loss_scale
            if overflow:
                return StepOutcome(applied=False, grad_norm=None)
            torch._foreach_mul_(grads, 1.0 / self._scale_used)
        norm = engine.hook.microspeed_clip_gradients(engine=engine, grads=grads)
        if not engine.grad_norm.finite(norm):  # a NaN/inf loss or gradient (bf16; fp16 past the overflow check)
            return StepOutcome(applied=False, grad_norm=norm, nonfinite=True)
        engine.optimizer.step()
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)
        return StepOutcome(applied=True, grad_norm=norm)

    def _overflow(self, grads: list[torch.Tensor]) -> bool:
        self._scale_used = self.scaler.loss_scale
        return overflow_across_ranks(has_inf_or_nan(grads))

    @hookimpl
    def microspeed_optimizer_param_names(self) -> dict[int, str] | None:
        """Name each fp32 master by its model parameter, so checkpoints key it (and its state) by FQN."""
        if self.dtype is None:
            return None
        return {id(m): self.names[id(p)] for p, m in self.pairs if id(p) in self.names}

    @hookimpl
    def microspeed_checkpoint_state(self) -> dict[str, Any] | None:
        """The loss scaler (the checkpoint core saves the fp32 masters, keyed by parameter name)."""
        if self.scaler is None:
            return None
        return {"mixed_precision": {"scaler": self.scaler.state_dict()}}

    @hookimpl
    def microspeed_load_checkpoint_state(self, states: dict[str, Any]) -> None:
        """Restore the loss scaler."""
        state = states.get("mixed_precision")
        if state is not None and self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])

    @hookimpl
    def microspeed_features(self) -> list[Feature]:
        """fp16 and bf16 training, for the composition matrix (it refuses no pair)."""
        return list(FEATURES)
