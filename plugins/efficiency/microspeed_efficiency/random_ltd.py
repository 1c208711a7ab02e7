"""Random layerwise token dropping (random-LTD): chosen middle layers process a random subset of the tokens.

Random-LTD (DeepSpeed's ``data_efficiency.data_routing.random_ltd``, after https://arxiv.org/abs/2211.11586)
speeds up training by letting some layers see only part of each sequence. For every forward of a chosen layer
in training mode:

1. ``K`` token positions of each sample are drawn uniformly without replacement and **sorted**, so a
   decoder's causal order holds among the kept tokens (:func:`sample_token_indices`);
2. the kept tokens are **gathered** into a ``[B, K, H]`` (or ``[K, B, H]``) tensor, which the layer processes
   (with the attention mask cut to the kept tokens, when the layer takes one);
3. the layer's output is **scattered** back into the full hidden states; the other tokens pass the layer
   unchanged.

``K`` follows a schedule (:class:`RandomLTDSchedule`): it grows from ``min_value`` to ``max_value`` over
``require_steps`` optimizer steps and is rounded down to a multiple of ``seq_per_step``. When ``K`` reaches the
sequence length, and always in eval mode, the layer runs on every token. Each layer draws its own tokens
from torch's global generator on the hidden states' device, so activation checkpointing (which restores that
generator before recomputing) redraws the same tokens. Layers spread over pipeline stages draw instead from a
:class:`KeyedTokenSampler` (a generator seeded by seed, step, micro-batch and layer), so every stage draws what
one process would.

The layers are modified with module hooks (:func:`convert_to_random_ltd`), not wrapped in another module, so
parameter names and checkpoints are the same with and without random-LTD (DeepSpeed's wrapper adds a
``random_ltd_layer`` level that ``remove_random_ltd_state_dict`` strips again).

Gather and scatter are autograd functions with two implementations: Triton kernels
(:mod:`microspeed_efficiency.random_ltd_kernels`) and the PyTorch references here (``*_torch``). The kernels
run for CUDA tensors, and for CPU tensors when ``TRITON_INTERPRET=1`` was set before the kernels were imported;
the environment variable ``MICROSPEED_RANDOM_LTD_KERNELS`` (``triton`` / ``torch`` / ``auto``) overrides.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from microspeed.plugin_api import ConfigError

__all__ = [
    "CONFIG_PATH",
    "KERNELS_ENV",
    "KeyedTokenSampler",
    "RandomLTD",
    "RandomLTDConfig",
    "RandomLTDLayer",
    "RandomLTDSchedule",
    "RandomLTDScheduler",
    "convert_to_random_ltd",
    "find_layer_list",
    "gather_attention_mask",
    "gather_tokens",
    "gather_tokens_torch",
    "kernel_backend",
    "sample_token_indices",
    "scatter_tokens",
    "scatter_tokens_torch",
    "zero_tokens_torch",
]

CONFIG_PATH = "data_efficiency.data_routing.random_ltd"
"""Where the random-LTD keys live in the ds_config."""

KERNELS_ENV = "MICROSPEED_RANDOM_LTD_KERNELS"
"""Environment variable that forces the gather/scatter implementation: ``triton``, ``torch``, or ``auto``."""

MODEL_TYPES = ("decoder", "encoder")
HIDDEN_STATE_ORDERS = ("batch_seq_dim", "seq_batch_dim")
SCHEDULE_TYPES = ("fixed_linear",)


# -- gather / scatter: PyTorch references ----------------------------------------------------------------------


def _check_tokens(name: str, x: torch.Tensor, idx: torch.Tensor, batch_first: bool) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"{name}: expected a 3-D tensor [B, S, H] or [S, B, H], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype != torch.int64:
        raise ValueError(f"idx: expected an int64 tensor [B, K] of token positions, got "
                         f"{(idx.dtype, tuple(idx.shape)) if isinstance(idx, torch.Tensor) else type(idx).__name__}")
    batch = x.shape[0] if batch_first else x.shape[1]
    if idx.shape[0] != batch or idx.device != x.device:
        raise ValueError(f"idx: expected {batch} rows on {x.device} (the batch of {name}, batch_first={batch_first}), "
                         f"got shape {tuple(idx.shape)} on {idx.device}")


def _index(idx: torch.Tensor, h: int, batch_first: bool) -> torch.Tensor:
    """``idx`` ``[B, K]`` expanded to the ``[B, K, H]`` / ``[K, B, H]`` index of ``torch.gather``."""
    return (idx if batch_first else idx.t()).unsqueeze(-1).expand(-1, -1, h)


def gather_tokens_torch(x: torch.Tensor, idx: torch.Tensor, batch_first: bool = True) -> torch.Tensor:
    """Reference gather: ``out[b, k] = x[b, idx[b, k]]``.

    Args:
        x: hidden states ``[B, S, H]`` (``batch_first``) or ``[S, B, H]``.
        idx: ``[B, K]`` int64 token positions, distinct within a row.
        batch_first: the order of ``x`` (and of the result).

    Returns:
        ``[B, K, H]`` or ``[K, B, H]``, a new tensor.
    """
    return torch.gather(x, 1 if batch_first else 0, _index(idx, x.shape[-1], batch_first))


def scatter_tokens_torch(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor,
                         batch_first: bool = True) -> torch.Tensor:
    """Reference scatter: a copy of ``dst`` with ``dst[b, idx[b, k]] = src[b, k]``.

    Args:
        dst: hidden states ``[B, S, H]`` (``batch_first``) or ``[S, B, H]``.
        src: the replacing tokens ``[B, K, H]`` or ``[K, B, H]``.
        idx: ``[B, K]`` int64 token positions, distinct within a row.
        batch_first: the order of ``dst`` and ``src``.
    """
    return dst.scatter(1 if batch_first else 0, _index(idx, dst.shape[-1], batch_first), src.to(dst.dtype))


def zero_tokens_torch(x: torch.Tensor, idx: torch.Tensor, batch_first: bool = True) -> torch.Tensor:
    """Reference: a copy of ``x`` whose tokens ``idx`` (``[B, K]`` int64) are zero."""
    return x.scatter(1 if batch_first else 0, _index(idx, x.shape[-1], batch_first), 0.0)


# -- backend choice ----------------------------------------------------------------------------------------------


def _kernels() -> Any:
    """Import :mod:`microspeed_efficiency.random_ltd_kernels`, explaining a failure to import Triton."""
    try:
        from microspeed_efficiency import random_ltd_kernels
    except ImportError as exc:
        raise ImportError(f"random-LTD's Triton kernels were selected ({KERNELS_ENV}="
                          f"{os.environ.get(KERNELS_ENV, 'auto')!r}) but cannot be imported: {exc}. "
                          f"Install triton, or set {KERNELS_ENV}=torch") from exc
    return random_ltd_kernels


def kernel_backend(t: torch.Tensor) -> str:
    """``'triton'`` or ``'torch'``: which implementation gathers and scatters tensors like ``t``.

    ``MICROSPEED_RANDOM_LTD_KERNELS=triton`` forces the Triton kernels (on CPU tensors they need the Triton
    interpreter, ``TRITON_INTERPRET=1`` set before :mod:`microspeed_efficiency.random_ltd_kernels` is
    imported); ``=torch`` forces the PyTorch references. Otherwise (unset, empty or ``auto``) the kernels run
    for CUDA tensors, and for CPU tensors when the kernels were imported under the interpreter; the references
    run everywhere else (and whenever Triton does not import).
    """
    from microspeed.plugin_api import env_choice

    choice = env_choice(KERNELS_ENV)
    if choice != "auto":
        return choice
    if t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        try:
            kernels = _kernels()
        except ImportError:
            return "torch"
        if t.is_cuda or kernels.INTERPRETED:
            return "triton"
    return "torch"


def _ops(backend: str) -> tuple[Any, Any, Any]:
    """``(gather, scatter, zero)`` of ``backend``."""
    if backend == "triton":
        k = _kernels()
        return k.gather_tokens_triton, k.scatter_tokens_triton, k.zero_tokens_triton
    return gather_tokens_torch, scatter_tokens_torch, zero_tokens_torch


# -- gather / scatter: autograd functions ------------------------------------------------------------------------


class _GatherTokens(torch.autograd.Function):
    """``x[b, idx[b, k]]``; backward scatters the gradient into zeros."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, idx: torch.Tensor, batch_first: bool, backend: str) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.batch_first, ctx.backend, ctx.shape = batch_first, backend, x.shape
        return _ops(backend)[0](x, idx, batch_first)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (idx,) = ctx.saved_tensors
        _, scatter, _ = _ops(ctx.backend)
        return scatter(grad.new_zeros(ctx.shape), grad, idx, ctx.batch_first), None, None, None


