"""What 1-bit Adam, 0/1 Adam and 1-bit LAMB share: the group, the compressors, the phase, the checks.

Each optimizer is an ordinary ``torch.optim.Optimizer`` that communicates inside ``step()`` (the
compressed all-reduce of its momentum, or of its gradients on some 0/1 Adam steps), so it also
works outside microspeed on any initialised ``torch.distributed`` group. What it needs from the
training loop is one fact per step, :meth:`OneBitOptimizer.full_precision_gradients_next`: whether
the gradients of the next step must arrive averaged at full precision (the warm-up; 0/1 Adam's
variance-update steps) or stay local (the optimizer compresses them itself). The ``comm`` plugin
reads it after every step and takes gradient reduction over from the built-in data-parallel
reducer, or hands it back (``engine.claim`` / ``engine.release``).

Where DeepSpeed's versions differ and ours follow on purpose (kept in the README):

* DeepSpeed's first ``step()`` is a dry run that sets up its cupy buffers and updates nothing; ours
  has none: step 1 is a real Adam step (the step counter is otherwise the same).
* Parameters whose gradient is ``None`` on a rank take part in the compressed all-reduce with a
  zero gradient (every rank must send the same layout); in full-precision steps they are skipped,
  as torch's Adam skips them.
* Every parameter's ``step`` advances together (the phase is global, read from the first one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from microspeed.plugin_api import comm, replica_group
from microspeed_comm.compressed import CompressedAllReduce

COMM_BACKEND_NAMES = ("nccl", "mpi", "hccl", "compressed", "gloo", "ccl")
"""``comm_backend_name`` values accepted for compatibility with DeepSpeed configs: they chose between
DeepSpeed's NCCL, MPI (cupy + mpi4py), HCCL and "compressed" backends. Ours always communicates through
``torch.distributed`` on the optimizer's group, whatever its backend (gloo, NCCL, ...)."""


def check_betas(betas: Any) -> tuple[float, float]:
    """``betas`` as a pair of floats in [0, 1), else ``ValueError`` naming it."""
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(f"betas: expected two numbers like [0.9, 0.999], got {betas!r}") from None
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas: each must be in [0, 1), got {betas!r}")
    return b1, b2


def check_number(name: str, value: Any, low: float | None = None, high: float | None = None,
                 integer: bool = False, low_open: bool = False) -> Any:
    """``value`` if it is a number (an ``int`` when ``integer``) within the bounds, else ``ValueError``."""
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name}: expected {kind}, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name}: must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name}: must be <= {high}, got {value!r}")
    return value


