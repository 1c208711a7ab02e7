"""ZeRO memory estimator: per-rank bytes of parameters, gradients and optimizer state.

:func:`estimate_memory` answers "how much memory does each rank need for the model states of a
Ψ-parameter model trained with ZeRO stage S on N ranks?", split by where the bytes live (the
accelerator, CPU memory, NVMe). :func:`main` is the ``microspeed estimate-memory`` command; it also prints each
row's predicted peak RSS per rank (:func:`microspeed_zero.peak_rss.predict_peak_rss`: baseline, runtime, the
states held in memory, buffers, gathered parameters, activations, the step's temporaries) and, with ``--budget``,
whether it fits ``zero_optimization.host_memory_budget``.

Model (Ψ trainable parameters, N ranks, p = bytes of a model parameter and of its gradient — 2 for
fp16/bf16, 4 for fp32 —, m = bytes of the fp32 master copy — 4 in mixed precision, 0 in fp32,
where the fp32 parameters are themselves the masters —, k = 4 × the optimizer's state tensors per
parameter: adam/adamw 2, sgd_momentum 1, adagrad 1, sgd 0). ``optimizer_states`` counts m + k::

    stage 0:  pΨ    + pΨ    + (m+k)Ψ          nothing partitioned
    stage 1:  pΨ    + pΨ    + (m+k)Ψ/N        optimizer state partitioned
    stage 2:  pΨ    + pΨ/N  + (m+k)Ψ/N        + gradients
    stage 3:  pΨ/N  + pΨ/N  + (m+k)Ψ/N        + parameters

so mixed-precision Adam needs 2Ψ+2Ψ+12Ψ at stage 0 and 16Ψ/N at stage 3, fp32 Adam 4Ψ+4Ψ+8Ψ and
16Ψ/N. A "Ψ/N" share is ``ceil(Ψ/N)`` elements: ranks hold equal partitions, the last one padded.

Offload (rules of DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs``; the optimizer step runs on the CPU):

* ``offload_optimizer`` = cpu|nvme (stage ≥ 1): the rank's fp32 master partition (4Ψ/N), its
  optimizer state (kΨ/N) and an fp32 copy of its gradient partition (4Ψ/N, what the CPU step
  reads) live there — 16Ψ/N for Adam, as DeepSpeed counts. The master is counted in fp32 runs
  too: the CPU step needs a CPU-resident copy of the parameter partition to update, while the
  device keeps its own fp32 parameters. At stage 2 and 3 gradients are reduced straight into that
  host copy, so no gradient partition stays on the device; at stage 1 the full device gradients
  remain (they are only reduced at the step) and the host copy is added.
* ``offload_param`` = cpu|nvme (stage 3 only): the rank's parameter partition (pΨ/N) lives there.

NVMe optimizer offload is accepted at stages 1 and 2 as the plugin's config accepts it (DeepSpeed
itself swaps to NVMe only at stage 3); the same bytes then sit on NVMe instead of in CPU memory.

Working memory: at stage 3 each layer's parameters are all-gathered before use, so the device
also needs ``working`` = largest layer's parameter count × p (one layer gathered at a time, ×1;
prefetching, ``max_live_parameters`` and communication buckets come on top and depend on the
config). Stages 0–2 gather nothing (``working`` = 0). Not counted anywhere: activations,
communication buckets, allocator fragmentation, the pinned CPU buffers that NVMe swapping uses.

Compared with DeepSpeed 0.19.8's estimators (whose CPU figures are per node, or summed over the
ranks at stage 2, and multiplied by ``additional_buffer_factor`` = 1.5):

* stage 2 without offload: DeepSpeed's device figure is 2Ψ + 18Ψ/N where ours is 2Ψ + 14Ψ/N —
  its 18 adds a 4-byte fp32 gradient partition (built for the step) to our 2 + 12;
* stage 3 without offload: DeepSpeed's is 18Ψ/N where ours is 16Ψ/N (2 bytes more per parameter,
  not broken down there), and it reserves 4 × largest layer of working memory where we reserve
  p × largest layer (gathered 16-bit parameters; the layer's gradients are reduce-scattered
  through buckets and do not scale with the layer);
* with ``offload_optimizer`` = cpu the figures agree: stage 2 device 2Ψ and CPU 16Ψ summed over
  the ranks (16Ψ/N each); stage 3 device 2Ψ/N (+ working) and CPU 16Ψ/N per rank, or device 0
  (+ working) and CPU 18Ψ/N per rank with ``offload_param`` = cpu too (DeepSpeed's
  ``zero_init=True`` case; with it off, and at stage 2 for N > 4, DeepSpeed budgets instead each
  process loading the whole model in fp32 on the CPU — a start-up peak, not steady state, which
  we leave out).

Trainable parameters only are counted (``requires_grad``), each once even when shared (tied
embeddings); DeepSpeed's ``model_to_params`` counts frozen parameters too.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "OFFLOAD_DEVICES",
    "OPTIMIZER_STATES",
    "PRECISIONS",
    "MemoryEstimate",
    "Placement",
    "count_parameters",
    "estimate_memory",
    "format_bytes",
    "main",
    "nvme_traffic",
    "parse_count",
    "parse_size",
]

PRECISIONS: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}
"""Accepted ``precision`` values -> bytes of a model parameter (and of its gradient)."""

OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1}
"""Accepted ``optimizer`` values -> fp32 state tensors kept per parameter (Adam: two moments)."""

OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")
"""Accepted values of ``offload_optimizer`` and ``offload_param``."""

_FP32 = 4
_PARTS = ("params", "gradients", "optimizer_states")


@dataclass(frozen=True)
class Placement:
    """Bytes of one kind of model state on one rank, by where they live.

    Attributes:
        device: bytes in accelerator memory.
        cpu: bytes in host (CPU) memory.
        nvme: bytes on NVMe (or any file system used for swapping).
    """

    device: int = 0
    cpu: int = 0
    nvme: int = 0

    @property
    def total(self) -> int:
        """``device + cpu + nvme``."""
        return self.device + self.cpu + self.nvme

    def at(self, where: str) -> int:
        """Bytes at ``where`` (``"device"``, ``"cpu"`` or ``"nvme"``)."""
        return {"device": self.device, "cpu": self.cpu, "nvme": self.nvme}[where]


def _placed(nbytes: int, where: str) -> Placement:
    """``nbytes`` at ``where`` (``"none"`` means the device)."""
    return Placement(**{"device" if where == "none" else where: nbytes})


def _plus(a: Placement, b: Placement) -> Placement:
    return Placement(a.device + b.device, a.cpu + b.cpu, a.nvme + b.nvme)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank memory of the model states under one ZeRO setup; build it with :func:`estimate_memory`.

    Attributes:
        num_params: Ψ, the trainable parameters counted.
        world_size: N, the data-parallel ranks the states are partitioned over.
        stage: ZeRO stage 0–3.
        precision: ``"fp16"``, ``"bf16"`` or ``"fp32"``.
        optimizer: one of :data:`OPTIMIZER_STATES`.
        offload_optimizer: ``"none"``, ``"cpu"`` or ``"nvme"``.
        offload_param: ``"none"``, ``"cpu"`` or ``"nvme"``.
        largest_layer_params: parameters of the largest layer (module), or ``None`` when unknown.
        params: the model parameters in the training dtype (whole, or the rank's partition at stage 3).
        gradients: the gradients (plus, with ``offload_optimizer``, the fp32 host copy of the partition).
        optimizer_states: the fp32 master partition (mixed precision, or any offload) and the
            optimizer's state tensors.
        working: device bytes for stage 3's gathered parameters (largest layer × parameter bytes);
            0 at stages 0–2 or when the largest layer is unknown.
    """

    num_params: int
    world_size: int
    stage: int
    precision: str
    optimizer: str
    offload_optimizer: str
    offload_param: str
    largest_layer_params: int | None
    params: Placement
    gradients: Placement
    optimizer_states: Placement
    working: int = 0

    def _sum(self, where: str) -> int:
        return sum(getattr(self, part).at(where) for part in _PARTS)

    @property
    def total_device(self) -> int:
        """Device bytes: model states on the device plus ``working``."""
        return self._sum("device") + self.working

    @property
    def total_cpu(self) -> int:
        """CPU bytes of the model states."""
        return self._sum("cpu")

    @property
    def total_nvme(self) -> int:
        """NVMe bytes of the model states."""
        return self._sum("nvme")

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer states, wherever they live (``working`` excluded)."""
        return self.params.total + self.gradients.total + self.optimizer_states.total

    @property
    def total(self) -> int:
        """Every counted byte: ``total_device + total_cpu + total_nvme``."""
        return self.total_device + self.total_cpu + self.total_nvme

    def table(self) -> str:
        """A readable per-rank breakdown: one row per kind of state, one column per location."""
        off = f"offload optimizer={self.offload_optimizer}, param={self.offload_param}"
        head = (f"ZeRO-{self.stage} per rank: {_count(self.num_params)} params on {self.world_size} rank(s), "
                f"{self.precision}, {self.optimizer}, {off}")
        cols = ("device", "cpu", "nvme")
        rows: list[tuple[str, ...]] = [("", *cols, "total")]
        labels = {"params": f"params ({self.precision})", "gradients": "gradients",
                  "optimizer_states": "optimizer states"}
        for part in _PARTS:
            pl: Placement = getattr(self, part)
            rows.append((labels[part], *(format_bytes(pl.at(c)) for c in cols), format_bytes(pl.total)))
        if self.stage == 3:
            layer = "unknown" if self.largest_layer_params is None else _count(self.largest_layer_params)
            rows.append((f"working (layer {layer})", format_bytes(self.working), "-", "-",
                         format_bytes(self.working)))
        rows.append(("total", format_bytes(self.total_device), format_bytes(self.total_cpu),
                     format_bytes(self.total_nvme), format_bytes(self.total)))
        return head + "\n" + _render(rows)

    def __str__(self) -> str:
        """Same as :meth:`table`."""
        return self.table()


def format_bytes(n: int | float) -> str:
    """``n`` bytes with a binary unit: ``"1.50 GiB"``, ``"12.0 MiB"``, ``"3.0 KiB"``, ``"0 B"``."""
    n = float(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.2f} {unit}" if unit in ("TiB", "GiB") else f"{value:.1f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _render(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def count_parameters(model: Any) -> tuple[int, int]:
    """``(Ψ, largest_layer)`` of a :class:`torch.nn.Module`, trainable parameters only.

    Ψ counts each parameter once even when several modules share it (tied weights: the same
    ``Parameter`` object, or tensors over the same storage). ``largest_layer`` is the largest
    number of parameters any single submodule owns directly (``recurse=False``). Works on
    ``meta``-device models, so huge configurations can be counted without allocating them.
    """
    seen_ids: set[int] = set()
    seen_storage: set[tuple[int, int, tuple[int, ...]]] = set()
    total = 0
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen_ids:
            continue
        seen_ids.add(id(p))
        if not p.is_meta:
            ptr = p.data_ptr()
            key = (ptr, p.storage_offset(), tuple(p.shape))
            if ptr and key in seen_storage:
                continue
            seen_storage.add(key)
        total += p.numel()
    largest = 0
    for module in model.modules():
        own = {id(p): p.numel() for p in module.parameters(recurse=False) if p.requires_grad}
        largest = max(largest, sum(own.values()))
    return total, largest


def _check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return value


def estimate_memory(
    model_or_numel: Any,
    world_size: int,
    stage: int,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    precision: str = "bf16",
    optimizer: str = "adam",
    largest_layer_params: int | None = None,
) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients and optimizer states under ZeRO ``stage`` on ``world_size`` ranks.

    The rules (ideal partition figures, offload placement, stage-3 working memory, how they
    compare with DeepSpeed's own estimators) are in this module's docstring.

    Args:
        model_or_numel: a :class:`torch.nn.Module` (its trainable parameters are counted, shared
            ones once, see :func:`count_parameters`) or Ψ as an int.
        world_size: N, data-parallel ranks (≥ 1).
        stage: ZeRO stage, 0–3.
        offload_optimizer: ``"none"``, ``"cpu"`` or ``"nvme"``; needs stage ≥ 1.
        offload_param: ``"none"``, ``"cpu"`` or ``"nvme"``; needs stage 3, and ``"nvme"`` needs
            ``offload_optimizer`` too (as the plugin's config requires).
        precision: ``"bf16"``/``"fp16"`` (mixed precision with fp32 masters) or ``"fp32"``.
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"`` (no momentum), ``"sgd_momentum"`` or ``"adagrad"``.
        largest_layer_params: parameters of the largest layer, for stage 3's working memory;
            defaults to the module's largest (when a module is given), else unknown (0 bytes).

    Raises:
        ValueError: naming the offending argument.
    """
    world_size = _check_int("world_size", world_size, 1)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3; got {stage!r}")
    precision = _check_choice("precision", precision, PRECISIONS)
    optimizer = _check_choice("optimizer", optimizer, OPTIMIZER_STATES)
    offload_optimizer = _check_choice("offload_optimizer", offload_optimizer, OFFLOAD_DEVICES)
    offload_param = _check_choice("offload_param", offload_param, OFFLOAD_DEVICES)
    if offload_optimizer != "none" and stage < 1:
        raise ValueError(f"offload_optimizer={offload_optimizer!r} needs stage >= 1 (got stage {stage})")
    if offload_param != "none" and stage < 3:
        raise ValueError(f"offload_param={offload_param!r} needs stage 3 (got stage {stage}): "
                         "only stage 3 partitions the parameters")
    if offload_param == "nvme" and offload_optimizer == "none":
        raise ValueError("offload_param='nvme' needs offload_optimizer 'cpu' or 'nvme' as well")
    if largest_layer_params is not None:
        largest_layer_params = _check_int("largest_layer_params", largest_layer_params, 0)

    if isinstance(model_or_numel, bool) or not isinstance(model_or_numel, int):
        if not callable(getattr(model_or_numel, "parameters", None)) or not hasattr(model_or_numel, "modules"):
            raise ValueError(f"model_or_numel must be a torch.nn.Module or an int >= 0; got {model_or_numel!r}")
        numel, largest = count_parameters(model_or_numel)
        if largest_layer_params is None:
            largest_layer_params = largest
    else:
        numel = _check_int("model_or_numel", model_or_numel, 0)

    p = PRECISIONS[precision]
    master = _FP32 if precision != "fp32" else 0
    k = _FP32 * OPTIMIZER_STATES[optimizer]
    share = math.ceil(numel / world_size)  # elements of one rank's partition

    params = _placed(p * (share if stage == 3 else numel), offload_param)
    if offload_optimizer == "none":
        gradients = Placement(device=p * (share if stage >= 2 else numel))
        optimizer_states = Placement(device=(master + k) * (share if stage >= 1 else numel))
    else:
        # The CPU step reads an fp32 gradient partition and updates an fp32 master partition held where
        # its state is; stages 2/3 reduce gradients straight into it, stage 1 keeps full device gradients.
        device_grads = Placement(device=p * numel) if stage == 1 else Placement()
        gradients = _plus(device_grads, _placed(_FP32 * share, offload_optimizer))
        optimizer_states = _placed((_FP32 + k) * share, offload_optimizer)
    working = p * (largest_layer_params or 0) if stage == 3 else 0
    return MemoryEstimate(
        num_params=numel, world_size=world_size, stage=stage, precision=precision, optimizer=optimizer,
        offload_optimizer=offload_optimizer, offload_param=offload_param,
        largest_layer_params=largest_layer_params, params=params, gradients=gradients,
        optimizer_states=optimizer_states, working=working,
    )