class _ScatterTokens(torch.autograd.Function):
    """A copy of ``dst`` with ``dst[b, idx[b, k]] = src[b, k]``; backward zeroes / gathers the gradient."""

    @staticmethod
    def forward(ctx: Any, dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, batch_first: bool,
                backend: str) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.batch_first, ctx.backend, ctx.src_dtype = batch_first, backend, src.dtype
        return _ops(backend)[1](dst, src, idx, batch_first)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (idx,) = ctx.saved_tensors
        gather, _, zero = _ops(ctx.backend)
        grad_dst = zero(grad, idx, ctx.batch_first) if ctx.needs_input_grad[0] else None
        grad_src = gather(grad, idx, ctx.batch_first).to(ctx.src_dtype) if ctx.needs_input_grad[1] else None
        return grad_dst, grad_src, None, None, None


def gather_tokens(x: torch.Tensor, idx: torch.Tensor, batch_first: bool = True) -> torch.Tensor:
    """The tokens ``idx`` of ``x``, differentiably: ``out[b, k] = x[b, idx[b, k]]``.

    Args:
        x: hidden states ``[B, S, H]`` (``batch_first=True``) or ``[S, B, H]``.
        idx: ``[B, K]`` int64 positions in ``[0, S)``, distinct within a row (as :func:`sample_token_indices`
            draws them).
        batch_first: the order of ``x`` and of the result.

    Returns:
        ``[B, K, H]`` or ``[K, B, H]``. Runs the Triton kernel or the PyTorch reference (:func:`kernel_backend`).
    """
    _check_tokens("x", x, idx, batch_first)
    return _GatherTokens.apply(x, idx, batch_first, kernel_backend(x))


