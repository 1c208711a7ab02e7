"""Offline difficulty analysis: compute a metric over a dataset once and write the index files.

The curriculum data sampler (:mod:`microspeed_efficiency.data_sampler`) draws each batch from the
samples whose difficulty is within the current curriculum difficulty. It learns each sample's
difficulty from index files written here, before training, by :class:`DataAnalyzer` — DeepSpeed's
``DataAnalyzer`` for the ``single_value_per_sample`` metric type.

**Files.** DeepSpeed writes its own memory-mapped indexed-dataset format (``.bin``/``.idx``); this
module writes plain NumPy ``.npy`` arrays (``numpy.load(path, mmap_mode="r")`` maps them). For a
metric ``m`` over ``N`` samples, under ``<save_path>/<m>/``:

* ``m_sample_to_metric.npy`` — shape ``(N,)``: the metric value of sample ``i`` at position ``i``;
* ``m_index_to_metric.npy`` — shape ``(K,)``: the ``K`` distinct values, ascending (row ``r``'s value);
* ``m_index_to_sample.npy`` — shape ``(N,)``: the sample indices grouped by value, ascending value,
  ascending index inside a group (row ``r`` is ``index_to_sample[offsets[r]:offsets[r + 1]]``);
* ``m_index_to_sample_offsets.npy`` — shape ``(K + 1,)``: the row boundaries of the former.

In the ds_config, ``index_to_sample_path`` names ``m_index_to_sample`` (``.npy`` optional; the
offsets file is found next to it) and ``index_to_metric_path`` names ``m_index_to_metric``. Integer
metrics are stored as ``int64``, others as ``float64``.

**Workers.** A large dataset may be analysed by several processes: worker ``w`` of ``W``
(``num_workers=W, worker_id=w``) runs :meth:`DataAnalyzer.run_map` on the contiguous slice
``[N*w//W, N*(w+1)//W)`` and writes ``m_sample_to_metric_worker<w>.npy``; once every worker has
finished, one process runs :meth:`DataAnalyzer.run_reduce` to merge them into the files above.
:meth:`DataAnalyzer.run` does both for a single worker.

Example::

    analyzer = DataAnalyzer(dataset, metric_names=["seqlen"],
                            metric_functions=[lambda sample: int((sample[0] != PAD).sum())],
                            save_path="analysis")
    analyzer.run()
    index = MetricIndex.load("analysis/seqlen/seqlen_index_to_sample", "analysis/seqlen/seqlen_index_to_metric")
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["DataAnalyzer", "MetricIndex", "metric_paths", "write_index"]


def metric_paths(save_path: str | os.PathLike[str], metric: str) -> dict[str, str]:
    """The files :class:`DataAnalyzer` writes for ``metric`` under ``save_path`` (keys as in the module docstring).

    Returns ``{"sample_to_metric", "index_to_metric", "index_to_sample", "index_to_sample_offsets"}``
    paths (with ``.npy``).
    """
    folder = os.path.join(os.fspath(save_path), metric)
    return {kind: os.path.join(folder, f"{metric}_{kind}.npy")
            for kind in ("sample_to_metric", "index_to_metric", "index_to_sample", "index_to_sample_offsets")}


def _npy(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    return path if path.endswith(".npy") else path + ".npy"


def _as_values(values: Any, count: int, name: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.dtype == bool or not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
        raise TypeError(f"metric {name!r}: the metric function must return numbers, got dtype {array.dtype}.")
    array = array.reshape(-1)
    if array.size != count:
        raise ValueError(f"metric {name!r}: the metric function returned {array.size} values for {count} samples; "
                         f"return one number per sample.")
    if np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
        raise ValueError(f"metric {name!r}: the metric function returned a NaN or infinite value.")
    return array.astype(np.int64) if np.issubdtype(array.dtype, np.integer) else array.astype(np.float64)


class DataAnalyzer:
    """Computes per-sample difficulty metrics over a dataset and writes the curriculum index files.

    Args:
        dataset: a map-style dataset (``len()`` and ``dataset[i]``).
        metric_names: one name per metric; each names a folder under ``save_path``.
        metric_functions: one per metric. Without ``batch_size``: ``fn(sample) -> number``, called on
            ``dataset[i]``. With ``batch_size``: ``fn(batch) -> 1-D array/tensor`` of one number per
            sample, called on batches collated by a ``DataLoader`` (DeepSpeed's convention).
        save_path: the output folder.
        batch_size: analyse in collated batches of this size (see ``metric_functions``).
        collate_fn: the ``DataLoader`` collate function for batches.
        num_workers, worker_id: this process analyses the ``worker_id``-th of ``num_workers``
            contiguous slices of the dataset (see the module docstring).
    """

    def __init__(self, dataset: Any, metric_names: Sequence[str], metric_functions: Sequence[Callable[[Any], Any]],
                 save_path: str | os.PathLike[str] = "./", *, batch_size: int | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 1,
                 worker_id: int = 0) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(f"DataAnalyzer(dataset=...): expected a map-style dataset (len() and [i]), "
                            f"got {type(dataset).__name__}.")
        names, functions = list(metric_names), list(metric_functions)
        if not names or len(names) != len(functions):
            raise ValueError(f"DataAnalyzer(metric_names, metric_functions): give one function per metric name; "
                             f"got {len(names)} names and {len(functions)} functions.")
        for name in names:
            if not isinstance(name, str) or not name or os.sep in name or name.startswith("."):
                raise ValueError(f"DataAnalyzer(metric_names=...): {name!r} is not a usable folder name.")
        if len(set(names)) != len(names):
            raise ValueError(f"DataAnalyzer(metric_names=...): names must be distinct, got {names}.")
        if not all(callable(f) for f in functions):
            raise TypeError("DataAnalyzer(metric_functions=...): every entry must be callable.")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"DataAnalyzer(batch_size=...): expected a positive int or None, got {batch_size!r}.")
        if not isinstance(num_workers, int) or num_workers < 1 or not isinstance(worker_id, int) \
                or not 0 <= worker_id < num_workers:
            raise ValueError(f"DataAnalyzer(num_workers={num_workers!r}, worker_id={worker_id!r}): need "
                             f"num_workers >= 1 and 0 <= worker_id < num_workers.")
        self.dataset, self.metric_names, self.metric_functions = dataset, names, functions
        self.save_path = os.fspath(save_path)
        self.batch_size, self.collate_fn = batch_size, collate_fn
        self.num_workers, self.worker_id = num_workers, worker_id

    def worker_range(self, worker_id: int | None = None) -> tuple[int, int]:
        """The ``[start, end)`` sample range of ``worker_id`` (default: this worker)."""
        w = self.worker_id if worker_id is None else worker_id
        n = len(self.dataset)
        return n * w // self.num_workers, n * (w + 1) // self.num_workers

    def _worker_file(self, metric: str, worker_id: int) -> str:
        return os.path.join(self.save_path, metric, f"{metric}_sample_to_metric_worker{worker_id}.npy")

    def _compute(self, start: int, end: int) -> list[np.ndarray]:
        if self.batch_size is None:
            columns: list[list[Any]] = [[] for _ in self.metric_names]
            for i in range(start, end):
                sample = self.dataset[i]
                for column, fn in zip(columns, self.metric_functions, strict=True):
                    column.append(fn(sample))
            return [_as_values(c, end - start, n) for c, n in zip(columns, self.metric_names, strict=True)]
        from torch.utils.data import DataLoader, Subset

        loader = DataLoader(Subset(self.dataset, range(start, end)), batch_size=self.batch_size, shuffle=False,
                            collate_fn=self.collate_fn)
        parts: list[list[np.ndarray]] = [[] for _ in self.metric_names]
        done = 0
        for batch in loader:
            count = min(self.batch_size, end - start - done)
            for part, fn, name in zip(parts, self.metric_functions, self.metric_names, strict=True):
                part.append(_as_values(fn(batch), count, name))
            done += count
        return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts]

    def run_map(self) -> list[str]:
        """Analyse this worker's slice; write and return its per-metric ``..._worker<w>.npy`` files."""
        start, end = self.worker_range()
        written = []
        for name, values in zip(self.metric_names, self._compute(start, end), strict=True):
            path = self._worker_file(name, self.worker_id)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            np.save(path, values)
            written.append(path)
        return written

    def run_reduce(self) -> dict[str, dict[str, str]]:
        """Merge every worker's map output into the index files; return ``{metric: metric_paths(...)}``.

        Raises:
            FileNotFoundError: a worker's output is missing (it has not run, or failed).
            ValueError: the outputs do not add up to ``len(dataset)`` samples.
        """
        result = {}
        for name in self.metric_names:
            parts = []
            for w in range(self.num_workers):
                path = self._worker_file(name, w)
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"DataAnalyzer.run_reduce: {path} is missing; run run_map() with "
                                            f"worker_id={w} (of num_workers={self.num_workers}) first.")
                part = np.load(path)
                lo, hi = self.worker_range(w)
                if part.shape != (hi - lo,):
                    raise ValueError(f"DataAnalyzer.run_reduce: {path} holds {part.size} values, expected {hi - lo}; "
                                     f"was it written for another dataset or num_workers? Rerun run_map().")
                parts.append(part)
            values = np.concatenate(parts)
            if values.dtype != np.float64 and any(p.dtype == np.float64 for p in parts):
                values = values.astype(np.float64)
            paths = metric_paths(self.save_path, name)
            write_index(values, paths)
            for w in range(self.num_workers):
                os.remove(self._worker_file(name, w))
            result[name] = paths
        return result

    def run(self) -> dict[str, dict[str, str]]:
        """Analyse the whole dataset in this process (``num_workers`` must be 1); return the written paths."""
        if self.num_workers != 1:
            raise ValueError("DataAnalyzer.run(): analyses everything in one process; with num_workers > 1 call "
                             "run_map() in every worker, then run_reduce() once.")
        self.run_map()
        return self.run_reduce()