class OneBitOptimizer(torch.optim.Optimizer):
    """Base of the 1-bit optimizers: process group, lazily built compressors, error state, phase.

    ``group`` is the data-parallel process group the momentum is averaged over (default: the
    world); the ``comm`` plugin sets the engine's with :meth:`set_process_group`. ``block_size``
    is the number of values per scale in the compressed all-reduce.
    """

    def __init__(self, params: Any, defaults: dict[str, Any], *, amsgrad: bool, max_grad_norm: float,
                 cuda_aware: bool, comm_backend_name: str, group: Any, block_size: int) -> None:
        name = type(self).__name__
        if amsgrad:
            raise ValueError(f"amsgrad: {name} does not support the AMSGrad variant (nor does DeepSpeed's); "
                             f"set it to false")
        if max_grad_norm:
            raise ValueError(f"max_grad_norm: not supported by {name}; clip with the top-level "
                             f"'gradient_clipping' key instead")
        if not isinstance(comm_backend_name, str) or comm_backend_name not in COMM_BACKEND_NAMES:
            raise ValueError(f"comm_backend_name: expected one of {', '.join(COMM_BACKEND_NAMES)} (accepted for "
                             f"DeepSpeed compatibility; torch.distributed is used either way), got "
                             f"{comm_backend_name!r}")
        check_number("lr", defaults["lr"], 0.0)
        check_number("eps", defaults["eps"], 0.0, low_open=True)
        check_number("weight_decay", defaults["weight_decay"], 0.0)
        defaults["betas"] = check_betas(defaults["betas"])
        super().__init__(params, defaults)
        self.comm_backend_name, self.cuda_aware = comm_backend_name, bool(cuda_aware)
        self.group, self.block_size = group, block_size
        self._compressors: dict[str, CompressedAllReduce] = {}
        self._pending_errors: dict[str, dict[str, Any]] = {}
        self._frozen_denoms: dict[torch.Tensor, torch.Tensor] = {}
        self.partitioned = False
        self._partition_errors: dict[str, torch.Tensor] = {}
        self._holders_mask: tuple[tuple, torch.Tensor | None] | None = None

    # -- group and phase ---------------------------------------------------------------------

    def set_process_group(self, group: Any) -> None:
        """Average over ``group`` from now on (the compressors and their errors start afresh)."""
        self.group = group
        self._compressors.clear()

    @property
    def world_size(self) -> int:
        """Ranks in the optimizer's group (1 without ``torch.distributed``)."""
        return comm.get_world_size(self.group)

    def set_partitioned(self) -> None:
        """Step a partition whose gradients arrive averaged over the group (ZeRO), communicating nothing.

        The gradient reducer that owns the exchange (ZeRO's reduce-scatter: exact, or compressed with
        error feedback when :meth:`full_precision_gradients_next` is false) delivers this rank's slice of
        the average; the momentum partition folds it in as the unpartitioned optimizer folds its averaged
        momentum. Only parameters holding a gradient are stepped (ZeRO may step its partitions segment by
        segment, calling :meth:`step` several times per training step), and the phase is read from them.
        """
        self.partitioned = True
        self.reset_errors()

    def stepped(self, group: dict[str, Any]) -> list[torch.Tensor]:
        """The parameters of ``group`` this ``step()`` updates: all, or those with a gradient when partitioned."""
        if self.partitioned:
            return [p for p in group["params"] if p.grad is not None]
        return list(group["params"])

    def global_step(self) -> int:
        """Steps taken so far (the first parameter's ``step``; all advance together).

        Partitioned, the first parameter holding a gradient is asked (inside a segment-by-segment step the
        parameters of segments already stepped are one ahead).
        """
        first = None
        for group in self.param_groups:
            for p in group["params"]:
                if not self.partitioned or p.grad is not None:
                    return int(self.state[p].get("step", 0)) if p in self.state else 0
                first = p if first is None else first
        return int(self.state[first].get("step", 0)) if first is not None and first in self.state else 0

    def full_precision_gradients_next(self) -> bool:
        """Whether the next ``step()`` expects gradients already averaged at full precision."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Bring the replicas' parameters together now, where the algorithm lets them drift (0/1 Adam)."""

    # -- streamed state (microspeed.plugin_api.ElementwiseState: ZeRO's NVMe offload) -------

    def elementwise_state(self) -> dict[str, float]:
        """The state tensors shaped like each parameter, with their initial values: momentum and variance."""
        return {"exp_avg": 0.0, "exp_avg_sq": 0.0}

    def forget(self, params: list[torch.Tensor]) -> None:
        """Drop what is cached for ``params`` outside ``state`` (their frozen denominators)."""
        for p in params:
            self._frozen_denoms.pop(p, None)

    # -- compression -------------------------------------------------------------------------

    def compressor(self, key: str, tensors: list[torch.Tensor], group: Any = None) -> CompressedAllReduce:
        """The compressed all-reduce for ``tensors`` under ``key`` over ``group`` (default: the optimizer's; built on
        first use; restored errors)."""
        sizes = tuple(t.numel() for t in tensors)
        c = self._compressors.get(key)
        if c is None or c.sizes != sizes:
            c = CompressedAllReduce(sizes, self.group if group is None else group, self.block_size, tensors[0].device)
            pending = self._pending_errors.pop(key, None)
            if pending is not None:
                c.load_state(pending)
            self._compressors[key] = c
        return c

    def _by_replica_group(self, tensors: list[torch.Tensor], params: list[torch.Tensor] | None
                          ) -> list[tuple[str, Any, int, list[torch.Tensor]]]:
        """``tensors`` split by their parameter's replica group: ``[(key suffix, group, size, tensors)]``.

        Parameters held by only some data-parallel ranks (MoE experts, :class:`~microspeed.plugin_api.ReplicaGroup`)
        are averaged over their own group; the rest over the optimizer's (first, suffix ``""``).
        """
        out: dict[Any, tuple[str, Any, int, list[torch.Tensor]]] = {None: ("", self.group, self.world_size, [])}
        for i, t in enumerate(tensors):
            rg = replica_group(params[i]) if params is not None else None
            k = None if rg is None else rg.ranks
            if k not in out:
                out[k] = (f"@{','.join(map(str, k))}", rg.group, rg.size, [])
            out[k][3].append(t)
        return [v for v in out.values() if v[3]]

    def compressed_average_(self, key: str, tensors: list[torch.Tensor],
                            params: list[torch.Tensor] | None = None) -> None:
        """Replace ``tensors`` by their compressed average over the group (identity on one rank, or partitioned:
        the gradients were averaged by the reducer, so what is folded from them is already the average).

        ``params[i]`` is the parameter of ``tensors[i]``: those of a replica group are averaged over it.
        """
        if not tensors or self.partitioned or self.world_size == 1:
            return
        for suffix, group, size, ts in self._by_replica_group(tensors, params):
            if size > 1:
                self.compressor(key + suffix, ts, group).average_(ts)

    def average_(self, tensors: list[torch.Tensor], params: list[torch.Tensor] | None = None) -> None:
        """Replace ``tensors`` by their full-precision average over the group (one flat all-reduce per group; none
        when partitioned); ``params`` as for :meth:`compressed_average_`."""
        if not tensors or self.partitioned or self.world_size == 1:
            return
        for _, group, size, ts in self._by_replica_group(tensors, params):
            if size == 1:
                continue
            flat = torch.cat([t.reshape(-1).float() for t in ts])
            comm.all_reduce(flat, group=group)
            flat.mul_(1.0 / size)
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def _scale_local_replica_gradients(self) -> None:
        """Before a step on local gradients: a replica group's parameter's gradient times ``its size / world``.

        An expert's gradient is the sum over its replica group divided by the data-parallel size (as the MoE
        plugin reduces it at full precision); averaging ``g * size / world`` over the group gives exactly that,
        and it stays linear through the momentum and the local steps.
        """
        world = self.world_size
        for group in self.param_groups:
            for p in group["params"]:
                rg = replica_group(p)
                if rg is not None and p.grad is not None and rg.size != world:
                    p.grad.mul_(rg.size / world)

    def reduce_partials(self, partial: torch.Tensor, summed: int) -> torch.Tensor:
        """Partitioned: per-parameter partial reductions (``[count, columns]``, row ``i`` this rank's part of the
        ``i``-th of the partitioner's parameters, ``partition_pieces``) combined over the ranks holding each parameter:
        the first ``summed`` columns summed, the others maximised.

        A parameter is held by the whole group, or (MoE experts: a slice carrying ``replica_group``) by its replica
        group only; the other ranks' rows of that index are other experts', left out. One all-gather over the group.
        """
        if self.world_size == 1:
            return partial
        gathered = [torch.empty_like(partial) for _ in range(self.world_size)]
        comm.all_gather(gathered, partial, group=self.group)
        stacked = torch.stack(gathered)
        holders = self._holders(partial.shape[0], partial.device)
        if holders is None:
            return torch.cat([stacked[..., :summed].sum(0), stacked[..., summed:].amax(0)], dim=1)
        held = holders.unsqueeze(-1)
        return torch.cat([(stacked[..., :summed] * held).sum(0),
                          stacked[..., summed:].masked_fill(~held, float("-inf")).amax(0)], dim=1)

    def _holders(self, count: int, device: Any) -> torch.Tensor | None:
        """``[world, count]`` bools: which ranks of the group hold (a copy of) each parameter this rank has pieces
        of; ``None`` when the slices carry no replica group (every parameter is the whole group's). Built once per set
        of slices (a streamer may step pieces of them, carrying their attributes)."""
        views = [view for group in self.param_groups for view in group["params"]]
        key = (count, tuple(id(v) for v in views))
        if self._holders_mask is not None and self._holders_mask[0] == key:
            return self._holders_mask[1]
        mask = None
        ranks = list(range(self.world_size)) if self.group is None else \
            list(torch.distributed.get_process_group_ranks(self.group))
        for view in views:
            rg = replica_group(view)
            if rg is None:
                continue
            if mask is None:
                mask = torch.ones(self.world_size, count, dtype=torch.bool, device=device)
            held = torch.tensor([r in rg.ranks for r in ranks], dtype=torch.bool, device=device)
            for index, _, _ in getattr(view, "partition_pieces", (0, ()))[1]:
                mask[:, index] = held
        self._holders_mask = (key, mask)
        return mask

    def partition_error(self, key: Any, numel: int, device: Any = None) -> torch.Tensor:
        """Partitioned: the sender-error buffer of the partitioner's compressed exchange ``key`` (kept here, so
        that it is checkpointed per rank with the other errors; zeros at first, or when ``numel`` changes)."""
        name = str(key)
        e = self._partition_errors.get(name)
        if e is None or e.numel() != numel:
            e = self._partition_errors[name] = torch.zeros(numel, dtype=torch.float32, device=device)
        return e

    def error_state(self) -> dict[str, Any]:
        """Every compressor's error buffers with their layout (per rank: they differ across ranks)."""
        out = {k: c.state() for k, c in self._compressors.items()}
        out.update({k: v for k, v in self._pending_errors.items() if k not in out})
        if self._partition_errors:
            out["partition"] = {"world": self.world_size, "rank": comm.get_rank(self.group),
                                "errors": dict(self._partition_errors)}
        return out

    def load_error_state(self, states: dict[str, Any]) -> None:
        """Restore error buffers saved by :meth:`error_state` when their layout and rank match (else zero)."""
        states = dict(states)
        part = states.pop("partition", None)
        self._partition_errors = {}
        if part and part.get("world") == self.world_size and part.get("rank") == comm.get_rank(self.group):
            self._partition_errors = {k: v.clone() for k, v in part["errors"].items()}
        self._pending_errors = dict(states)
        for key, c in self._compressors.items():
            if key in self._pending_errors:
                c.load_state(self._pending_errors.pop(key))
        expected = {"sizes", "world", "rank", "block"}
        for key, st in list(self._pending_errors.items()):
            other = "@" not in key and (st["world"] != self.world_size or st["rank"] != comm.get_rank(self.group))
            if not expected <= set(st) or other:  # (a replica group's compressor checks its own on restore)
                del self._pending_errors[key]  # another topology: start from zero errors

    def reset_errors(self) -> None:
        """Forget all error-feedback state."""
        self._compressors.clear()
        self._pending_errors.clear()
        self._partition_errors.clear()

    # -- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step (``closure`` re-evaluates the loss, as torch's optimizers allow)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_dtypes()
        if not self.partitioned and self.world_size > 1 and not self.full_precision_gradients_next():
            self._scale_local_replica_gradients()
        self._step()
        return loss

    def _step(self) -> None:
        raise NotImplementedError

    # -- helpers for the subclasses ----------------------------------------------------------

    def _adam_update(self, group: dict[str, Any], ps: list, ms: list, vs: list, frozen: bool = False) -> None:
        """``p -= lr * (m / denominator + weight_decay * p)`` for the params ``ps``, in fused passes.

        ``frozen``: the variances no longer change, so their denominators are computed once and kept.
        """
        denom = self.frozen_denominators(group, ps, vs) if frozen else \
            self._denominators(vs, group["eps"], group["eps_inside_sqrt"])
        if group["weight_decay"] > 0:  # p - lr*wd*p - lr*m/denom, as DeepSpeed's update += wd * p
            torch._foreach_mul_(ps, 1.0 - group["lr"] * group["weight_decay"])
        torch._foreach_addcdiv_(ps, ms, denom, value=-group["lr"])

    def frozen_denominators(self, group: dict[str, Any], ps: list, vs: list) -> list[torch.Tensor]:
        """``sqrt(v) + eps`` of frozen variances, computed on first use and kept (one buffer per parameter)."""
        cache = self._frozen_denoms
        missing = [(p, v) for p, v in zip(ps, vs, strict=True) if p not in cache]
        if missing:
            fresh = self._denominators([v for _, v in missing], group["eps"], group["eps_inside_sqrt"])
            cache.update({p: d for (p, _), d in zip(missing, fresh, strict=True)})
        return [cache[p] for p in ps]

    def _check_dtypes(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise TypeError(f"{type(self).__name__} steps fp32 parameters, got a {p.dtype} one: for a "
                                    f"low-precision model enable the config's fp16 or bf16 section (the optimizer "
                                    f"then steps fp32 master copies)")

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        state.setdefault("step", 0)  # (also when a streamer hands the state tensors in)
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    @staticmethod
    def _denominators(exp_avg_sqs: list[torch.Tensor], eps: float, eps_inside_sqrt: bool) -> list[torch.Tensor]:
        """``sqrt(v) + eps`` (or ``sqrt(v + eps)`` with ``eps_inside_sqrt``) for each ``v``."""
        if eps_inside_sqrt:
            return torch._foreach_sqrt(torch._foreach_add(exp_avg_sqs, eps))
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, eps)
        return denom

    @staticmethod
    def _apply_masks(group: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """DeepSpeed's ``exp_avg_mask`` group key: zero momentum entries that must stay exactly zero."""
        mask = group.get("exp_avg_mask")
        if mask is None:
            return
        for t in tensors:
            if mask.device != t.device:
                mask = group["exp_avg_mask"] = mask.to(t.device)
            t.mul_(mask)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, keeping the current groups' ``exp_avg_mask`` (as DeepSpeed does); errors reset.

        The error-feedback buffers are not part of the optimizer's state dict: they differ per rank;
        the ``comm`` plugin saves them per rank in the checkpoint and restores them after this.
        """
        masks = [g.get("exp_avg_mask") for g in self.param_groups]
        super().load_state_dict(state_dict)
        self._frozen_denoms = {}
        for g, mask in zip(self.param_groups, masks, strict=True):
            if mask is not None:
                g["exp_avg_mask"] = mask
            else:
                g.pop("exp_avg_mask", None)
        self.reset_errors()
