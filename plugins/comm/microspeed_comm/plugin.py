"""The ``comm`` plugin: builds the 1-bit optimizers and hands gradient reduction over and back.

Active when ``optimizer.type`` is ``OneBitAdam``, ``ZeroOneAdam`` or ``OneBitLamb`` (any case, as
DeepSpeed matches them), or when the client passes one of those optimizers to ``initialize``.

* **Build.** Answers ``make_optimizer`` for those types; the ``optimizer.params`` keys are checked
  at ``initialize()`` and a bad one is refused naming ``optimizer.params.<key>``.
* **Hand-over.** After every step it asks the optimizer whether the next step's gradients must be
  averaged at full precision (:meth:`~microspeed_comm.onebit.OneBitOptimizer.full_precision_gradients_next`).
  If not, it claims the :attr:`~microspeed.plugin_api.Role.GRADIENT_REDUCTION` role, so the built-in
  data-parallel reducer neither launches its all-reduce from the autograd hooks nor reduces at the
  boundary; the optimizer then exchanges compressed momentum (or gradients) inside its step. If so,
  it releases the role again (0/1 Adam's variance steps, or a checkpoint of the warm-up being loaded).
* **Checkpoints.** The optimizer's state (momenta, variances, counters) goes through the core's
  default optimizer save, keyed by parameter name. The error-feedback buffers differ per rank:
  they are saved per rank (``plugins/comm/rank<r>/...``) and restored when the checkpoint is loaded
  by the same rank of the same world size, else they start from zero (DeepSpeed always resets them).
  Before a save, 0/1 Adam synchronises pending local steps, so the checkpoint holds one model.
* **ZeRO.** The plugin states :class:`~microspeed.plugin_api.GradientCompression`: a plugin that
  partitions gradients and steps the optimizer itself (ZeRO stages 1 and 2) asks it whether it serves
  the client's optimizer, builds its partition optimizer (the same 1-bit class over this rank's flat
  slices) and attaches it here. That optimizer then takes this rank's slice of the averaged gradient
  and communicates nothing; the partitioner averages the gradients exactly while
  ``full_precision_gradients_next()`` is true (the warm-up, 0/1 Adam's variance steps) and with its
  error-feedback 1-bit reduce-scatter otherwise. 1-bit LAMB reads the parameter boundaries the
  partitioner puts on its slices (``partition_pieces``) and sums its whole-parameter norms over the
  data-parallel group. With MoE, the partitioner lays experts out in segments of their replica group and
  runs that exchange (error buffers included) per group; 1-bit LAMB sums an expert's norms over the
  ranks of its replica group (the slices carry ``replica_group``). Refused with a partitioning, with the
  reason: 0/1 Adam with local steps (``local_step_clipper`` > 1: a local step updates every parameter
  from that rank's own momentum), and any partitioner that does not attach (it would split what the
  optimizer exchanges whole).
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from typing import Any

import torch

from microspeed.plugin_api import (
    Capabilities,
    Capability,
    ConfigError,
    Feature,
    GradientCompression,
    GradientPartitioning,
    Refusal,
    Role,
    comm,
    get_logger,
    hookimpl,
)
from microspeed_comm import bitpack
from microspeed_comm.adam import OneBitAdam
from microspeed_comm.compositions import FEATURES, LOCAL_STEPS_WITH_ZERO, REFUSALS
from microspeed_comm.compressed import DEFAULT_BLOCK_SIZE
from microspeed_comm.lamb import OneBitLamb
from microspeed_comm.onebit import OneBitOptimizer
from microspeed_comm.zero_one_adam import ZeroOneAdam

OPTIMIZERS: dict[str, type[OneBitOptimizer]] = {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam,
                                                "OneBitLamb": OneBitLamb}
"""``optimizer.type`` names this plugin builds (matched case-insensitively), and their classes."""

_NO_EFFECT = {
    "bias_correction": (True, "as in DeepSpeed, the 1-bit optimizers apply no bias correction"),
    "cuda_aware": (True, "it selected CUDA-aware MPI in DeepSpeed; microspeed communicates through "
                         "torch.distributed on the data-parallel group"),
}


PARAM_DOCS = {
    "lr": "learning rate",
    "freeze_step": "warm-up steps at full precision before compression (>= 1)",
    "var_freeze_step": "last step that may update the variance; local steps after it",
    "var_update_scaler": "variance updates per interval before the interval doubles",
    "local_step_scaler": "steps before the local-step interval doubles",
    "local_step_clipper": "largest local-step interval (steps between synchronisations)",
    "bias_correction": "accepted; no effect, as in DeepSpeed (warns when true)",
    "betas": "momentum and variance decay",
    "eps": "added to the denominator",
    "eps_inside_sqrt": "use sqrt(v + eps) instead of sqrt(v) + eps",
    "weight_decay": "decoupled weight decay",
    "max_grad_norm": "must be 0: use the top-level gradient_clipping",
    "max_coeff": "upper bound of the LAMB trust ratio",
    "min_coeff": "lower bound of the LAMB trust ratio",
    "amsgrad": "must be false (not supported, as in DeepSpeed)",
    "cuda_aware": "accepted; no effect (CUDA-aware MPI in DeepSpeed; warns when true)",
    "comm_backend_name": "accepted: nccl, mpi, hccl, compressed, gloo, ccl; torch.distributed is used",
    "coeff_beta": "decay of the average of the warm-up trust ratios",
    "factor_max": "upper bound of the compression-stage factor",
    "factor_min": "lower bound of the compression-stage factor",
    "factor_threshold": "largest relative change of the factor per step",
}
"""What each ``optimizer.params`` key of the 1-bit optimizers means (the README's table)."""


def params_table() -> str:
    """The README's Markdown table: every ``optimizer.params`` key, its default per type, its meaning."""
    defaults = {}
    for name, cls in OPTIMIZERS.items():
        sig = inspect.signature(cls.__init__)
        defaults[name] = {k: p.default for k, p in sig.parameters.items()
                          if k not in ("self", "params", "deepspeed") and p.kind is p.POSITIONAL_OR_KEYWORD}
    keys = list(dict.fromkeys(k for d in defaults.values() for k in d))
    lines = ["| key | " + " | ".join(OPTIMIZERS) + " | meaning |", "|---" * (len(OPTIMIZERS) + 2) + "|"]
    for key in keys:
        cells = [f"`{defaults[n][key]!r}`".replace("'", '"') if key in defaults[n] else "—" for n in OPTIMIZERS]
        lines.append(f"| `{key}` | " + " | ".join(cells) + f" | {PARAM_DOCS[key]} |")
    return "\n".join(lines)


def optimizer_class(type_name: Any) -> type[OneBitOptimizer] | None:
    """The class for an ``optimizer.type`` value, or ``None`` if this plugin does not build it."""
    if not isinstance(type_name, str):
        return None
    return {k.lower(): v for k, v in OPTIMIZERS.items()}.get(type_name.lower())


def check_params(cls: type[OneBitOptimizer], params: dict[str, Any]) -> dict[str, Any]:
    """``params`` checked against ``cls``'s signature and bounds; raises :class:`ConfigError` naming the key."""
    sig = inspect.signature(cls.__init__)
    accepted = [n for n, p in sig.parameters.items()
                if n not in ("self", "params", "deepspeed") and p.kind is p.POSITIONAL_OR_KEYWORD]
    for key in params:
        if key not in accepted:
            near = difflib.get_close_matches(key, accepted, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"optimizer.params.{key}: not a parameter of {cls.__name__}{hint}; accepted: "
                              f"{', '.join(accepted)}")
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"optimizer.params.{exc}") from None
    return dict(params)