def nvme_traffic(est: MemoryEstimate, grad_accum: int = 1, max_in_cpu: int = 1_000_000_000) -> tuple[int, int]:
    """``(read, write)`` bytes the NVMe swappers move per optimizer step on one rank, from ``est``'s accounting.

    * ``offload_optimizer = "nvme"``: the optimizer swapper (:mod:`microspeed_zero.swap`) reads every
      sub-group's fp32 master and state tensors once per step and writes them back once:
      ``est.optimizer_states.nvme`` bytes each way (Adam: 4 + 2·4 bytes per element of the partition).
      At stages 2 and 3 the gradient partition lives in the same files (:mod:`microspeed_zero.grad_swap`,
      in the model's dtype): each micro-step writes it (and, after the first, reads it back to accumulate),
      and the step reads it once: ``grad_accum`` × p bytes per element each way.
    * ``offload_param = "nvme"`` (stage 3): shards beyond ``offload_param.max_in_cpu`` elements live in
      files (``est.params.nvme`` scaled to that part); each micro-step's forward and backward read them for
      their gathers (at most twice: a segment kept gathered from forward into backward is not re-read),
      and the step reads them once more and writes them back once:
      reads ``(2·grad_accum + 1)`` × and writes 1 × the file-resident bytes.

    At stage 1 the gradients stay in memory (not counted). Gradients accumulated in fp32
    (``data_types.grad_accum_dtype``) move 4 bytes per element instead of p.
    """
    grad_accum = _check_int("grad_accum", grad_accum, 1)
    max_in_cpu = _check_int("max_in_cpu", max_in_cpu, 0)
    opt = est.optimizer_states.nvme
    share = math.ceil(est.num_params / est.world_size)
    grads = grad_accum * PRECISIONS[est.precision] * share if opt and est.stage >= 2 else 0
    in_files = est.params.nvme * max(0, share - max_in_cpu) // share if share else 0
    return opt + grads + (2 * grad_accum + 1) * in_files, opt + grads + in_files