def write_index(values: np.ndarray, paths: dict[str, str]) -> None:
    """Write one metric's four index files from its per-sample ``values`` to ``paths`` (see :func:`metric_paths`)."""
    os.makedirs(os.path.dirname(paths["sample_to_metric"]), exist_ok=True)
    order = np.argsort(values, kind="stable")  # ascending value, ascending index inside a value
    uniques, counts = np.unique(values, return_counts=True)
    offsets = np.zeros(len(uniques) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    np.save(paths["sample_to_metric"], values)
    np.save(paths["index_to_metric"], uniques)
    np.save(paths["index_to_sample"], order.astype(np.int64))
    np.save(paths["index_to_sample_offsets"], offsets)


@dataclass(frozen=True)
class MetricIndex:
    """One metric's index, as read back from the analyzer's files.

    Attributes:
        samples: sample indices ordered by ascending metric value (``index_to_sample``).
        offsets: row boundaries into ``samples``: row ``r`` is ``samples[offsets[r]:offsets[r+1]]``.
        values: the value of each row, ascending (``index_to_metric``); ``None`` if not loaded.
    """

    samples: np.ndarray
    offsets: np.ndarray
    values: np.ndarray | None = None

    @classmethod
    def load(cls, index_to_sample_path: str | os.PathLike[str],
             index_to_metric_path: str | os.PathLike[str] | None = None) -> MetricIndex:
        """Read ``index_to_sample`` (and its ``_offsets`` file) and, if given, ``index_to_metric``.

        Raises:
            FileNotFoundError: a file is missing; the message says how to create it.
            ValueError: the files do not fit together.
        """
        sample_path = _npy(index_to_sample_path)
        offsets_path = sample_path[: -len(".npy")] + "_offsets.npy"
        for path in (sample_path, offsets_path) + ((_npy(index_to_metric_path),) if index_to_metric_path else ()):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"curriculum index file {path} does not exist; write the index files with "
                                        f"microspeed_efficiency.data_analyzer.DataAnalyzer(...).run() first.")
        samples, offsets = np.load(sample_path), np.load(offsets_path)
        values = np.load(_npy(index_to_metric_path)) if index_to_metric_path else None
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(samples) \
                or np.any(np.diff(offsets) < 0):
            raise ValueError(f"{offsets_path}: not the row offsets of {sample_path} (written by another run?).")
        if values is not None and len(values) != len(offsets) - 1:
            raise ValueError(f"{_npy(index_to_metric_path)} has {len(values)} values for {len(offsets) - 1} rows of "
                             f"{sample_path}: the two files come from different analyses.")
        return cls(samples=samples, offsets=offsets, values=values)

    @property
    def num_samples(self) -> int:
        """How many samples the index covers (the dataset size it was written for)."""
        return int(len(self.samples))

    def __len__(self) -> int:
        """The number of rows (distinct metric values)."""
        return int(len(self.offsets) - 1)

    def row(self, r: int) -> np.ndarray:
        """The sample indices of row ``r`` (all samples with the ``r``-th smallest value)."""
        return self.samples[self.offsets[r]: self.offsets[r + 1]]

    def samples_with_value(self, above: float | None, at_most: float) -> np.ndarray:
        """Sample indices whose value ``v`` satisfies ``above < v <= at_most`` (``above=None``: no lower bound)."""
        if self.values is None:
            raise ValueError("MetricIndex.samples_with_value: this index was loaded without index_to_metric_path "
                             "(needed for difficulty_type 'value').")
        lo = 0 if above is None else int(np.searchsorted(self.values, above, side="right"))
        hi = int(np.searchsorted(self.values, at_most, side="right"))
        return self.samples[self.offsets[lo]: self.offsets[max(hi, lo)]]

    def samples_in_percentile(self, start: float, end: float, max_percentile: float) -> np.ndarray:
        """Samples ranked in ``(start, end]`` percent of ``max_percentile`` by ascending value.

        The first ``N * p // max_percentile`` samples of the value order make percentile ``p``
        (``N``: all samples; ``p == max_percentile``: all of them).
        """
        n = self.num_samples

        def _count(p: float) -> int:
            return n if p >= max_percentile else max(int(n * p // max_percentile), 0)

        return self.samples[_count(start): _count(end)]
