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
        }, doc="optimizer")}

    @hookimpl(trylast=True)
    def microspeed_make_optimizer(self, params: list[Any], config) -> Any:
        """Build the optimizer the ``optimizer`` section names."""
        from microspeed.builtin.optimizers import build_optimizer

        return build_optimizer(params, config["optimizer"])

    @hookimpl(trylast=True)
    def microspeed_optimizer_step(self, engine) -> StepOutcome:
        """Clip by the global norm, then step."""
        grads = [p.grad for g in engine.optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = engine.hook.microspeed_clip_gradients(engine=engine, grads=grads)
        engine.optimizer.step()
        return StepOutcome(applied=True, grad_norm=norm)
