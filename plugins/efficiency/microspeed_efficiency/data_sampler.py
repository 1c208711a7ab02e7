"""The curriculum data sampler of ``data_efficiency.data_sampling.curriculum_learning``.

:class:`CurriculumDataSampler` is DeepSpeed's ``DeepSpeedDataSampler``: a batch sampler that, at
every optimizer step, draws the global batch only from samples whose difficulty (per metric, read
from the index files of :mod:`microspeed_efficiency.data_analyzer`) is within the current
curriculum difficulty, then hands each data-parallel rank its micro-batches of it.

**How a batch is drawn** (as DeepSpeed does it). Step ``s`` (1, 2, ...) first moves every metric's
:class:`~microspeed_efficiency.curriculum.CurriculumScheduler` to step ``s``. When a difficulty
changed, a new *cluster* is formed from the samples that became admissible:

* one metric with ``clustering_type: "schedule_based"`` — the samples whose metric lies in
  ``(previous difficulty, current difficulty]``: metric values for ``difficulty_type: "value"``;
  ranks in ascending-value order for ``"percentile"`` (percentile ``p`` of ``max_difficulty`` is
  the first ``N * p // max_difficulty`` samples of that order; DeepSpeed rounds per percentile,
  ``(N // max) * p``, which is the same when ``max_difficulty`` divides ``N``);
* several ``schedule_based`` metrics — the samples within every metric's current difficulty that
  are in no earlier cluster;
* only ``single_cluster`` metrics — every sample, once (the curriculum then does not filter).

Each cluster is kept in a shuffled order. The global batch (``micro_batch_size * data-parallel
size * gradient_accumulation_steps`` samples) takes from each cluster a count drawn in proportion
to the clusters' sizes, reading the cluster's order onward (a cluster read to its end is shuffled
again), and is shuffled. Every ``micro_batch_size * data-parallel size`` slice of it is one
micro-step of all ranks; rank ``r`` gets positions ``[r * micro_batch_size, (r + 1) *
micro_batch_size)`` of the slice. So the ranks' micro-batches are disjoint and together make the
global batch, and every sample in it is within the difficulty.

**Differences from DeepSpeed.** Every rank computes the same global batch from the same seed
(``data_efficiency.seed``), so no broadcast and no cluster files are needed (DeepSpeed's rank 0
writes clusters under ``data_cluster_path`` and broadcasts each batch). A cluster's shuffled order
is a function of the seed, the cluster's number and how often it was reshuffled, so the sampler's
state is a few numbers: :meth:`CurriculumDataSampler.state_dict` records the consumed samples, the
curriculum step and difficulties, the rest of the current global batch, each cluster's position and
the generator state, and a sampler restored from it yields exactly the batches the original would
have (DeepSpeed saves the *global* NumPy RNG instead of its generator's, so its resume is not
exact). A cluster smaller than what a batch needs from it is read around more than once instead
of leaving the batch short.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import reduce
from typing import Any

import numpy as np
import torch

from microspeed.plugin_api import ConfigError
from microspeed_efficiency.curriculum import CurriculumScheduler
from microspeed_efficiency.data_analyzer import MetricIndex

__all__ = [
    "CLUSTERING_TYPES",
    "DIFFICULTY_TYPES",
    "CurriculumDataLoader",
    "CurriculumDataSampler",
    "DeepSpeedDataSampler",
    "parse_curriculum_metrics",
]

DIFFICULTY_TYPES = ("value", "percentile")
"""Accepted ``difficulty_type`` of a curriculum metric."""

CLUSTERING_TYPES = ("schedule_based", "single_cluster")
"""Accepted ``clustering_type`` of a curriculum metric."""

METRIC_KEYS = ("index_to_sample_path", "index_to_metric_path", "difficulty_type", "clustering_type",
               "min_difficulty", "max_difficulty", "schedule_type", "schedule_config")
"""The keys of one entry of ``curriculum_metrics``."""

METRICS_PATH = "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics"
"""The config path of the metrics, for error messages."""


def parse_curriculum_metrics(metrics: Any, path: str = METRICS_PATH) -> dict[str, dict[str, Any]]:
    """Validate ``curriculum_metrics`` (``{name: {...}}``); return it with defaults filled in.

    Each metric needs ``difficulty_type``, ``min_difficulty``, ``max_difficulty``, ``schedule_type``
    (and ``schedule_config``), and ``index_to_sample_path`` unless ``clustering_type`` is
    ``"single_cluster"``; ``index_to_metric_path`` too for ``difficulty_type: "value"``.
    ``clustering_type`` defaults to ``"schedule_based"``.

    Raises:
        ConfigError: naming the key path, the value and what is accepted.
    """
    if not isinstance(metrics, Mapping) or not metrics:
        raise ConfigError(f"{path}: curriculum learning needs at least one metric, e.g. {{\"seqlen\": "
                          f"{{\"index_to_sample_path\": ..., \"index_to_metric_path\": ..., \"difficulty_type\": "
                          f"\"value\", \"clustering_type\": \"schedule_based\", \"min_difficulty\": 8, "
                          f"\"max_difficulty\": 1024, \"schedule_type\": \"fixed_linear\", \"schedule_config\": "
                          f"{{...}}}}}}; got {metrics!r}.")
    out: dict[str, dict[str, Any]] = {}
    for name, spec in metrics.items():
        where = f"{path}.{name}"
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where}: expected an object (one metric's settings), got {spec!r}.")
        unknown = [k for k in spec if k not in METRIC_KEYS]
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown key. Valid keys here: {', '.join(METRIC_KEYS)}.")
        spec = {"clustering_type": "schedule_based", **spec}
        if spec.get("difficulty_type") not in DIFFICULTY_TYPES:
            raise ConfigError(f"{where}.difficulty_type: got {spec.get('difficulty_type')!r}; accepted values: "
                              f"{', '.join(map(repr, DIFFICULTY_TYPES))} (required).")
        if spec["clustering_type"] not in CLUSTERING_TYPES:
            raise ConfigError(f"{where}.clustering_type: got {spec['clustering_type']!r}; accepted values: "
                              f"{', '.join(map(repr, CLUSTERING_TYPES))}.")
        needs = []
        if spec["clustering_type"] != "single_cluster":
            needs.append("index_to_sample_path")
            if spec["difficulty_type"] == "value":
                needs.append("index_to_metric_path")
        for key in needs:
            if not isinstance(spec.get(key), str) or not spec[key]:
                raise ConfigError(f"{where}.{key}: required (a path written by "
                                  f"microspeed_efficiency.data_analyzer.DataAnalyzer), got {spec.get(key)!r}.")
        scheduler = CurriculumScheduler(spec, name=where)  # checks the schedule keys
        if spec["difficulty_type"] == "percentile" and not 0 <= scheduler.min_difficulty:
            raise ConfigError(f"{where}.min_difficulty: a percentile must be >= 0, got {scheduler.min_difficulty!r}.")
        out[str(name)] = dict(spec)
    return out


@dataclass
class _Cluster:
    previous: dict[str, Any]  # metric -> difficulty before the change (None: none yet)
    current: dict[str, Any]   # metric -> difficulty that formed the cluster
    members: np.ndarray       # sorted sample indices
    order: np.ndarray         # members, shuffled
    position: int = 0
    reshuffles: int = 0


class CurriculumDataSampler:
    """Batch sampler for ``data_efficiency`` curriculum learning; yields this rank's micro-batch indices.

    Args:
        data_efficiency_config: the ``data_efficiency`` section (parsed, or a ds_config dict):
            ``seed``, ``data_sampling.num_epochs`` and ``data_sampling.curriculum_learning.
            curriculum_metrics`` are read.
        one_epoch_total_samples: the dataset size ``N``; the sampler stops after ``N * num_epochs``
            samples (all ranks together).
        micro_batch_size: samples per micro-batch per rank.
        data_parallel_rank, data_parallel_size: this rank and the number of data-parallel ranks.
        gradient_accumulation_steps: micro-steps per optimizer step (the global batch is
            ``micro_batch_size * data_parallel_size * gradient_accumulation_steps``).
        drop_last: kept for DeepSpeed's signature; every micro-batch is full here.
        metric_indexes: ``{metric: MetricIndex}`` already loaded (default: read from the paths in
            the config).

    Iterating yields lists of ``micro_batch_size`` dataset indices; iterating again continues
    where the previous iteration stopped. ``len()`` is the number of micro-batches per rank of
    the whole run.
    """

    def __init__(self, data_efficiency_config: Mapping[str, Any], one_epoch_total_samples: int,
                 micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int,
                 gradient_accumulation_steps: int = 1, drop_last: bool = True,
                 metric_indexes: Mapping[str, MetricIndex] | None = None) -> None:
        for key, value, low in (("one_epoch_total_samples", one_epoch_total_samples, 1),
                                ("micro_batch_size", micro_batch_size, 1),
                                ("data_parallel_size", data_parallel_size, 1),
                                ("gradient_accumulation_steps", gradient_accumulation_steps, 1),
                                ("data_parallel_rank", data_parallel_rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"CurriculumDataSampler({key}=...): expected an integer >= {low}, got {value!r}.")
        if data_parallel_rank >= data_parallel_size:
            raise ValueError(f"CurriculumDataSampler(data_parallel_rank={data_parallel_rank}): must be below "
                             f"data_parallel_size={data_parallel_size}.")
        sampling = data_efficiency_config.get("data_sampling", {}) or {}
        curriculum = sampling.get("curriculum_learning", {}) or {}
        self.seed = int(data_efficiency_config.get("seed", 1234))
        if self.seed < 0:
            raise ConfigError(f"data_efficiency.seed: expected an integer >= 0, got {self.seed!r}.")
        self.num_epochs = int(sampling.get("num_epochs", 1000))
        self.metrics = parse_curriculum_metrics(curriculum.get("curriculum_metrics"))
        self.one_epoch_total_samples = one_epoch_total_samples
        self.total_samples = one_epoch_total_samples * self.num_epochs
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.drop_last = drop_last
        self.schedulers = {m: CurriculumScheduler(spec, name=f"{METRICS_PATH}.{m}") for m, spec in self.metrics.items()}
        self.indexes: dict[str, MetricIndex] = {}
        for m, spec in self.metrics.items():
            if spec["clustering_type"] == "single_cluster":
                continue
            index = (metric_indexes or {}).get(m)
            if index is None:
                by_value = spec["difficulty_type"] == "value"
                index = MetricIndex.load(spec["index_to_sample_path"],
                                         spec.get("index_to_metric_path") if by_value else None)
            if index.num_samples != one_epoch_total_samples:
                raise ValueError(f"{METRICS_PATH}.{m}: the index covers {index.num_samples} samples but the dataset "
                                 f"has {one_epoch_total_samples}; rerun the DataAnalyzer on this dataset.")
            self.indexes[m] = index
        self._reset()

    def _reset(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, Any] = {}
        self.batch: list[int] = []
        self.clusters: list[_Cluster] = []
        self._generation = 0

    def __len__(self) -> int:
        """Micro-batches per rank over the whole run (``num_epochs`` epochs)."""
        return self.total_samples // self.micro_batch_times_data_parallel_size

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], Any]]) -> None:
        """Give ``schedule_type: "custom"`` metrics their ``step -> difficulty`` functions (``{metric: fn}``)."""
        unknown = [m for m in schedule_func_dict if m not in self.schedulers]
        if unknown:
            raise KeyError(f"set_custom_curriculum_learning_schedule: no curriculum metric named {unknown[0]!r}; "
                           f"metrics: {sorted(self.schedulers)}.")
        for metric, fn in schedule_func_dict.items():
            self.schedulers[metric].set_custom_get_difficulty(fn)

    # -- clusters -----------------------------------------------------------------------------

    def _admissible(self, metric: str, above: Any, at_most: Any) -> np.ndarray:
        index, spec = self.indexes[metric], self.metrics[metric]
        if spec["difficulty_type"] == "value":
            return index.samples_with_value(above, at_most)
        return index.samples_in_percentile(above or 0, at_most, self.schedulers[metric].max_difficulty)

    def _members(self, previous: Mapping[str, Any], current: Mapping[str, Any], clusters: list[_Cluster]) -> np.ndarray:
        scheduled = [m for m in self.metrics if self.metrics[m]["clustering_type"] != "single_cluster"]
        if len(scheduled) > 1:
            sets = [np.sort(self._admissible(m, None, current[m])) for m in scheduled]
            members = reduce(lambda a, b: np.intersect1d(a, b, assume_unique=True), sets)
            for cluster in clusters:
                members = np.setdiff1d(members, cluster.members, assume_unique=True)
        elif scheduled:
            m = scheduled[0]
            members = self._admissible(m, previous.get(m), current[m])
        else:
            members = np.arange(self.one_epoch_total_samples) if not clusters else np.zeros(0, np.int64)
        return np.sort(np.asarray(members, dtype=np.int64))

    def _shuffled(self, members: np.ndarray, cluster_number: int, reshuffles: int) -> np.ndarray:
        return np.random.default_rng([self.seed, cluster_number, reshuffles]).permutation(members)

    def _add_cluster(self, previous: dict[str, Any], current: dict[str, Any], position: int = 0,
                     reshuffles: int = 0, clusters: list[_Cluster] | None = None) -> bool:
        clusters = self.clusters if clusters is None else clusters
        members = self._members(previous, current, clusters)
        if len(members) == 0:
            return False
        clusters.append(_Cluster(previous, current, members, self._shuffled(members, len(clusters), reshuffles),
                                 position, reshuffles))
        return True

    def _take(self, cidx: int, count: int) -> np.ndarray:
        cluster = self.clusters[cidx]
        parts = []
        while count > 0:
            if cluster.position >= len(cluster.order):
                cluster.reshuffles += 1
                cluster.order = self._shuffled(cluster.members, cidx, cluster.reshuffles)
                cluster.position = 0
            part = cluster.order[cluster.position: cluster.position + count]
            cluster.position += len(part)
            count -= len(part)
            parts.append(part)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _next_global_batch(self) -> None:
        self.curriculum_step += 1
        previous, changed = {}, False
        for metric, scheduler in self.schedulers.items():
            difficulty = scheduler.update_difficulty(self.curriculum_step)
            changed |= metric not in self.current_difficulties or difficulty != self.current_difficulties[metric]
            previous[metric] = self.current_difficulties.get(metric)
            self.current_difficulties[metric] = difficulty
        if changed:
            self._add_cluster(previous, dict(self.current_difficulties))
        if not self.clusters:
            raise RuntimeError(f"curriculum data sampler: no sample is within the difficulties "
                               f"{self.current_difficulties} at curriculum step {self.curriculum_step}; raise the "
                               f"metrics' min_difficulty in {METRICS_PATH} (check the values the DataAnalyzer wrote).")
        sizes = np.array([len(c.members) for c in self.clusters], dtype=np.float64)
        picks = self.rng.choice(len(self.clusters), size=self.global_batch_size, replace=True, p=sizes / sizes.sum())
        counts = np.bincount(picks, minlength=len(self.clusters))
        batch = np.concatenate([self._take(c, int(n)) for c, n in enumerate(counts)])
        self.rng.shuffle(batch)
        self.batch = [int(i) for i in batch]

    # -- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's micro-batches, from the current position on (stops after ``N * num_epochs`` samples)."""
        generation = self._generation
        while generation == self._generation and self.consumed_samples < self.total_samples:
            if not self.batch:
                self._next_global_batch()
            step = self.micro_batch_times_data_parallel_size
            chunk, self.batch = self.batch[:step], self.batch[step:]
            self.consumed_samples += len(chunk)
            start = self.data_parallel_rank * self.micro_batch_size
            yield chunk[start: start + self.micro_batch_size]

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The exact position: consumed samples, curriculum step and difficulties, clusters, generator state."""
        return {
            "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step,
            "current_difficulties": dict(self.current_difficulties),
            "batch": list(self.batch),
            "rng": json.dumps(self.rng.bit_generator.state),
            "clusters": [{"previous": dict(c.previous), "current": dict(c.current), "position": c.position,
                          "reshuffles": c.reshuffles} for c in self.clusters],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next iteration yields what the saved sampler would have.

        Iterators started before the call stop; start a new one. The curriculum settings and index
        files must be those of the saved run; the data-parallel size may differ when the state was
        taken at an optimizer-step boundary (as checkpoints are).

        Raises:
            ValueError: the state does not fit this sampler (other metrics, other index files, or a
                global batch cut mid-way under another batch layout).
        """
        missing = [k for k in ("consumed_samples", "curriculum_step", "current_difficulties", "batch", "rng",
                               "clusters") if k not in state]
        if missing:
            raise ValueError(f"CurriculumDataSampler.load_state_dict: the state lacks {missing}; pass what "
                             f"state_dict() returned.")
        difficulties = dict(state["current_difficulties"])
        if state["curriculum_step"] and set(difficulties) != set(self.metrics):
            raise ValueError(f"CurriculumDataSampler.load_state_dict: the state has metrics {sorted(difficulties)}, "
                             f"this sampler {sorted(self.metrics)}; resume with the saved run's curriculum_metrics.")
        batch = [int(i) for i in state["batch"]]
        if len(batch) % self.micro_batch_times_data_parallel_size:
            raise ValueError(f"CurriculumDataSampler.load_state_dict: {len(batch)} samples of the current global batch "
                             f"remain, not a multiple of micro_batch_size*data_parallel_size="
                             f"{self.micro_batch_times_data_parallel_size}; resume from a state taken at an optimizer "
                             f"step boundary, or with the saved run's batch layout.")
        clusters: list[_Cluster] = []
        for saved in state["clusters"]:
            number = len(clusters)
            if not self._add_cluster(dict(saved["previous"]), dict(saved["current"]), int(saved["position"]),
                                     int(saved["reshuffles"]), clusters):
                raise ValueError(f"CurriculumDataSampler.load_state_dict: cluster {number} "
                                 f"(difficulties {dict(saved['current'])}) has no sample under the current index "
                                 f"files; resume with the index files of the saved run.")
        rng = np.random.default_rng(self.seed)
        rng.bit_generator.state = json.loads(state["rng"])
        self.rng, self.clusters, self.batch = rng, clusters, batch
        self.consumed_samples, self.curriculum_step = int(state["consumed_samples"]), int(state["curriculum_step"])
        self.current_difficulties = difficulties
        for metric, scheduler in self.schedulers.items():
            scheduler.set_current_difficulty(difficulties.get(metric, scheduler.min_difficulty))
        self._generation += 1


