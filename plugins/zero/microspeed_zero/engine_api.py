"""DeepSpeed's ``engine.zero_*`` accessors, answered from the parsed ``zero_optimization`` section.

Served through the core's ``microspeed_engine_api`` hook (``engine.zero_optimization_stage()``
and the like, as Hugging Face Accelerate/Trainer and Lightning call them). DeepSpeed returns an
offload section object or ``None`` for ``zero_offload_optimizer()`` / ``zero_offload_param()``;
here it is the section as a dict, or ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _consolidated(rt: Any, engine: Any, gather: Callable[[Any], dict | None],
                  exclude_frozen_parameters: bool = False) -> dict | None:
    """Stage 3: the whole state dict on data-parallel rank 0 (``None`` elsewhere, as DeepSpeed); collective.

    ``gather(engine)`` runs the ``microspeed_consolidated_state_dict`` hook (not this plugin's answer alone), so
    what other plugins add to the consolidation (MoE: the experts other ranks hold) is in it.
    """
    if rt.stage3 is None:
        raise ValueError("_zero3_consolidated_16bit_state_dict requires zero_optimization.stage 3; at stage "
                         f"{rt.stage} engine.module.state_dict() already holds the whole weights.")
    whole = gather(engine)
    if whole is None:
        whole = engine.module.state_dict()
    if rt.rank != 0:
        return None
    if exclude_frozen_parameters:
        frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
        whole = {k: v for k, v in whole.items() if k not in frozen}
    return whole


def engine_api(engine: Any, rt: Any, config: Any, gather: Callable[[Any], dict | None]) -> dict[str, Any]:
    """The accessors (see the module docstring) for a ZeRO ``rt`` (stage >= 1).

    ``gather(engine)``: the whole state dict by every plugin's consolidation (``_zero3_consolidated_16bit_state_dict``).
    """
    cfg = rt.cfg
    z = config["zero_optimization"]
    oo, op = dict(z["offload_optimizer"]), dict(z["offload_param"])
    oo["device"], op["device"] = cfg.offload_optimizer, cfg.offload_param
    offload_opt = oo if cfg.offload_optimizer != "none" else None
    offload_par = op if cfg.offload_param != "none" else None
    section = {**z, "stage": cfg.stage, "offload_optimizer": offload_opt, "offload_param": offload_par}
    return {
        "zero_optimization": lambda: cfg.stage > 0,
        "zero_optimization_stage": lambda: cfg.stage,
        "zero_optimization_partition_gradients": lambda: cfg.stage >= 2,
        "zero_optimization_partition_weights": lambda: cfg.stage >= 3,
        "zero_config": section,
        "zero_offload_optimizer": lambda: offload_opt,
        "zero_offload_param": lambda: offload_par,
        "zero_cpu_offload": lambda: cfg.offload_optimizer == "cpu",
        "zero_use_cpu_optimizer": lambda: cfg.offload_optimizer in ("cpu", "nvme"),
        "zero_nvme_offload_optimizer": lambda: cfg.offload_optimizer == "nvme",
        "zero_partial_offload": lambda: oo.get("ratio", 1.0) if offload_opt else False,
        "zero_sub_group_size": lambda: cfg.sub_group_size,
        "zero_reduce_scatter": lambda: cfg.reduce_scatter,
        "zero_overlap_comm": lambda: cfg.overlap_comm,
        "zero_reduce_bucket_size": lambda: cfg.reduce_bucket_size,
        "zero_allgather_bucket_size": lambda: cfg.allgather_bucket_size,
        "zero_allgather_partitions": lambda: True,
        "zero_contiguous_gradients": lambda: cfg.contiguous_gradients,
        "zero_load_from_fp32_weights": lambda: cfg.load_from_fp32_weights,
        "zero_ignore_unused_parameters": lambda: cfg.ignore_unused_parameters,
        "zero_max_live_parameters": lambda: cfg.max_live_parameters,
        "zero_max_reuse_distance": lambda: cfg.max_reuse_distance,
        "zero_prefetch_bucket_size": lambda: cfg.prefetch_bucket_size,
        "zero_param_persistence_threshold": lambda: cfg.param_persistence_threshold,
        "zero_gather_16bit_weights_on_model_save": lambda: cfg.gather_16bit_weights_on_model_save,
        "zero_round_robin_gradients": lambda: bool(z.get("round_robin_gradients", False)),
        "_zero3_consolidated_16bit_state_dict":
            lambda exclude_frozen_parameters=False: _consolidated(rt, engine, gather, exclude_frozen_parameters),
    }