def scatter_tokens(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, batch_first: bool = True) -> torch.Tensor:
    """A copy of ``dst`` whose tokens ``idx`` are ``src``, differentiably in both.

    Args:
        dst: hidden states ``[B, S, H]`` (``batch_first=True``) or ``[S, B, H]``.
        src: ``[B, K, H]`` or ``[K, B, H]``: what replaces the tokens ``idx``.
        idx: ``[B, K]`` int64 positions in ``[0, S)``, distinct within a row.
        batch_first: the order of ``dst`` and ``src``.
    """
    _check_tokens("dst", dst, idx, batch_first)
    want = (idx.shape[0], idx.shape[1], dst.shape[-1]) if batch_first else (idx.shape[1], idx.shape[0], dst.shape[-1])
    if tuple(src.shape) != want:
        raise ValueError(f"src: expected shape {want} (the tokens idx of dst), got {tuple(src.shape)}")
    return _ScatterTokens.apply(dst, src, idx, batch_first, kernel_backend(dst))


def sample_token_indices(reserved: int, seq_len: int, batch_size: int,
                         device: torch.device | str | None = None,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """``reserved`` distinct positions of ``range(seq_len)`` per sample, uniformly drawn and sorted.

    Draws from ``generator`` (on ``device``), by default torch's global generator of ``device``. Returns
    ``[batch_size, reserved]`` int64.
    """
    if not 0 < reserved <= seq_len:
        raise ValueError(f"reserved: expected 0 < reserved <= seq_len={seq_len}, got {reserved}")
    scores = torch.rand(batch_size, seq_len, device=device, generator=generator)
    return scores.topk(reserved, dim=1, sorted=False).indices.sort(dim=1).values


def gather_attention_mask(mask: torch.Tensor, idx: torch.Tensor, model_type: str) -> torch.Tensor:
    """Cut an attention mask to the kept tokens ``idx`` (``[B, K]``, sorted).

    * a ``[B or 1, S]`` padding mask: the kept columns (either model type);
    * a ``[B or 1, *, S, S]`` mask of a ``decoder``: its top-left ``K x K`` corner — a causal mask is the
      same for any sorted subset, as DeepSpeed does;
    * a ``[B or 1, *, S, S]`` mask of an ``encoder``: the kept rows and columns of each sample.
    """
    batch, k = idx.shape
    if mask.dim() == 2:
        return torch.gather(mask.expand(batch, -1), 1, idx)
    if mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        raise ValueError(f"attention mask: expected [B, S] or [B, heads, S, S], got {tuple(mask.shape)}")
    if model_type == "decoder":
        return mask[..., :k, :k]
    m = mask.expand(batch, -1, -1, -1)
    heads, s = m.shape[1], m.shape[-1]
    rows = torch.gather(m, 2, idx[:, None, :, None].expand(batch, heads, k, s))
    return torch.gather(rows, 3, idx[:, None, None, :].expand(batch, heads, k, k))


# -- schedule ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RandomLTDSchedule:
    """How many tokens the dropping layers keep at each optimizer step (``fixed_linear``).

    ``K(t) = floor(min_value + (max_value - min_value) * t / require_steps)``, rounded down to a multiple of
    ``seq_per_step``, for ``t < require_steps``; ``K(t) = max_value`` from ``require_steps`` on. (DeepSpeed
    rounds the last value too, so a ``max_value`` that is not a multiple of ``seq_per_step`` is reached there
    later or never; here the schedule always ends at ``max_value``.)

    Attributes:
        min_value: tokens kept at step 0 (at least ``seq_per_step``).
        max_value: tokens kept from ``require_steps`` on (usually the sequence length: no dropping).
        require_steps: optimizer steps from ``min_value`` to ``max_value``.
        seq_per_step: granularity of ``K``.
        schedule_type: ``"fixed_linear"`` (the only one DeepSpeed implements).
    """

    min_value: int
    max_value: int
    require_steps: int
    seq_per_step: int = 1
    schedule_type: str = "fixed_linear"

    def __post_init__(self) -> None:
        for name in ("min_value", "max_value", "require_steps", "seq_per_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"RandomLTDSchedule.{name}: expected an integer > 0, got {value!r}")
        if self.max_value < self.min_value:
            raise ValueError(f"RandomLTDSchedule: max_value ({self.max_value}) must be >= min_value ({self.min_value})")
        if self.min_value < self.seq_per_step:
            raise ValueError(f"RandomLTDSchedule: min_value ({self.min_value}) must be >= seq_per_step "
                             f"({self.seq_per_step}), or the first steps would keep no token")
        if self.schedule_type not in SCHEDULE_TYPES:
            raise ValueError(f"RandomLTDSchedule.schedule_type: expected one of {SCHEDULE_TYPES}, "
                             f"got {self.schedule_type!r}")

    @classmethod
    def fixed(cls, tokens: int) -> RandomLTDSchedule:
        """A schedule that keeps ``tokens`` tokens at every step."""
        return cls(min_value=tokens, max_value=tokens, require_steps=1, seq_per_step=1)

    def value_at(self, step: int) -> int:
        """``K`` at optimizer step ``step`` (0-based)."""
        if step >= self.require_steps:
            return self.max_value
        value = math.floor(self.min_value + (self.max_value - self.min_value) * max(step, 0) / self.require_steps)
        return value - value % self.seq_per_step


class RandomLTDScheduler:
    """The running schedule: the current ``K`` and DeepSpeed's consumed-layer-tokens counter.

    Args:
        schedule: the token schedule.
        total_layer_num: layers of the model (for the counter).
        random_ltd_layer_num: how many of them drop tokens (for the counter).
        global_batch_size: samples per optimizer step (for the counter).
    """

    def __init__(self, schedule: RandomLTDSchedule, total_layer_num: int = 1, random_ltd_layer_num: int = 1,
                 global_batch_size: int = 1) -> None:
        self.schedule = schedule
        self.total_layer_num, self.random_ltd_layer_num = total_layer_num, random_ltd_layer_num
        self.global_batch_size = global_batch_size
        self.current_value = schedule.value_at(0)
        self.current_step = -1
        self.consumed_layer_tokens = 0

    def update(self, global_step: int) -> int:
        """Set ``K`` for ``global_step`` (called before each training forward); return it.

        The first call of a step adds the step's layer tokens to :attr:`consumed_layer_tokens`:
        ``global_batch_size * (K * random_ltd_layer_num + max_value * (total_layer_num - random_ltd_layer_num))``.
        """
        self.current_value = self.schedule.value_at(global_step)
        if global_step != self.current_step:
            self.consumed_layer_tokens += self.global_batch_size * (
                self.current_value * self.random_ltd_layer_num
                + self.schedule.max_value * (self.total_layer_num - self.random_ltd_layer_num))
            self.current_step = global_step
        return self.current_value

    def state_dict(self) -> dict[str, int]:
        """The state to checkpoint: ``current_value``, ``current_step``, ``consumed_layer_tokens``."""
        return {"current_value": self.current_value, "current_step": self.current_step,
                "consumed_layer_tokens": self.consumed_layer_tokens}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`state_dict`'s values."""
        self.current_value = int(state["current_value"])
        self.current_step = int(state["current_step"])
        self.consumed_layer_tokens = int(state["consumed_layer_tokens"])


# -- config ------------------------------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(path: str, v: Any) -> int:
    if not _is_int(v) or v <= 0:
        raise ConfigError(f"{path}: expected an integer > 0, got {v!r}.")
    return v


def _strict_keys(path: str, given: Any, allowed: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(given, Mapping):
        raise ConfigError(f"{path}: expected an object (section), got {given!r}.")
    for key in given:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), list(allowed), n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}.{key}: unknown key.{hint} Valid keys here: {', '.join(sorted(allowed))}.")
    return given


_KEYS = ("enabled", "total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_mask_name",
         "model_type", "hidden_state_order", "random_ltd_schedule", "layer_token_lr_schedule")
_REQUIRED = ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "random_ltd_schedule")