# --------------------------------------------------------------------------------------------------- CLI

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9_]*)?(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)


def parse_count(text: str) -> int:
    """A parameter count from ``"45e6"``, ``"1.3B"``, ``"350M"``, ``"125k"``, ``"7_000_000"``.

    Raises:
        ValueError: not a non-negative count.
    """
    m = _COUNT_RE.match(str(text))
    if not m:
        raise ValueError(f"not a parameter count: {text!r} (examples: 45e6, 1.3B, 350M, 125k)")
    value = float(m.group(1).replace("_", "")) * _SUFFIXES[m.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError(f"not a parameter count: {text!r}")
    return round(value)


def _csv(values: Sequence[str] | None) -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def _literal(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


class _UsageError(Exception):
    """A bad command line: printed and answered with exit code 2."""


def _load_factory(spec: str) -> Callable[[], Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise _UsageError(f"--model must be 'module:factory' (or 'demo:gpt'); got {spec!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            file_spec = importlib.util.spec_from_file_location(path.stem, path)
            if file_spec is None or file_spec.loader is None or not path.is_file():
                raise ImportError(f"no such file {module_name!r}")
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise _UsageError(f"--model {spec}: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise _UsageError(f"--model {spec}: {module_name!r} has no callable {attr!r}")
    return factory


def _build_model(spec: str, model_args: Sequence[str]) -> Any:
    """The module ``--model`` names, built on the ``meta`` device when it can be (no memory used)."""
    import torch

    if spec == "demo:gpt":
        from dataclasses import fields

        from microspeed.models import GPT, GPTConfig

        known = {f.name for f in fields(GPTConfig)}
        kwargs: dict[str, Any] = {}
        for item in model_args:
            key, sep, value = item.partition("=")
            if not sep or key not in known:
                raise _UsageError(f"--model-arg {item!r}: expected key=value, key one of {', '.join(sorted(known))}")
            kwargs[key] = _literal(value)
        try:
            config = GPTConfig(**kwargs)
        except (TypeError, ValueError) as exc:
            raise _UsageError(f"--model-arg: {exc}") from exc

        def factory() -> Any:
            return GPT(config)
    else:
        if model_args:
            raise _UsageError("--model-arg applies only to --model demo:gpt (a factory takes no arguments)")
        factory = _load_factory(spec)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception:
        try:
            model = factory()
        except Exception as exc:
            raise _UsageError(f"--model {spec}: the factory failed: {exc!r}") from exc
    if not isinstance(model, torch.nn.Module):
        raise _UsageError(f"--model {spec}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="microspeed estimate-memory",
        description="Per-rank memory of parameters, gradients and optimizer states under ZeRO stages 0-3, and "
                    "each rank's predicted peak RSS (model states in memory, buffers, gathered parameters, "
                    "activations, the step's temporaries, torch's baseline); --budget checks it.",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--params", metavar="N", help="trainable parameter count, e.g. 45e6, 350M, 1.3B")
    what.add_argument("--model", metavar="MODULE:FACTORY",
                      help="import MODULE (or a .py file) and call FACTORY() for an nn.Module; "
                           "'demo:gpt' builds microspeed.models.GPT from --model-arg key=value")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a GPTConfig field for --model demo:gpt (repeatable), e.g. n_layer=24")
    parser.add_argument("--largest-layer", metavar="N", default=None,
                        help="parameters of the largest layer, for stage 3's working memory (with --params)")
    parser.add_argument("--world-size", action="append", metavar="N[,N...]",
                        help="data-parallel ranks; repeatable or comma list (default 1)")
    parser.add_argument("--stage", action="append", metavar="S[,S...]",
                        help="ZeRO stages; repeatable or comma list (default 0,1,2,3)")
    parser.add_argument("--offload-optimizer", action="append", metavar="DEV[,DEV...]",
                        help="none|cpu|nvme; repeatable or comma list (default none)")
    parser.add_argument("--offload-param", action="append", metavar="DEV[,DEV...]",
                        help="none|cpu|nvme, stage 3 only; repeatable or comma list (default none)")
    parser.add_argument("--precision", default="bf16", help="bf16 | fp16 | fp32 (default bf16)")
    parser.add_argument("--optimizer", default="adam", help=f"{' | '.join(OPTIMIZER_STATES)} (default adam)")
    probe = parser.add_argument_group(
        "disk probe and step time",
        "measure a folder's direct-I/O bandwidth; with --params/--model, print each NVMe-offload row's expected "
        "step time (bytes the swappers move / the bandwidth, next to 6*params*tokens FLOPs / this CPU's matmul rate)")
    probe.add_argument("--probe-disk", metavar="PATH", help="folder to probe (the nvme_path you will use)")
    probe.add_argument("--probe-size", default="1G", metavar="SIZE",
                       help="bytes written and read by the probe, e.g. 256M, 4G (default 1G; >= 1M; larger than "
                            "the disk's cache)")
    probe.add_argument("--tokens-per-step", default="2048", metavar="N",
                       help="tokens one rank processes per optimizer step: micro-batch x sequence x accumulation "
                            "steps (default 2048)")
    probe.add_argument("--grad-accum", default="1", metavar="N",
                       help="micro-steps per optimizer step (offload_param nvme re-reads parameters in each; "
                            "default 1)")
    probe.add_argument("--max-in-cpu", default="1e9", metavar="N",
                       help="zero_optimization.offload_param.max_in_cpu: parameter elements per rank kept in "
                            "memory (default 1e9, DeepSpeed's)")
    rss = parser.add_argument_group(
        "peak RSS", "the predicted peak resident memory of each rank's process (microspeed_zero.peak_rss: baseline, "
        "runtime, model states in memory, buffers, gathered parameters, activations, step temporaries); "
        "--grad-accum and --max-in-cpu count here too")
    rss.add_argument("--micro-batch", default="1", metavar="N", help="train_micro_batch_size_per_gpu (default 1)")
    rss.add_argument("--seq-len", default=None, metavar="N",
                     help="tokens per sequence, for the activations (default: the model's config.seq_len)")
    rss.add_argument("--sub-group-size", default="1e9", metavar="N", help="zero_optimization.sub_group_size")
    rss.add_argument("--buffer-count", default="4", metavar="N", help="offload_optimizer.buffer_count (default 4)")
    rss.add_argument("--reduce-bucket", default="5e8", metavar="N", help="zero_optimization.reduce_bucket_size")
    rss.add_argument("--max-live", default="1e9", metavar="N", help="stage3_max_live_parameters")
    rss.add_argument("--prefetch-bucket", default="5e7", metavar="N", help="stage3_prefetch_bucket_size")
    rss.add_argument("--activations", default=None, metavar="SIZE",
                     help="bytes of activations at the peak, e.g. 2G (default: estimated for a GPT-like --model)")
    rss.add_argument("--baseline", default=None, metavar="SIZE",
                     help="the process's RSS before building (default: 322M, torch + microspeed imported here)")
    rss.add_argument("--budget", default=None, metavar="SIZE",
                     help="zero_optimization.host_memory_budget to check, e.g. 8GiB or 500MB: each row's verdict; "
                          "exit code 1 when a row exceeds it")
    return parser


def _ints(name: str, values: list[str], minimum: int) -> list[int]:
    out = []
    for v in values:
        try:
            out.append(int(v))
        except ValueError:
            raise _UsageError(f"{name}: {v!r} is not an integer") from None
        if out[-1] < minimum:
            raise _UsageError(f"{name}: {v!r} must be >= {minimum}")
    return list(dict.fromkeys(out))


def main(argv: Sequence[str] | None = None) -> int:
    """``microspeed estimate-memory``: print per-rank memory for each (stage, world size, offload); exit code."""
    parser = _parser()
    try:
        opts = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse already printed usage and the error
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return _run(opts)
    except _UsageError as exc:
        print(f"microspeed estimate-memory: error: {exc}", file=sys.stderr)
        return 2


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str, flag: str = "--probe-size") -> int:
    """Bytes from ``"1G"``, ``"256M"``, ``"64MiB"``, ``"4096"`` (binary units: K = 1024); errors name ``flag``."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{flag}: {text!r} is not a size; give bytes or a number with K, M, G or T (e.g. 1G)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def _probe(opts: argparse.Namespace) -> Any:
    from microspeed_zero.diskprobe import probe_disk

    try:
        size = parse_size(opts.probe_size)
        disk = probe_disk(opts.probe_disk, size)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    mode = "O_DIRECT" if disk.direct else "buffered + fsync + fadvise(DONTNEED): the file system refused O_DIRECT"
    print(f"disk {disk.path}: {format_bytes(disk.size)} sequential, {format_bytes(disk.request)} requests, {mode}")
    print(f"  write {disk.write_bps / 1e9:.3f} GB/s ({disk.write_seconds:.2f} s, fsync included), "
          f"read {disk.read_bps / 1e9:.3f} GB/s ({disk.read_seconds:.2f} s)")
    if not disk.direct:
        print("  note: without O_DIRECT the figures may include the page cache (tmpfs is memory, not a disk)")
    return disk


def _step_times(opts: argparse.Namespace, disk: Any, rows: list[MemoryEstimate]) -> None:
    import torch

    from microspeed_zero.diskprobe import matmul_flops, step_time

    nvme = [r for r in rows if r.total_nvme]
    if not nvme:
        print("no row offloads to NVMe (--offload-optimizer nvme / --offload-param nvme): no step time to estimate")
        return
    tokens = _ints("--tokens-per-step", [opts.tokens_per_step], 1)[0]
    accum = _ints("--grad-accum", [opts.grad_accum], 1)[0]
    try:
        max_in_cpu = parse_count(opts.max_in_cpu)
    except ValueError as exc:
        raise _UsageError(f"--max-in-cpu: {exc}") from None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[opts.precision]
    rate = matmul_flops(dtype)
    print(f"expected step time per rank with NVMe offload: {tokens} tokens/step, {accum} micro-step(s), "
          f"max_in_cpu {_count(max_in_cpu)}; CPU matmul {rate / 1e9:.1f} GFLOP/s ({opts.precision}, "
          f"{torch.get_num_threads()} threads); the CPU optimizer step is not counted")
    table = [["stage", "ranks", "offload opt/param", "nvme read", "nvme write", "I/O time", "compute time",
              "step (overlapped)", "step (serial)", "bound"]]
    for r in nvme:
        read, write = nvme_traffic(r, accum, max_in_cpu)
        t = step_time(read, write, r.num_params, tokens, disk, rate)
        table.append([str(r.stage), str(r.world_size), f"{r.offload_optimizer}/{r.offload_param}",
                      format_bytes(read), format_bytes(write), f"{t.io_seconds:.3f} s", f"{t.compute_seconds:.3f} s",
                      f"{t.seconds:.3f} s", f"{t.serial_seconds:.3f} s", t.bound])
    print(_render(table))


def _run(opts: argparse.Namespace) -> int:
    if opts.probe_disk is None:
        for flag, value, default in (("--probe-size", opts.probe_size, "1G"),
                                     ("--tokens-per-step", opts.tokens_per_step, "2048")):
            if value != default:
                raise _UsageError(f"{flag} goes with --probe-disk PATH (the step time needs the disk's bandwidth)")
        if not opts.params and not opts.model:
            raise _UsageError("one of --params, --model or --probe-disk is required")
    disk = _probe(opts) if opts.probe_disk is not None else None
    if not opts.params and not opts.model:
        return 0
    sizes = _ints("--world-size", _csv(opts.world_size) or ["1"], 1)
    stage_list = _ints("--stage", _csv(opts.stage) or ["0", "1", "2", "3"], 0)
    oo_list = list(dict.fromkeys(_csv(opts.offload_optimizer) or ["none"]))
    op_list = list(dict.fromkeys(_csv(opts.offload_param) or ["none"]))
    for flag, values, choices in (("--stage", [str(s) for s in stage_list], ("0", "1", "2", "3")),
                                  ("--offload-optimizer", oo_list, OFFLOAD_DEVICES),
                                  ("--offload-param", op_list, OFFLOAD_DEVICES),
                                  ("--precision", [opts.precision], PRECISIONS),
                                  ("--optimizer", [opts.optimizer], OPTIMIZER_STATES)):
        for v in values:
            if v not in choices:
                raise _UsageError(f"{flag}: {v!r} is not one of {', '.join(choices)}")
    largest: int | None = None
    if opts.largest_layer is not None:
        try:
            largest = parse_count(opts.largest_layer)
        except ValueError as exc:
            raise _UsageError(f"--largest-layer: {exc}") from None
    if opts.model:
        if opts.largest_layer is not None:
            raise _UsageError("--largest-layer goes with --params (a --model's largest layer is counted)")
        subject: Any = _build_model(opts.model, opts.model_arg)
        numel, largest = count_parameters(subject)
        source = f"{opts.model}"
    else:
        if opts.model_arg:
            raise _UsageError("--model-arg goes with --model demo:gpt")
        try:
            numel = parse_count(opts.params)
        except ValueError as exc:
            raise _UsageError(f"--params: {exc}") from None
        subject, source = numel, "--params"

    rows: list[MemoryEstimate] = []
    skipped: list[str] = []
    for stage in sorted(stage_list):
        for n in sizes:
            for oo in oo_list:
                for op in op_list:
                    try:
                        rows.append(estimate_memory(numel if isinstance(subject, int) else subject, n, stage,
                                                    oo, op, opts.precision, opts.optimizer, largest))
                    except ValueError as exc:
                        skipped.append(f"stage {stage}, offload optimizer={oo} param={op}: {exc}")
    if not rows:
        raise _UsageError("no valid combination: " + "; ".join(skipped))

    layer = _count(largest) if largest is not None else "unknown (--largest-layer)"
    print(f"{source}: {_count(numel)} trainable params ({numel:,}), largest layer {layer}; "
          f"{opts.precision}, {opts.optimizer}; bytes per rank (model states; stage 3 adds one gathered layer)")
    show_nvme = any(r.total_nvme for r in rows)
    header = ["stage", "ranks", "offload opt/param", "params", "grads", "optim states", "working",
              "total device", "total cpu"] + (["total nvme"] if show_nvme else [])
    table = [header]
    for r in rows:
        cells = [str(r.stage), str(r.world_size), f"{r.offload_optimizer}/{r.offload_param}",
                 format_bytes(r.params.total), format_bytes(r.gradients.total),
                 format_bytes(r.optimizer_states.total), format_bytes(r.working),
                 format_bytes(r.total_device), format_bytes(r.total_cpu)]
        table.append(cells + ([format_bytes(r.total_nvme)] if show_nvme else []))
    print(_render(table))
    for note in dict.fromkeys(skipped):
        print(f"skipped {note}")
    over = _peak_rss(opts, subject, largest, rows)
    if disk is not None:
        _step_times(opts, disk, rows)
    return 1 if over else 0


def _peak_rss(opts: argparse.Namespace, subject: Any, largest: int | None, rows: list[MemoryEstimate]) -> bool:
    """Print each row's predicted peak RSS per rank, term by term, and the budget's verdict; whether one is over."""
    from microspeed_zero.peak_rss import check_budget, parse_bytes, predict_peak_rss

    def count(flag: str, value: str | None) -> int | None:
        if value is None:
            return None
        try:
            return parse_count(value)
        except ValueError as exc:
            raise _UsageError(f"{flag}: {exc}") from None

    def size(flag: str, value: str | None) -> int | None:
        if value is None:
            return None
        try:
            return parse_bytes(value, flag)
        except ValueError as exc:
            raise _UsageError(str(exc)) from None

    knobs = dict(micro_batch=count("--micro-batch", opts.micro_batch), seq_len=count("--seq-len", opts.seq_len),
                 grad_accum=count("--grad-accum", opts.grad_accum), sub_group_size=count("--sub-group-size",
                                                                                     opts.sub_group_size),
                 buffer_count=count("--buffer-count", opts.buffer_count),
                 reduce_bucket_size=count("--reduce-bucket", opts.reduce_bucket),
                 max_live_parameters=count("--max-live", opts.max_live),
                 prefetch_bucket_size=count("--prefetch-bucket", opts.prefetch_bucket),
                 max_in_cpu=count("--max-in-cpu", opts.max_in_cpu),
                 activation_bytes_given=size("--activations", opts.activations),
                 baseline=size("--baseline", opts.baseline))
    for name in ("micro_batch", "grad_accum", "sub_group_size", "buffer_count", "reduce_bucket_size",
                 "max_live_parameters", "prefetch_bucket_size"):
        if knobs[name] is not None and knobs[name] < 1:
            raise _UsageError(f"{name.replace('_', '-')} must be >= 1")
    budget = size("--budget", opts.budget)
    print(f"predicted peak RSS per rank (micro-batch {knobs['micro_batch']}, sequence "
          f"{knobs['seq_len'] or 'from the model'}, grad-accum {knobs['grad_accum']}, sub_group_size "
          f"{_count(knobs['sub_group_size'])}, buffer_count {knobs['buffer_count']}); peak = baseline + runtime + "
          f"states + buffers + max(gathered + activations, unstaged, step)")
    table = [["stage", "ranks", "offload opt/param", "baseline", "runtime", "states", "buffers", "gathered",
              "activations", "unstaged", "step", "peak RSS"] + (["budget"] if budget else [])]
    over = False
    notes: list[str] = []
    for r in rows:
        pred = predict_peak_rss(subject, r.world_size, r.stage, r.offload_optimizer, r.offload_param, r.precision,
                                r.optimizer, largest_layer_params=largest if isinstance(subject, int) else None,
                                **knobs)
        notes += pred.notes
        verdict = []
        if budget:
            fits = check_budget(pred, budget) is None
            over = over or not fits
            verdict = ["fits" if fits else "OVER"]
        table.append([str(r.stage), str(r.world_size), f"{r.offload_optimizer}/{r.offload_param}"]
                     + [format_bytes(v) for v in (pred.baseline, pred.runtime, pred.model_states, pred.buffers,
                                                   pred.gathered, pred.activations, pred.unstaged, pred.step,
                                                   pred.total)] + verdict)
    print(_render(table))
    for note in dict.fromkeys(notes):
        print(f"note: {note}")
    if budget:
        print(f"budget {format_bytes(budget)} (zero_optimization.host_memory_budget): "
              + ("some rows are OVER: initialize() refuses those configs" if over else "every row fits"))
    return over


if __name__ == "__main__":
    sys.exit(main())