def _partitioning_reason(name: str, part: GradientPartitioning) -> str:
    """Why the 1-bit optimizer ``name`` cannot run with a partitioner that did not attach it, and the fix."""
    return (f"{name} averages whole momenta with a compressed all-reduce, while {part.config_key}={part.stage} "
            f"partitions optimizer state across ranks and its provider does not take the compressed gradient "
            f"exchange (GradientCompression) that lets {name} step partitions; {part.disable_hint} to use "
            f"{name}, or use Adam with partitioning")


def partition_refusal(opt: OneBitOptimizer | type[OneBitOptimizer], clipper: int | None = None) -> str | None:
    """Why ``opt`` (an optimizer or its class) cannot step partitions (a declared refusal's message), or None."""
    cls = opt if isinstance(opt, type) else type(opt)
    if issubclass(cls, ZeroOneAdam):
        clipper = opt.local_step_clipper if clipper is None else clipper
        if clipper > 1:
            return LOCAL_STEPS_WITH_ZERO[0].message()
    return None


class CommPlugin:
    """1-bit Adam, 0/1 Adam and 1-bit LAMB wired into the engine (one instance per engine)."""

    def __init__(self) -> None:
        self.cls: type[OneBitOptimizer] | None = None
        self.params: dict[str, Any] = {}
        self.optimizer: OneBitOptimizer | None = None
        self.engine: Any = None
        self.compressing = False
        self.partitioned = False
        self.log = None

    # -- set-up --------------------------------------------------------------------------------

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Recognise a 1-bit ``optimizer.type`` and check its params (at ``initialize()``)."""
        section = config["optimizer"] if config.is_set("optimizer") else {}
        self.cls = optimizer_class(section.get("type"))
        if self.cls is None:
            return
        params = dict(section.get("params") or {})
        self.params = check_params(self.cls, params)
        for key, (value, why) in _NO_EFFECT.items():
            if params.get(key) == value:
                warnings.warn(f"optimizer.params.{key}: {value} has no effect in {self.cls.__name__}: {why}",
                              stacklevel=2)

    @hookimpl
    def microspeed_capabilities(self) -> list[Capability]:
        """The compressed gradient exchange a partitioner (ZeRO) may use for the 1-bit optimizers."""
        return [GradientCompression(accepts=self._accepts, attach=self._attach, compress=bitpack.compress,
                                    decompress=bitpack.decompress, block_size=DEFAULT_BLOCK_SIZE,
                                    error=self._partition_error)]

    @hookimpl
    def microspeed_conflicts(self, capabilities: Capabilities) -> list[tuple[str, str]] | None:
        """With a gradient partitioning: refuse 0/1 Adam's local steps (:func:`partition_refusal`)."""
        part = capabilities.get(GradientPartitioning)
        if self.cls is None or part is None:
            return None
        clipper = self.params.get("local_step_clipper",
                                  inspect.signature(ZeroOneAdam.__init__).parameters["local_step_clipper"].default)
        why = partition_refusal(self.cls, clipper)
        if why is None:
            return None
        return [("optimizer.type", f"{self.cls.__name__} with {part.config_key}={part.stage}: {why}")]

    # -- the partitioner's side of GradientCompression -----------------------------------------

    def _accepts(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` is one of ours (the partitioner then attaches its partition optimizer)."""
        return isinstance(optimizer, OneBitOptimizer)

    def _attach(self, optimizer: Any) -> Any:
        """Adopt ``optimizer``, the partitioner's copy over this rank's slices; return "compress the next step?"."""
        name = type(optimizer).__name__
        why = partition_refusal(optimizer)
        if why is not None:
            raise ConfigError(f"{name}: cannot step a gradient partitioning: {why}")
        for i, group in enumerate(optimizer.param_groups):
            for key in ("non_freeze", "exp_avg_mask"):
                if group.get(key) is not None and group.get(key) is not False:
                    raise ConfigError(f"{name}: param group {i} sets {key!r}, which applies to whole parameters "
                                      f"(full-precision groups, momentum masks shaped like the parameter), while "
                                      f"a gradient partitioning steps flat slices; drop {key!r} or use "
                                      f"zero_optimization.stage 0.")
        if isinstance(optimizer, OneBitLamb):
            cut = [i for i, g in enumerate(optimizer.param_groups) for p in g["params"]
                   if not hasattr(p, "partition_pieces")]
            if cut:
                raise ConfigError(f"{name}: the partitioner does not say which parameter each slice of param group "
                                  f"{cut[0]} belongs to (partition_pieces), and 1-bit LAMB's trust ratios are "
                                  f"functions of whole parameters; use OneBitAdam or ZeroOneAdam with it.")
            optimizer.set_process_group(self.engine.topology.data_parallel_group)
        optimizer.set_partitioned()
        self.optimizer, self.partitioned = optimizer, True
        self.log = get_logger("microspeed.comm")
        if comm.get_rank() == 0:
            self.log.info("comm: the partitioner steps its slices with this optimizer; it averages their gradients "
                          "exactly while the optimizer asks for full precision, else with its 1-bit reduce-scatter",
                          optimizer=name)
        return lambda: not optimizer.full_precision_gradients_next()

    def _partition_error(self, key: Any, numel: int, device: Any) -> torch.Tensor:
        """The attached optimizer's sender-error buffer ``key`` (checkpointed per rank with its other errors)."""
        if not self.partitioned:
            raise RuntimeError("GradientCompression.error: no partition optimizer is attached")
        return self.optimizer.partition_error(key, numel, device)

    @hookimpl
    def microspeed_setup(self, engine) -> None:
        """Keep the engine (the optimizer comes later)."""
        self.engine = engine
        engine.set_plugin_state("comm", self)

    @hookimpl
    def microspeed_make_optimizer(self, engine, params: list[Any]) -> Any:
        """Build the 1-bit optimizer the config names, over the data-parallel group."""
        if self.cls is None:
            return None
        return self.cls(params, **self.params, group=engine.topology.data_parallel_group)

    @hookimpl(trylast=True)
    def microspeed_wrap_optimizer(self, engine, optimizer: Any) -> None:
        """Adopt the final optimizer if it is a 1-bit one (built here, or passed by the client)."""
        part = engine.capabilities.get(GradientPartitioning)
        if self.partitioned:  # the partitioner attached its partition optimizer: it reduces and steps
            return None
        if not isinstance(optimizer, OneBitOptimizer) and (self.cls is None or part is None):
            return None
        name = type(optimizer).__name__ if isinstance(optimizer, OneBitOptimizer) else self.cls.__name__
        if part is not None:
            raise ConfigError(f"{part.config_key}: cannot be combined with {name} (the plugin 'comm'): "
                              f"{_partitioning_reason(name, part)}")
        stepper, reducer = engine.owner(Role.OPTIMIZER_STEP), engine.owner(Role.GRADIENT_REDUCTION)
        if stepper not in (None, "comm") or reducer is not None:
            other = stepper if stepper not in (None, "comm") else reducer
            raise ConfigError(f"{name}: the plugin {other!r} steps the optimizer or reduces gradients itself; the "
                              f"1-bit optimizers need the whole momentum on every rank and do both: turn that "
                              f"plugin's feature off, or use another optimizer.")
        optimizer.set_process_group(engine.topology.data_parallel_group)
        self.optimizer = optimizer
        self.log = get_logger("microspeed.comm")
        self._sync_role(engine)
        return None

    # -- the hand-over -------------------------------------------------------------------------

    def _sync_role(self, engine) -> None:
        """Claim gradient reduction when the next step wants local gradients; release it otherwise."""
        opt = self.optimizer
        if opt is None or self.partitioned:  # the partitioner reduces (exactly or compressed, as opt says)
            return
        compress = not opt.full_precision_gradients_next() and opt.world_size > 1
        if compress == self.compressing:
            return
        if compress:
            engine.claim(Role.GRADIENT_REDUCTION, "comm")
        else:
            engine.release(Role.GRADIENT_REDUCTION, "comm")
        self.compressing = compress
        if comm.get_rank() == 0 and self.log is not None:
            self.log.info("comm: gradients of the next step " + ("stay local (compressed communication)"
                          if compress else "are averaged at full precision"),
                          optimizer=type(opt).__name__, step=opt.global_step())

    @hookimpl(tryfirst=True)
    def microspeed_reduce_gradients(self, engine) -> bool | None:
        """Nothing to reduce while the optimizer communicates compressed (it does so in its step)."""
        return True if self.optimizer is not None and engine.owner(Role.GRADIENT_REDUCTION) == "comm" else None

    @hookimpl
    def microspeed_after_step(self, engine) -> None:
        """Decide who reduces the next step's gradients."""
        self._sync_role(engine)

    @hookimpl
    def microspeed_features(self) -> list[Feature]:
        """1-bit Adam, 0/1 Adam and 1-bit LAMB, for the composition matrix."""
        return list(FEATURES)

    @hookimpl
    def microspeed_refusals(self) -> list[Refusal]:
        """The pairs this plugin refuses at ``initialize()`` (:mod:`microspeed_comm.compositions`)."""
        return list(REFUSALS)

    # -- checkpoints ---------------------------------------------------------------------------

    @hookimpl
    def microspeed_before_checkpoint_save(self) -> None:
        """0/1 Adam: synchronise pending local steps, so every rank saves the same parameters."""
        if self.optimizer is not None:
            self.optimizer.synchronize()

    @hookimpl
    def microspeed_checkpoint_state(self) -> dict[str, Any] | None:
        """This rank's error-feedback buffers, under a rank-unique key."""
        if self.optimizer is None:
            return None
        rank = comm.get_rank()
        return {"comm": {"world": comm.get_world_size(), f"rank{rank}": self.optimizer.error_state()}}

    @hookimpl
    def microspeed_load_checkpoint_state(self, engine, states: dict[str, Any]) -> None:
        """Restore this rank's errors when the topology matches (else zero); re-decide the hand-over."""
        if self.optimizer is None:
            return
        saved = states.get("comm") or {}
        mine = saved.get(f"rank{comm.get_rank()}")
        if mine is not None and saved.get("world") == comm.get_world_size():
            self.optimizer.load_error_state(mine)
        else:
            self.optimizer.reset_errors()
        self._sync_role(engine)
