"""The ``data_efficiency`` section: DeepSpeed's data-efficiency library (data sampling part).

Owns the whole section::

    "data_efficiency": {
        "enabled": true, "seed": 1234,
        "data_sampling": {
            "enabled": true, "num_epochs": 1000, "num_workers": 0, "pin_memory": false,
            "curriculum_learning": {
                "enabled": true, "data_cluster_path": "/tmp/clusters",
                "curriculum_metrics": {"seqlen": {
                    "index_to_sample_path": "analysis/seqlen/seqlen_index_to_sample",
                    "index_to_metric_path": "analysis/seqlen/seqlen_index_to_metric",
                    "difficulty_type": "value", "clustering_type": "schedule_based",
                    "min_difficulty": 8, "max_difficulty": 128,
                    "schedule_type": "fixed_root",
                    "schedule_config": {"total_curriculum_step": 1000, "difficulty_step": 8, "root_degree": 2}}}
            }
        },
        "data_routing": {...}
    }

With ``curriculum_learning.enabled`` (as in DeepSpeed, the switch; ``data_efficiency.enabled`` and
``data_sampling.enabled`` may be left out, and set to false they are refused as a contradiction) and
``initialize(training_data=dataset)``, the data loader
``initialize`` returns is a :class:`~microspeed_efficiency.data_sampler.CurriculumDataLoader`
whose :class:`~microspeed_efficiency.data_sampler.CurriculumDataSampler` draws every global batch
from the samples within the current difficulty (index files written beforehand by
:class:`~microspeed_efficiency.data_analyzer.DataAnalyzer`). The sampler's position is saved in
checkpoints and restored on load, so a resumed run sees exactly the batches the original would have.

``data_cluster_path`` is accepted for DeepSpeed configs and not used: clusters are index arrays
kept in memory (see :mod:`~microspeed_efficiency.data_sampler`). ``data_routing`` is open here:
the random-LTD plugin reads and checks it. DeepSpeed's ``dynamic_batching`` is not supported (an
unknown key). Custom schedules: ``engine.plugin_state("data_efficiency")
.set_custom_curriculum_learning_schedule({metric: fn})``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from microspeed.plugin_api import ConfigError, Field, Section, hookimpl, non_negative, positive
from microspeed_efficiency.data_sampler import CurriculumDataLoader, CurriculumDataSampler, parse_curriculum_metrics

NAME = "data_efficiency"
"""The config section, plugin-state key and checkpoint-state key."""


class DataEfficiencyPlugin:
    """microspeed plugin owning ``data_efficiency``; builds the curriculum data loader (entry point of that name).

    One instance per engine. Attributes: ``config`` (the parsed section), ``active`` (the curriculum
    sampler is on), ``loader`` (the :class:`CurriculumDataLoader`, once built).
    """

    def __init__(self) -> None:
        self.config: dict[str, Any] = {}
        self.active = False
        self.loader: CurriculumDataLoader | None = None
        self._custom: dict[str, Callable[[int], Any]] = {}

    @hookimpl
    def microspeed_config_sections(self) -> dict[str, Section]:
        """Claim ``data_efficiency`` (``data_routing`` below it is open, for the random-LTD plugin)."""
        curriculum = Section({
            "enabled": Field((bool,), False, "draw each batch from samples within the curriculum difficulty"),
            "data_cluster_path": Field((str,), None, "accepted for DeepSpeed configs; unused (clusters are in memory)"),
            "curriculum_metrics": Section(doc="{metric: {index_to_sample_path, index_to_metric_path, difficulty_type, "
                                              "clustering_type, min_difficulty, max_difficulty, schedule_type, "
                                              "schedule_config}}", open=True),
        }, doc="curriculum learning by data sampling")
        sampling = Section({
            "enabled": Field((bool,), False, "turn data sampling on"),
            "num_epochs": Field((int,), 1000, "epochs of data the sampler provides", positive),
            "num_workers": Field((int,), 0, "DataLoader worker processes", non_negative),
            "pin_memory": Field((bool,), False, "DataLoader pin_memory"),
            "curriculum_learning": curriculum,
        }, doc="data sampling")
        return {NAME: Section({
            "enabled": Field((bool,), False, "turn the data-efficiency library on"),
            "seed": Field((int,), 1234, "seed of the data sampler (and of random-LTD's token draws in a pipeline)",
                          non_negative),
            "data_sampling": sampling,
            "data_routing": Section(doc="data routing (random-LTD); checked by its plugin", open=True),
        }, doc="data efficiency (microspeed-efficiency)")}

    @hookimpl
    def microspeed_configure(self, config) -> None:
        """Decide whether the sampler is on; check the curriculum metrics (a bad one is refused here)."""
        self.config = config[NAME]
        sampling = self.config["data_sampling"]
        wanted = sampling["curriculum_learning"]["enabled"]
        if not wanted:
            self.active = False
            return
        for key in (f"{NAME}.enabled", f"{NAME}.data_sampling.enabled"):
            if config.is_set(key) and not config.get(key):
                raise ConfigError(f"{key}: is false while {NAME}.data_sampling.curriculum_learning.enabled is true; "
                                  f"set {key} to true or leave it out (or turn curriculum_learning off).")
        parse_curriculum_metrics(sampling["curriculum_learning"].get("curriculum_metrics"))
        self.active = True

    @hookimpl
    def microspeed_setup(self, engine) -> None:
        """Expose this plugin as ``engine.plugin_state("data_efficiency")``."""
        engine.set_plugin_state(NAME, self)

    @hookimpl
    def microspeed_make_dataloader(self, engine, dataset: Any, collate_fn: Callable | None) -> Any:
        """The curriculum data loader when the sampler is on; otherwise leave it to the default loader."""
        if not self.active:
            return None
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ConfigError(f"initialize(training_data=...): curriculum data sampling needs a map-style dataset "
                              f"(len() and dataset[i]), got {type(dataset).__name__}.")
        topo = engine.topology
        sampler = CurriculumDataSampler(self.config, len(dataset), engine.train_micro_batch_size_per_gpu(),
                                        topo.data_parallel_rank, topo.data_parallel_size,
                                        engine.gradient_accumulation_steps(),
                                        drop_last=bool(engine.config.get("dataloader_drop_last", True)))
        if self._custom:
            sampler.set_custom_curriculum_learning_schedule(self._custom)
        sampling = self.config["data_sampling"]
        self.loader = CurriculumDataLoader(dataset, sampler, collate_fn=collate_fn,
                                           num_workers=sampling["num_workers"], pin_memory=sampling["pin_memory"])
        return self.loader

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], Any]]) -> None:
        """Set ``step -> difficulty`` functions of ``custom`` metrics (DeepSpeed's engine method of that name)."""
        self._custom.update(schedule_func_dict)
        if self.loader is not None:
            self.loader.data_sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    @property
    def current_difficulties(self) -> dict[str, Any]:
        """``{metric: difficulty}`` of the latest global batch (empty before the first)."""
        return dict(self.loader.data_sampler.current_difficulties) if self.loader is not None else {}

    @hookimpl
    def microspeed_checkpoint_state(self) -> dict[str, Any] | None:
        """The sampler's position (after the last batch the loader returned)."""
        if self.loader is None:
            return None
        return {NAME: {"data_sampler": self.loader.state_dict()}}

    @hookimpl
    def microspeed_load_checkpoint_state(self, states: dict[str, Any]) -> None:
        """Restore the sampler's position (a checkpoint without it leaves the sampler where it is)."""
        if self.loader is not None and NAME in states and "data_sampler" in states[NAME]:
            self.loader.load_state_dict(states[NAME]["data_sampler"])
