"""Per-feature recipes of the composition matrix, and how two recipes combine into one run and its reference.

A :class:`Recipe` says, for one declared feature, what it needs (pipeline stages, tensor-parallel size, expert
parallel size, data-parallel ranks), its ds_config fragment (``config``: values that must hold; ``defaults``:
values another recipe may override), what the model needs (:class:`~matrix_model.ModelSpec` fields), what the
single-process reference keeps of it, and how close the losses must be. :func:`plan_pair` combines any two recipes
generically: the largest of each parallel size, the two fragments merged (the same key set to two different values
is a pair that one config cannot express), the reference built from the features that stay on in one process.

Every pair runs on at least two data-parallel ranks unless its parallelism fills the ranks, so even a pair of two
algorithmic features (which stay on in the reference) is a distributed run compared with one process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from matrix_model import MICRO, N_MICRO, ModelSpec

MAX_WORLD = 4
"""The most ranks a pair may use on this machine."""

STEPS = 3
"""Optimizer steps per run (a recipe may ask for more)."""

FP32_RTOL = 1e-5
"""Relative tolerance of per-step losses when the math is the same as one process's (fp32)."""

NVME_PLACEHOLDER = "<nvme>"
"""Stands for a fresh per-run folder in a config (the runner replaces it)."""

BASE_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": MICRO,
    "steps_per_print": 10**6,
    "gradient_clipping": 1.0,
}
"""Every run's config (plus ``gradient_accumulation_steps`` = micro-batches per global batch / data-parallel size)."""

BASE_DEFAULTS: dict[str, Any] = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
"""Values a recipe may override (the optimizer)."""


@dataclass(frozen=True)
class Recipe:
    """How to turn one feature on in the matrix run, and what its single-process reference keeps.

    Attributes:
        feature: the declared feature name (``Feature.name``).
        pp / chunks / tp / ep: pipeline stages, model chunks per stage, tensor-parallel size, expert-parallel size.
        dp: data-parallel ranks the feature needs to act (ZeRO partitions, compressed exchange).
        config: ds_config values that must hold (two recipes setting one key differently cannot combine).
        defaults: ds_config values another recipe may override (e.g. the ZeRO stage offload uses).
        alternative: another way to turn the feature on, used when ``config`` collides with the other recipe's
            (NVMe offload of the parameters when the optimizer state is offloaded to the CPU).
        model: :class:`~matrix_model.ModelSpec` fields the run's model needs.
        algorithmic: True when the feature changes the math, so the reference runs it too (config and model);
            False for parallelism, whose single-process equivalent is the plain model without it.
        steps: optimizer steps the run needs.
        rtol: relative tolerance of the losses (:data:`FP32_RTOL` when the math is the same as one process's).
        exact_steps / band: compression: the first ``exact_steps`` losses are compared at ``rtol``, later ones
            within ``band`` (relative).
        tolerance_why: why the tolerance is not :data:`FP32_RTOL`.
        pipeline_reference: when set (the reason), a pair of this feature with a pipeline is compared with the same
            layers as a one-stage pipeline in one process, not as one plain module.
    """

    feature: str
    pp: int = 1
    chunks: int = 1
    tp: int = 1
    ep: int = 1
    dp: int = 1
    config: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)
    alternative: dict[str, Any] | None = None
    model: dict[str, Any] = field(default_factory=dict)
    algorithmic: bool = False
    steps: int = STEPS
    rtol: float = FP32_RTOL
    exact_steps: int | None = None
    band: float | None = None
    tolerance_why: str = ""
    pipeline_reference: str = ""


def _zero(stage: int) -> Recipe:
    return Recipe(f"zero-{stage}", dp=2, config={"zero_optimization": {"stage": stage}})


_ONEBIT_WHY = ("compression: the {n} warm-up steps (and the loss after them) equal one process running the same "
               "optimizer; later losses follow 1-bit-compressed momentum with error feedback, within {band:g} "
               "relative")

_ONEBIT_DEFAULTS = {"zero_force_ds_cpu_optimizer": False}
"""With CPU offload, step the 1-bit optimizer itself on the CPU (ZeRO's fast CPU Adam would replace it; the
declarations refuse that condition)."""

