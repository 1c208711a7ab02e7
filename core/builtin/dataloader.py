"""The simplified data loader: ``training_data`` becomes a distributed-sampled DataLoader.

Each data-parallel rank reads its own shard (``DistributedSampler``) in micro-batches of
``train_micro_batch_size_per_gpu``; the shuffle order changes every epoch, deterministically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from microspeed.config import Field
from microspeed.data import RepeatingLoader  # noqa: F401 - its home before the kernel took it
from microspeed.hookspecs import hookimpl


class MicroBatchLoader:
    """Iterates micro-batches of one data-parallel rank's shard; reshuffles each epoch.

    ``len()`` is the number of micro-batches per epoch on this rank. ``state_dict()`` records
    the epoch and how many micro-batches of it were consumed, so a resumed run continues where
    it stopped.
    """

    def __init__(self, dataset: Any, batch_size: int, num_replicas: int, rank: int,
                 collate_fn: Callable | None = None, drop_last: bool = False, seed: int = 0,
                 shuffle: bool = True) -> None:
        self.sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                                          seed=seed, drop_last=drop_last)
        # No generator of its own: starting an epoch draws one number from the global torch RNG (the
        # DataLoader's base seed), exactly as DeepSpeed's loader does, so dropout and noisy gates that
        # draw afterwards see the same stream as under DeepSpeed on the same seed.
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, collate_fn=collate_fn,
                                 drop_last=drop_last)
        self.epoch = 0
        self.consumed = 0
        self._skip = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        skip, self._skip = self._skip, 0
        self.consumed = 0
        # A resumed epoch must not draw again: the run it continues drew this epoch's number before it saved
        # (with load_rng_state=True the restored stream then continues exactly).
        self.loader.generator = torch.Generator() if skip else None
        for i, batch in enumerate(self.loader):
            if i < skip:
                continue
            self.consumed = i + 1
            yield batch
        self.epoch += 1
        self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        """Epoch and micro-batches consumed in it."""
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position: the next ``iter()`` skips what was consumed.

        A checkpoint also records ``micro_batch_size`` and ``num_replicas``. When they differ from
        this loader's (a run resumed on another number of ranks), the position is carried over by
        *global sample count*: every rank's shuffled order of an epoch is the same permutation, and
        micro-batch ``k`` of all ranks together covers its positions ``[k*B*N, (k+1)*B*N)``, so the
        resumed run continues with the very same samples. A count that does not divide
        ``micro_batch_size * num_replicas`` rounds down (a few samples are seen again), with a warning.
        """
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        old = (int(state.get("micro_batch_size", self.loader.batch_size)),
               int(state.get("num_replicas", self.sampler.num_replicas)))
        new = (int(self.loader.batch_size), int(self.sampler.num_replicas))
        if old != new:
            samples = consumed * old[0] * old[1]
            consumed, rest = divmod(samples, new[0] * new[1])
            if rest:
                import warnings

                warnings.warn(f"data loader resumed with micro_batch_size*ranks {new[0]}*{new[1]} instead of "
                              f"{old[0]}*{old[1]}: {samples} samples of epoch {epoch} were consumed, resuming at "
                              f"{consumed * new[0] * new[1]} ({rest} samples are seen again)", stacklevel=2)
        self.epoch, self._skip = epoch, consumed


class DataLoaderPlugin:
    """Default answer to ``microspeed_make_dataloader``."""

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``dataloader_drop_last``."""
        return {"dataloader_drop_last": Field((bool,), False, "drop the last incomplete micro-batch")}

    @hookimpl(trylast=True)
    def microspeed_make_dataloader(self, engine, dataset: Any, collate_fn: Callable | None) -> MicroBatchLoader:
        """A :class:`MicroBatchLoader` over this rank's shard of ``dataset``.

        As DeepSpeed: any map-style dataset — an object with ``__getitem__`` and ``__len__``, a
        list or tuple of samples included — is accepted.
        """
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            from microspeed.errors import ConfigError

            iterable = isinstance(dataset, torch.utils.data.IterableDataset)
            kind = ("an IterableDataset, which cannot be sharded across ranks by index; wrap it in a map-style "
                    "Dataset or pass the loader to your own loop" if iterable else type(dataset).__name__)
            raise ConfigError(f"initialize(training_data=...): expected a map-style dataset (an indexable sequence "
                              f"with __getitem__ and __len__: a torch Dataset, a list, ...), got {kind}.")
        topo = engine.topology
        return MicroBatchLoader(dataset, engine.train_micro_batch_size_per_gpu(), topo.data_parallel_size,
                                topo.data_parallel_rank, collate_fn, engine.config["dataloader_drop_last"])

    @hookimpl
    def microspeed_checkpoint_state(self, engine) -> dict | None:
        """The loader's position, so resumed training sees the same data."""
        loader = engine.training_dataloader
        if not isinstance(loader, MicroBatchLoader):
            return None
        return {"dataloader": {**loader.state_dict(), "micro_batch_size": loader.loader.batch_size,
                               "num_replicas": loader.sampler.num_replicas}}

    @hookimpl
    def microspeed_load_checkpoint_state(self, engine, states: dict) -> None:
        """Restore the loader's position."""
        loader = engine.training_dataloader
        if isinstance(loader, MicroBatchLoader) and "dataloader" in states:
            loader.load_state_dict(states["dataloader"])
