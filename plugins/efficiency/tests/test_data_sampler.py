"""Data analyzer index files, the curriculum data sampler and the ``data_efficiency`` plugin."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from microspeed_efficiency.data_analyzer import DataAnalyzer, MetricIndex, metric_paths
from microspeed_efficiency.data_efficiency_plugin import DataEfficiencyPlugin
from microspeed_efficiency.data_sampler import CurriculumDataLoader, CurriculumDataSampler, parse_curriculum_metrics

import microspeed
from microspeed.checkpoint.manifest import pack, unpack
from microspeed.testing import run_distributed, tiny_engine

N = 240


def difficulty_of(i: int) -> int:
    """The test metric: values 1..60, four samples each, scattered over the dataset."""
    return (i * 37) % 60 + 1


def rarity_of(i: int) -> float:
    """A second, float-valued metric."""
    return float((i * 11) % 7) / 2.0


class IdDataset(torch.utils.data.Dataset):
    """``(x, y)`` for TinyModel; ``x[0]`` is the sample's index, so batches tell which samples they hold."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((8,), 0.01)
        x[0] = float(i)
        return x, torch.tensor([0.5])


@pytest.fixture(scope="module")
def analysis(tmp_path_factory) -> str:
    """Index files of the two metrics over IdDataset, written once for the module."""
    root = tmp_path_factory.mktemp("analysis")
    DataAnalyzer(IdDataset(), ["difficulty", "rarity"], [lambda s: difficulty_of(int(s[0][0])),
                                                         lambda s: rarity_of(int(s[0][0]))], root).run()
    return str(root)


