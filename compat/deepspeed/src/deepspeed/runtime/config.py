"""``deepspeed.runtime.config``: ``DeepSpeedConfig``, a ds_config read the way microspeed reads it.

``DeepSpeedConfig(config, mpu=None)`` takes a dict, a JSON/hjson file or a base64 string, as DeepSpeed
does, and exposes DeepSpeed's public attributes (``train_batch_size``, ``zero_config``,
``zero_optimization_stage``, ``fp16_enabled``, ``bfloat16_enabled``, ``monitor_config``, ...). Nothing is
parsed twice: the config is validated by :func:`microspeed.config.parse` against the schema the
installed plugins claim (:mod:`microspeed.compat.deepspeed_config`), so a key the engine would refuse is refused
here with the same message (a :class:`microspeed.ConfigError`, which is a ``ValueError``), and every
value is the one ``initialize()`` would use. The batch triad is resolved by
:func:`microspeed.config.resolve_batch_triad` over the data-parallel world size (``mpu``'s, else
torch.distributed's, else 1); an inconsistent triad raises :class:`BatchSizeError`, an
``AssertionError`` as DeepSpeed's.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from deepspeed.monitor.config import get_monitor_config
from deepspeed.runtime.config_utils import (
    DeepSpeedConfigObject,
    ScientificNotationEncoder,
    dict_raise_error_on_duplicate_keys,
)
from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
from deepspeed.runtime.zero.config import ZeroStageEnum, get_zero_config
from deepspeed.utils.logging import logger
from microspeed import comm
from microspeed.compat.deepspeed_config import parse_config, read_config
from microspeed.config import AUTO, Config, resolve_batch_triad
from microspeed.errors import ConfigError

__all__ = ["ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "DEEPSPEED_OPTIMIZERS", "LAMB_OPTIMIZER",
           "MUON_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER", "ONEBIT_LAMB_OPTIMIZER", "ZERO_ONE_ADAM_OPTIMIZER",
           "BatchSizeError", "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedConfigObject",
           "ScientificNotationEncoder", "dict_raise_error_on_duplicate_keys"]

#: DeepSpeed's names for ``optimizer.type`` (case does not matter, in DeepSpeed and here).
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
MUON_OPTIMIZER = "muon"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"

#: The ``optimizer.type`` names microspeed builds itself (lower case), as DeepSpeed's list of its own optimizers.
DEEPSPEED_OPTIMIZERS: list[str] = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, MUON_OPTIMIZER,
                                   ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER]


DeepSpeedConfigError = ConfigError
"""DeepSpeed's error class for config problems: microspeed's :class:`~microspeed.ConfigError` itself, so
``except deepspeed.DeepSpeedConfigError`` catches every config error microspeed raises (and, since it is a
``ValueError``, ``except ValueError`` still does too)."""


class BatchSizeError(ConfigError, AssertionError):
    """The batch triad does not add up (a :class:`microspeed.ConfigError` and, as in DeepSpeed, an AssertionError)."""


def _given(raw: dict[str, Any], key: str) -> Any:
    value = raw.get(key)
    return None if isinstance(value, str) and value == AUTO else value


class DeepSpeedConfig:
    """A parsed ds_config with DeepSpeed's attribute names (see the module docstring)."""

    def __init__(self, config: str | dict[str, Any], mpu: Any = None, mesh_device: Any = None) -> None:
        if mesh_device is not None:
            raise ConfigError("DeepSpeedConfig(mesh_device=...): microspeed has no sequence-parallel device mesh; "
                              "leave it None")
        self._param_dict: dict[str, Any] = read_config(config)
        self.global_rank = comm.get_rank() if comm.is_initialized() else 0
        if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
            self.world_size = int(mpu.get_data_parallel_world_size())
        else:
            self.world_size = comm.get_world_size() if comm.is_initialized() else 1
        op = self._param_dict.get("gradient_allreduce_op", "mean")
        if not isinstance(op, str) or op.lower() not in ("mean", "sum"):
            raise ConfigError(f"Invalid gradient_allreduce_op {op!r}: DeepSpeed accepts 'mean' or 'sum'; microspeed "
                              "averages gradients ('mean', the default), so remove the key")
        if op.lower() == "sum":
            self._refuse_sum_with(self._param_dict)
        self._config: Config = parse_config(copy.deepcopy(self._param_dict))
        self._initialize_params(self._config)
        self._configure_train_batch_size()
        self._do_sanity_check()

    @staticmethod
    def _refuse_sum_with(raw: dict[str, Any]) -> None:
        """``gradient_allreduce_op: "sum"`` with a feature DeepSpeed itself refuses it with: that reason first."""
        zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
        compile_section = raw.get("compile") if isinstance(raw.get("compile"), dict) else {}
        for clash, name in ((zero.get("stage") == 3, "ZeRO stage 3"), ("zenflow" in zero, "ZenFlow"),
                            (bool(compile_section.get("deepcompile")), "DeepCompile")):
            if clash:
                raise ConfigError(f"gradient_allreduce_op='sum' is not supported with {name} (in DeepSpeed either); "
                                  "microspeed averages gradients ('mean'), so remove the key")

    # ------------------------------------------------------------------ reading
    def _initialize_params(self, cfg: Config) -> None:
        raw = self._param_dict
        self.train_batch_size = _given(raw, "train_batch_size")
        self.train_micro_batch_size_per_gpu = _given(raw, "train_micro_batch_size_per_gpu")
        self.gradient_accumulation_steps = _given(raw, "gradient_accumulation_steps")
        self.steps_per_print = cfg.get("steps_per_print")
        self.wall_clock_breakdown = bool(cfg.get("wall_clock_breakdown", False)
                                         or cfg.get("flops_profiler.enabled", False))
        self.dataloader_drop_last = cfg.get("dataloader_drop_last", False)
        self.gradient_clipping = cfg.get("gradient_clipping", 0.0)
        self.prescale_gradients = cfg.get("prescale_gradients", False)
        self.gradient_predivide_factor = cfg.get("gradient_predivide_factor", 1.0)
        self.communication_data_type = cfg.get("communication_data_type")
        self.gradient_allreduce_op = str(raw.get("gradient_allreduce_op", "mean")).lower()
        self.memory_breakdown = bool(raw.get("memory_breakdown", False))

        self.zero_config = get_zero_config(raw) if "zero_optimization" in cfg else get_zero_config({})
        self.zero_optimization_stage = int(self.zero_config.stage)
        self.zero_enabled = self.zero_optimization_stage > 0
        self.zero_allow_untested_optimizer = cfg.get("zero_allow_untested_optimizer", False)
        self.zero_force_ds_cpu_optimizer = cfg.get("zero_force_ds_cpu_optimizer", True)

        self.float16_config = get_float16_config(raw)
        self.bfloat16_config = get_bfloat16_config(raw)
        self.fp16_enabled = bool(cfg.get("fp16.enabled", False))
        self.bfloat16_enabled = bool(cfg.get("bf16.enabled", False))
        self.fp16_auto_cast = bool(cfg.get("fp16.auto_cast", False))
        self.loss_scale = cfg.get("fp16.loss_scale", 0.0)
        self.initial_dynamic_scale = 2 ** cfg.get("fp16.initial_scale_power", 16)
        assert not (self.fp16_enabled and self.bfloat16_enabled), "bfloat16 and fp16 modes cannot be simultaneously " \
                                                                  "enabled"
        self.monitor_config = get_monitor_config(raw)

        self.optimizer_name = cfg.get("optimizer.type")
        if isinstance(self.optimizer_name, str) and self.optimizer_name.lower() in DEEPSPEED_OPTIMIZERS:
            self.optimizer_name = self.optimizer_name.lower()
        self.optimizer_params = cfg.get("optimizer.params")
        self.optimizer_legacy_fusion = cfg.get("optimizer.legacy_fusion", False)
        self.scheduler_name = cfg.get("scheduler.type")
        self.scheduler_params = cfg.get("scheduler.params")
        self.pipeline = cfg.get("pipeline", {})
        self.activation_checkpointing_config = cfg.get("activation_checkpointing", {})
        self.comms_config = cfg.get("comms_logger", {})
        self.flops_profiler_config = cfg.get("flops_profiler", {})
        self.data_efficiency_config = cfg.get("data_efficiency", {})
        self.data_efficiency_enabled = bool(self.data_efficiency_config.get("enabled", False))
        self.grad_accum_dtype = cfg.get("data_types.grad_accum_dtype")
        self.eigenvalue_enabled = bool((raw.get("eigenvalue") or {}).get("enabled", False))
        self.eigenvalue_verbose = bool((raw.get("eigenvalue") or {}).get("verbose", False))
        self.notices = list(cfg.notices)

    def _configure_train_batch_size(self) -> None:
        """Fill the missing member(s) of the batch triad; :class:`BatchSizeError` when it does not add up."""
        triad = Config({}, {"train_batch_size": self.train_batch_size,
                            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
                            "gradient_accumulation_steps": self.gradient_accumulation_steps})
        for key, value in triad.values.items():
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise BatchSizeError(f"{key}: {value!r} must be a positive integer")
        try:
            tbs, mbs, gas = resolve_batch_triad(triad, self.world_size)
        except ConfigError as exc:
            raise BatchSizeError(str(exc)) from exc
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = tbs, mbs, gas

    def _do_sanity_check(self) -> None:
        if self.zero_enabled:
            assert self.zero_optimization_stage <= ZeroStageEnum.max_stage, (
                f"zero_optimization.stage: at most {int(ZeroStageEnum.max_stage)}")

    # ------------------------------------------------------------------ printing
    def print_user_config(self) -> None:
        """Log the user's config as JSON."""
        logger.info("  json = %s", json.dumps(self._param_dict, sort_keys=True, indent=4,
                                              cls=ScientificNotationEncoder, separators=(",", ":")))

    def print(self, name: str) -> None:
        """Log every attribute, then the user's config."""
        logger.info("%s:", name)
        for key in sorted(vars(self)):
            if not key.startswith("_"):
                logger.info("  %s %s %s", key, "." * (29 - len(key)), getattr(self, key))
        self.print_user_config()
