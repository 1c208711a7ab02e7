"""The ZeRO optimizer: the user's optimizer, stepping only this rank's slice of every segment.

:class:`ZeroOptimizer` is what ``initialize()`` returns as the optimizer. Its ``param_groups``
are the user's groups (the LR scheduler and ``engine.get_lr()`` read and write them as usual);
underneath, an *inner* optimizer of the same class and hyper-parameters steps 1-D fp32 views
("runs") of this rank's master partition, one run per stretch of a segment slice whose
parameters share a param group. The optimizer state is therefore partitioned by construction:
1/N of the elements on each rank.

Masters: with fp16/bf16 the fp32 master partition is a separate tensor; with fp32 (and no
offload) the master *is* the rank's slice of the parameters themselves, so nothing is copied.
With ``offload_optimizer`` the masters, their gradients and the optimizer state live in CPU
memory (or stream from NVMe, :mod:`microspeed_zero.swap`).

Each run view carries ``partition_pieces = (count, ((index, lo, hi), ...))``: the parameters whose
pieces it holds (``index`` numbers the ``count`` partitioned parameters the same way on every rank of the
group; ``view[lo:hi]`` is that parameter's piece). An optimizer whose update needs whole-parameter
quantities (1-bit LAMB's trust ratios, attached through ``GradientCompression``) sums its partial
reductions per ``index`` over the data-parallel group.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any

import torch

from microspeed.plugin_api import ZERO_ELEMENTWISE, ConfigError

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta,
)
"""Optimizers whose update of an element depends only on that element (and a step count): they give
the same result on any partition of a flat tensor, so ZeRO can run them on slices."""


class UntestedOptimizerError(ConfigError, AssertionError):
    """ZeRO was given an optimizer not known to be element-wise while ``zero_allow_untested_optimizer`` is false.

    Also an :class:`AssertionError`, the type DeepSpeed raises there (its ``initialize()`` asserts it)."""


def check_partitionable(optimizer: Any, allow_untested: bool) -> None:
    """Refuse an optimizer whose update mixes elements (LAMB's trust ratio, Adafactor's factoring)."""
    if isinstance(optimizer, (*ELEMENTWISE_OPTIMIZERS, *ZERO_ELEMENTWISE)) or allow_untested:
        return
    raise UntestedOptimizerError(
        f"zero_optimization.stage >= 1 with the optimizer {type(optimizer).__name__}: ZeRO runs the optimizer on "
        f"slices of flattened parameters, which is exact only for element-wise optimizers "
        f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}). Use one of those, stage 0, or set "
        f"\"zero_allow_untested_optimizer\": true if {type(optimizer).__name__} is element-wise.")


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


class ZeroOptimizer(torch.optim.Optimizer):
    """The user's optimizer over this rank's partitions (see the module docstring).

    ``step()`` is driven by the engine (``engine.step()``); calling it directly does the same
    (overflow check, unscale, clip, step, gather) through :class:`microspeed_zero.runtime.ZeroRuntime`.
    """

    def __init__(self, base: torch.optim.Optimizer, runtime: Any) -> None:
        self.base_class = type(base)
        # settings kept as attributes rather than hyperparameters (FusedAdam's adam_w_mode): the inner optimizer
        # gets them too, else it would step with its constructor's defaults
        self.base_settings = {name: value for name, value in vars(base).items()
                              if not name.startswith("_") and isinstance(value, (bool, int, float, str))}
        self.runtime = runtime
        self.defaults = dict(base.defaults)
        self.param_groups = base.param_groups  # the user's groups: schedulers adjust these
        self.state = {}  # the real state is the inner optimizer's (partitioned)
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        self._zero_grad_profile_name = "Optimizer.zero_grad#ZeroOptimizer.zero_grad"
        self.inner: torch.optim.Optimizer | None = None
        self.runs: list[tuple[Any, int, int, int, torch.Tensor]] = []  # (segment, group, start, end, view)
        self.applied_steps = 0

    def destroy(self) -> None:
        """DeepSpeed's ``optimizer.destroy()``, which the engine's ``destroy()`` calls first: drop the partitioned
        inner optimizer (its states, the masters' views) and the runtime, so that an optimizer the caller still
        holds (``engine, optimizer, *_ = initialize(...)``) pins none of the engine's memory. It steps no more."""
        self.inner = None
        self.runs = []
        self.runtime = None

    def build_inner(self, masters: dict[int, torch.Tensor]) -> None:
        """Make the inner optimizer over 1-D views of ``masters`` (segment index -> fp32 slice)."""
        per_group: list[list[torch.Tensor]] = [[] for _ in self.param_groups]
        self.runs = []
        first = {}  # segment index -> global index of its first parameter (the same on every rank)
        for seg in self.runtime.segments:
            first[seg.index] = sum(len(s.params) for s in self.runtime.segments if s.index < seg.index)
        count = sum(len(s.params) for s in self.runtime.segments)
        for seg in self.runtime.segments:
            master = masters.get(seg.index)
            if master is None:
                continue
            for g, start, end in seg.runs(seg.rank):
                view = master[start:end]
                view.partition_pieces = (count, tuple(
                    (first[seg.index] + i, s - start, s - start + seg.param_range(i, seg.rank)[1] - a)
                    for i, a, s in seg.pieces(seg.rank) if start <= s < end))
                per_group[g].append(view)
                self.runs.append((seg, g, start, end, view))
        groups = []
        for g, group in enumerate(self.param_groups):
            params = per_group[g] or [torch.zeros(0, device=self.runtime.master_device)]
            if not per_group[g]:
                params[0].partition_pieces = (count, ())
            groups.append({**_hyper(group), "params": params})
        accepted = inspect.signature(self.base_class.__init__).parameters
        kwargs = {k: v for k, v in self.defaults.items() if k in accepted}
        self.inner = self.base_class(groups, **kwargs)
        for name, value in self.base_settings.items():
            setattr(self.inner, name, value)

    def sync_hyperparameters(self) -> None:
        """Copy the user's group settings (lr, betas, ...) into the inner optimizer's groups."""
        for inner, group in zip(self.inner.param_groups, self.param_groups, strict=True):
            for k, v in group.items():
                if k != "params":
                    inner[k] = v

    def step(self, closure: Any = None) -> Any:
        """Step through the engine's ZeRO runtime (overflow check, clip, step, gather)."""
        loss = closure() if closure is not None else None
        self.runtime.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient partitions (and stage 1's whole-gradient buffers)."""
        self.runtime.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """This rank's partition of the optimizer, as DeepSpeed's ZeRO optimizers return it.

        ``base_optimizer_state`` (the inner optimizer over this rank's slices),
        ``single_partition_of_fp32_groups`` (the fp32 master slices, one per stepped segment),
        the user's ``param_groups`` hyper-parameters, ``zero_stage``, ``partition_count`` and
        ``loss_scaler``. Only :meth:`load_state_dict` of an engine with the same model, stage and
        data-parallel size (and this rank) reads it back; for a checkpoint any world size can
        load, use ``engine.save_checkpoint``.
        """
        rt = self.runtime
        resident = rt.swapper.resident() if rt.swapper is not None else contextlib.nullcontext()
        with resident:
            masters = [rt.masters[seg.index].detach().clone() for seg in rt.optimized]
            base = copy.deepcopy(self.inner.state_dict())
        scaler = rt.scaler
        return {
            "zero_stage": rt.stage,
            "partition_count": rt.world,
            "partition_rank": rt.rank,
            "segment_numels": [seg.numel for seg in rt.optimized],
            "base_optimizer_state": base,
            "single_partition_of_fp32_groups": masters,
            "param_groups": [_hyper(g) for g in self.param_groups],
            "applied_steps": self.applied_steps,
            "loss_scaler": scaler.state_dict() if scaler is not None and hasattr(scaler, "state_dict") else None,
            "clip_grad": rt.max_norm,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on this rank (same model, stage and data-parallel size).

        Masters, optimizer state and hyper-parameters are restored and the parameters take the
        masters' values (gathered again, so every rank's whole parameters match).
        """
        rt = self.runtime
        mine = {"zero_stage": rt.stage, "partition_count": rt.world, "partition_rank": rt.rank,
                "segment_numels": [seg.numel for seg in rt.optimized]}
        for key, value in mine.items():
            if state_dict.get(key) != value:
                raise ValueError(f"ZeroOptimizer.load_state_dict: {key} is {state_dict.get(key)!r} in the state dict "
                                 f"but {value!r} here; an optimizer state dict holds one rank's partition and loads "
                                 f"only into the same layout. Use engine.save_checkpoint/load_checkpoint to change "
                                 f"stage or world size.")
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(saved)
        resident = rt.swapper.resident(writeback=True) if rt.swapper is not None else contextlib.nullcontext()
        with resident, torch.no_grad():
            self.inner.load_state_dict(state_dict["base_optimizer_state"])
            for seg, master in zip(rt.optimized, state_dict["single_partition_of_fp32_groups"], strict=True):
                rt.masters[seg.index].copy_(master)
                rt._write_back(seg)
        rt.wait_gathers()
        if rt.stage3 is not None:
            rt.stage3.wait_all()
        self.applied_steps = state_dict.get("applied_steps", self.applied_steps)
        scaler = rt.scaler
        if scaler is not None and state_dict.get("loss_scaler") is not None and hasattr(scaler, "load_state_dict"):
            scaler.load_state_dict(state_dict["loss_scaler"])
        self.sync_hyperparameters()

    def run_states(self) -> list[dict[str, Any]]:
        """The inner optimizer's state of each run (in :attr:`runs` order)."""
        return [self.inner.state.get(view, {}) for *_, view in self.runs]

    @property
    def loss_scaler(self) -> Any:
        """The fp16 loss scaler (DeepSpeed's ``optimizer.loss_scaler``, with its ``cur_scale``, ``cur_iter`` and
        ``scale_window``); ``None`` without fp16."""
        return self.runtime.scaler if self.runtime is not None else None

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the fp16 loss scale is dynamic (DeepSpeed's ``optimizer.dynamic_loss_scale``)."""
        return bool(getattr(self.loss_scaler, "dynamic", False))

    @property
    def cur_scale(self) -> float:
        """The current loss scale (DeepSpeed's ``optimizer.cur_scale``): 1.0 without fp16."""
        scaler = self.loss_scaler
        return float(scaler.cur_scale) if scaler is not None else 1.0

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.runtime.cfg.stage}, {self.base_class.__name__}, runs={len(self.runs)})"


class ZeroOptimizerStage3(ZeroOptimizer):
    """:class:`ZeroOptimizer` at stage 3 (``deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3``), so
    ``isinstance`` tells stage 3 from stages 1 and 2 as DeepSpeed's classes do."""

    @property
    def forward_hooks(self) -> list[Any]:
        """The handles of the module hooks stage 3 installed to gather parameters (DeepSpeed's attribute of that
        name; empty inside :func:`~microspeed_zero.generation.unwrap_model_for_generation`)."""
        return list(self.runtime.stage3.handles)