RECIPES: dict[str, Recipe] = {r.feature: r for r in [
    _zero(1),
    _zero(2),
    _zero(3),
    Recipe("offload-cpu", dp=2, config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
           defaults={"zero_optimization": {"stage": 2}}),
    Recipe("offload-nvme", dp=2,
           config={"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": NVME_PLACEHOLDER}}},
           defaults={"zero_optimization": {"stage": 3}},
           alternative={"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                           "nvme_path": NVME_PLACEHOLDER}}}),
    Recipe("pipeline-1f1b", pp=2, config={"pipeline": {"schedule": "1f1b"}}),
    Recipe("pipeline-interleaved", pp=2, chunks=2, config={"pipeline": {"schedule": "interleaved"}}),
    Recipe("tensor-parallel", tp=2, model={"tp": True}),
    Recipe("moe", ep=2, dp=2, model={"moe": True}, algorithmic=True),
    Recipe("onebit-adam", dp=2, algorithmic=True, steps=4, exact_steps=3, band=0.05,
           config={"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}},
           defaults=_ONEBIT_DEFAULTS,
           tolerance_why=_ONEBIT_WHY.format(n=2, band=0.05)),
    Recipe("zero-one-adam", dp=2, algorithmic=True, steps=4, exact_steps=3, band=0.05,
           config={"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3,
               "var_freeze_step": 2, "var_update_scaler": 1, "local_step_scaler": 1, "local_step_clipper": 1}}},
           defaults=_ONEBIT_DEFAULTS,
           tolerance_why=_ONEBIT_WHY.format(n=2, band=0.05)),
    Recipe("onebit-lamb", dp=2, algorithmic=True, steps=4, exact_steps=3, band=0.05,
           config={"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-2, "freeze_step": 2}}},
           defaults=_ONEBIT_DEFAULTS,
           tolerance_why=_ONEBIT_WHY.format(n=2, band=0.05)),
    Recipe("fp16", algorithmic=True, rtol=5e-4, config={"fp16": {"enabled": True, "initial_scale_power": 8}},
           tolerance_why="fp16: the reference runs fp16 too; parallel runs sum in another order (worst seen 6e-5)"),
    Recipe("bf16", algorithmic=True, rtol=2e-3, config={"bf16": {"enabled": True}},
           tolerance_why="bf16: the reference runs bf16 too; parallel runs sum in another order (worst seen 2.4e-4)"),
    Recipe("activation-checkpointing", algorithmic=True, model={"ac": True},
           config={"activation_checkpointing": {"partition_activations": False}}),
    Recipe("sparse-attention", algorithmic=True, config={"sparse_attention": {
        "mode": "fixed", "block": 16, "num_local_blocks": 1, "num_global_blocks": 1, "attention": "unidirectional"}}),
    Recipe("random-ltd", algorithmic=True, pipeline_reference=(
        "random-LTD in a pipeline draws each layer's kept tokens from a generator keyed by (seed, step, micro-batch, "
        "layer), so that every stage draws alike; one plain module draws from torch's global generator (as "
        "DeepSpeed's does), so the reference is the same layers as a one-stage pipeline"),
        config={"data_efficiency": {"enabled": True, "data_routing": {
        "enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 1, "random_ltd_layer_id": [1],
            "model_mask_name": None, "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": 16, "max_value": 32, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 2, "seq_per_step": 16}}}}}}),
    Recipe("pld", algorithmic=True, config={"progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 1.0}}),
    Recipe("curriculum", algorithmic=True, config={"curriculum_learning": {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 16, "max_difficulty": 32,
        "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 16}}}),
]}
"""One recipe per declared feature name."""


class Conflict(ValueError):
    """Two recipes set the same config key (or model field) to different values."""


def _merge(into: dict[str, Any], new: dict[str, Any], path: str = "", strict: bool = True) -> None:
    for key, value in new.items():
        where = f"{path}.{key}" if path else key
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, where, strict)
        elif key in into and into[key] != value and strict:
            raise Conflict(f"{where} is {into[key]!r} for one feature and {value!r} for the other")
        else:
            into[key] = copy.deepcopy(value)


def merged_config(recipes: list[Recipe], gas: int) -> dict[str, Any]:
    """Base config, the recipes' defaults (overridable), then their fixed values (conflicts raise :class:`Conflict`)."""
    cfg = copy.deepcopy(BASE_CONFIG)
    cfg["gradient_accumulation_steps"] = gas
    _merge(cfg, BASE_DEFAULTS, strict=False)
    for r in recipes:
        _merge(cfg, r.defaults, strict=False)
    hard: dict[str, Any] = {}
    for r in recipes:
        _merge(hard, r.config)
    _merge(cfg, hard, strict=False)
    return cfg


def _model(recipes: list[Recipe], ep: int) -> ModelSpec:
    fields: dict[str, Any] = {}
    for r in recipes:
        _merge(fields, r.model)
    if fields.get("moe"):
        fields["ep"] = ep
    return ModelSpec(**fields)


@dataclass(frozen=True)
class Plan:
    """One matrix run and its reference.

    Attributes:
        features: the two feature names.
        world: ranks of the run (the job it belongs to); pp x tp x dp == world.
        config / model: the run's ds_config and model; ref_config / ref_model: the single-process reference's.
        steps, rtol, exact_steps, band, tolerance_why: the most steps, the loosest tolerances of the two recipes.
        unexpressible: why one config cannot hold both features (None when it can).
        ref_pipelined: the reference is a one-stage pipeline (a recipe's ``pipeline_reference``), not one module.
    """

    features: tuple[str, str]
    world: int = 0
    pp: int = 1
    chunks: int = 1
    tp: int = 1
    dp: int = 1
    config: dict[str, Any] = field(default_factory=dict)
    model: ModelSpec = ModelSpec()
    ref_config: dict[str, Any] = field(default_factory=dict)
    ref_model: ModelSpec = ModelSpec()
    steps: int = STEPS
    rtol: float = FP32_RTOL
    exact_steps: int | None = None
    band: float | None = None
    tolerance_why: str = ""
    unexpressible: str | None = None
    ref_pipelined: bool = False

    @property
    def key(self) -> str:
        """The pair's id: ``a+b``."""
        return "+".join(self.features)

    def describe(self) -> str:
        """The topology in words, e.g. ``pp2 x tp1 x dp2 (4 ranks)``."""
        chunks = f" ({self.chunks} chunks)" if self.chunks > 1 else ""
        return f"pp{self.pp}{chunks} x tp{self.tp} x dp{self.dp} ({self.world} ranks)"

    def reference_key(self) -> str:
        """Plans with equal keys share one reference run."""
        return repr((sorted(self.ref_config.items(), key=str), self.ref_model, self.ref_pipelined))


def plan_pair(a: str, b: str) -> Plan:
    """Combine the recipes of features ``a`` and ``b`` into a run and its reference (see the module docstring)."""
    ra, rb = RECIPES[a], RECIPES[b]
    both = [ra, rb]
    pp, tp, chunks = max(ra.pp, rb.pp), max(ra.tp, rb.tp), max(ra.chunks, rb.chunks)
    ep = max(ra.ep, rb.ep)
    dp_needed = max(ra.dp, rb.dp, ep)
    needed = pp * tp * dp_needed
    world = 2 if needed <= 2 else needed if needed > MAX_WORLD else MAX_WORLD
    dp = max(world // (pp * tp), 1)
    steps = max(ra.steps, rb.steps)
    rtol = max(r.rtol for r in both)
    exact = [r.exact_steps for r in both if r.exact_steps is not None]
    bands = [r.band for r in both if r.band is not None]
    why = "; ".join(r.tolerance_why for r in both if r.tolerance_why)
    common = dict(features=(a, b), world=world, pp=pp, chunks=chunks, tp=tp, dp=dp, steps=steps, rtol=rtol,
                  exact_steps=min(exact) if exact else None, band=max([rtol, *bands]) if bands else None,
                  tolerance_why=why)
    try:
        config = merged_config(both, N_MICRO // dp)
        model = _model(both, ep)
    except Conflict as exc:
        config = None
        for i, r in enumerate(both):  # the other way to turn one of them on
            if r.alternative is not None:
                swapped = [replace(x, config=x.alternative) if j == i else x for j, x in enumerate(both)]
                try:
                    config, model = merged_config(swapped, N_MICRO // dp), _model(both, ep)
                    break
                except Conflict:
                    continue
        if config is None:
            return Plan(**common, unexpressible=str(exc))
    kept = [r for r in both if r.algorithmic]
    ref_config = merged_config(kept, N_MICRO)
    ref_model = _model(kept, 1)
    ref_pipelined = pp > 1 and any(r.pipeline_reference for r in kept)
    return Plan(**common, config=config, model=model, ref_config=ref_config, ref_model=ref_model,
                ref_pipelined=ref_pipelined)


def compare_losses(plan: Plan, losses: list[float], reference: list[float]) -> str | None:
    """None when ``losses`` match ``reference`` (its first ``len(losses)``) within the plan's tolerances, else the
    steps that do not."""
    reference = reference[:len(losses)]
    if len(losses) != plan.steps or len(reference) != plan.steps:
        return f"{len(losses)} losses, the reference has {len(reference)}"
    bad = []
    for step, (got, want) in enumerate(zip(losses, reference, strict=True)):
        compressed = plan.exact_steps is not None and step >= plan.exact_steps
        tol = plan.band if compressed and plan.band is not None else plan.rtol
        rel = abs(got - want) / max(abs(want), 1e-12)
        if not rel <= tol:
            bad.append(f"step {step}: {got!r} vs reference {want!r} (relative {rel:.2e} > {tol:g})")
    return "; ".join(bad) or None
