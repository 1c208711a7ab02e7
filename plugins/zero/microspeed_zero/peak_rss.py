"""Peak resident set (RSS) of one rank's process under ZeRO: a prediction from the model's shape and the config.

:func:`predict_peak_rss` answers "what will ``VmHWM`` (the process's peak resident memory) of each rank be once
training runs?" — not only the model states :func:`~microspeed_zero.estimator.estimate_memory` counts, but
everything this runtime holds at its peak, term by term (:class:`RssPrediction`), each mirroring a structure of
the code:

* ``baseline``: the interpreter, torch and microspeed imported (measured in the calling process when it is
  given, else :data:`BASELINE`, measured here);
* ``runtime``: what a training step adds whatever the model — library code pages the kernels touch, the
  allocator's own bookkeeping, the process group's buffers (:data:`RUNTIME`, calibrated);
* ``model_states``: the states resident in memory: the parameters (stages 1, 2: whole, p bytes each; stage 3:
  this rank's shards, of which at most ``offload_param.max_in_cpu`` elements with ``offload_param`` on NVMe),
  the gradients (stage 1: whole, in the accumulation dtype; stages 2, 3: this rank's partition; none with the
  optimizer on NVMe, whose files hold them), fp32 masters (mixed precision) and the optimizer's fp32 state
  tensors (in memory unless the optimizer is on NVMe);
* ``buffers``: the reducer's pool, kept for the run: the buffers of the reductions in flight at once (two), each
  as large as the largest wire — stage 1: a receive buffer per reduction, as large as the largest segment padded
  to the ranks (its accumulator is the wire); stages 2, 3: a staging and a receive buffer, as large as the
  largest segment or, for a larger one, a column chunk of at most ``reduce_bucket_size`` and ``2**23`` values
  (as few chunks as fit, of even widths); none on one rank, where the gradients are added to the partition as
  they are. No receive buffers through the shared-memory exchange, which sums into the rank's slice as it receives
  (unless the gradients are in the NVMe files). On several ranks the shared-memory exchange's slots
  (:mod:`microspeed_zero.shm`), ``world x 4 x`` the
  largest round (a reduction's wire, a stage-3 gather's slice), at most 1 MiB. Then the NVMe optimizer swapper's
  slots (``buffer_count x`` the largest sub-group ``x 4 bytes x`` its
  tensors, :meth:`~microspeed_zero.swap.OptimizerSwapper.budget_bytes` — resident as touched, so with no more
  sub-groups than slots the partition's elements once) and the gradient swapper's (its step slots likewise, one
  fp32 sub-group, the norm chunk, and the segment buffers in use at once: one of the largest slice, two with
  gradient accumulation);
* ``gathered``: stage 3's gathered parameters, ``p x (min(stage3_max_live_parameters, stage3_prefetch_bucket_size
  + 2 x the largest module) + the largest module)`` (the last term: autograd's gradient of the module being
  reduced, before it is staged), at most the whole model; with parameters on NVMe, plus the buffers of shards
  read from files (read ahead of their gathers, or kept for reuse: ``p x (stage3_prefetch_bucket_size + the
  largest module) / ranks``);
* ``unstaged``: stage 2's whole gradients of the largest reduction bucket, which autograd holds until the bucket
  is staged — at the end of backward, when the activations are gone;
* ``activations``: the forward's saved tensors and the backward's gradients of them, from the model's shape
  when it is GPT-like (a ``config`` with ``d_model``, ``n_layer``, ``vocab_size``; see :func:`activation_bytes`)
  and the micro-batch and sequence, else the ``activation_bytes`` given (0 when not known: stated);
* ``step``: the optimizer step's temporaries — the new values in the model's dtype, of one sub-group (NVMe:
  torch's fused Adam updates the slot in place) or of the partition (the step runs after backward has freed the
  rest; measured: never the peak in the calibration runs).

The peak is ``baseline + runtime + model_states + buffers + max(gathered + activations, unstaged, step)``: the
optimizer's state is created at the first step, so the second step is the first to hold everything. The figures
assume freed memory is returned to the system (glibc's mmap threshold fixed at 1 MiB:
:func:`~microspeed_zero.host_memory.return_freed_memory`), which the runtime does with the optimizer or
parameters on NVMe and whenever ``zero_optimization.host_memory_budget`` is set; without it, glibc keeps freed
1-32 MiB blocks and the peak creeps up over the first steps (measured: +5 % on a 45M GPT at stage 2).
Calibration figures are in the plugin's README ("Predicted peak RSS").

:func:`predict_for_config` reads the same inputs from a ds_config dict; :func:`check_budget` compares a
prediction with ``zero_optimization.host_memory_budget`` (:func:`parse_bytes`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from microspeed_zero.chunking import MAX_IN_FLIGHT, chunk_cap, column_width, shm_enabled, shm_touched_bytes

__all__ = ["AUTO_FRACTION", "BASELINE", "RUNTIME", "RssPrediction", "activation_bytes", "cgroup_memory_limit",
           "check_budget", "default_budget",
           "default_budget_origin", "measured_peak", "parse_bytes", "predict_for_config", "predict_peak_rss"]

MIB = 1 << 20

BASELINE = 322 * MIB
"""``VmRSS`` of a process that imported torch, microspeed and its plugins and built one torch optimizer (measured
here: 322-323 MiB on every rank of every calibration run); used when no measured baseline is given."""

RUNTIME = 80 * MIB
"""What training adds to the baseline whatever the model: code pages of the kernels a step runs, allocator
bookkeeping, the process group (calibrated: the residual of the runs in the README's table)."""

_FP32 = 4
_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1}
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_NORM_CHUNK = 1 << 20  # grad_swap.NORM_CHUNK
_SWAP_BUFFERS = 4  # grad_swap.BUFFERS


