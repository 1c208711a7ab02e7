"""The ``zero_optimization`` section: DeepSpeed's keys, their defaults and what we refuse.

Both DeepSpeed spellings of the stage-3 keys are accepted (``stage3_prefetch_bucket_size`` and
``prefetch_bucket_size``, ...). Sizes may be written as floats (``5e8``), as DeepSpeed users do.
Every key DeepSpeed 0.19.8's ``DeepSpeedZeroConfig`` (and its offload sections) knows is accepted:
acted on, or — the keys in :data:`NOTICE_KEYS` — accepted with a one-line notice (once, rank 0)
saying why it has no effect here. DeepSpeed's deprecated spellings are acted on (``cpu_offload``:
``offload_optimizer.device = "cpu"``; ``cpu_offload_param``; ``cpu_offload_use_pin_memory``;
``stage3_gather_fp16_weights_on_model_save``). A key not listed here is refused by the core's
strict validation, with a suggestion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from microspeed.plugin_api import ConfigError, Field, Section, non_negative, positive
from microspeed_zero.aio import AioConfig
from microspeed_zero.leaf import DEFAULT_LEAF_MODULE_CLASSES

_SIZE = (int, float)
_ANY = (bool, int, float, str, dict, list, type(None))

#: Keys DeepSpeed 0.19.8 knows that change nothing here, with why (shown once when set to a non-default value).
NOTICE_KEYS: dict[str, tuple[Any, str]] = {
    "use_multi_rank_bucket_allreduce": (True, "gradient buckets are reduced per segment over the data-parallel "
                                        "group already"),
    "compute_grad_norm": (True, "the global gradient norm is always computed (clipping and get_global_grad_norm "
                          "use it)"),
    "elastic_checkpoint": (False, "checkpoints are saved per parameter and load at any world size anyway"),
    "zenflow": (None, "ZenFlow (stale CPU updates) is not implemented; the step is the ordinary synchronous one"),
    "stage3_model_persistence_threshold": (None, "persistence is decided per parameter "
                                           "(stage3_param_persistence_threshold) only"),
    "model_persistence_threshold": (None, "persistence is decided per parameter "
                                    "(stage3_param_persistence_threshold) only"),
    "stage3_module_granularity_threshold": (0, "stage 3 hooks every module; group fine-grained ones with leaf "
                                            "modules (set_z3_leaf_modules / leaf_module)"),
    "module_granularity_threshold": (0, "stage 3 hooks every module; group fine-grained ones with leaf modules"),
    "stage3_use_all_reduce_for_fetch_params": (False, "parameters are always fetched with all-gather"),
    "use_all_reduce_for_fetch_params": (False, "parameters are always fetched with all-gather"),
    "stage3_allgather_sequential": (False, "each segment is fetched by one all-gather into its flat buffer"),
    "allgather_sequential": (False, "each segment is fetched by one all-gather into its flat buffer"),
    "legacy_stage1": (False, "there is one stage-1 implementation"),
    "round_robin_gradients": (False, "every segment's gradient partition is already split evenly over the ranks "
                              "(DeepSpeed's round-robin balances whole-tensor placement, which does not arise here)"),
    "parameter_alignment": (False, "partitions are padded to equal slices; no extra alignment is needed on CPU/gloo "
                            "or NCCL"),
    "zero_hpz_partition_size": (1, "hierarchical (ZeRO++ hpZ) secondary partitions are not implemented; parameters "
                                "are gathered over the whole data-parallel group"),
    "zero_quantized_weights": (False, "ZeRO++ qwZ is not implemented; parameters are gathered in their dtype"),
    "zero_quantized_nontrainable_weights": (False, "ZeRO++ quantized frozen weights are not implemented; they are "
                                            "kept in their dtype"),
    "zero_quantized_gradients": (False, "ZeRO++ qgZ is not implemented; use communication_data_type to reduce "
                                 "gradients in 16 bits"),
    "memory_efficient_linear": (True, "stage 3 does not replace F.linear: the gathered weight is a view of the "
                                "segment buffer, which is released after forward, so autograd keeps no copy anyway"),
    "pipeline_loading_checkpoint": (False, "checkpoints are loaded straight into each rank's partitions"),
    "override_module_apply": (True, "module.apply is not patched; change partitioned parameters inside "
                              "GatheredParameters(..., modifier_rank=0)"),
    "log_trace_cache_warnings": (False, "the prefetch order is re-recorded every forward; there is no trace cache "
                                 "to warn about"),
    "enable_sanity_checks": (False, "no extra sanity checks exist to enable"),
    "save_muon_momentum_buffer_in_memory": (False, "Muon is not a ZeRO optimizer here (only element-wise ones are)"),
    "offload_param.buffer_count": (5, "offloaded parameter shards are read into a buffer per gather; there is no "
                                   "fixed swap-buffer pool to size"),
    "offload_param.buffer_size": (100_000_000, "offloaded parameter shards are read into a buffer per gather; there "
                                  "is no fixed swap-buffer pool to size"),
    "offload_optimizer.pipeline_read": (False, "NVMe reads of optimizer sub-groups already run ahead of the step"),
    "offload_optimizer.pipeline_write": (False, "NVMe write-back of optimizer sub-groups already runs behind the "
                                         "step"),
    "offload_optimizer.fast_init": (False, "masters are built from the parameters in memory (no slow path to skip)"),
    "offload_optimizer.ratio": (1.0, "partial offload is not implemented: all optimizer state is offloaded"),
    "offload_optimizer.super_offload": (False, "SuperOffload is not implemented; the offloaded step is the CPU Adam "
                                        "step"),
    "offload_optimizer.cpuadam_cores_perc": (0.8, "the CPU step uses torch's intra-op threads "
                                             "(torch.set_num_threads)"),
}

#: DeepSpeed's short name -> the ``stage3_`` name both spell the same key.
STAGE3_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}


def _offload(devices: tuple[str, ...], doc: str, extra: dict[str, Field]) -> Section:
    return Section({
        "device": Field((str, type(None)), "none", "where it lives: " + ", ".join(devices),
                        choices=(*devices, None)),
        "nvme_path": Field((str, type(None)), None, "folder (any file system) for device 'nvme'"),
        "pin_memory": Field((bool,), False, "page-locked host buffers (faster GPU<->CPU copies; CUDA only)"),
        **extra,
    }, doc=doc)


def _notice_fields(prefix: str) -> dict[str, Field]:
    return {k[len(prefix):]: Field(_ANY, default, "no effect here: " + why)
            for k, (default, why) in NOTICE_KEYS.items() if k.startswith(prefix) and "." not in k[len(prefix):]}


def zero_section() -> Section:
    """The schema of ``zero_optimization``."""
    fields: dict[str, Field | Section] = {
        "stage": Field((int,), 0, "0 off; 1 optimizer state, 2 + gradients, 3 + parameters partitioned",
                       choices=(0, 1, 2, 3)),
        "contiguous_gradients": Field((bool,), True, "copy gradients into contiguous buckets before reducing; "
                                      "false: reduce each gradient by itself"),
        "overlap_comm": Field((bool,), True, "reduce during backward and gather parameters lazily, "
                              "overlapped with compute"),
        "reduce_scatter": Field((bool,), True, "partitioned reduction with the backend's fastest collective "
                                "(reduce-scatter, or all-reduce where that is faster: gloo); false: all-reduce"),
        "reduce_bucket_size": Field(_SIZE, 500_000_000, "elements per gradient-reduction bucket", positive),
        "allgather_bucket_size": Field(_SIZE, 500_000_000, "elements per parameter all-gather (stages 1, 2)",
                                       positive),
        "allgather_partitions": Field((bool,), True, "gather updated partitions with all-gather (false refused)"),
        "sub_group_size": Field(_SIZE, 1_000_000_000, "elements per optimizer sub-group (the unit streamed "
                                "from NVMe)", positive),
        "ignore_unused_parameters": Field((bool,), True, "stage 3: parameters without a gradient are fine; "
                                          "false: an error names them"),
        "load_from_fp32_weights": Field((bool,), True, "restore fp32 masters from the checkpoint's fp32 copy; "
                                        "false: from the 16-bit weights"),
        "offload_optimizer": _offload(("none", "cpu", "nvme"), "optimizer state (and its step) off the device", {
            "buffer_count": Field((int,), 4, "nvme: in-memory slots the sub-groups stream through", positive),
            **_notice_fields("offload_optimizer."),
        }),
        "offload_param": _offload(("none", "cpu", "nvme"), "stage 3: parameter partitions off the device", {
            "max_in_cpu": Field(_SIZE, 1_000_000_000, "nvme: elements of parameter shards kept in CPU memory",
                                non_negative),
            **_notice_fields("offload_param."),
        }),
        "cpu_offload": Field((bool, type(None)), None, "deprecated (DeepSpeed): true means "
                             "offload_optimizer.device 'cpu'"),
        "cpu_offload_param": Field((bool, type(None)), None, "deprecated (DeepSpeed): true means "
                                   "offload_param.device 'cpu'"),
        "cpu_offload_use_pin_memory": Field((bool, type(None)), None, "deprecated (DeepSpeed): pin_memory of the "
                                            "offload sections"),
        "stage3_gather_fp16_weights_on_model_save": Field((bool, type(None)), None, "deprecated (DeepSpeed): same "
                                                          "as stage3_gather_16bit_weights_on_model_save"),
        "host_memory_budget": Field((int, float, str, type(None)), "auto", "microspeed: bytes (or \"8GiB\", "
                                    "\"500MB\") this rank's process may hold at its peak; initialize() refuses a "
                                    "config whose predicted peak RSS exceeds it, each step warns if the measured "
                                    "peak (VmHWM) does; \"auto\": with offload_optimizer or offload_param, 80 % of "
                                    "RAM (or of the cgroup's memory limit, if lower) over the node's ranks, else no "
                                    "check; none: no check"),
        "leaf_module": Section({
            "classes": Field((list, str), list(DEFAULT_LEAF_MODULE_CLASSES), "class names (or qualified names) of "
                             "leaf modules (default: Hugging Face's Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks, "
                             "as DeepSpeed's)"),
            "names": Field((list, str), [], "module names (as in named_modules) to make leaves"),
            "name_suffixes": Field((list, str), [], "module-name suffixes to make leaves"),
        }, doc="stage 3: modules gathered whole when they run (see microspeed.zero.set_z3_leaf_modules)"),
        **_notice_fields(""),
    }
    for short, long in STAGE3_ALIASES.items():
        default, doc, check = {
            "prefetch_bucket_size": (50_000_000, "stage 3: elements gathered ahead of use", positive),
            "param_persistence_threshold": (100_000, "stage 3: parameters this small stay whole", non_negative),
            "max_live_parameters": (1_000_000_000, "stage 3: gathered elements alive at once (prefetch stops "
                                    "there)", positive),
            "max_reuse_distance": (1_000_000_000, "stage 3: keep a parameter gathered if reused within this "
                                   "many elements of execution", non_negative),
            "gather_16bit_weights_on_model_save": (False, "stage 3: save_16bit_model gathers whole weights", None),
        }[short]
        types = (bool,) if isinstance(default, bool) else _SIZE
        fields[long] = Field(types, default, doc, check, auto=True)
        fields[short] = Field(types + (type(None),), None, f"same as {long}", auto=True)
    return Section(fields, doc="ZeRO: partition optimizer state, gradients and parameters (microspeed-zero)")


@dataclass(frozen=True)
class ZeroConfig:
    """The parsed ``zero_optimization`` section, with aliases folded and sizes made ints."""

    stage: int
    contiguous_gradients: bool
    overlap_comm: bool
    reduce_scatter: bool
    reduce_bucket_size: int
    allgather_bucket_size: int
    sub_group_size: int
    ignore_unused_parameters: bool
    load_from_fp32_weights: bool
    offload_optimizer: str
    offload_optimizer_nvme_path: str | None
    offload_param: str
    offload_param_nvme_path: str | None
    pin_memory: bool
    buffer_count: int
    max_in_cpu: int
    prefetch_bucket_size: int
    param_persistence_threshold: int
    max_live_parameters: int
    max_reuse_distance: int
    gather_16bit_weights_on_model_save: bool
    leaf_classes: tuple[str, ...] = ()
    leaf_names: tuple[str, ...] = ()
    leaf_suffixes: tuple[str, ...] = ()
    notices: tuple[str, ...] = ()
    aio: AioConfig = AioConfig()
    host_memory_budget: int | None = None
    host_memory_budget_auto: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ZeroConfig:
        """Read ``config["zero_optimization"]`` (and the ``aio`` section the NVMe swappers use); :class:`ConfigError`
        for combinations we cannot serve."""
        z = dict(config["zero_optimization"])
        aio = AioConfig.from_section(config["aio"])
        z["offload_optimizer"], z["offload_param"] = dict(z["offload_optimizer"]), dict(z["offload_param"])
        for sec in (z["offload_optimizer"], z["offload_param"]):
            if sec["device"] is None:
                sec["device"] = "none"
        _fold_deprecated(z, config)
        auto = {"stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
                "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                "stage3_gather_16bit_weights_on_model_save": False}
        for short, long in STAGE3_ALIASES.items():  # "auto" left unresolved (no client filled it): the default
            if z.get(long) == "auto":
                z[long] = auto[long]
            if z.get(short) == "auto":
                z[short] = None
            if z.get(short) is not None:
                if config.is_set(f"zero_optimization.{long}") and z[short] != z[long]:
                    raise ConfigError(f"zero_optimization.{short} ({z[short]}) and zero_optimization.{long} "
                                      f"({z[long]}) are the same key with different values; keep one.")
                z[long] = z[short]
        stage = z["stage"]
        oo, op = z["offload_optimizer"], z["offload_param"]
        if not z["allgather_partitions"]:
            raise ConfigError("zero_optimization.allgather_partitions: false (a broadcast per rank) is not "
                              "supported; remove the key (all-gather gives the same parameters, faster).")
        if oo["device"] != "none" and stage == 0:
            raise ConfigError(f"zero_optimization.offload_optimizer.device={oo['device']!r} needs "
                              f"zero_optimization.stage >= 1 (got stage 0).")
        if op["device"] != "none" and stage < 3:
            raise ConfigError(f"zero_optimization.offload_param.device={op['device']!r} needs "
                              f"zero_optimization.stage 3 (got stage {stage}): only stage 3 partitions "
                              f"parameters. Set stage 3 or remove offload_param.")
        for name, sec in (("offload_optimizer", oo), ("offload_param", op)):
            if sec["device"] == "nvme" and not sec["nvme_path"]:
                raise ConfigError(f"zero_optimization.{name}.device='nvme' needs "
                                  f"zero_optimization.{name}.nvme_path (a folder to keep the state in).")
        if op["device"] == "nvme" and oo["device"] == "none":
            raise ConfigError("zero_optimization.offload_param.device='nvme' needs offload_optimizer.device "
                              "'cpu' or 'nvme' as well (as DeepSpeed): the step runs where the state is.")
        budget = z.get("host_memory_budget")
        if budget == "auto":  # offloading is how a model bigger than memory trains: hold it to the machine's RAM
            from microspeed_zero.peak_rss import default_budget

            budget = default_budget() if oo["device"] != "none" or op["device"] != "none" else None
        elif budget is not None:
            from microspeed_zero.peak_rss import parse_bytes

            try:
                budget = parse_bytes(budget)
            except ValueError as exc:
                raise ConfigError(f"{exc} (e.g. \"host_memory_budget\": \"8GiB\"; null for no check)") \
                    from None
        return cls(
            host_memory_budget=budget, host_memory_budget_auto=z.get("host_memory_budget") == "auto",
            stage=stage, contiguous_gradients=z["contiguous_gradients"], overlap_comm=z["overlap_comm"],
            reduce_scatter=z["reduce_scatter"], reduce_bucket_size=int(z["reduce_bucket_size"]),
            allgather_bucket_size=int(z["allgather_bucket_size"]), sub_group_size=int(z["sub_group_size"]),
            ignore_unused_parameters=z["ignore_unused_parameters"],
            load_from_fp32_weights=z["load_from_fp32_weights"],
            offload_optimizer=oo["device"], offload_optimizer_nvme_path=oo["nvme_path"],
            offload_param=op["device"], offload_param_nvme_path=op["nvme_path"],
            pin_memory=oo["pin_memory"] or op["pin_memory"], buffer_count=oo["buffer_count"],
            max_in_cpu=int(op["max_in_cpu"]),
            prefetch_bucket_size=int(z["stage3_prefetch_bucket_size"]),
            param_persistence_threshold=int(z["stage3_param_persistence_threshold"]),
            max_live_parameters=int(z["stage3_max_live_parameters"]),
            max_reuse_distance=int(z["stage3_max_reuse_distance"]),
            gather_16bit_weights_on_model_save=z["stage3_gather_16bit_weights_on_model_save"],
            leaf_classes=_leaf_list(z, "classes"), leaf_names=_leaf_list(z, "names"),
            leaf_suffixes=_leaf_list(z, "name_suffixes"),
            notices=tuple(_notices(z) + _aio_notice(aio, oo["device"], op["device"])), aio=aio,
        )


def _leaf_list(z: dict[str, Any], key: str) -> tuple[str, ...]:
    """``leaf_module.<key>``: a list of strings (one string stands for a list of it, as DeepSpeed reads it), repeated
    entries dropped."""
    value = z["leaf_module"][key]
    items = [value] if isinstance(value, str) else value
    if not all(isinstance(v, str) for v in items):
        raise ConfigError(f"zero_optimization.leaf_module.{key}: expected a list of strings, got {value!r}")
    return tuple(dict.fromkeys(items))


def _fold_deprecated(z: dict[str, Any], config: Any) -> None:
    """Act on DeepSpeed's deprecated spellings (``cpu_offload`` & co.), refusing a conflict with the new key."""
    oo, op = z["offload_optimizer"], z["offload_param"]
    for old, sec, name in (("cpu_offload", oo, "offload_optimizer"), ("cpu_offload_param", op, "offload_param")):
        if z.get(old):
            if sec["device"] not in ("none", "cpu"):
                raise ConfigError(f"zero_optimization.{old}: true (offload to cpu) conflicts with "
                                  f"zero_optimization.{name}.device={sec['device']!r}; keep {name} only.")
            sec["device"] = "cpu"
    if z.get("cpu_offload_use_pin_memory") is not None:
        for sec in (oo, op):
            sec["pin_memory"] = sec["pin_memory"] or z["cpu_offload_use_pin_memory"]
    old = z.get("stage3_gather_fp16_weights_on_model_save")
    if old is not None:
        new = "zero_optimization.stage3_gather_16bit_weights_on_model_save"
        if config.is_set(new) and z["stage3_gather_16bit_weights_on_model_save"] != old:
            raise ConfigError(f"zero_optimization.stage3_gather_fp16_weights_on_model_save ({old}) and {new} "
                              f"({z['stage3_gather_16bit_weights_on_model_save']}) disagree; keep the second.")
        z["stage3_gather_16bit_weights_on_model_save"] = old


def _aio_notice(aio: AioConfig, *devices: str) -> list[str]:
    """A line when ``aio`` is set to something other than the defaults but nothing is swapped to NVMe."""
    if aio == AioConfig() or "nvme" in devices:
        return []
    return ["aio has no effect here: no zero_optimization offload device is 'nvme' (the aio settings drive the "
            "NVMe swap files only)."]


def _notices(z: dict[str, Any]) -> list[str]:
    """One line for each :data:`NOTICE_KEYS` key set to something other than DeepSpeed's default."""
    out = []
    for key, (default, why) in NOTICE_KEYS.items():
        section, _, leaf = key.rpartition(".")
        value = (z[section] if section else z).get(leaf, default)
        if value != default and value != "auto":
            out.append(f"zero_optimization.{key}={value!r} has no effect here: {why}.")
    return out