DeepSpeedDataSampler = CurriculumDataSampler
"""DeepSpeed's name for :class:`CurriculumDataSampler`."""


class _RecordingBatches:
    """The batch sampler handed to the ``DataLoader``: records the sampler's state after each batch."""

    def __init__(self, sampler: CurriculumDataSampler, states: deque) -> None:
        self.sampler, self.states = sampler, states

    def __iter__(self) -> Iterator[list[int]]:
        for indices in self.sampler:
            self.states.append(self.sampler.state_dict())
            yield indices

    def __len__(self) -> int:
        return len(self.sampler)


class CurriculumDataLoader:
    """The training data loader when the curriculum sampler is on: a ``DataLoader`` over the sampler.

    ``data_sampler`` is the :class:`CurriculumDataSampler` (DeepSpeed's attribute name). Iterating
    continues where the last iteration stopped. :meth:`state_dict` is the sampler's position after
    the last batch *returned* (batches the ``DataLoader``'s workers fetched ahead do not count), and
    :meth:`load_state_dict` makes the running iterator continue from a saved position.
    """

    def __init__(self, dataset: Any, data_sampler: CurriculumDataSampler, collate_fn: Callable | None = None,
                 num_workers: int = 0, pin_memory: bool = False) -> None:
        self.dataset, self.data_sampler = dataset, data_sampler
        self._states: deque = deque()
        self.loader = torch.utils.data.DataLoader(dataset, batch_sampler=_RecordingBatches(data_sampler, self._states),
                                                  collate_fn=collate_fn, num_workers=num_workers, pin_memory=pin_memory)
        self._state = data_sampler.state_dict()
        self._generation = 0

    def __len__(self) -> int:
        """Micro-batches per rank over the whole run."""
        return len(self.data_sampler)

    def __iter__(self) -> Iterator[Any]:
        while True:
            generation = self._generation
            self._states.clear()
            batches = iter(self.loader)
            while generation == self._generation:
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                self._state = self._states.popleft()
                yield batch
            del batches  # restored mid-iteration: what was fetched ahead belongs to the old position

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state after the last batch this loader returned."""
        return dict(self._state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (also in an iterator already running)."""
        self.data_sampler.load_state_dict(state)
        self._state = self.data_sampler.state_dict()
        self._generation += 1
