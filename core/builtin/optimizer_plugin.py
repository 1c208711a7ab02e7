"""The ``optimizer`` section and the default optimizer step (clip, then ``optimizer.step()``)."""

from __future__ import annotations

from typing import Any

from microspeed.config import Field, Section
from microspeed.hookspecs import StepOutcome, hookimpl


class OptimizerPlugin:
    """Builds optimizers by DeepSpeed name (:mod:`microspeed.builtin.optimizers`) and steps them."""

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``optimizer``: ``type`` and ``params`` (checked against the optimizer's signature)."""
        return {"optimizer": Section({
            "type": Field((str,), None, "optimizer name (Adam, AdamW, SGD, Adagrad, Lamb, any torch.optim)",
                          required=True),
            "params": Section(open=True, doc="keyword arguments of the optimizer"),
        }, doc="optimizer", notices={
            "legacy_fusion": "a switch of DeepSpeed's old fused fp16 optimizer; microspeed's fp16 path keeps fp32 "
                             "masters and steps the optimizer on them",
        })}

    @hookimpl(trylast=True)
    def microspeed_make_optimizer(self, params: list[Any], config) -> Any:
        """Build the optimizer the ``optimizer`` section names."""
        from microspeed.builtin.optimizers import build_optimizer

        return build_optimizer(params, config["optimizer"])

    @hookimpl(trylast=True)
    def microspeed_save_optimizer_state(self, engine, tensors: dict) -> dict:
        """Default: ``optimizer.state_dict()`` with parameters named by FQN."""
        from microspeed.checkpoint import save_optimizer_state

        return save_optimizer_state(engine, tensors)

    @hookimpl(trylast=True)
    def microspeed_load_optimizer_state(self, engine, saved, reader, load_states: bool, strict: bool,
                                        after: list) -> bool:
        """Default: fp32 masters by FQN, then ``optimizer.load_state_dict``."""
        from microspeed.checkpoint import load_optimizer_state

        return load_optimizer_state(engine, saved, reader, load_states, strict, after)

    @hookimpl(trylast=True)
    def microspeed_optimizer_step(self, engine) -> StepOutcome:
        """Clip by the global norm, then step — unless the norm is not finite (then skip: ``nonfinite``)."""
        grads = [p.grad for g in engine.optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = engine.hook.microspeed_clip_gradients(engine=engine, grads=grads)
        if not engine.grad_norm.finite(norm):
            return StepOutcome(applied=False, grad_norm=norm, nonfinite=True)
        engine.optimizer.step()
        return StepOutcome(applied=True, grad_norm=norm)