@dataclass(frozen=True)
class RssPrediction:
    """A predicted peak RSS of one rank, in bytes, term by term (see the module docstring for each term)."""

    num_params: int
    world_size: int
    stage: int
    precision: str
    offload_optimizer: str
    offload_param: str
    baseline: int
    runtime: int
    model_states: int
    buffers: int
    gathered: int
    activations: int
    unstaged: int
    step: int
    notes: tuple[str, ...] = field(default=())

    @property
    def transient(self) -> int:
        """The largest of the working sets: ``gathered + activations`` (forward, early backward), ``unstaged`` (the end
        of backward, activations freed) and ``step`` (the optimizer step's temporaries)."""
        return max(self.gathered + self.activations, self.unstaged, self.step)

    @property
    def total(self) -> int:
        """The predicted peak: ``baseline + runtime + model_states + buffers + transient``."""
        return self.baseline + self.runtime + self.model_states + self.buffers + self.transient

    def parts(self) -> dict[str, int]:
        """The terms by name, in the order they add up (``transient`` is the larger of the last two groups)."""
        return {"baseline": self.baseline, "runtime": self.runtime, "model_states": self.model_states,
                "buffers": self.buffers, "gathered": self.gathered, "activations": self.activations,
                "unstaged": self.unstaged, "step": self.step}

    def table(self) -> str:
        """A readable breakdown, one term a line, and the total."""
        from microspeed_zero.estimator import format_bytes

        head = (f"predicted peak RSS per rank: ZeRO-{self.stage}, {self.num_params:,} params, {self.world_size} "
                f"rank(s), {self.precision}, offload optimizer={self.offload_optimizer}, param={self.offload_param}")
        rows = [("baseline (interpreter, torch, microspeed)", self.baseline),
                ("runtime (kernels' code pages, allocator, process group)", self.runtime),
                ("model states in memory", self.model_states),
                ("buffers (reduction pool, shared-memory exchange, NVMe swapper slots)", self.buffers),
                ("gathered parameters (stage 3)", self.gathered),
                ("activations", self.activations),
                ("unstaged gradients (stage 2, end of backward)", self.unstaged),
                ("optimizer step temporaries", self.step)]
        width = max(len(r[0]) for r in rows)
        lines = [head] + [f"  {name.ljust(width)}  {format_bytes(v):>10}" for name, v in rows]
        lines.append(f"  {'peak = baseline + runtime + states + buffers + max(gathered + activations, unstaged, step)'}"
                     f"  {format_bytes(self.total)}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        """Same as :meth:`table`."""
        return self.table()


def activation_bytes(shape: Mapping[str, int], micro_batch: int, seq_len: int, precision: str) -> int:
    """Bytes of a GPT-like model's activations at the backward's peak, one micro-batch of ``seq_len`` tokens.

    ``shape``: ``d_model``, ``n_layer``, ``vocab_size`` and ``n_head``. Each block keeps about 16 ``d_model``-wide
    tensors per token in the model's dtype (layer norms, q/k/v, attention output, the 4x MLP hidden before and
    after GELU, residuals) plus its attention's ``n_head x seq_len`` scores; the head keeps the logits, their
    log-softmax and their gradient in fp32 (3 x ``vocab_size`` x 4 bytes a token).
    """
    tokens = micro_batch * seq_len
    p = _BYTES[precision]
    d, layers, vocab, heads = (int(shape[k]) for k in ("d_model", "n_layer", "vocab_size", "n_head"))
    per_layer = 16 * d * p + heads * seq_len * p
    return tokens * (layers * per_layer + 3 * vocab * _FP32)


def _shape_of(model: Any) -> dict[str, int] | None:
    cfg = getattr(model, "config", None)
    keys = ("d_model", "n_layer", "vocab_size", "n_head")
    if cfg is not None and all(isinstance(getattr(cfg, k, None), int) for k in keys):
        return {k: getattr(cfg, k) for k in keys}
    return None


def _layout(model: Any) -> tuple[list[int], list[int]]:
    """``(per-parameter numels in backward order, per-module own numels)`` of the trainable parameters, each
    parameter once (shared ones: the first owner); ``ds_numel`` for a partitioned parameter (``zero.Init``)."""
    seen: set[int] = set()
    params: list[int] = []
    modules: list[int] = []
    for module in model.modules():
        own = 0
        for p in module.parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            n = int(getattr(p, "ds_numel", None) or p.numel())
            params.append(n)
            own += n
        if own:
            modules.append(own)
    params.reverse()
    return params, modules


def _cut(numels: list[int], cap: int) -> list[int]:
    """Segment sizes of ``numels`` cut in order at ``cap`` elements (a larger parameter alone), as ZeRO 1/2 cut."""
    out: list[int] = []
    size = 0
    for n in numels:
        if size and size + n > cap:
            out.append(size)
            size = 0
        size += n
    if size:
        out.append(size)
    return out


def predict_peak_rss(
    model_or_numel: Any,
    world_size: int,
    stage: int,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    precision: str = "bf16",
    optimizer: str = "adam",
    *,
    micro_batch: int = 1,
    seq_len: int | None = None,
    grad_accum: int = 1,
    sub_group_size: int = 1_000_000_000,
    buffer_count: int = 4,
    reduce_bucket_size: int = 500_000_000,
    max_live_parameters: int = 1_000_000_000,
    prefetch_bucket_size: int = 50_000_000,
    max_in_cpu: int = 1_000_000_000,
    grad_accum_fp32: bool = False,
    largest_layer_params: int | None = None,
    activation_bytes_given: int | None = None,
    model_shape: Mapping[str, int] | None = None,
    baseline: int | None = None,
    local_exchange: bool | None = None,
) -> RssPrediction:
    """Predict one rank's peak RSS (bytes, :class:`RssPrediction`) for ZeRO ``stage`` on ``world_size`` ranks.

    Args:
        model_or_numel: a :class:`torch.nn.Module` (its trainable parameters, its modules' own parameters for
            stage 3's segments and, when GPT-like, its shape for the activations; ``meta`` or ``zero.Init``
            models are fine) or Ψ as an int (then ``largest_layer_params`` and ``model_shape`` help).
        world_size, stage, offload_optimizer, offload_param, precision, optimizer: as
            :func:`~microspeed_zero.estimator.estimate_memory`.
        micro_batch, seq_len: ``train_micro_batch_size_per_gpu`` and the sequence length, for the activations
            (``seq_len`` ``None``: the model's ``config.seq_len`` if it has one).
        grad_accum: ``gradient_accumulation_steps`` (the NVMe gradient swapper holds two slices from 2 on).
        sub_group_size, buffer_count, reduce_bucket_size, max_live_parameters, prefetch_bucket_size, max_in_cpu:
            the ``zero_optimization`` keys of the same names (stage-3 ones without their ``stage3_`` prefix).
        grad_accum_fp32: ``data_types.grad_accum_dtype`` is fp32.
        largest_layer_params: with an int Ψ, the largest module's parameters (stage 3 gathers, stage 2's bucket).
        activation_bytes_given: the activations' bytes, when known better than :func:`activation_bytes` (or the
            model is not GPT-like).
        model_shape: ``d_model``, ``n_layer``, ``vocab_size``, ``n_head`` when the model is given as an int.
        baseline: this process's ``VmRSS`` before building (default :data:`BASELINE`).
        local_exchange: the ranks exchange through shared memory (:mod:`microspeed_zero.shm`: gloo, one host);
            default: unless ``MICROSPEED_ZERO_SHM=0`` is set.
    """
    from microspeed_zero.estimator import estimate_memory

    layout = None if isinstance(model_or_numel, int) else _layout(model_or_numel)
    numel = model_or_numel if layout is None else sum(layout[0])
    estimate_memory(numel, world_size, stage, offload_optimizer, offload_param, precision, optimizer,
                    largest_layer_params)  # checks the arguments as the model-state estimate does
    n, N = numel, world_size
    if local_exchange is None:
        local_exchange = shm_enabled()
    p = _BYTES[precision]
    g = _FP32 if grad_accum_fp32 else p
    share = math.ceil(n / N)
    notes: list[str] = []
    if isinstance(model_or_numel, int):
        largest = largest_layer_params or 0
        params_bw = [n]
        modules = [largest] if largest else [n]
        if not largest and stage >= 2:
            notes.append("largest layer unknown: stage 2/3 buffers assume one segment of the whole model")
        shape = dict(model_shape) if model_shape else None
    else:
        params_bw, modules = layout
        shape = _shape_of(model_or_numel) if model_shape is None else dict(model_shape)
        if seq_len is None and shape is not None:
            seq_len = getattr(model_or_numel.config, "seq_len", None)
    segments = modules if stage == 3 else _cut(params_bw, int(reduce_bucket_size))
    largest_seg = max(segments, default=0)
    nvme_opt = offload_optimizer == "nvme"
    k = _FP32 * _STATES[optimizer]
    master = _FP32 if (precision != "fp32" or offload_optimizer != "none") else 0

    # model states resident in memory
    if stage == 3:
        params = p * (min(share, int(max_in_cpu)) if offload_param == "nvme" else share)
    else:
        params = p * n
    if stage == 0:
        notes.append("stage 0 is not ZeRO (the data-parallel built-in's buckets are not modelled): a rough figure")
    if stage <= 1:
        grads = g * n
    else:
        grads = 0 if nvme_opt else g * share
    states = 0 if nvme_opt else (master + k) * (share if stage else n)
    model_states = params + grads + states

    # buffers
    buffers = 0
    round_bytes = p * math.ceil(largest_seg / N) if stage == 3 else 0  # a gather's slice
    # the shared-memory exchange sums each reduction into the rank's slice as it receives it: no receive buffers
    # (but with the gradients in the NVMe files, summed into the slice once it is read back)
    summed = local_exchange and not (nvme_opt and stage >= 2)
    if stage == 1 and N > 1:  # the accumulator is the wire: a receive buffer per reduction, segments whole
        wire = g * max((math.ceil(s / N) * N for s in segments), default=0)
        buffers += 0 if summed else wire * min(MAX_IN_FLIGHT, len(segments))
        round_bytes = wire
    elif stage >= 2 and N > 1:  # staging + receive per reduction, a larger segment in column chunks
        cap = chunk_cap(reduce_bucket_size)
        wires, reductions = [], 0
        for x in (math.ceil(s / N) * N for s in segments):
            width = column_width(x, N, cap)
            wires.append(N * width if width else x)
            reductions += math.ceil(x / N / width) if width else 1
        buffers += p * max(wires, default=0) * (1 if summed else 2) * min(MAX_IN_FLIGHT, reductions)
        round_bytes = max(round_bytes, p * max(wires, default=0))
    if local_exchange and stage >= 1:  # the shared-memory exchange's slots, as far as its rounds fill them
        buffers += shm_touched_bytes(N, round_bytes)
    if nvme_opt:
        n_sg = max(1, math.ceil(share / int(sub_group_size)))
        widest = min(int(sub_group_size), share)
        # the slots are page-aligned mappings, resident where touched: each slot as large as the widest sub-group
        # it ever holds (with no more sub-groups than slots, each holds one: the partition's elements in all)
        touched = share if n_sg <= int(buffer_count) else int(buffer_count) * widest
        tensors = 1 + _STATES[optimizer]
        buffers += touched * _FP32 * tensors
        if stage >= 2:
            slice_ = math.ceil(largest_seg / N)
            buffers += touched * g + (widest * _FP32 if g != _FP32 else 0)
            buffers += min(slice_, _NORM_CHUNK) * _FP32 if g != _FP32 else 0
            buffers += min(_SWAP_BUFFERS, 2 if grad_accum > 1 else 1) * slice_ * g

    # transient: backward's working set, the step's temporaries
    # stage 3: what is gathered (live, or prefetched) plus the gradient autograd makes of the module being reduced
    live = min(int(max_live_parameters), int(prefetch_bucket_size) + 2 * largest_seg) + largest_seg
    gathered = p * min(n, live) if stage == 3 else 0
    if stage == 3 and offload_param == "nvme":  # shards read from files: a prefetch bucket's ahead, and the largest
        gathered += p * min(share, math.ceil(int(prefetch_bucket_size) / N) + math.ceil(largest_seg / N))
    unstaged = p * largest_seg if stage == 2 else 0  # autograd's whole gradients of the bucket being staged
    if activation_bytes_given is not None:
        activations = int(activation_bytes_given)
    elif shape is not None and seq_len:
        activations = activation_bytes(shape, micro_batch, int(seq_len), precision)
    else:
        activations = 0
        notes.append("activations not estimated (the model is not GPT-like or the sequence length is unknown): "
                     "pass activation_bytes_given (CLI: --activations)")
    if nvme_opt:  # torch's fused Adam updates a slot in place; the new values go to the shards in the model's dtype
        step = p * min(int(sub_group_size), share)
    elif precision != "fp32":
        step = p * (share if stage else n)  # the partition's new values cast to the model's dtype
    else:
        step = 0
    return RssPrediction(
        num_params=n, world_size=N, stage=stage, precision=precision, offload_optimizer=offload_optimizer,
        offload_param=offload_param, baseline=BASELINE if baseline is None else int(baseline), runtime=RUNTIME,
        model_states=model_states, buffers=buffers, gathered=gathered, activations=activations, unstaged=unstaged,
        step=step,
        notes=tuple(notes))


def _get(d: Mapping[str, Any], path: str, default: Any) -> Any:
    cur: Any = d
    for key in path.split("."):
        if not isinstance(cur, Mapping) or key not in cur or cur[key] is None:
            return default
        cur = cur[key]
    return cur


def predict_for_config(model: Any, config: Mapping[str, Any], world_size: int = 1, *,
                       seq_len: int | None = None, activation_bytes_given: int | None = None,
                       baseline: int | None = None) -> RssPrediction:
    """:func:`predict_peak_rss` with the inputs read from a ds_config dict (``zero_optimization``, ``bf16``/``fp16``,
    ``optimizer.type``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
    ``data_types.grad_accum_dtype``); ``model`` a module or Ψ (int)."""
    z = _get(config, "zero_optimization", {})
    precision = "bf16" if _get(config, "bf16.enabled", False) else "fp16" if _get(config, "fp16.enabled", False) \
        else "fp32"
    opt = str(_get(config, "optimizer.type", "adam")).lower()
    optimizer = opt if opt in _STATES else "adam"

    def zget(*names: str, default: Any) -> Any:
        for name in names:
            value = _get(z, name, None)
            if value is not None and value != "auto":
                return value
        return default

    return predict_peak_rss(
        model, world_size, int(zget("stage", default=0)),
        str(zget("offload_optimizer.device", default="none")), str(zget("offload_param.device", default="none")),
        precision, optimizer,
        micro_batch=int(_get(config, "train_micro_batch_size_per_gpu", 1) or 1), seq_len=seq_len,
        grad_accum=int(_get(config, "gradient_accumulation_steps", 1) or 1),
        sub_group_size=int(zget("sub_group_size", default=1e9)),
        buffer_count=int(zget("offload_optimizer.buffer_count", default=4)),
        reduce_bucket_size=int(zget("reduce_bucket_size", default=5e8)),
        max_live_parameters=int(zget("stage3_max_live_parameters", "max_live_parameters", default=1e9)),
        prefetch_bucket_size=int(zget("stage3_prefetch_bucket_size", "prefetch_bucket_size", default=5e7)),
        max_in_cpu=int(zget("offload_param.max_in_cpu", default=1e9)),
        grad_accum_fp32=str(_get(config, "data_types.grad_accum_dtype", "")).lower() in ("fp32", "float32"),
        activation_bytes_given=activation_bytes_given, baseline=baseline)


_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


AUTO_FRACTION = 0.8
"""``host_memory_budget: "auto"`` (the default) with offloading: this share of the machine's RAM, over its ranks."""


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The tightest memory limit of this process's cgroup and its ancestors, in bytes; ``None`` if unlimited.

    cgroup v2 (``0::<path>``: ``memory.max``) and v1 (the ``memory`` controller's line:
    ``memory.limit_in_bytes``, where a value near 2**63 means no limit). A container or a ``systemd-run -p
    MemoryMax=`` scope kills a process at this limit whatever the machine's RAM.
    """
    try:
        with open(proc_cgroup) as fh:
            lines = [line.rstrip("\n").split(":", 2) for line in fh]
    except OSError:
        return None
    limits = []
    for fields in lines:
        if len(fields) != 3:
            continue
        _hid, controllers, path = fields
        if controllers == "":
            base, name = root if os.path.exists(os.path.join(root, "cgroup.controllers")) \
                else os.path.join(root, "unified"), "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [x for x in path.split("/") if x]
        for depth in range(len(parts), -1, -1):
            try:
                with open(os.path.join(base, *parts[:depth], name)) as fh:
                    raw = fh.read().strip()
            except OSError:
                continue
            if raw.isdigit() and int(raw) < 1 << 60:
                limits.append(int(raw))
    return min(limits) if limits else None


def _auto_basis() -> tuple[int, str, int] | None:
    """``(bytes, what they are, local ranks)`` behind the ``"auto"`` budget; ``None`` without ``/proc/meminfo``."""
    try:
        with open("/proc/meminfo") as fh:
            total = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return None
    what = "MemTotal"
    limit = cgroup_memory_limit()
    if limit is not None and limit < total:
        total, what = limit, "the cgroup's memory limit"
    return total, what, max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def default_budget() -> int | None:
    """The ``"auto"`` budget of one rank: :data:`AUTO_FRACTION` of the memory this process may use over
    ``LOCAL_WORLD_SIZE`` (1 if unset): ``MemTotal``, or its cgroup's limit where that is lower
    (:func:`cgroup_memory_limit`); ``None`` where ``/proc/meminfo`` cannot be read (no check)."""
    basis = _auto_basis()
    return None if basis is None else int(AUTO_FRACTION * basis[0] / basis[2])


def default_budget_origin() -> str:
    """How the ``"auto"`` budget was reached, for messages: e.g. ``80 % of the cgroup's memory limit 4.00 GiB over
    1 local rank(s)``."""
    from microspeed_zero.estimator import format_bytes

    basis = _auto_basis()
    if basis is None:
        return "no /proc/meminfo"
    return f"{AUTO_FRACTION:.0%} of {basis[1]} {format_bytes(basis[0])} over {basis[2]} local rank(s)"


def parse_bytes(value: Any, key: str = "zero_optimization.host_memory_budget") -> int:
    """Bytes from an int/float or a string: ``"8GiB"``, ``"500MB"``, ``"1.5G"`` (``KiB``/``MiB``/``GiB``/``TiB`` and
    bare ``K``/``M``/``G``/``T`` binary, ``KB``/``MB``/``GB``/``TB`` decimal); ``ValueError`` naming ``key``."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: {value!r} is not a size")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{key}: {value!r} must be a positive number of bytes")
        return int(value)
    m = _BYTES_RE.match(str(value))
    if not m:
        raise ValueError(f"{key}: {value!r} is not a size; write bytes or e.g. \"8GiB\", \"500MB\", \"1.5G\"")
    unit, binary = m.group(2).lower(), m.group(3).lower() == "i"
    decimal = unit and not binary and str(value).strip().lower().endswith("b")
    scale = (1000 if decimal else 1024) ** " kmgt".index(unit or " ")
    out = int(float(m.group(1)) * scale)
    if out <= 0:
        raise ValueError(f"{key}: {value!r} must be a positive size")
    return out


