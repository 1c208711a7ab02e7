"""DeepSpeed's flops profiler (``deepspeed.profiling.flops_profiler``): FLOPs, MACs, parameters and latency per module.

``import microspeed as deepspeed`` scripts reach it as ``deepspeed.profiling.flops_profiler``::

    flops, macs, params = get_model_profile(model, args=[tokens])          # "8.39 M", "4.19 MMACs", "107.9 K"

    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    prof.stop_profile()
    prof.print_model_profile(module_depth=2, top_modules=3)
    prof.end_profile()

How it counts
-------------
While a profile is running, a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op
and prices it with PyTorch's own FLOP formulas (``torch.utils.flop_counter``'s registry: ``mm``, ``addmm``,
``bmm``, ``baddbmm``, convolutions, scaled-dot-product attention kernels, and any formula registered with
``torch.utils.flop_counter.register_flop_formula``), trying an op's decomposition first when it has no
formula, exactly as :class:`torch.utils.flop_counter.FlopCounterMode` does. Forward pre/post hooks on every
module keep the stack of modules that are running; an op's FLOPs are added to each module on the stack (so
a module's count includes its children's) — the profile's total therefore equals ``FlopCounterMode``'s total
for the same forward pass.

Conventions, and where they differ from DeepSpeed's profiler (which patches ``torch.nn.functional``):

* **FLOPs and MACs.** Every op in the registry is a multiply-accumulate kernel (matmul, convolution,
  attention) whose formula counts 2 FLOPs per MAC, so ``MACs = FLOPs / 2`` for each op (DeepSpeed uses the
  same ``2 * MACs`` for linear layers).
* **Element-wise ops are not counted** (activations, normalisation, softmax, pooling, residual adds):
  DeepSpeed adds an estimate for each; here the count is ``FlopCounterMode``'s, which is the tensor-core work
  that dominates and what MFU calculations use. Pass ``custom_mapping`` (``{aten op: formula}``, formulas
  as in ``FlopCounterMode(custom_mapping=...)``) to price more ops.
* **Only the model's forward is counted**: ops outside the profiled module's forward (a loss computed
  outside it, the backward pass, the optimizer) are not. Ops inside an ``ignore_modules`` module (and its
  children) are excluded from every count, that module's and its ancestors'.
* **CPU attention**: PyTorch's registry prices SDPA's CUDA kernels; on CPU SDPA runs
  ``aten._scaled_dot_product_flash_attention_for_cpu``, which the registry (and so ``FlopCounterMode``)
  does not price. :data:`CPU_ATTENTION_FLOPS` is a ready ``custom_mapping`` for it.
* **Parameters** are the trainable ones (``requires_grad``), counted once per module even when shared, as
  DeepSpeed does.
* **Latency** is the wall time of each module's forward (summed over calls), measured by the hooks with a
  CUDA synchronisation on each side when the model is on a GPU. It includes the counting overhead (one
  Python call per aten op), which matters for small models and on CPU: time a run without the profiler
  for precise latencies.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count, shape_wrapper

__all__ = [
    "CPU_ATTENTION_FLOPS",
    "DEFAULT_PRECISION",
    "FlopsProfiler",
    "ModuleProfile",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
    "write_profile_text",
]

DEFAULT_PRECISION = 2
"""Digits after the decimal point in the human-readable numbers."""



def _cpu_sdpa_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                    **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


CPU_ATTENTION_FLOPS: dict[Any, Callable[..., int]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
}
"""A ``custom_mapping`` pricing SDPA's CPU kernel with PyTorch's own SDPA formula (``2 * B * H * (L*S*E + L*S*Ev)``;
causal masking is not discounted, as for the CUDA kernels)."""

# Metadata queries FlopCounterMode leaves to the default dispatch (they are not ops that compute anything).
_PASS_THROUGH = {
    torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format,
    torch.ops.aten.is_strides_like_format.default,
    torch.ops.aten.is_non_overlapping_and_dense.default,
    torch.ops.aten.size.default,
    torch.ops.aten.sym_size.default,
    torch.ops.aten.stride.default,
    torch.ops.aten.sym_stride.default,
    torch.ops.aten.storage_offset.default,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.numel.default,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.dim.default,
    torch.ops.prim.layout.default,
}
_sym_is_contiguous = getattr(torch.ops.aten, "sym_is_contiguous", None)
if _sym_is_contiguous is not None:
    _PASS_THROUGH.add(_sym_is_contiguous.default)


# ---------------------------------------------------------------------------------------------------------
# Human-readable numbers (DeepSpeed's formats: "8.39 M", "4.19 MMACs", "1.2 GFLOPS", "12.3 ms").

_UNITS = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0), ("m", 1e-3), ("u", 1e-6))


def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``num`` with a metric prefix: ``number_to_string(8388608) == "8.39 M"``; ``units`` forces one (``"G"``)."""
    if units is None:
        magnitude, units = 1e-6, "u"
        if num == 0:
            magnitude, units = 1.0, ""
        else:
            for prefix, scale in _UNITS:
                if abs(num) >= scale:
                    magnitude, units = scale, prefix
                    break
    else:
        scales = dict(_UNITS)
        if units not in scales:
            raise ValueError(f"units={units!r}: expected one of {', '.join(repr(u) for u, _ in _UNITS)} or None.")
        magnitude = scales[units]
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """MACs with a prefix: ``"4.19 MMACs"``."""
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """A FLOP rate (per second) with a prefix: ``"1.2 GFLOPS"``."""
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """A parameter count, billions as ``B``: ``"107.9 K"``, ``"1.3 B"``."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """A duration in seconds with a prefix: ``"12.3 ms"``."""
    return f"{number_to_string(seconds, units, precision)}s"


# ---------------------------------------------------------------------------------------------------------
# Per-module records and the counting mode.


@dataclass
class ModuleProfile:
    """What the profiler measured for one module (children included in every number).

    Attributes:
        name: the module's name in the model (``"blocks.0.attn"``; ``""`` for the model itself).
        type_name: the module's class name.
        depth: 0 for the model, 1 for its children, ...
        params: trainable parameters (``requires_grad``) of the module and its children.
        flops: floating-point operations of its forward calls while profiling.
        macs: multiply-accumulates (``flops / 2`` per op).
        latency: seconds spent in its forward calls while profiling.
        calls: forward calls while profiling (0 for a container such as ``ModuleList`` that is never
            called: its flops, MACs and latency are then its children's sums).
        ignored: whether ``ignore_modules`` named it (its ops are not counted).
        children: names of the direct children, in registration order.
    """

    name: str
    type_name: str
    depth: int
    params: int
    flops: int = 0
    macs: int = 0
    latency: float = 0.0
    calls: int = 0
    ignored: bool = False
    children: list[str] = field(default_factory=list)

    def reset(self) -> None:
        """Zero the measured numbers (parameters stay)."""
        self.flops = self.macs = self.calls = 0
        self.latency = 0.0


class _CountingMode(TorchDispatchMode):
    """Prices each aten op as ``FlopCounterMode`` does and hands the count to the profiler."""

    def __init__(self, profiler: FlopsProfiler) -> None:
        super().__init__()
        self.profiler = profiler

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105 - torch protocol
        kwargs = kwargs or {}
        if func in _PASS_THROUGH:
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            return NotImplemented
        registry = self.profiler._registry
        # As FlopCounterMode: an overload is never a registry key (packets are), so every op but prim.device
        # first tries its CompositeImplicit decomposition, whose ops come back here and are priced one by one.
        if func not in registry and func is not torch.ops.prim.device.default:
            with self:
                out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
        out = func(*args, **kwargs)
        formula = registry.get(func._overloadpacket)
        if formula is not None:
            self.profiler._count(func._overloadpacket, formula(*args, **kwargs, out_val=out))
        return out


def _trainable_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _is_ignored(module: nn.Module, ignore: Sequence[Any]) -> bool:
    return any(module is item or (isinstance(item, type) and isinstance(module, item)) for item in ignore)


def _check_ignore_list(ignore_list: Iterable[Any] | None) -> list[Any]:
    items = list(ignore_list or [])
    for item in items:
        if not (isinstance(item, nn.Module) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(f"ignore_modules / ignore_list: {item!r} is neither an nn.Module class nor an "
                            "nn.Module instance; give module classes (nn.Dropout) or modules of the model.")
    return items


def _sync_if_cuda(model: nn.Module) -> Callable[[], None]:
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


class FlopsProfiler:
    """Measures FLOPs, MACs, parameters and forward latency of every module of ``model``.

    Use ``start_profile()`` before a forward pass, ``stop_profile()`` after it, read the totals
    (``get_total_flops()``, ...) or print the profile (``print_model_profile()``), then ``end_profile()``.
    Calls made between start and stop add up (several forward passes are summed).

    Args:
        model: the module to profile.
        ds_engine: the training engine, when profiling inside one: its world size, data-parallel size
            and micro-batch size are added to the printed summary.
        recompute_fwd_factor: fraction of the forward recomputed in the backward (activation
            checkpointing), used for the printed ``fwd+bwd`` estimate: ``(3 + factor) * forward flops``.
        custom_mapping: extra ``{aten op (packet or overload): formula}`` prices, formulas taking the
            op's argument shapes as ``FlopCounterMode(custom_mapping=...)``'s do (e.g.
            :data:`CPU_ATTENTION_FLOPS`).
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0,
                 custom_mapping: Mapping[Any, Callable[..., int]] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler(model=...): expected a torch.nn.Module, got {type(model).__name__}.")
        if not isinstance(recompute_fwd_factor, int | float) or recompute_fwd_factor < 0:
            raise ValueError(f"FlopsProfiler(recompute_fwd_factor={recompute_fwd_factor!r}): expected a number "
                             ">= 0 (the fraction of the forward recomputed in the backward, 0.0 without it).")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self._registry: dict[Any, Callable[..., int]] = dict(flop_registry)
        for op, formula in (custom_mapping or {}).items():
            packet = getattr(op, "_overloadpacket", op)
            self._registry[packet] = formula if getattr(formula, "_get_raw", False) else shape_wrapper(formula)
        self.started = False
        self.profiles: dict[str, ModuleProfile] = {}
        self.flops_by_op: dict[str, int] = {}
        self._handles: list[Any] = []
        self._mode: _CountingMode | None = None
        self._stack: list[ModuleProfile] = []
        self._ignored_running = 0
        self._starts: dict[int, list[float]] = {}
        self._sync: Callable[[], None] = lambda: None

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether a profile is being taken now (between ``start_profile`` and ``stop_profile``)."""
        return self._mode is not None

    def start_profile(self, ignore_list: Iterable[Any] | None = None) -> None:
        """Start counting: install the module hooks and the counting mode, from zero.

        Args:
            ignore_list: module classes (``nn.Dropout``) or module instances whose forward is not
                counted (nor their children's).
        """
        if self.running:
            raise RuntimeError("FlopsProfiler.start_profile(): a profile is already running; call stop_profile() "
                               "first.")
        ignore = _check_ignore_list(ignore_list)
        self.profiles = self._build_profiles(ignore)
        self.flops_by_op = {}
        self._stack, self._ignored_running, self._starts = [], 0, {}
        self._sync = _sync_if_cuda(self.model)
        for name, module in self.model.named_modules():
            record = self.profiles[name]
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(record)))
            self._handles.append(module.register_forward_hook(self._post_hook(record), always_call=True))
        self._mode = _CountingMode(self)
        self._mode.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting and remove the hooks; the measured profile stays until ``end_profile``."""
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()
        self._ignored_running = 0
        if "" in self.profiles:
            self._fill_containers(self.profiles[""])

    def _fill_containers(self, record: ModuleProfile) -> None:
        """A module never called (a ``ModuleList``) shows the sums of its children, as in DeepSpeed."""
        for child in record.children:
            self._fill_containers(self.profiles[child])
        if record.calls == 0 and record.children and not record.ignored:
            kids = [self.profiles[c] for c in record.children]
            record.flops = sum(k.flops for k in kids)
            record.macs = sum(k.macs for k in kids)
            record.latency = sum(k.latency for k in kids)

    def reset_profile(self) -> None:
        """Zero the measured FLOPs, MACs, latencies and calls (a running profile keeps running)."""
        for record in self.profiles.values():
            record.reset()
        self.flops_by_op = {}

    def end_profile(self) -> None:
        """Stop (if running) and drop the profile."""
        self.stop_profile()
        self.profiles = {}
        self.flops_by_op = {}
        self.started = False

    def _build_profiles(self, ignore: Sequence[Any]) -> dict[str, ModuleProfile]:
        profiles: dict[str, ModuleProfile] = {}
        for name, module in self.model.named_modules():
            profiles[name] = ModuleProfile(
                name=name, type_name=type(module).__name__, depth=0 if not name else name.count(".") + 1,
                params=_trainable_params(module), ignored=_is_ignored(module, ignore),
            )
        for name in profiles:
            if name:
                parent = name.rpartition(".")[0]
                profiles[parent].children.append(name)
        return profiles

    def _pre_hook(self, record: ModuleProfile) -> Callable[..., None]:
        def pre(module: nn.Module, inputs: Any) -> None:
            if record.ignored:
                self._ignored_running += 1
            self._stack.append(record)
            self._sync()
            self._starts.setdefault(id(record), []).append(time.perf_counter())

        return pre

    def _post_hook(self, record: ModuleProfile) -> Callable[..., None]:
        def post(module: nn.Module, inputs: Any, output: Any) -> None:
            starts = self._starts.get(id(record))
            if not starts:  # the hooks were installed while this module was already running
                return
            self._sync()
            record.latency += time.perf_counter() - starts.pop()
            record.calls += 1
            for i in range(len(self._stack) - 1, -1, -1):
                if self._stack[i] is record:
                    del self._stack[i]
                    break
            if record.ignored:
                self._ignored_running -= 1

        return post

    def _count(self, op: Any, flops: int) -> None:
        if not self._stack or self._ignored_running or not flops:
            return
        flops = int(flops)
        seen: set[int] = set()
        for record in self._stack:
            if id(record) not in seen:  # a module re-entered (recursion) counts once
                seen.add(id(record))
                record.flops += flops
                record.macs += flops // 2
        key = str(op)
        self.flops_by_op[key] = self.flops_by_op.get(key, 0) + flops

    # -- totals --------------------------------------------------------------------------------------

    def _root(self) -> ModuleProfile:
        if not self.started or "" not in self.profiles:
            raise RuntimeError("FlopsProfiler: no profile; call start_profile(), run the model, then stop_profile().")
        return self.profiles[""]

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """FLOPs of the model's profiled forward pass(es) (``"8.39 M"`` with ``as_string``)."""
        flops = self._root().flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulates of the profiled forward pass(es) (``"4.19 MMACs"`` with ``as_string``)."""
        macs = self._root().macs
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds spent in the model's forward while profiling (``"12.3 ms"`` with ``as_string``)."""
        seconds = self._root().latency
        return duration_to_string(seconds) if as_string else seconds

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Trainable parameters of the model (``"107.9 K"`` with ``as_string``)."""
        params = self._root().params
        return params_to_string(params) if as_string else params

    def get_module_profile(self, name: str = "") -> ModuleProfile:
        """The record of the module called ``name`` in the model (``""``: the model itself)."""
        self._root()
        if name not in self.profiles:
            raise KeyError(f"FlopsProfiler.get_module_profile({name!r}): no such module; names are those of "
                           "model.named_modules().")
        return self.profiles[name]

    # -- printing ------------------------------------------------------------------------------------

    def format_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                             detailed: bool = True, extra_summary: Sequence[tuple[str, str]] = ()) -> str:
        """The profile as text: summary, top modules per depth, and (``detailed``) the module tree.

        ``extra_summary`` adds ``(label, value)`` lines to the summary (the engine plugin adds the
        backward and step latencies there).
        """
        _check_print_args(module_depth, top_modules)
        root = self._root()
        out = io.StringIO()
        line = "{:<66}  {}".format
        print("\n-------------------------- microspeed flops profiler --------------------------", file=out)
        print(f"Profile summary at step {profile_step}:", file=out)
        print("Notation: params (trainable parameters), MACs (multiply-accumulates), flops (floating-point\n"
              "operations, 2 per MAC), FLOPS (flops per second), fwd/bwd latency (forward/backward wall time).\n",
              file=out)
        engine = self.ds_engine
        if engine is not None:
            for label, value in _engine_lines(engine):
                print(line(label, value), file=out)
        print(line("params per GPU:", params_to_string(root.params)), file=out)
        print(line("fwd MACs per GPU:", macs_to_string(root.macs)), file=out)
        print(line("fwd flops per GPU:", f"{number_to_string(root.flops)} ({root.flops} flops)"), file=out)
        print(line("fwd latency:", duration_to_string(root.latency)), file=out)
        print(line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency:",
                   flops_to_string(root.flops / root.latency) if root.latency > 0 else "n/a"), file=out)
        for label, value in extra_summary:
            print(line(label, value), file=out)
        if self.flops_by_op:
            by_op = ", ".join(f"{op}: {number_to_string(n)}" for op, n in
                              sorted(self.flops_by_op.items(), key=lambda kv: -kv[1]))
            print(line("fwd flops by op:", by_op), file=out)

        print("\n----------------------------- Aggregated profile per GPU -----------------------------", file=out)
        print(self._aggregated(module_depth, top_modules), file=out, end="")
        if detailed:
            print("\n------------------------------ Detailed profile per GPU ------------------------------",
                  file=out)
            print("Each module: params, % of total params, MACs, % of total MACs, fwd latency, % of total fwd "
                  "latency, fwd FLOPS", file=out)
            print("(a module called several times sums its calls; an ignored module shows 0 MACs)\n", file=out)
            self._tree(root, root, module_depth, out)
        print("--------------------------------------------------------------------------------------", file=out)
        return out.getvalue()

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | os.PathLike | None = None) -> None:
        """Print the profile (see :meth:`format_model_profile`) to stdout, or write it to ``output_file``.

        Args:
            profile_step: the training step the profile was taken at (shown in the header).
            module_depth: deepest module level shown in the tables (``-1``: all of them).
            top_modules: how many modules per depth the aggregated table lists.
            detailed: also print the module tree with each module's numbers.
            output_file: a file to write (overwritten; folders are made) instead of printing.
        """
        if not self.started:
            return
        write_profile_text(self.format_model_profile(profile_step, module_depth, top_modules, detailed), output_file)

    def _aggregated(self, module_depth: int, top_modules: int) -> str:
        by_depth: dict[int, dict[str, list[float]]] = {}
        for record in self.profiles.values():
            agg = by_depth.setdefault(record.depth, {}).setdefault(record.type_name, [0, 0, 0.0])
            agg[0] += record.params
            agg[1] += record.macs
            agg[2] += record.latency
        depths = sorted(by_depth) if module_depth < 0 else [d for d in sorted(by_depth) if d <= module_depth]
        out = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
        for depth in depths:
            info = by_depth[depth]

            def top(i: int, fmt: Callable[[float], str], info: dict[str, list[float]] = info) -> str:
                best = sorted(info.items(), key=lambda kv: -kv[1][i])[:top_modules]
                return "{" + ", ".join(f"'{name}': '{fmt(v[i])}'" for name, v in best) + "}"

            out.append(f"depth {depth}:")
            out.append(f"    params      - {top(0, params_to_string)}")
            out.append(f"    MACs        - {top(1, macs_to_string)}")
            out.append(f"    fwd latency - {top(2, duration_to_string)}")
        return "\n".join(out) + "\n"

    def _tree(self, record: ModuleProfile, root: ModuleProfile, module_depth: int, out: io.StringIO) -> None:
        indent = "  " * record.depth
        label = f"({record.name.rpartition('.')[2]}): " if record.name else ""
        flops_rate = flops_to_string(record.flops / record.latency) if record.latency > 0 else "0 FLOPS"
        print(f"{indent}{label}{record.type_name}{' [ignored]' if record.ignored else ''}: "
              f"{params_to_string(record.params)} = {_pct(record.params, root.params)} Params, "
              f"{macs_to_string(record.macs)} = {_pct(record.macs, root.macs)} MACs, "
              f"{duration_to_string(record.latency)} = {_pct(record.latency, root.latency)} latency, "
              f"{flops_rate}", file=out)
        if module_depth < 0 or record.depth < module_depth:
            for child in record.children:
                self._tree(self.profiles[child], root, module_depth, out)


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"


def _check_print_args(module_depth: int, top_modules: int) -> None:
    if not isinstance(module_depth, int) or isinstance(module_depth, bool) or module_depth < -1:
        raise ValueError(f"module_depth={module_depth!r}: expected an integer >= -1 (-1 shows every depth).")
    if not isinstance(top_modules, int) or isinstance(top_modules, bool) or top_modules < 1:
        raise ValueError(f"top_modules={top_modules!r}: expected an integer >= 1.")


def _engine_lines(engine: Any) -> list[tuple[str, str]]:
    lines = []
    topology = getattr(engine, "topology", None)
    world = getattr(topology, "world_size", None)
    dp = getattr(topology, "data_parallel_size", None)
    if world is not None:
        lines.append(("world size:", str(world)))
    if dp is not None:
        lines.append(("data parallel size:", str(dp)))
    with contextlib.suppress(Exception):
        lines.append(("batch size per GPU:", str(engine.train_micro_batch_size_per_gpu())))
    return lines


def write_profile_text(text: str, output_file: str | os.PathLike | None) -> None:
    """Write ``text`` to ``output_file`` (overwritten, folders made), or to stdout when it is empty or ``None``."""
    if output_file:
        folder = os.path.dirname(os.path.abspath(output_file))
        os.makedirs(folder, exist_ok=True)
        with open(output_file, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | os.PathLike | None = None,
    ignore_modules: Iterable[Any] | None = None,
    custom_mapping: Mapping[Any, Callable[..., int]] | None = None,
) -> tuple[Any, Any, Any]:
    """Profile one forward pass of ``model``; return ``(flops, macs, params)``.

    The model runs in eval mode (restored afterwards) under ``torch.no_grad()``: ``warm_up`` times
    unprofiled, then once profiled.

    Args:
        model: the module.
        input_shape: a tuple: the model is called with one tensor of that shape (``torch.ones`` in the
            dtype and on the device of the model's first parameter). Otherwise give ``args``/``kwargs``.
        args: positional inputs of the forward.
        kwargs: keyword inputs of the forward.
        print_profile: print (or write to ``output_file``) the profile.
        detailed: include the module tree in the printed profile.
        module_depth: deepest module level printed (``-1``: all).
        top_modules: modules per depth in the aggregated table.
        warm_up: unprofiled forward passes before the profiled one (``>= 0``).
        as_string: return ``("8.39 M", "4.19 MMACs", "107.9 K")`` rather than integers.
        output_file: write the printed profile to this file instead of stdout.
        ignore_modules: module classes or instances not counted (nor their children).
        custom_mapping: extra op prices (see :class:`FlopsProfiler`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile(model=...): expected a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(warm_up, int) or isinstance(warm_up, bool) or warm_up < 0:
        raise ValueError(f"get_model_profile(warm_up={warm_up!r}): expected an integer >= 0.")
    _check_print_args(module_depth, top_modules)
    kwargs = dict(kwargs or {})
    args = list(args or [])
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in input_shape):
            raise ValueError(f"get_model_profile(input_shape={input_shape!r}): expected a non-empty tuple of "
                             "positive integers, e.g. (batch, 3, 224, 224).")
        if args:
            raise ValueError("get_model_profile(): give input_shape or args, not both.")
        param = next(model.parameters(), None)
        args = [torch.ones(input_shape, dtype=param.dtype if param is not None else torch.float32,
                           device=param.device if param is not None else None)]
    if not args and not kwargs:
        raise ValueError("get_model_profile(): give the model's inputs as input_shape=(...), args=[...] or "
                         "kwargs={...}.")
    profiler = FlopsProfiler(model, custom_mapping=custom_mapping)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(warm_up):
                model(*args, **kwargs)
            profiler.start_profile(ignore_list=ignore_modules)
            try:
                model(*args, **kwargs)
            finally:
                profiler.stop_profile()
        flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
        if print_profile:
            profiler.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                         detailed=detailed, output_file=output_file)
    finally:
        profiler.end_profile()
        model.train(was_training)
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