@pytest.fixture
def engine_env(monkeypatch):
    """Only the built-ins plus the plugins a test passes (an installed microspeed-efficiency would clash)."""
    monkeypatch.setenv("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("MICROSPEED_PLUGINS", raising=False)


def metric(root: str, name: str = "difficulty", kind: str = "value", **schedule) -> dict:
    """One ``curriculum_metrics`` entry over the analysis under ``root``."""
    paths = metric_paths(root, name)
    return {"index_to_sample_path": paths["index_to_sample"][:-4], "index_to_metric_path": paths["index_to_metric"],
            "difficulty_type": kind, "clustering_type": "schedule_based", "min_difficulty": 12,
            "max_difficulty": 60, "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 6}, **schedule}


def efficiency(metrics: dict, seed: int = 7, epochs: int = 1000) -> dict:
    """A ``data_efficiency`` section with the curriculum sampler on."""
    return {"enabled": True, "seed": seed,
            "data_sampling": {"enabled": True, "num_epochs": epochs,
                              "curriculum_learning": {"enabled": True, "curriculum_metrics": metrics}}}


def samplers(config: dict, world: int, micro: int, gas: int, n: int = N) -> list[CurriculumDataSampler]:
    """One sampler per simulated data-parallel rank."""
    return [CurriculumDataSampler(config, n, micro, rank, world, gas) for rank in range(world)]


def lockstep(ranks: list[CurriculumDataSampler], micro_steps: int) -> list[list[list[int]]]:
    """``out[k][r]``: rank ``r``'s ``k``-th micro-batch, drawing from every rank's sampler in turn."""
    iters = [iter(s) for s in ranks]
    return [[next(it) for it in iters] for _ in range(micro_steps)]


# -- the analyzer -----------------------------------------------------------------------------------


def test_analyzer_files(analysis):
    paths = metric_paths(analysis, "difficulty")
    values = np.load(paths["sample_to_metric"])
    assert values.dtype == np.int64 and values.tolist() == [difficulty_of(i) for i in range(N)]
    index = MetricIndex.load(paths["index_to_sample"], paths["index_to_metric"])
    assert index.values.tolist() == list(range(1, 61)) and len(index) == 60 and index.num_samples == N
    for r, v in enumerate(index.values):
        assert sorted(index.row(r).tolist()) == index.row(r).tolist() == [i for i in range(N) if difficulty_of(i) == v]
    between = sorted(i for i in range(N) if 10 < difficulty_of(i) <= 12)
    assert sorted(index.samples_with_value(10, 12).tolist()) == between
    assert index.samples_in_percentile(0, 25, 100).tolist() == index.samples[:60].tolist()
    rarity = np.load(metric_paths(analysis, "rarity")["sample_to_metric"])
    assert rarity.dtype == np.float64 and rarity.tolist() == [rarity_of(i) for i in range(N)]


def test_analyzer_workers_and_batches(tmp_path, analysis):
    data = IdDataset()
    fn = [lambda s: difficulty_of(int(s[0][0]))]
    workers = [DataAnalyzer(data, ["difficulty"], fn, tmp_path / "w", num_workers=3, worker_id=w) for w in range(3)]
    with pytest.raises(ValueError, match="run_map"):
        workers[0].run()
    for w in (2, 0):
        workers[w].run_map()
    with pytest.raises(FileNotFoundError, match="worker_id=1"):
        workers[0].run_reduce()
    workers[1].run_map()
    workers[0].run_reduce()
    batched = DataAnalyzer(data, ["difficulty"], [lambda b: (b[0][:, 0].long() * 37) % 60 + 1], tmp_path / "b",
                           batch_size=7)
    batched.run()
    for root in (tmp_path / "w", tmp_path / "b"):
        for kind, path in metric_paths(root, "difficulty").items():
            assert np.array_equal(np.load(path), np.load(metric_paths(analysis, "difficulty")[kind])), (root, kind)
    with pytest.raises(ValueError, match="one number per sample"):
        DataAnalyzer(data, ["d"], [lambda b: torch.zeros(3)], tmp_path / "x", batch_size=5).run()
    with pytest.raises(FileNotFoundError, match="DataAnalyzer"):
        MetricIndex.load(tmp_path / "nothing_here")


# -- the sampler ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "micro"), [(1, 4), (2, 2), (4, 1)])
def test_partition_and_difficulty(analysis, world, micro):
    gas = 3
    config = efficiency({"difficulty": metric(analysis)})
    ranks = samplers(config, world, micro, gas)
    global_batch = micro * world * gas
    steps = []
    for step in range(12):
        batch = []
        for micro_batches in lockstep(ranks, gas):
            assert [len(b) for b in micro_batches] == [micro] * world
            batch += [i for b in micro_batches for i in b]
        assert len(batch) == len(set(batch)) == global_batch  # disjoint; together the global batch
        difficulty = ranks[0].current_difficulties["difficulty"]
        assert all(r.current_difficulties == ranks[0].current_difficulties for r in ranks)
        assert difficulty == ranks[0].schedulers["difficulty"].get_difficulty(step + 1)
        assert max(difficulty_of(i) for i in batch) <= difficulty
        steps.append(batch)
    assert max(difficulty_of(i) for i in steps[0]) <= 18  # step 1: floor(1/8 * 48 + 12) = 18
    assert max(difficulty_of(i) for i in steps[-1]) > 30  # the curriculum did open up
    # the sequence of global batches does not depend on how it is split over ranks
    single = samplers(config, 1, global_batch, 1)[0]
    assert [sorted(s) for s in steps] == [sorted(b) for b in itertools.islice(iter(single), 12)]


def test_value_versus_percentile(analysis):
    hold = {"min_difficulty": 12, "max_difficulty": 60, "schedule_type": "fixed_discrete",
            "schedule_config": {"difficulty": [12, 60], "max_step": [1000]}}  # 12 for the first 1000 steps
    value = samplers(efficiency({"difficulty": metric(analysis, **hold)}), 1, 8, 1)[0]
    percentile = samplers(efficiency({"difficulty": metric(analysis, kind="percentile", **hold)}), 1, 8, 1)[0]
    index = MetricIndex.load(metric_paths(analysis, "difficulty")["index_to_sample"])
    seen_value = {i for b in itertools.islice(iter(value), 40) for i in b}
    seen_percentile = {i for b in itertools.islice(iter(percentile), 40) for i in b}
    # value 12: metric <= 12 (48 samples); percentile 12 of 60: the lowest N * 12 // 60 = 48 samples by value
    assert seen_value == {i for i in range(N) if difficulty_of(i) <= 12}
    assert seen_percentile == set(index.samples[:48].tolist())
    assert seen_value == seen_percentile  # here both are the 48 samples of values 1..12: four per value
    value_8 = samplers(efficiency({"difficulty": metric(analysis, **{**hold, "min_difficulty": 8,
                                                                      "schedule_config": {"difficulty": [8, 60],
                                                                                          "max_step": [1000]}})}),
                       1, 8, 1)[0]
    assert {i for b in itertools.islice(iter(value_8), 30) for i in b} == {i for i in range(N) if difficulty_of(i) <= 8}
    low = samplers(efficiency({"difficulty": metric(analysis, kind="percentile", min_difficulty=5, max_difficulty=100,
                                                    schedule_type="fixed_discrete",
                                                    schedule_config={"difficulty": [5, 100], "max_step": [9]})}),
                   1, 4, 1)[0]
    first = set(next(iter(low)))
    assert first <= set(index.samples[: N * 5 // 100].tolist())  # 12 samples: values 1..3
    assert max(difficulty_of(i) for i in first) <= 3


def test_percentile_formula_reaches_everything(analysis):
    sampler = samplers(efficiency({"difficulty": metric(analysis, kind="percentile", min_difficulty=100,
                                                        max_difficulty=100)}), 1, 60, 1)[0]
    batches = [set(b) for b in itertools.islice(iter(sampler), 8)]
    # one cluster of the whole dataset, read in a shuffled order: every pass covers each sample once ...
    assert set().union(*batches[:4]) == set().union(*batches[4:]) == set(range(N))
    assert sum(map(len, batches[:4])) == N
    assert batches[4] != batches[0]  # ... and a cluster read to its end is shuffled again


def test_two_metrics_and_single_cluster(analysis):
    both = efficiency({"difficulty": metric(analysis),
                       "rarity": metric(analysis, "rarity", min_difficulty=1.0, max_difficulty=3.0,
                                        schedule_type="fixed_discrete",
                                        schedule_config={"difficulty": [1.0, 3.0], "max_step": [4]})})
    sampler = samplers(both, 2, 3, 1)[0]
    partner = samplers(both, 2, 3, 1)[1]
    for step, mine, theirs in zip(range(1, 11), iter(sampler), iter(partner), strict=False):
        d = sampler.current_difficulties
        assert d["rarity"] == (1.0 if step <= 4 else 3.0)
        for i in mine + theirs:
            assert difficulty_of(i) <= d["difficulty"] and rarity_of(i) <= d["rarity"]
    single = efficiency({"difficulty": metric(analysis),
                         "rarity": {"difficulty_type": "value", "clustering_type": "single_cluster",
                                    "min_difficulty": 0, "max_difficulty": 1, "schedule_type": "fixed_discrete",
                                    "schedule_config": {"difficulty": [0, 1], "max_step": [2]}}})
    sampler = samplers(single, 1, 6, 1)[0]
    for batch in itertools.islice(iter(sampler), 6):  # rarity does not filter: only difficulty does
        assert all(difficulty_of(i) <= sampler.current_difficulties["difficulty"] for i in batch)
    everything = efficiency({"rarity": {"difficulty_type": "value", "clustering_type": "single_cluster",
                                        "min_difficulty": 0, "max_difficulty": 1, "schedule_type": "fixed_linear",
                                        "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 1}}})
    sampler = samplers(everything, 1, 40, 1)[0]
    assert len({i for b in itertools.islice(iter(sampler), 6) for i in b}) == N


@pytest.mark.parametrize("stop", [5, 6, 7, 30])
def test_resume_gives_the_same_batches(analysis, stop):
    config = efficiency({"difficulty": metric(analysis),
                         "rarity": metric(analysis, "rarity", kind="percentile", min_difficulty=20,
                                          max_difficulty=100, schedule_config={"total_curriculum_step": 12,
                                                                               "difficulty_step": 10})})
    original = samplers(config, 2, 2, 3)[1]
    it = iter(original)
    for _ in range(stop):  # 6 micro-steps = 2 optimizer steps; 5 and 7 stop inside a global batch
        next(it)
    state = unpack(pack(original.state_dict()))  # what a checkpoint manifest stores and gives back
    expected = [next(it) for _ in range(40)]
    resumed = samplers(config, 2, 2, 3)[1]
    resumed.load_state_dict(state)
    assert list(itertools.islice(iter(resumed), 40)) == expected
    # at a step boundary the state also resumes under another data-parallel layout of the same global batch
    if stop % 3 == 0:
        wide = samplers(config, 4, 1, 3)
        for sampler in wide:
            sampler.load_state_dict(state)
        wide_batches = lockstep(wide, 30)
        narrow = [expected[k] for k in range(30)]
        # rank 1 of 2 with micro 2 holds positions 2..3 of each micro-step: ranks 2 and 3 of 4 with micro 1
        assert [w[2] + w[3] for w in wide_batches] == narrow


def test_live_iterator_follows_a_load(analysis):
    config = efficiency({"difficulty": metric(analysis)})
    data = IdDataset()
    loader = CurriculumDataLoader(data, samplers(config, 1, 4, 1)[0])
    it = iter(loader)
    first = [next(it)[0][:, 0].long().tolist() for _ in range(3)]
    state = loader.state_dict()
    after = [next(it)[0][:, 0].long().tolist() for _ in range(3)]
    loader.load_state_dict(state)
    assert [next(it)[0][:, 0].long().tolist() for _ in range(3)] == after  # the running iterator rewound
    assert first != after and len(loader) == N * 1000 // 4


def test_workers_fetching_ahead_do_not_move_the_saved_position(analysis):
    config = efficiency({"difficulty": metric(analysis)})
    plain = CurriculumDataLoader(IdDataset(), samplers(config, 1, 4, 1)[0])
    ahead = CurriculumDataLoader(IdDataset(), samplers(config, 1, 4, 1)[0], num_workers=2)
    plain_it, ahead_it = iter(plain), iter(ahead)
    for _ in range(5):
        assert _ids(next(plain_it)) == _ids(next(ahead_it))
    assert ahead.data_sampler.consumed_samples > 20  # the workers were handed batches beyond the fifth
    assert ahead.state_dict() == plain.state_dict()
    assert ahead.state_dict()["consumed_samples"] == 20


def test_epoch_budget_ends_iteration(analysis):
    sampler = samplers(efficiency({"difficulty": metric(analysis, min_difficulty=60)}, epochs=1), 2, 5, 2)[0]
    assert len(list(iter(sampler))) == len(sampler) == N // 10
    assert list(iter(sampler)) == []


@pytest.mark.parametrize(("change", "key"), [
    ({"difficulty_type": "rank"}, "difficulty.difficulty_type"),
    ({"clustering_type": "kmeans"}, "difficulty.clustering_type"),
    ({"index_to_metric_path": None}, "difficulty.index_to_metric_path"),
    ({"seed_path": "x"}, "difficulty.seed_path"),
    ({"schedule_config": {"total_curriculum_step": 8}}, "difficulty.schedule_config.difficulty_step"),
    ({"max_difficulty": None}, "difficulty.max_difficulty"),
])
def test_bad_metric_configs_name_the_key(analysis, change, key):
    spec = {**metric(analysis), **change}
    with pytest.raises(microspeed.ConfigError, match=r"curriculum_metrics\." + key.replace(".", r"\.")):
        parse_curriculum_metrics({"difficulty": spec})
    with pytest.raises(microspeed.ConfigError, match="at least one metric"):
        parse_curriculum_metrics({})


def test_bad_sampler_inputs(analysis):
    config = efficiency({"difficulty": metric(analysis)})
    with pytest.raises(ValueError, match="covers 240 samples but the dataset has 100"):
        CurriculumDataSampler(config, 100, 2, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        CurriculumDataSampler(config, N, 2, 2, 2)
    never = {"min_difficulty": 0, "schedule_type": "fixed_discrete",
             "schedule_config": {"difficulty": [0, 60], "max_step": [9]}}  # no sample has a value <= 0
    nothing = CurriculumDataSampler(efficiency({"difficulty": metric(analysis, **never)}), N, 2, 0, 1)
    with pytest.raises(RuntimeError, match="raise the metrics' min_difficulty"):
        next(iter(nothing))
    sampler = CurriculumDataSampler(config, N, 2, 0, 1, 3)
    next(iter(sampler))
    with pytest.raises(ValueError, match="step boundary"):
        CurriculumDataSampler(config, N, 3, 0, 1, 2).load_state_dict(sampler.state_dict())  # 4 left, micro 3


# -- the plugin -------------------------------------------------------------------------------------


def test_plugin_builds_the_loader(engine_env, analysis):
    config = {"data_efficiency": {**efficiency({"difficulty": metric(analysis)}),
                                  "data_routing": {"random_ltd": {"enabled": False, "anything": 1}}}}
    engine = tiny_engine(config, plugins=[("data_efficiency", DataEfficiencyPlugin)], training_data=IdDataset())
    loader = engine.training_dataloader
    assert isinstance(loader, CurriculumDataLoader)
    x, _ = next(iter(loader))
    assert x.shape == (2, 8) and all(difficulty_of(int(i)) <= 18 for i in x[:, 0])
    assert engine.plugin_state("data_efficiency").current_difficulties == {"difficulty": 18}
    plain = tiny_engine({"data_efficiency": {"enabled": True}}, plugins=[("data_efficiency", DataEfficiencyPlugin)],
                        training_data=IdDataset())
    assert not isinstance(plain.training_dataloader, CurriculumDataLoader)
    assert plain.config["data_efficiency"]["data_sampling"]["num_epochs"] == 1000


def test_plugin_config_errors(engine_env, analysis):
    plugin = [("data_efficiency", DataEfficiencyPlugin)]
    off = efficiency({"difficulty": metric(analysis)})
    off["data_sampling"]["enabled"] = False
    with pytest.raises(microspeed.ConfigError, match=r"data_efficiency\.data_sampling\.enabled: is false"):
        tiny_engine({"data_efficiency": off}, plugins=plugin)
    implicit = efficiency({"difficulty": metric(analysis)})
    del implicit["enabled"], implicit["data_sampling"]["enabled"]  # the curriculum switch alone turns it on
    engine = tiny_engine({"data_efficiency": implicit}, plugins=plugin, training_data=IdDataset())
    assert isinstance(engine.training_dataloader, CurriculumDataLoader)
    with pytest.raises(microspeed.ConfigError, match=r"curriculum_metrics\.difficulty\.difficulty_type"):
        tiny_engine({"data_efficiency": efficiency({"difficulty": {**metric(analysis), "difficulty_type": "x"}})},
                    plugins=plugin)
    with pytest.raises(microspeed.ConfigError, match=r"data_efficiency\.data_sampling\.dynamic_batching: unknown"):
        tiny_engine({"data_efficiency": {"data_sampling": {"dynamic_batching": {}}}}, plugins=plugin)
    with pytest.raises(microspeed.ConfigError, match="data_efficiency: this section belongs"):
        tiny_engine({"data_efficiency": {}, "plugins": {"disable": ["data_efficiency"]}}, plugins=plugin)


def _ids(batch) -> list[int]:
    return batch[0][:, 0].long().tolist()


def _train(analysis: str, save_dir: str, steps: int) -> dict:
    """Rank body: train, checkpoint, train on (reference); a fresh engine loads the checkpoint and trains on."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "data_efficiency": efficiency({"difficulty": metric(analysis)})}
    plugins = [("data_efficiency", DataEfficiencyPlugin)]

    def run(engine, it, n):
        seen, difficulties = [], []
        for _ in range(n * engine.gradient_accumulation_steps()):
            batch = next(it)
            seen.append(_ids(batch))
            engine.backward(engine(*batch))
            engine.step()
            difficulties.append(engine.plugin_state("data_efficiency").current_difficulties["difficulty"])
        return seen, difficulties

    engine = tiny_engine(config, plugins=plugins, training_data=IdDataset())
    it = iter(engine.training_dataloader)
    before, diff_before = run(engine, it, steps)
    engine.save_checkpoint(save_dir, tag="mid")
    reference, _ = run(engine, it, steps)
    fresh = tiny_engine(config, plugins=plugins, training_data=IdDataset(), seed=1)
    fresh.load_checkpoint(save_dir, tag="mid")
    resumed, _ = run(fresh, iter(fresh.training_dataloader), steps)
    return {"before": before, "difficulties": diff_before, "reference": reference, "resumed": resumed,
            "rank": fresh.topology.data_parallel_rank}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_with_checkpoint_resume(analysis, tmp_path):
    results = run_distributed(_train, world_size=2, args=(analysis, str(tmp_path / "ckpt"), 4),
                              env={"MICROSPEED_DISABLE_PLUGIN_AUTOLOAD": "1", "MICROSPEED_PLUGINS": ""},
                              timeout=200)
    r0, r1 = results
    assert (r0["rank"], r1["rank"]) == (0, 1)
    for k, (a, b) in enumerate(zip(r0["before"], r1["before"], strict=True)):
        assert len(a) == len(b) == 2 and not set(a) & set(b)  # disjoint micro-batches of one micro-step
        assert max(difficulty_of(i) for i in a + b) <= r0["difficulties"][k]
    assert r0["difficulties"] == r1["difficulties"] and r0["difficulties"][0] == 18
    for r in (r0, r1):
        assert r["resumed"] == r["reference"]  # the checkpoint restored the exact position
        assert r["reference"] != r["before"]
    assert os.path.isdir(tmp_path / "ckpt" / "mid")