@dataclass(frozen=True)
class RandomLTDConfig:
    """The validated ``data_efficiency.data_routing.random_ltd`` section.

    Attributes:
        enabled: random-LTD is on.
        total_layer_num: layers of the model; the plugin finds the ``nn.ModuleList`` of that length.
        random_ltd_layer_num: how many layers drop tokens (``len(random_ltd_layer_id)``).
        random_ltd_layer_id: indices (0-based, in that list) of the layers that drop tokens.
        model_mask_name: keyword argument of the layers that carries the attention mask, or ``None``.
        model_type: ``"decoder"`` or ``"encoder"`` (how the mask is cut: :func:`gather_attention_mask`).
        hidden_state_order: ``"batch_seq_dim"`` (``[B, S, H]``) or ``"seq_batch_dim"`` (``[S, B, H]``).
        schedule: the token schedule.
    """

    enabled: bool = False
    total_layer_num: int = 0
    random_ltd_layer_num: int = 0
    random_ltd_layer_id: tuple[int, ...] = ()
    model_mask_name: str | None = None
    model_type: str = "decoder"
    hidden_state_order: str = "batch_seq_dim"
    schedule: RandomLTDSchedule | None = field(default=None)

    @classmethod
    def from_section(cls, section: Mapping[str, Any] | None, path: str = CONFIG_PATH) -> RandomLTDConfig:
        """Validate the section strictly; raise :class:`~microspeed.ConfigError` naming ``<path>.<key>``.

        Unknown keys are refused at every depth. When ``enabled`` is true, ``total_layer_num``,
        ``random_ltd_layer_num``, ``random_ltd_layer_id`` and ``random_ltd_schedule`` are required.
        ``layer_token_lr_schedule`` is accepted only disabled (DeepSpeed does not implement it either).
        """
        s = _strict_keys(path, section or {}, _KEYS)
        enabled = s.get("enabled", False)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{path}.enabled: expected true/false, got {enabled!r}.")
        for key, choices in (("model_type", MODEL_TYPES), ("hidden_state_order", HIDDEN_STATE_ORDERS)):
            if key in s and s[key] not in choices:
                raise ConfigError(f"{path}.{key}: got {s[key]!r}; accepted values: {', '.join(map(repr, choices))}.")
        mask_name = s.get("model_mask_name")
        if mask_name is not None and (not isinstance(mask_name, str) or not mask_name.isidentifier()):
            raise ConfigError(f"{path}.model_mask_name: expected null or the name of the layers' mask keyword "
                              f"argument, got {mask_name!r}.")
        lr = _strict_keys(f"{path}.layer_token_lr_schedule", s.get("layer_token_lr_schedule", {}), ("enabled",))
        if lr.get("enabled", False) is not False:
            raise ConfigError(f"{path}.layer_token_lr_schedule.enabled: got {lr['enabled']!r}; the layer-token LR "
                              "schedule is not supported (nor implemented by DeepSpeed); set it to false.")
        if not enabled:
            for key in ("total_layer_num", "random_ltd_layer_num"):
                if key in s:
                    _positive_int(f"{path}.{key}", s[key])
            return cls(enabled=False, model_mask_name=mask_name, model_type=s.get("model_type", "decoder"),
                       hidden_state_order=s.get("hidden_state_order", "batch_seq_dim"))
        for key in _REQUIRED:
            if key not in s:
                raise ConfigError(f"{path}.{key}: required when {path}.enabled is true.")
        total = _positive_int(f"{path}.total_layer_num", s["total_layer_num"])
        num = _positive_int(f"{path}.random_ltd_layer_num", s["random_ltd_layer_num"])
        ids = s["random_ltd_layer_id"]
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) for i in ids):
            raise ConfigError(f"{path}.random_ltd_layer_id: expected a list of layer indices, got {ids!r}.")
        bad = [i for i in ids if not 0 <= i < total]
        if bad:
            raise ConfigError(f"{path}.random_ltd_layer_id: {bad} out of range; layer indices are 0-based and below "
                              f"total_layer_num={total}.")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"{path}.random_ltd_layer_id: {list(ids)} names a layer twice.")
        if len(ids) != num:
            raise ConfigError(f"{path}.random_ltd_layer_num: got {num}, but random_ltd_layer_id lists {len(ids)} "
                              "layers; they must agree.")
        return cls(enabled=True, total_layer_num=total, random_ltd_layer_num=num,
                   random_ltd_layer_id=tuple(sorted(ids)), model_mask_name=mask_name,
                   model_type=s.get("model_type", "decoder"),
                   hidden_state_order=s.get("hidden_state_order", "batch_seq_dim"),
                   schedule=_parse_schedule(f"{path}.random_ltd_schedule", s["random_ltd_schedule"]))


