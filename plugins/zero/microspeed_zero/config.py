"""The ``zero_optimization`` section: DeepSpeed's keys, their defaults and what we refuse.

Both DeepSpeed spellings of the stage-3 keys are accepted (``stage3_prefetch_bucket_size`` and
``prefetch_bucket_size``, ...). Sizes may be written as floats (``5e8``), as DeepSpeed users do.
A key not listed here is refused by the core's strict validation, with a suggestion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from microspeed.config import Field, Section, non_negative, positive
from microspeed.errors import ConfigError

_SIZE = (int, float)

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
        "device": Field((str,), "none", "where it lives: " + ", ".join(devices), choices=devices),
        "nvme_path": Field((str, type(None)), None, "folder (any file system) for device 'nvme'"),
        "pin_memory": Field((bool,), False, "page-locked host buffers (faster GPU<->CPU copies; CUDA only)"),
        **extra,
    }, doc=doc)


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
        }),
        "offload_param": _offload(("none", "cpu", "nvme"), "stage 3: parameter partitions off the device", {
            "max_in_cpu": Field(_SIZE, 1_000_000_000, "nvme: elements of parameter shards kept in CPU memory",
                                non_negative),
        }),
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
        fields[long] = Field(types, default, doc, check)
        fields[short] = Field(types + (type(None),), None, f"same as {long}")
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

    @classmethod
    def from_config(cls, config: Any) -> ZeroConfig:
        """Read ``config["zero_optimization"]``; :class:`ConfigError` for combinations we cannot serve."""
        z = dict(config["zero_optimization"])
        for short, long in STAGE3_ALIASES.items():
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
        return cls(
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
        )
