"""DeepSpeed's engine accessors that clients call, with DeepSpeed's answers where no feature plugin answers.

Hugging Face Accelerate and Trainer, Lightning and DeepSpeed's own scripts ask the engine
``engine.zero_optimization_stage()``, ``engine.local_rank``, ``engine.steps_per_print()`` and
the like. Every feature plugin answers for what it owns through ``microspeed_engine_api``; this
built-in is ``trylast`` and gives what DeepSpeed 0.19.8 returns when the feature is off (ZeRO
stage 0, no offload) or what the parsed config says (batch triad, clipping, logging). A plugin
that acts on a feature (``microspeed-zero`` for ZeRO) answers before it and wins.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from microspeed import comm
from microspeed.hookspecs import hookimpl

#: ZeRO accessors that are ``False`` when no ZeRO plugin answers (DeepSpeed's values at stage 0).
ZERO_FLAGS_OFF: tuple[str, ...] = (
    "zero_optimization", "zero_offload_optimizer", "zero_offload_param", "zero_cpu_offload",
    "zero_use_cpu_optimizer", "zero_partial_offload", "zero_optimization_partition_gradients",
    "zero_optimization_partition_weights", "zero_gather_16bit_weights_on_model_save", "zero_nvme_offload_optimizer",
    "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
    "zero_elastic_checkpoint", "zero_round_robin_gradients",
)


def _config(engine: Any, dotted: str, default: Any) -> Any:
    value = engine.config.get(dotted, default)
    return default if value is None else value


def _communication_dtype(engine: Any) -> torch.dtype:
    """The dtype gradients are reduced in: the configured one, else the training dtype (DeepSpeed's rule)."""
    names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    named = _config(engine, "communication_data_type", None)
    if named is not None:
        return names.get(named, named)
    if _config(engine, "fp16.enabled", False):
        return torch.float16
    return torch.bfloat16 if _config(engine, "bf16.enabled", False) else torch.float32


def _consolidated_16bit_state_dict(exclude_frozen_parameters: bool = False) -> dict:
    """DeepSpeed's answer outside ZeRO-3 and tensor parallelism: there is nothing to consolidate."""
    del exclude_frozen_parameters
    raise ValueError("consolidated_16bit_state_dict is only applicable to cases where weights are partitioned, "
                     "including Zero Stage 3 and tensor parallelism.")


def _zero3_consolidated_16bit_state_dict(exclude_frozen_parameters: bool = False) -> dict:
    """DeepSpeed's answer outside ZeRO-3."""
    del exclude_frozen_parameters
    raise ValueError("this function requires ZeRO-3 mode (zero_optimization.stage 3 with the microspeed-zero "
                     "plugin); otherwise engine.module.state_dict() already holds the full weights.")


def _optimizer_param(engine: Any, name: str) -> list[Any]:
    """Each parameter group's ``name`` (0.0 where a group lacks it); empty without an optimizer."""
    if engine.optimizer is None:
        return []
    return [group.get(name, 0.0) for group in engine.optimizer.param_groups]


def _get_mom(engine: Any) -> list[Any]:
    """DeepSpeed's ``get_mom``: ``momentum`` for SGD and RMSprop, else each group's ``betas``."""
    name = engine.config.get("optimizer.type") or type(engine.optimizer).__name__
    return _optimizer_param(engine, "momentum" if name in ("SGD", "RMSprop") else "betas")


def _set_train_batch_size(engine: Any, train_batch_size: int) -> None:
    """A new global batch: the accumulation steps change, the micro-batch does not (DeepSpeed's rule)."""
    per_step = engine.train_micro_batch_size_per_gpu() * engine.topology.data_parallel_size
    if train_batch_size % per_step != 0:
        raise ValueError(f"Train batch size must be divisible by micro-batch data parallelism: {train_batch_size} "
                         f"is not a multiple of {per_step} (micro-batch x data-parallel size)")
    engine.config.set("train_batch_size", train_batch_size)
    engine.config.set("gradient_accumulation_steps", train_batch_size // per_step)


def _set_train_micro_batch_size(engine: Any, micro_batch_size: int) -> None:
    """A new micro-batch with the same accumulation steps; the global batch follows (DeepSpeed's rule)."""
    gas, dp = engine.gradient_accumulation_steps(), engine.topology.data_parallel_size
    engine.config.set("train_micro_batch_size_per_gpu", micro_batch_size)
    engine.config.set("train_batch_size", micro_batch_size * gas * dp)


def _destroy(engine: Any) -> None:
    """Release what the engine holds for training (as DeepSpeed's ``destroy``): the optimizer's own ``destroy`` first,
    then every plugin's (``microspeed_destroy``: hooks removed, threads stopped, swap files closed), then the
    plugins' states. Afterwards the engine and the model are freed as soon as the caller drops them. Idempotent."""
    if engine.plugin_state("destroyed"):
        return
    optimizer = engine.optimizer
    if optimizer is not None and hasattr(optimizer, "destroy"):
        optimizer.destroy()
    engine.hook.microspeed_destroy(engine=engine)
    engine.drop_plugin_states()
    engine.set_plugin_state("destroyed", True)
    engine.optimizer = engine.lr_scheduler = engine.training_dataloader = None
    engine.set_dataiterator(None)


class DeepSpeedApiPlugin:
    """Answers DeepSpeed's engine accessors for which no feature plugin answers."""

    @hookimpl(trylast=True)
    def microspeed_engine_api(self, engine: Any) -> dict[str, Any]:
        """Ranks and sizes as attributes; config readers and stage-0 ZeRO answers as methods."""
        topo = engine.topology
        api: dict[str, Any] = {name: (lambda: False) for name in ZERO_FLAGS_OFF}
        api.update({
            # attributes, as DeepSpeed sets them in __init__
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "global_rank": comm.get_rank(),
            "world_size": comm.get_world_size(),
            "dp_world_size": topo.data_parallel_size,
            "mp_world_size": topo.model_parallel_size,
            "seq_dp_world_size": topo.data_parallel_size,
            "enable_backward_allreduce": True,
            # methods
            "zero_optimization_stage": lambda: 0,
            "zero_allow_untested_optimizer": lambda: bool(_config(engine, "zero_allow_untested_optimizer", False)),
            "zero_force_ds_cpu_optimizer": lambda: bool(_config(engine, "zero_force_ds_cpu_optimizer", False)),
            "get_data_parallel_rank": lambda: topo.data_parallel_rank,
            "get_model_parallel_rank": lambda: topo.model_parallel_rank,
            "get_batch_info": lambda: (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                                       engine.gradient_accumulation_steps()),
            "managed_gradient_accumulation": lambda: True,
            "steps_per_print": lambda: _config(engine, "steps_per_print", 10),
            "wall_clock_breakdown": lambda: bool(_config(engine, "wall_clock_breakdown", False)),
            "memory_breakdown": lambda: bool(engine.config.raw.get("memory_breakdown", False)),
            "dataloader_drop_last": lambda: bool(_config(engine, "dataloader_drop_last", False)),
            "gradient_clipping": lambda: float(_config(engine, "gradient_clipping", 0.0)),
            "postscale_gradients": lambda: not bool(_config(engine, "prescale_gradients", False)),
            "gradient_predivide_factor": lambda: float(_config(engine, "gradient_predivide_factor", 1.0)),
            "communication_data_type": _communication_dtype(engine),
            "optimizer_name": lambda: _config(engine, "optimizer.type", None),
            "optimizer_params": lambda: _config(engine, "optimizer.params", None),
            "scheduler_name": lambda: _config(engine, "scheduler.type", None),
            "scheduler_params": lambda: _config(engine, "scheduler.params", None),
            "fp16_enabled": lambda: False,
            "bfloat16_enabled": lambda: False,
            "fp16_auto_cast": lambda: False,
            "amp_enabled": lambda: False,
            "_consolidated_16bit_state_dict": _consolidated_16bit_state_dict,
            "_zero3_consolidated_16bit_state_dict": _zero3_consolidated_16bit_state_dict,
            "destroy": lambda: _destroy(engine),
            "get_mom": lambda: _get_mom(engine),
            "set_train_batch_size": lambda n: _set_train_batch_size(engine, n),
            "set_train_micro_batch_size": lambda n: _set_train_micro_batch_size(engine, n),
        })
        return api
