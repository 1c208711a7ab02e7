"""RNG states for tensor parallelism: dropout that differs across shards where it should.

Inside a tensor-parallel region each rank holds a different slice of the activations (the output
of a :class:`~microspeed_pipeline.tensor_parallel.ColumnParallelLinear`), so dropout there must draw
*different* masks on each rank — otherwise the shards of one full tensor would share a pattern. On
replicated activations (after a row-parallel reduce, in layer norms) every tensor-parallel rank must
draw the *same* mask. Megatron's answer, kept here: the default generator is seeded identically on
every tensor-parallel rank, and a named extra state (``model-parallel-rng``), seeded with an offset
by the tensor-parallel rank, is swapped in with ``with get_rng_tracker().fork(): ...``.

States are those of the CPU generator and, when CUDA is available, the current CUDA device's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""Name of the tracker state used inside tensor-parallel regions."""

_MODEL_PARALLEL_OFFSET = 2718


def _get_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if torch.cuda.is_available() else None)


def _set_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


class RNGStatesTracker:
    """Named RNG states that can be swapped in for a block of code (``fork``)."""

    def __init__(self) -> None:
        self.states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every state."""
        self.states.clear()
        self.seeds.clear()

    def get_states(self) -> dict[str, Any]:
        """A copy of the named states (for activation-checkpoint recomputation)."""
        return dict(self.states)

    def set_states(self, states: dict[str, Any]) -> None:
        """Replace the named states (the inverse of :meth:`get_states`)."""
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Create the state ``name`` from ``seed`` (both must be new)."""
        if seed in self.seeds:
            raise ValueError(f"RNG seed {seed} already exists in the tracker.")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists in the tracker.")
        self.seeds.add(seed)
        saved = _get_state()
        torch.manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the state ``name``; it advances, and the outer state is restored after."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not in the tracker: call model_parallel_seed(seed) first.")
        outer = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(outer)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (process wide, as the RNGs it manages)."""
    return _TRACKER


def model_parallel_seed(seed: int, tensor_parallel_rank: int | None = None) -> None:
    """Seed the default RNG with ``seed`` and the model-parallel state with ``seed + 2718 + tp_rank``.

    ``tensor_parallel_rank`` defaults to the default grid's (see
    :func:`microspeed_pipeline.topology.get_default_grid`), or 0 without one.
    """
    if tensor_parallel_rank is None:
        from microspeed_pipeline.topology import get_default_grid

        grid = get_default_grid()
        tensor_parallel_rank = grid.get_model_parallel_rank() if grid is not None else 0
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_OFFSET + tensor_parallel_rank)


get_cuda_rng_tracker = get_rng_tracker
"""Megatron's and DeepSpeed's name for :func:`get_rng_tracker`."""

model_parallel_cuda_manual_seed = model_parallel_seed
"""Megatron's and DeepSpeed's name for :func:`model_parallel_seed`."""