def _parse_schedule(path: str, given: Any) -> RandomLTDSchedule:
    s = _strict_keys(path, given, ("min_value", "max_value", "schedule_type", "schedule_config"))
    for key in ("min_value", "max_value", "schedule_config"):
        if key not in s:
            raise ConfigError(f"{path}.{key}: required.")
    lo = _positive_int(f"{path}.min_value", s["min_value"])
    hi = _positive_int(f"{path}.max_value", s["max_value"])
    kind = s.get("schedule_type", "fixed_linear")
    if kind not in SCHEDULE_TYPES:
        raise ConfigError(f"{path}.schedule_type: got {kind!r}; accepted values: "
                          f"{', '.join(map(repr, SCHEDULE_TYPES))}.")
    c = _strict_keys(f"{path}.schedule_config", s["schedule_config"], ("require_steps", "seq_per_step"))
    for key in ("require_steps", "seq_per_step"):
        if key not in c:
            raise ConfigError(f"{path}.schedule_config.{key}: required.")
    steps = _positive_int(f"{path}.schedule_config.require_steps", c["require_steps"])
    per = _positive_int(f"{path}.schedule_config.seq_per_step", c["seq_per_step"])
    if hi < lo:
        raise ConfigError(f"{path}.max_value: got {hi}, below min_value={lo}; max_value must be >= min_value.")
    if lo < per:
        raise ConfigError(f"{path}.min_value: got {lo}, below schedule_config.seq_per_step={per}; the kept tokens are "
                          "rounded down to a multiple of seq_per_step, so the first steps would keep none. Raise "
                          "min_value or lower seq_per_step.")
    return RandomLTDSchedule(min_value=lo, max_value=hi, require_steps=steps, seq_per_step=per, schedule_type=kind)


