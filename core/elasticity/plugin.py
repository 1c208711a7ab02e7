"""The built-in ``elasticity`` plugin: DeepSpeed's ``elasticity`` section, applied at ``initialize()``.

With ``elasticity.enabled`` the batch triad is not the user's: it is computed for the data-parallel
world size the job starts at, as DeepSpeed 0.16's engine computed it (its ``DeepSpeedConfig``):
``train_batch_size`` is the elastic batch (the same at every valid world size, so restarting at
another size keeps the global batch), ``train_micro_batch_size_per_gpu`` the largest allowed
micro batch that divides the per-rank share, and ``gradient_accumulation_steps`` the rest. A batch
key given next to an enabled section is refused unless ``ignore_non_elastic_batch_info`` is true
(then it is overridden, and the override is logged). A world size the section does not allow is
refused with the valid counts.
"""

from __future__ import annotations

from typing import Any

from microspeed import comm
from microspeed.config import Config, Field, Section, non_negative, positive
from microspeed.elasticity.compute import compute_elastic_config, ensure_immutable_elastic_config
from microspeed.elasticity.config import DEEPSPEED_ELASTIC_RELEASE, DEFAULTS, SECTION
from microspeed.elasticity.errors import ElasticityConfigError, ElasticityIncompatibleWorldSize
from microspeed.hookspecs import hookimpl

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _positive_ints(value: list) -> str | None:
    ok = value and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    return None if ok else "a non-empty list of positive integers"


def _version(value: float | str) -> str | None:
    try:
        return None if float(value) in (0.1, 0.2) else "0.1 or 0.2"
    except ValueError:
        return "0.1 or 0.2"


class ElasticityPlugin:
    """Claims the ``elasticity`` section; sets the batch triad for the world size (hook ``adjust_batch``)."""

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """The ``elasticity`` section, with DeepSpeed 0.16's keys and defaults."""
        d = DEFAULTS
        return {SECTION: Section({
            "enabled": Field((bool,), d["enabled"], "set the batch triad from this section for the world size"),
            "max_train_batch_size": Field((int,), d["max_train_batch_size"],
                                          "largest acceptable train_batch_size (required when enabled)", positive),
            "micro_batch_sizes": Field((list,), d["micro_batch_sizes"],
                                       "acceptable micro batches per GPU (required when enabled)", _positive_ints),
            "min_gpus": Field((int,), d["min_gpus"], "fewest GPUs the batch must be valid for", positive),
            "max_gpus": Field((int,), d["max_gpus"], "most GPUs the batch must be valid for", positive),
            "min_time": Field((int, float), d["min_time"], "minutes before a resource scheduler may rescale the "
                              "job (read by schedulers, not by training)", non_negative),
            "prefer_larger_batch": Field((bool,), d["prefer_larger_batch"],
                                         "among equally elastic batches take the larger"),
            "ignore_non_elastic_batch_info": Field((bool,), d["ignore_non_elastic_batch_info"],
                                                   "override a batch triad given next to the section instead of "
                                                   "refusing it"),
            "model_parallel_size": Field((int,), d["model_parallel_size"],
                                         "GPUs per model replica (version 0.2)", positive),
            "num_gpus_per_node": Field((int,), d["num_gpus_per_node"], "GPUs per node (version 0.2)", positive),
            "version": Field((float, str), d["version"], "batch computation: 0.1, or 0.2 (node-aware; a world "
                             "size outside the list gets a batch of its own)", _version),
        }, doc="DeepSpeed 0.16's elastic batch sizes")}

    @hookimpl
    def microspeed_adjust_batch(self, config: Config, dp_world_size: int) -> None:
        """Set the batch triad from an enabled ``elasticity`` section for ``dp_world_size``."""
        if not config.get(f"{SECTION}.enabled"):
            return
        section: dict[str, Any] = dict(config.raw[SECTION])
        ensure_immutable_elastic_config(section)
        given = [key for key in BATCH_KEYS if config.is_set(key)]
        if given and not section.get("ignore_non_elastic_batch_info", False):
            raise ElasticityConfigError(
                f"{', '.join(given)}: given next to an enabled elasticity section, which sets the batch triad "
                f"itself; remove {'them' if len(given) > 1 else 'it'}, or set "
                f"\"{SECTION}.ignore_non_elastic_batch_info\": true to have them overridden.")
        batch, valid, micro = compute_elastic_config({SECTION: section}, DEEPSPEED_ELASTIC_RELEASE,
                                                     world_size=dp_world_size)
        steps = batch // (micro * dp_world_size)
        if steps < 1 or batch != micro * steps * dp_world_size:
            raise ElasticityIncompatibleWorldSize(
                f"{SECTION}.max_train_batch_size: the elastic batch for data-parallel size {dp_world_size} is "
                f"{batch}, which is not micro batch {micro} x accumulation steps x {dp_world_size}; raise "
                f"{SECTION}.max_train_batch_size or run at one of {valid}.")
        triad = dict(zip(BATCH_KEYS, (batch, micro, steps), strict=True))
        overridden = [f"{key} {config.get(key)!r} -> {triad[key]}" for key in given]
        for key, value in triad.items():
            config.set(key, value)
        if comm.get_rank() == 0:
            from microspeed.log import get_logger

            get_logger("microspeed.elasticity").info(
                f"elasticity: data-parallel size {dp_world_size}: train_batch_size={batch} = micro batch {micro} x "
                f"gradient_accumulation_steps {steps} x {dp_world_size} (valid sizes: {valid})"
                + ("; valid only at this size: another world size gets another batch" if valid == [dp_world_size]
                   else "")
                + (f"; overriding {', '.join(overridden)}" if overridden else "")
                + ("; min_time is for the resource scheduler, training does not read it" if config.is_set(
                    f"{SECTION}.min_time") else ""))
