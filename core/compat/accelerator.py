"""``get_accelerator()``: DeepSpeed's device abstraction, for the CPU and CUDA.

Scripts written for DeepSpeed ask the accelerator object, not ``torch.cuda``, which device to
use, how much memory is in use, whether bf16 works and which communication backend to start
(``get_accelerator().device_name()``, ``.memory_allocated()``, ``.communication_backend_name()``).
:class:`Accelerator` answers for the device :func:`microspeed.comm.device` picks: CUDA when it is
available (each method delegates to ``torch.cuda``), else the CPU (memory figures come from the
process's resident set, streams and events are inert objects, as DeepSpeed's CPU accelerator has).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]


def _rss_bytes() -> int:
    """Resident memory of this process in bytes (0 where /proc is not readable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _meminfo(field: str) -> int:
    """A ``/proc/meminfo`` field in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class _CpuStream:
    """A stream on the CPU: work is already ordered, so every method returns at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def synchronize(self) -> None:
        """Nothing to wait for on the CPU."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for on the CPU."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for on the CPU."""

    def query(self) -> bool:
        """Always complete."""
        return True


class _CpuEvent:
    """An event on the CPU: records the wall time, so ``elapsed_time`` works as with CUDA events."""

    def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
        del kwargs
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        """Remember the time."""
        import time

        self._t = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for on the CPU."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for on the CPU."""

    def elapsed_time(self, end: _CpuEvent) -> float:
        """Milliseconds from this event's record to ``end``'s."""
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time: both events must have been recorded")
        return (end._t - self._t) * 1000.0


class Accelerator:
    """DeepSpeed's accelerator interface for ``cuda`` or ``cpu`` (see the module docstring)."""

    def __init__(self, name: str | None = None) -> None:
        if name is None:
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name not in ("cuda", "cpu"):
            raise ValueError(f"Accelerator({name!r}): microspeed supports 'cuda' and 'cpu'")
        if name == "cuda" and not torch.cuda.is_available():
            raise ValueError("Accelerator('cuda'): torch.cuda.is_available() is False; use 'cpu'")
        self._name = name
        self._cuda = name == "cuda"
        self._peak_rss = _rss_bytes()
        self._compile_backend = "inductor"

    # ---------------------------------------------------------------- device
    def is_synchronized_device(self) -> bool:
        """Whether work runs in program order with the host (the CPU: yes)."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        """Whether timers may read the host clock (as on a synchronized device)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """Whether the device orders dependent work itself (the CPU: yes)."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """Whether allocation waits for memory to free up (the CPU: yes)."""
        return self.is_synchronized_device()

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``/``"cpu"``, or ``"cuda:<i>"`` with an index (the CPU ignores it)."""
        if device_index is None or not self._cuda:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        """The ``torch.device`` of ``device_index`` (default: the current device)."""
        if not self._cuda:
            return torch.device("cpu")
        return torch.device("cuda", self.current_device() if device_index is None else device_index)

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` current (nothing to do on the CPU)."""
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """Index of the current device (the CPU: 0)."""
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        """``"cuda:<i>"`` of the current device, or ``"cpu"``."""
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """Number of devices: CUDA's count; on the CPU, ``$LOCAL_SIZE`` when set (the ranks a launcher runs on
        this host, each its own "CPU device", as DeepSpeed's CPU accelerator counts), else one."""
        if self._cuda:
            return torch.cuda.device_count()
        try:
            local = int(os.environ.get("LOCAL_SIZE", "0"))
        except ValueError:
            local = 0
        return local if local > 0 else 1

    def is_available(self) -> bool:
        """Whether the device can be used."""
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        """The ``torch.distributed`` backend for this device: ``nccl`` or ``gloo``."""
        return "nccl" if self._cuda else "gloo"

    def is_triton_supported(self) -> bool:
        """Whether Triton kernels can run here (CUDA with the ``triton`` package)."""
        if not self._cuda:
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True

    def prefer_triton_grouped_mm(self) -> bool:
        """Whether grouped matmuls should use Triton (where Triton is supported)."""
        return self.is_triton_supported()

    def visible_devices_envs(self) -> list[str]:
        """Environment variables that select visible devices."""
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda else []

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        """Write the visible-device variables for a launched process into ``current_env``."""
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        """Prefixes of environment variables a launcher should pass on."""
        return ["NCCL"] if self._cuda else []

    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend in use (default ``inductor``)."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose the ``torch.compile`` backend."""
        self._compile_backend = backend

    # ---------------------------------------------------------------- random
    def random(self) -> Any:
        """The module holding the RNG functions (``torch.random``)."""
        return torch.random

    def manual_seed(self, seed: int) -> None:
        """Seed the device's generator (the CPU's is torch's global one)."""
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device's generator."""
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        """The seed the device's generator started from."""
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The device generator's state."""
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore the device generator's state."""
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        """The device's default generator."""
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # ---------------------------------------------------------------- streams and events
    @property
    def Stream(self) -> type:  # noqa: N802 - DeepSpeed's name
        """The stream class (inert on the CPU)."""
        return torch.cuda.Stream if self._cuda else _CpuStream

    @property
    def Event(self) -> type:  # noqa: N802 - DeepSpeed's name
        """The event class (on the CPU it records wall time)."""
        return torch.cuda.Event if self._cuda else _CpuEvent

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context that makes ``stream`` current (does nothing on the CPU)."""
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        """The current stream."""
        return torch.cuda.current_stream(device_index) if self._cuda else _CpuStream()

    def default_stream(self, device_index: int | None = None) -> Any:
        """The default stream."""
        return torch.cuda.default_stream(device_index) if self._cuda else _CpuStream()

    def is_current_stream_capturing(self) -> bool:
        """Whether a CUDA graph is being captured on the current stream."""
        return torch.cuda.is_current_stream_capturing() if self._cuda else False

    # ---------------------------------------------------------------- memory
    def empty_cache(self) -> None:
        """Release cached device memory (nothing cached on the CPU)."""
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes in use: CUDA's allocated memory, or the process's resident set on the CPU."""
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        rss = _rss_bytes()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated` since the last reset (CPU: as sampled by the calls)."""
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return max(self._peak_rss, self.memory_allocated())

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Start the peak over from now."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = _rss_bytes()

    reset_peak_memory_stats = reset_max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes reserved by the allocator (on the CPU the resident set)."""
        return torch.cuda.memory_reserved(device_index) if self._cuda else self.memory_allocated()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_reserved`."""
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else self.max_memory_allocated()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        """Allocator statistics (on the CPU the current and peak resident set)."""
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        current = self.memory_allocated()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self.max_memory_allocated(),
                "reserved_bytes.all.current": current}

    def total_memory(self, device_index: int | None = None) -> int:
        """Device memory in bytes (the CPU: the machine's RAM)."""
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return _meminfo("MemTotal")

    def available_memory(self, device_index: int | None = None) -> int:
        """Free device memory in bytes (the CPU: MemAvailable)."""
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return _meminfo("MemAvailable")

    # ---------------------------------------------------------------- dtypes
    def is_bf16_supported(self) -> bool:
        """Whether bf16 arithmetic works (the CPU: yes)."""
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        """Whether fp16 training is supported: yes, on CUDA and on the CPU alike.

        microspeed trains with ``fp16`` on the CPU (master weights, dynamic loss scaling; fp16 arithmetic runs
        on any CPU torch supports), so DeepSpeed's tests and scripts that pick fp16 when the accelerator
        offers it run here (DeepSpeed's own CPU accelerator answers yes where oneDNN has fp16 kernels).
        """
        return True

    def is_fp64_supported(self) -> bool:
        """Whether fp64 works."""
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        """Training dtypes supported here, in DeepSpeed's CPU accelerator's order (fp32, bf16, fp16)."""
        dtypes = [torch.float]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        return dtypes

    # ---------------------------------------------------------------- misc
    def range_push(self, msg: str) -> None:
        """Open a profiler range (NVTX on CUDA)."""
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        """Close the innermost profiler range."""
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` once the device is initialized (at once on the CPU)."""
        if self._cuda:
            torch.cuda._lazy_call(callback)
        else:
            callback()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """A page-locked copy of ``tensor`` where CUDA can use it; the tensor itself on the CPU."""
        del align_bytes
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is page-locked."""
        return tensor.is_pinned() if self._cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's device type."""
        return tensor.device.type == self._name

    def create_graph(self) -> Any:
        """A CUDA graph object (``None`` on the CPU)."""
        return torch.cuda.CUDAGraph() if self._cuda else None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> contextlib.AbstractContextManager:
        """Context that captures work into ``graph`` (runs the work plainly on the CPU)."""
        if self._cuda:
            return torch.cuda.graph(graph, pool, stream)
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        """Replay ``graph`` (nothing was captured on the CPU)."""
        if self._cuda:
            graph.replay()

    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        device = self._name

        def make(*args: Any) -> torch.Tensor:
            return torch.tensor(*args, dtype=dtype, device=device) if args and not isinstance(args[0], int) \
                else torch.empty(*args, dtype=dtype, device=device)
        return make

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        """Constructor of bf16 tensors on this device."""
        return self._tensor_type(torch.bfloat16)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        """Constructor of fp16 tensors on this device."""
        return self._tensor_type(torch.half)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        """Constructor of fp32 tensors on this device."""
        return self._tensor_type(torch.float)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        """Constructor of fp64 tensors on this device."""
        return self._tensor_type(torch.double)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        """Constructor of int32 tensors on this device."""
        return self._tensor_type(torch.int)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        """Constructor of int64 tensors on this device."""
        return self._tensor_type(torch.long)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        """Constructor of uint8 tensors on this device."""
        return self._tensor_type(torch.uint8)

    def op_builder_dir(self) -> str:
        """DeepSpeed compiles C++/CUDA ops through op builders; microspeed has none to build."""
        raise NotImplementedError("microspeed builds no DeepSpeed ops: its kernels are Triton or PyTorch "
                                  "(microspeed.ops), so there is no op builder directory")

    def create_op_builder(self, class_name: str) -> Any:
        """DeepSpeed's op builders have no counterpart here (see :meth:`op_builder_dir`)."""
        raise NotImplementedError(f"create_op_builder({class_name!r}): microspeed builds no DeepSpeed ops; "
                                  "use microspeed.ops (Triton/PyTorch kernels) instead")

    get_op_builder = create_op_builder

    def __repr__(self) -> str:
        return f"microspeed.Accelerator({self._name!r})"


_accelerator: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's accelerator: CUDA when available, else the CPU (``DS_ACCELERATOR`` chooses, as in DeepSpeed)."""
    global _accelerator
    if _accelerator is None:
        wanted = os.environ.get("DS_ACCELERATOR") or None
        if wanted not in (None, "cuda", "cpu"):
            raise ValueError(f"DS_ACCELERATOR={wanted!r}: microspeed supports 'cuda' and 'cpu'; unset it to choose "
                             "CUDA when available, else the CPU")
        _accelerator = Accelerator(wanted)
    return _accelerator


def set_accelerator(accel: Accelerator) -> None:
    """Replace the process's accelerator (DeepSpeed's ``set_accelerator``)."""
    global _accelerator
    _accelerator = accel

