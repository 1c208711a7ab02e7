"""DeepSpeed 0.19.8's ds_config keys, and what microspeed does with those no plugin acts on.

A key DeepSpeed knows is never reported like a typo. :func:`microspeed.config.parse` asks this
module about every key no section schema lists:

* a key a plugin's :class:`~microspeed.config.Section` declares in ``notices`` is accepted with a
  one-line notice that it has no effect here and why (the plugin knows its own reasons);
* a top-level key in :data:`NO_EFFECT` is accepted with that notice (no plugin claims it);
* a key in :data:`REFUSED` is refused with the reason, when it turns something on;
* any other key DeepSpeed knows is refused as "known to DeepSpeed, not supported here", naming
  the section's owner — never with "did you mean";
* everything else is a typo, with a suggestion.

The table was read off DeepSpeed 0.19.8's pydantic config models (``DeepSpeedZeroConfig``,
``DeepSpeedFP16Config``, the monitor and comms-logger configs, ``TPTrainingConfig``) and its
``runtime/constants.py``, ``swap_tensor/constants.py``, ``profiling/constants.py`` and
``runtime/config.py`` (``DeepSpeedConfig._initialize_params``); the ``elasticity`` keys are those of its
last elastic release, 0.16.9 (``elasticity/constants.py``). DeepSpeed is never imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Sections whose every subkey counts as DeepSpeed's (it passes them on, or no plugin here validates them).
OPEN_SECTIONS: frozenset[str] = frozenset({
    "amp", "autotuning", "compile", "compression_training", "eigenvalue", "expert_parallel",
    "hybrid_engine", "nebula", "optimizer.params", "quantize_training", "scheduler.params", "timers",
    "weight_quantization",
})

#: Top-level keys without listed subkeys: scalars, and sections a plugin here validates key by key.
_SCALARS = (
    "bfloat16 check_overflow communication_data_type dataloader_drop_last disable_allgather disable_python_gc "
    "curriculum_learning data_efficiency progressive_layer_drop sparse_attention "
    "dump_state gradient_accumulation_steps gradient_allreduce_op gradient_clipping gradient_predivide_factor "
    "log_level managed_gradient_accumulation memory_breakdown prescale_gradients seq_parallel_communication_data_type "
    "sparse_gradients steps_per_print train_batch_size train_micro_batch_size_per_gpu "
    "use_data_before_expert_parallelism vocabulary_size wall_clock_breakdown zero_allow_untested_optimizer "
    "zero_force_ds_cpu_optimizer"
)

#: Sections and their keys (dotted below the section), as DeepSpeed 0.19.8 reads them.
_SECTIONS: dict[str, str] = {
    "activation_checkpointing": ("contiguous_memory_optimization cpu_checkpointing number_checkpoints "
        "partition_activations profile synchronize_checkpoint_boundary"),
    "aio": ("block_size intra_op_parallelism overlap_events queue_depth single_submit thread_count use_gds"),
    "bf16": ("bf16_master_weights_and_grads bf16_optimizer_states check_grad_overflow enabled "
        "immediate_grad_update"),
    "checkpoint": ("load_universal parallel_write parallel_write.pipeline_stage tag_validation use_node_local_storage "
        "writer"),
    "comet": ("api_key enabled experiment_key experiment_name mode online project samples_log_interval workspace"),
    "comms_logger": ("debug enabled prof_all prof_ops verbose"),
    "csv_monitor": ("enabled job_name output_path"),
    "data_types": ("buffer_dtype grad_accum_dtype param_dtype"),
    "elasticity": ("enabled ignore_non_elastic_batch_info max_gpus max_train_batch_size micro_batch_sizes min_gpus "
        "min_time model_parallel_size num_gpus_per_node prefer_larger_batch version"),
    "flops_profiler": ("detailed enabled module_depth output_file profile_step recompute_fwd_factor top_modules"),
    "fp16": ("auto_cast consecutive_hysteresis enabled fp16_master_weights_and_grads hysteresis "
        "initial_scale_power loss_scale loss_scale_window min_loss_scale"),
    "optimizer": ("legacy_fusion params type"),
    "scheduler": ("params type"),
    "tensor_parallel": ("autotp_size dtype injection_policy_tuple keep_module_on_host kernel_inject partition_config "
        "preset_model replace_with_kernel_inject tensor_parallel tensor_parallel.mpu "
        "tensor_parallel.tp_grain_size tensor_parallel.tp_group tensor_parallel.tp_size tp tp.mpu "
        "tp.tp_grain_size tp.tp_group tp.tp_size tp_overlap_comm vocab_parallel_ce_backend "
        "vocab_parallel_lm_head"),
    "tensorboard": ("enabled job_name output_path"),
    "torch_autocast": ("dtype enabled lower_precision_safe_modules"),
    "wandb": ("enabled group project team"),
    "zero_optimization": ("allgather_bucket_size allgather_partitions allgather_sequential compute_grad_norm "
        "contiguous_gradients cpu_offload cpu_offload_param cpu_offload_use_pin_memory elastic_checkpoint "
        "enable_sanity_checks gather_16bit_weights_on_model_save ignore_unused_parameters leaf_module "
        "leaf_module.classes leaf_module.name_suffixes leaf_module.names legacy_stage1 load_from_fp32_weights "
        "log_trace_cache_warnings max_live_parameters max_reuse_distance memory_efficient_linear "
        "model_persistence_threshold module_granularity_threshold offload_optimizer "
        "offload_optimizer.buffer_count offload_optimizer.cpuadam_cores_perc offload_optimizer.device "
        "offload_optimizer.fast_init offload_optimizer.nvme_path offload_optimizer.pin_memory "
        "offload_optimizer.pipeline_read offload_optimizer.pipeline_write offload_optimizer.ratio "
        "offload_optimizer.super_offload offload_param offload_param.buffer_count offload_param.buffer_size "
        "offload_param.device offload_param.max_in_cpu offload_param.nvme_path offload_param.pin_memory "
        "overlap_comm override_module_apply param_persistence_threshold parameter_alignment "
        "pipeline_loading_checkpoint prefetch_bucket_size reduce_bucket_size reduce_scatter "
        "round_robin_gradients save_muon_momentum_buffer_in_memory stage stage3_allgather_sequential "
        "stage3_gather_16bit_weights_on_model_save stage3_gather_fp16_weights_on_model_save "
        "stage3_max_live_parameters stage3_max_reuse_distance stage3_model_persistence_threshold "
        "stage3_module_granularity_threshold stage3_param_persistence_threshold stage3_prefetch_bucket_size "
        "stage3_use_all_reduce_for_fetch_params sub_group_size use_all_reduce_for_fetch_params "
        "use_multi_rank_bucket_allreduce zenflow zenflow.auto_ratio zenflow.full_warm_up_rounds "
        "zenflow.offload zenflow.overlap_step zenflow.pt_reserved_cores_perc zenflow.select_interval "
        "zenflow.select_strategy zenflow.steps_per_epoch zenflow.topk_ratio zenflow.update_interval "
        "zero_hpz_partition_size zero_quantized_gradients zero_quantized_nontrainable_weights "
        "zero_quantized_weights"),
    "pipeline": "activation_checkpoint_interval grad_partitioned partition pipe_partitioned seed_layers stages "
    "use_reentrant",
}


def _build() -> frozenset[str]:
    keys = set(_SCALARS.split())
    for section, below in _SECTIONS.items():
        keys.add(section)
        keys.update(f"{section}.{k}" for k in below.split())
    keys.update(s.split(".")[0] for s in OPEN_SECTIONS)
    keys.update(OPEN_SECTIONS)
    return frozenset(keys)


#: Every dotted key path DeepSpeed 0.19.8 knows (plus everything below :data:`OPEN_SECTIONS`).
DEEPSPEED_KEYS: frozenset[str] = _build()

#: Top-level keys no built-in acts on, accepted with a notice: key -> why it has no effect here.
#: A plugin that acts on one claims it as a section, and the notice no longer applies.
NO_EFFECT: dict[str, str] = {
    "aio": "asynchronous NVMe I/O settings of ZeRO-Infinity's swap files; microspeed-zero, which acts on them, "
           "is not installed",
    "wandb": "microspeed's monitor writes tensorboard and csv_monitor only; log engine.metrics to Weights & "
             "Biases from your script",
    "comet": "microspeed's monitor writes tensorboard and csv_monitor only; log engine.metrics to Comet from "
             "your script",
    "memory_breakdown": "microspeed does not print per-phase memory; the trace (\"trace\": {\"enabled\": true}) "
                        "records it",
    "dump_state": "microspeed does not print the engine state at start-up; print(engine.config.to_dict())",
    "disable_allgather": "a legacy DeepSpeed switch that microspeed's reduction never reads",
    "disable_python_gc": "microspeed leaves Python's garbage collector as it is",
    "log_level": "microspeed's logs go through structlog; filter them in your logging set-up",
    "sparse_gradients": "gradients are always reduced dense (sparse embedding gradients are densified)",
    "seq_parallel_communication_data_type": "microspeed has no Ulysses sequence parallelism",
    "use_data_before_expert_parallelism": "expert groups follow microspeed-moe's own rank order",
    "vocabulary_size": "only DeepSpeed's autotuner reads it",
    "autotuning": "DeepSpeed's autotuner is a launcher feature microspeed does not have",
    "compile": "microspeed does not wrap the model in torch.compile; call torch.compile on it yourself",
    "timers": "microspeed times phases through wall_clock_breakdown and the trace",
    "nebula": "Azure Nebula checkpoint service is not used; checkpoints go through torch.distributed.checkpoint",
    "check_overflow": "fp16 overflow is always checked when a loss scaler is in use",
    "bfloat16": "DeepSpeed's old name for 'bf16', read only when 'bf16' is absent (as DeepSpeed); 'bf16' is given",
}

#: DeepSpeed keys microspeed refuses when they turn something on: key -> why, and what to do.
REFUSED: dict[str, str] = {
    "amp": "NVIDIA Apex AMP is not supported; use \"bf16\" or \"fp16\"",
    "torch_autocast": "torch.autocast training is not supported; use \"bf16\" or \"fp16\" (whole-model "
                      "low precision with fp32 master weights)",
    "compression_training": "DeepSpeed Compression is not supported",
    "quantize_training": "quantization-aware training is not supported",
    "weight_quantization": "weight quantization is not supported",
    "eigenvalue": "eigenvalue computation is not supported",
    "hybrid_engine": "the RLHF hybrid engine is not supported",
    "expert_parallel": "AutoEP is not supported; build MoE layers with microspeed-moe",
    "tensor_parallel": "AutoTP is not supported; split the model with microspeed-pipeline's tensor parallelism",
    "managed_gradient_accumulation": "microspeed always counts micro-steps itself (DeepSpeed's default, true); "
                                     "drive the boundary with engine.set_gradient_accumulation_boundary()",
    "gradient_allreduce_op": "gradients are always averaged (\"mean\", DeepSpeed's default)",
}

#: Values that leave a :data:`REFUSED` key off (nothing to refuse).
_OFF_VALUES: dict[str, tuple[Any, ...]] = {"managed_gradient_accumulation": (True,), "gradient_allreduce_op": ("mean",)}


def is_deepspeed_key(path: str) -> bool:
    """Whether DeepSpeed 0.19.8 knows the dotted key ``path`` (``"zero_optimization.offload_param.buffer_count"``)."""
    if path in DEEPSPEED_KEYS:
        return True
    return any(path.startswith(f"{open_}.") for open_ in OPEN_SECTIONS)


def turns_on(key: str, value: Any) -> bool:
    """Whether a :data:`REFUSED` top-level ``value`` enables the feature (an ``enabled: false`` section does not)."""
    if key in _OFF_VALUES:
        return value not in _OFF_VALUES[key]
    if isinstance(value, Mapping):
        return bool(value.get("enabled", bool(value))) if "enabled" in value else bool(value)
    return bool(value)


def subkeys(section: str) -> list[str]:
    """The keys DeepSpeed reads directly below ``section`` (empty for scalars and open sections)."""
    prefix = f"{section}."
    return sorted({k[len(prefix):].split(".")[0] for k in DEEPSPEED_KEYS if k.startswith(prefix)})