def check_budget(pred: RssPrediction, budget: int, key: str = "zero_optimization.host_memory_budget") -> str | None:
    """``None`` when ``pred.total`` fits ``budget``; else the refusal: the key, the breakdown and what to lower."""
    from microspeed_zero.estimator import format_bytes

    if pred.total <= budget:
        return None
    fixes = []
    if pred.offload_optimizer == "nvme":
        fixes.append("lower zero_optimization.offload_optimizer.buffer_count or sub_group_size (the swapper's slots "
                     "and the step's temporaries scale with them)")
    else:
        fixes.append("offload the optimizer to NVMe (zero_optimization.offload_optimizer.device 'nvme')")
    if pred.stage == 3:
        fixes.append("lower zero_optimization.stage3_max_live_parameters / stage3_prefetch_bucket_size")
        if pred.offload_param != "nvme":
            fixes.append("offload the parameters to NVMe (offload_param.device 'nvme')")
    else:
        fixes.append("raise zero_optimization.stage (3 partitions the parameters too) or lower reduce_bucket_size")
    fixes.append("use more ranks, a smaller micro-batch, or raise the budget")
    return (f"{key} = {format_bytes(budget)} ({budget:,} bytes), but this rank's predicted peak RSS is "
            f"{format_bytes(pred.total)}:\n{pred.table()}\nTo fit: " + "; ".join(fixes) + ".")


def measured_peak() -> int | None:
    """This process's peak resident set so far (``VmHWM`` of ``/proc/self/status``), or ``None`` where unknown."""
    try:
        with open(f"/proc/{os.getpid()}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