# -- installing random-LTD on layers -----------------------------------------------------------------------------


_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 over each in turn): nearby keys give unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (an activation checkpoint recomputes)."""
    return torch._C._current_graph_task_id() != -1


class KeyedTokenSampler:
    """Draws each layer's kept tokens from a generator seeded by ``(seed, step, micro-batch, layer)``.

    With the global generator (the default of :class:`RandomLTDLayer`), which tokens a layer keeps depends on
    every draw made before it in the process. When a model's layers are spread over processes (pipeline stages)
    that run micro-batches in another order than one process would, the draws must depend on the micro-batch
    and the layer alone: this sampler counts each layer's training forwards since :meth:`start_step` (the
    ``n``-th is micro-batch ``n``: every schedule runs one layer's micro-batches in order) and seeds a fresh
    generator from ``(seed, step, n, layer key)``. Forwards that run inside a backward are activation
    checkpoints recomputing; they are counted apart (backwards also run a layer's micro-batches in order), so
    a recompute redraws its forward's tokens.

    Attributes:
        seed: the run's seed; processes that must agree use the same one.
        step: the optimizer step the counts belong to.
    """

    def __init__(self, seed: int) -> None:
        self.seed, self.step = int(seed), 0
        self._counts: dict[int, list[int]] = {}

    def start_step(self, step: int) -> None:
        """Begin step ``step``: every layer's next forward is micro-batch 0 again."""
        self.step = int(step)
        self._counts.clear()

    def draw(self, key: int, reserved: int, seq_len: int, batch_size: int, device: torch.device) -> torch.Tensor:
        """The kept positions ``[batch_size, reserved]`` for the next forward of the layer ``key``."""
        counts = self._counts.setdefault(key, [0, 0])
        slot = 1 if _in_backward() else 0
        micro_batch = counts[slot]
        counts[slot] += 1
        generator = torch.Generator(device=device)
        generator.manual_seed(_mix(self.seed, self.step, micro_batch, key))
        return sample_token_indices(reserved, seq_len, batch_size, device=device, generator=generator)


class RandomLTDLayer:
    """Random-LTD installed on one layer with module hooks: gather before it, scatter after it.

    The layer must take the hidden states as its first positional argument and return a tensor of the same
    shape, or a tuple whose first element is one. Made by :func:`convert_to_random_ltd`.

    Attributes:
        module: the layer.
        name: its name in the model.
        scheduler: gives the current ``K`` (:attr:`RandomLTDScheduler.current_value`).
        batch_first: the hidden states are ``[B, S, H]`` (else ``[S, B, H]``).
        model_type: ``"decoder"`` or ``"encoder"``.
        mask_name: the layer's mask keyword argument, or ``None``.
        sampler: a :class:`KeyedTokenSampler` the tokens are drawn from (with ``key``), or ``None``: torch's
            global generator.
        key: the layer's key in ``sampler`` (its index in the model's layer list).
        last_tokens: how many tokens per sample the layer processed in its latest call (``None`` before).
    """

    def __init__(self, module: nn.Module, name: str, scheduler: RandomLTDScheduler, *, batch_first: bool = True,
                 model_type: str = "decoder", mask_name: str | None = None,
                 sampler: KeyedTokenSampler | None = None, key: int = 0) -> None:
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type: expected one of {MODEL_TYPES}, got {model_type!r}")
        if getattr(module, "_microspeed_random_ltd", None) is not None:
            raise ValueError(f"layer {name!r} already drops tokens (random-LTD is installed on it); "
                             "call .remove() on its RandomLTD handle first")
        self.module, self.name, self.scheduler = module, name, scheduler
        self.batch_first, self.model_type, self.mask_name = batch_first, model_type, mask_name
        self.sampler, self.key = sampler, key
        self.last_tokens: int | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._handles = [module.register_forward_pre_hook(self._before, with_kwargs=True),
                         module.register_forward_hook(self._after, with_kwargs=True)]
        module._microspeed_random_ltd = self

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
            raise TypeError(f"random-LTD layer {self.name!r}: expected the hidden states [B, S, H] or [S, B, H] as "
                            f"the first positional argument, got {type(args[0]).__name__ if args else 'nothing'}")
        hidden = args[0]
        seq_dim = 1 if self.batch_first else 0
        seq, batch = hidden.shape[seq_dim], hidden.shape[1 - seq_dim]
        keep = int(self.scheduler.current_value)
        if not module.training or keep >= seq:
            self._pending.append(None)
            self.last_tokens = seq
            return None
        if self.sampler is None:
            idx = sample_token_indices(keep, seq, batch, device=hidden.device)
        else:
            idx = self.sampler.draw(self.key, keep, seq, batch, hidden.device)
        part = gather_tokens(hidden, idx, self.batch_first)
        if self.mask_name is not None:
            if self.mask_name not in kwargs:
                raise TypeError(f"random-LTD layer {self.name!r}: model_mask_name is {self.mask_name!r}, but the "
                                f"layer was called without that keyword argument (got {sorted(kwargs)}); pass the "
                                "mask by that keyword, or set model_mask_name to null")
            if kwargs[self.mask_name] is not None:
                mask = gather_attention_mask(kwargs[self.mask_name], idx, self.model_type)
                kwargs = {**kwargs, self.mask_name: mask}
        self._pending.append((hidden, idx))
        self.last_tokens = keep
        return (part, *args[1:]), kwargs

    def _after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        pending = self._pending.pop()
        if pending is None:
            return None
        hidden, idx = pending
        if isinstance(output, torch.Tensor):
            return scatter_tokens(hidden, output, idx, self.batch_first)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (scatter_tokens(hidden, output[0], idx, self.batch_first), *output[1:])
        raise TypeError(f"random-LTD layer {self.name!r}: expected the layer to return the hidden states (a tensor, "
                        f"or a tuple starting with one), got {type(output).__name__}")

    def remove(self) -> None:
        """Uninstall the hooks: the layer processes every token again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._pending.clear()
        if getattr(self.module, "_microspeed_random_ltd", None) is self:
            del self.module._microspeed_random_ltd


class RandomLTD:
    """The handle :func:`convert_to_random_ltd` returns: the converted layers and their scheduler.

    Attributes:
        layers: one :class:`RandomLTDLayer` per converted layer, in model order.
        scheduler: the shared :class:`RandomLTDScheduler`.
    """

    def __init__(self, layers: list[RandomLTDLayer], scheduler: RandomLTDScheduler) -> None:
        self.layers, self.scheduler = layers, scheduler

    @property
    def reserved_length(self) -> int:
        """The current ``K``: tokens per sample each converted layer processes in training."""
        return int(self.scheduler.current_value)

    def remove(self) -> None:
        """Uninstall random-LTD from every converted layer."""
        for layer in self.layers:
            layer.remove()


def find_layer_list(model: nn.Module, num_layers: int | None = None) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` holding the model's layers: ``(name, list)``.

    With ``num_layers``, the one list of that length; without, the one list of the model. Several or no
    candidates are a ``ValueError`` that lists the model's ModuleLists.
    """
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    found = [(n, m) for n, m in lists if num_layers is None or len(m) == num_layers]
    if len(found) == 1:
        return found[0]
    have = ", ".join(f"{n or '<model>'} ({len(m)})" for n, m in lists) or "none"
    want = f" of length {num_layers}" if num_layers is not None else ""
    raise ValueError(f"cannot tell which nn.ModuleList{want} holds the layers: found "
                     f"{len(found)} among the model's ModuleLists [{have}]; pass layer_list=<its name>")


def convert_to_random_ltd(
    model: nn.Module,
    layer_ids: Sequence[int | str],
    reserved: int | RandomLTDScheduler,
    *,
    layer_list: str | None = None,
    model_type: str = "decoder",
    hidden_state_order: str = "batch_seq_dim",
    mask_name: str | None = None,
    sampler: KeyedTokenSampler | None = None,
) -> RandomLTD:
    """Make layers of ``model`` drop tokens in training (see the module docstring); returns the handle.

    Args:
        model: the model (an object with a ``.module``, such as an engine, is unwrapped).
        layer_ids: the layers: integers index the layer list (``layer_list``), strings are module names in
            ``model`` (``"blocks.1"``).
        reserved: tokens per sample the layers keep — a fixed number, or a :class:`RandomLTDScheduler` whose
            ``current_value`` is read at every call (the plugin updates it every step).
        layer_list: name of the ``nn.ModuleList`` that integer ids index; default: the model's only one
            (:func:`find_layer_list`).
        model_type: ``"decoder"`` or ``"encoder"``: how a mask is cut (:func:`gather_attention_mask`).
        hidden_state_order: ``"batch_seq_dim"`` or ``"seq_batch_dim"``.
        mask_name: the layers' attention-mask keyword argument, or ``None``.
        sampler: draw the tokens from this :class:`KeyedTokenSampler` (each layer keyed by its integer id, or
            by its position among the chosen layers when named) instead of torch's global generator.

    The layers' parameters keep their names (module hooks, no wrapper module). ``handle.remove()`` undoes it.
    """
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    if hidden_state_order not in HIDDEN_STATE_ORDERS:
        raise ValueError(f"hidden_state_order: expected one of {HIDDEN_STATE_ORDERS}, got {hidden_state_order!r}")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type: expected one of {MODEL_TYPES}, got {model_type!r}")
    if isinstance(reserved, RandomLTDScheduler):
        scheduler = reserved
    elif _is_int(reserved) and reserved > 0:
        scheduler = RandomLTDScheduler(RandomLTDSchedule.fixed(reserved))
    else:
        raise ValueError(f"reserved: expected a token count > 0 or a RandomLTDScheduler, got {reserved!r}")
    if not layer_ids:
        raise ValueError("layer_ids: expected at least one layer index or module name")
    modules = dict(model.named_modules())
    chosen: dict[str, nn.Module] = {}
    base: tuple[str, nn.ModuleList] | None = None
    for lid in layer_ids:
        if isinstance(lid, str):
            if lid not in modules:
                raise ValueError(f"layer_ids: the model has no module named {lid!r}")
            chosen[lid] = modules[lid]
        elif _is_int(lid):
            if base is None:
                if layer_list is None:
                    base = find_layer_list(model)
                elif isinstance(modules.get(layer_list), nn.ModuleList):
                    base = (layer_list, modules[layer_list])
                else:
                    raise ValueError(f"layer_list: the model has no nn.ModuleList named {layer_list!r}")
            name, layers = base
            if not 0 <= lid < len(layers):
                raise ValueError(f"layer_ids: index {lid} is out of range for {name!r} ({len(layers)} layers)")
            chosen[f"{name}.{lid}" if name else str(lid)] = layers[lid]
        else:
            raise ValueError(f"layer_ids: expected layer indices or module names, got {lid!r}")
    if len(chosen) != len(layer_ids) or len({id(m) for m in chosen.values()}) != len(chosen):
        raise ValueError(f"layer_ids: {list(layer_ids)} names a layer twice")
    keys = {name: lid if _is_int(lid) else i for i, (name, lid) in enumerate(zip(chosen, layer_ids, strict=True))}
    order = {name: i for i, name in enumerate(modules)}
    converted: list[RandomLTDLayer] = []
    try:
        for name in sorted(chosen, key=order.__getitem__):
            converted.append(RandomLTDLayer(chosen[name], name, scheduler, batch_first=hidden_state_order ==
                                            "batch_seq_dim", model_type=model_type, mask_name=mask_name,
                                            sampler=sampler, key=keys[name]))
    except ValueError:
        for layer in converted:
            layer.remove()
        raise
    return RandomLTD(converted, scheduler)
