"""0/1 Adam (Lu et al., 2022, arXiv:2202.06009) with DeepSpeed's parameters and meaning.

Two phases, switched by ``var_freeze_step``:

* **Variance phase** (steps ``1..var_freeze_step + 1``). The variance is updated only on steps
  that are multiples of an interval that starts at 1 and doubles after every ``var_update_scaler``
  updates; those steps get gradients averaged at full precision (the engine's reduction). On the
  other steps each rank's gradient is averaged by the 1-bit all-reduce and folded into the momentum.
* **Local-step phase** (after). The variance is frozen; each rank takes Adam steps with its local
  gradient and momentum, and every ``local_step_interval`` steps the ranks synchronise: the
  updates accumulated since the last synchronisation are averaged by the 1-bit all-reduce, the
  parameters are set to the last synchronised ones plus that average, and the momentum is rebuilt
  from it (``m = -avg * (sqrt(v) + eps) / sum(lr)``). The interval starts at 1 and doubles every
  ``local_step_scaler`` steps, up to ``local_step_clipper``. Steps between synchronisations move
  no bytes at all.

Two differences from DeepSpeed, on purpose:

* What is compressed. DeepSpeed (and the paper) compress the accumulated update multiplied by
  ``sqrt(v) + eps`` and divide the average by it again; we compress the accumulated update itself.
  Before compression the two are equal (``v`` is frozen and the same on every rank), but the sign
  compression error is then not divided by the small ``sqrt(v)`` of rarely-updated weights. On
  the 2-rank MLP of ``tests/test_comm_engine.py`` with lr 3e-3 (betas 0.9, 0.9; local steps from
  step 5), DeepSpeed's form diverged (loss 2e7 at step 11) while ours kept training.
* Instead of accumulating the local updates in a separate buffer and subtracting it, we keep the
  parameters of the last synchronisation (the same memory) and set ``p = anchor + avg``, so that
  every replica holds bit-identical parameters after each synchronisation (DeepSpeed's replicas
  drift apart by rounding).
:meth:`ZeroOneAdam.synchronize` runs a synchronisation out of turn; the ``comm`` plugin calls it
before a checkpoint is written, so that the checkpoint holds one consistent model.
"""

from __future__ import annotations

from typing import Any

import torch

from microspeed_comm.compressed import DEFAULT_BLOCK_SIZE
from microspeed_comm.onebit import OneBitOptimizer, check_number

_SCHEDULE = ("var_interval", "var_counter", "local_step_interval", "local_step_counter", "lrs")


class ZeroOneAdam(OneBitOptimizer):
    """0/1 Adam: adaptive variance freezing and 1-bit synchronisation with local steps.

    Args mirror DeepSpeed's ``ZeroOneAdam``: ``deepspeed`` (accepted, unused), ``lr``,
    ``bias_correction`` (no effect, as in DeepSpeed), ``betas``, ``eps``, ``eps_inside_sqrt``,
    ``weight_decay``, ``max_grad_norm`` (must be 0), ``var_freeze_step`` (the last step that may
    update the variance), ``var_update_scaler`` (variance updates per interval before it doubles),
    ``local_step_scaler`` (steps before the local-step interval doubles), ``local_step_clipper``
    (the largest local-step interval), ``amsgrad`` (must be false), ``cuda_aware`` and
    ``comm_backend_name`` (accepted). Keyword-only ``group`` and ``block_size`` as in
    :class:`~microspeed_comm.adam.OneBitAdam`.
    """

    def __init__(self, params: Any, deepspeed: Any = None, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl", *,
                 group: Any = None, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        del deepspeed
        check_number("var_freeze_step", var_freeze_step, 1, integer=True)
        check_number("var_update_scaler", var_update_scaler, 1, integer=True)
        check_number("local_step_scaler", local_step_scaler, 1, integer=True)
        check_number("local_step_clipper", local_step_clipper, 1, integer=True)
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay, "eps_inside_sqrt": bool(eps_inside_sqrt),
                    "var_freeze_step": var_freeze_step, "var_update_scaler": var_update_scaler,
                    "local_step_scaler": local_step_scaler, "local_step_clipper": local_step_clipper}
        super().__init__(params, defaults, amsgrad=amsgrad, max_grad_norm=max_grad_norm, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, group=group, block_size=block_size)
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self._anchor: dict[torch.Tensor, torch.Tensor] = {}

    # -- the schedule (kept in every parameter's state, as DeepSpeed does) --------------------

    def _schedule(self, params: list[list[torch.Tensor]] | None = None) -> dict[str, Any]:
        """The counters (the same in every parameter's state) and ``lrs``, the sum of each group's lr.

        Read from the first of each group's ``params`` (default: all of the group's parameters).
        """
        params = [g["params"] for g in self.param_groups] if params is None else params
        sched: dict[str, Any] = {"var_interval": 1, "var_counter": 0, "local_step_interval": 1,
                                 "local_step_counter": 0}
        lrs = []
        for ps in params:
            st = self.state.get(ps[0], {}) if ps else {}
            if "var_interval" in st:
                sched.update({k: st[k] for k in _SCHEDULE if k != "lrs"})
            lrs.append(float(st.get("lrs", 0.0)))
        sched["lrs"] = lrs
        return sched

    def _store_schedule(self, sched: dict[str, Any], params: list[list[torch.Tensor]] | None = None) -> None:
        params = [g["params"] for g in self.param_groups] if params is None else params
        for ps, lrs in zip(params, sched["lrs"], strict=True):
            for p in ps:
                self.state[p].update({k: sched[k] for k in _SCHEDULE if k != "lrs"}, lrs=lrs)

    def frozen_at(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is in the local-step phase (the variance is frozen)."""
        return step - 1 > self.var_freeze_step

    def full_precision_gradients_next(self) -> bool:
        """True when the next step updates the variance: its gradients must be averaged at full precision."""
        t = self.global_step() + 1
        return not self.frozen_at(t) and t % self._schedule()["var_interval"] == 0

    # -- the step ----------------------------------------------------------------------------

    def _step(self) -> None:
        """One 0/1 Adam step (see the module docstring for the two phases)."""
        stepped = [self.stepped(group) for group in self.param_groups]
        sched = self._schedule(stepped)
        t = self.global_step() + 1
        frozen = self.frozen_at(t)
        groups = []
        for group, ps in zip(self.param_groups, stepped, strict=True):
            for p in ps:
                self._init_state(p)
            groups.append((group, ps, [self._grad_or_zeros(p) for p in ps], [self.state[p]["exp_avg"] for p in ps],
                           [self.state[p]["exp_avg_sq"] for p in ps]))
        if not frozen:
            full = t % sched["var_interval"] == 0
            if not full:  # a 1-bit step: average the local gradients compressed
                self.compressed_average_("grad", [g for *_, grads, _, _ in groups for g in grads],
                                         [p for _, ps, *_ in groups for p in ps])
                for group, _, grads, _, _ in groups:
                    self._apply_masks(group, grads)
            for group, _, grads, ms, vs in groups:
                b1, b2 = group["betas"]
                if full:
                    torch._foreach_mul_(vs, b2)
                    torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
                torch._foreach_lerp_(ms, grads, 1 - b1)
            for group, ps, _, ms, vs in groups:
                self._adam_update(group, ps, ms, vs)
            if full:
                sched["var_counter"] += 1
                if sched["var_counter"] == self.var_update_scaler:
                    sched["var_counter"] = 0
                    sched["var_interval"] *= 2
        elif self.partitioned:  # one synchronisation per step (local_step_clipper 1): the averaged gradient
            for group, ps, grads, ms, vs in groups:
                torch._foreach_lerp_(ms, grads, 1 - group["betas"][0])
                self._adam_update(group, ps, ms, vs, frozen=True)
        else:
            if not self._anchor:  # entering the phase, or after a load: the replicas agree now
                self._anchor = {p: p.detach().clone() for _, ps, *_ in groups for p in ps}
                self._compressors.pop("grad", None)  # the variance phase's errors are of no further use
            for i, (group, ps, grads, ms, vs) in enumerate(groups):
                torch._foreach_lerp_(ms, grads, 1 - group["betas"][0])
                self._adam_update(group, ps, ms, vs, frozen=True)
                sched["lrs"][i] += group["lr"]
            if t % sched["local_step_interval"] == 0:
                self._synchronize(groups, sched)
            sched["local_step_counter"] += 1
            if sched["local_step_counter"] == self.local_step_scaler:
                sched["local_step_counter"] = 0
                sched["local_step_interval"] = min(self.local_step_clipper, sched["local_step_interval"] * 2)
        for _, ps, *_ in groups:
            for p in ps:
                self.state[p]["step"] += 1
        self._store_schedule(sched, stepped)

    def _synchronize(self, groups: list, sched: dict[str, Any]) -> None:
        """Average the updates since the last synchronisation (1-bit) and restart from the anchor."""
        deltas = [torch._foreach_sub(ps, [self._anchor[p] for p in ps]) for _, ps, *_ in groups]  # -sum(lr * u)
        self.compressed_average_("momentum", [d for ds in deltas for d in ds], [p for _, ps, *_ in groups for p in ps])
        for (group, ps, _, ms, vs), delta, lrs in zip(groups, deltas, sched["lrs"], strict=True):
            self._apply_masks(group, delta)
            if lrs > 0:  # m = -avg * (sqrt(v) + eps) / sum(lr): the momentum that made the averaged update
                denom = self.frozen_denominators(group, ps, vs)
                torch._foreach_copy_(ms, torch._foreach_div(torch._foreach_mul(delta, denom), -lrs))
            anchors = [self._anchor[p] for p in ps]
            torch._foreach_add_(anchors, delta)
            torch._foreach_copy_(ps, anchors)
        sched["lrs"] = [0.0] * len(sched["lrs"])

    @torch.no_grad()
    def synchronize(self) -> None:
        """Run a synchronisation now if local steps are pending (the replicas' parameters then agree)."""
        sched = self._schedule()
        if not self._anchor or not any(sched["lrs"]):
            return
        groups = [(g, list(g["params"]), None, [self.state[p]["exp_avg"] for p in g["params"]],
                   [self.state[p]["exp_avg_sq"] for p in g["params"]]) for g in self.param_groups]
        self._synchronize(groups, sched)
        self._store_schedule(sched)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does; the anchor is retaken at the next local step (saved after a synchronisation)."""
        super().load_state_dict(state_dict)
        self._anchor = {}
