"""The composition matrix: gathered from what the installed plugins declare, shown by ``microspeed plugins --matrix``,
kept equal to ``docs/compositions.md`` and the plugin READMEs, and true at ``initialize()``."""

from __future__ import annotations

import importlib
import importlib.util
import textwrap
from itertools import combinations
from pathlib import Path

import pytest
import torch

import microspeed
from microspeed import cli
from microspeed.compositions import Feature, Matrix, Refusal, composition_matrix, refuse_pairs
from microspeed.errors import ConfigError, PluginError
from microspeed.plugins import PluginManager

ROOT = Path(__file__).resolve().parents[1]

ISSUE_17_FEATURES = {
    "zero": {"zero-1", "zero-2", "zero-3", "offload-cpu", "offload-nvme"},
    "pipeline": {"pipeline-1f1b", "pipeline-interleaved", "tensor-parallel"},
    "activation_checkpointing": {"activation-checkpointing"},
    "moe": {"moe"},
    "comm": {"onebit-adam", "zero-one-adam", "onebit-lamb"},
    "mixed_precision": {"fp16", "bf16"},
    "sparse_attn": {"sparse-attention"},
    "random_ltd": {"random-ltd"},
    "progressive_layer_drop": {"pld"},
    "curriculum": {"curriculum"},
}
"""The features issue 17's matrix names, by the plugin that provides each."""


def _script():
    spec = importlib.util.spec_from_file_location("update_compositions", ROOT / "scripts" / "update_compositions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _manager(*extra) -> PluginManager:
    pm = PluginManager()
    pm.load_all(extra=extra)
    return pm


@pytest.fixture(scope="module")
def matrix() -> Matrix:
    return composition_matrix()


class ThirdParty:
    """A third party's plugin: one feature, refused with ZeRO stage 3."""

    @microspeed.hookimpl
    def microspeed_features(self):
        return [Feature("kit-compress", "Kit compression", '"kit": {"enabled": true}')]

    @microspeed.hookimpl
    def microspeed_refusals(self):
        return [Refusal(("kit-compress", "zero-3"), "kit compresses whole parameters, which stage 3 never holds",
                        "use ZeRO stage 1 or 2 with kit")]


def test_every_feature_of_issue_17_is_declared_by_its_plugin(matrix):
    by_plugin: dict[str, set[str]] = {}
    for f in matrix.features:
        by_plugin.setdefault(f.plugin, set()).add(f.name)
        assert f.title and f.enable, f
    assert by_plugin == ISSUE_17_FEATURES
    assert len(matrix.features) == 19 == len({f.name for f in matrix.features})


def test_status_is_symmetric_and_pairs_leave_out_alternatives(matrix):
    names = [f.name for f in matrix.features]
    for a, b in combinations(names, 2):
        assert matrix.status(a, b) is matrix.status(b, a), (a, b)
        assert matrix.conditions(a, b) == matrix.conditions(b, a), (a, b)
    pairs = matrix.pairs()
    assert len(pairs) == len(names) * (len(names) - 1) // 2 - 8  # ZeRO stages 3, schedules 1, 1-bit 3, fp16/bf16 1
    assert matrix.alternatives("zero-1", "zero-3") and matrix.alternatives("bf16", "fp16")
    assert not matrix.alternatives("zero-1", "offload-cpu")
    assert all(not matrix.alternatives(a.name, b.name) for a, b, _ in pairs)
    for a, b, refusal in pairs:
        assert refusal is None or (refusal.names(a.name, b.name) and not refusal.when)
    s = matrix.summary()
    assert (s["pairs"], s["supported"] + s["refused"]) == (len(pairs), len(pairs))
    assert s["refused"] == sum(r is not None for *_, r in pairs)


def test_refusal_message_and_error_name_the_key():
    r = Refusal(("a", "b"), "A keeps what B splits.", "use A alone")
    assert r.message() == "A keeps what B splits; use A alone"
    err = r.error("a.enabled")
    assert isinstance(err, ConfigError) and str(err) == "a.enabled: A keeps what B splits; use A alone"
    assert [x.features for x in refuse_pairs(("a",), ("b", "c"), "why", "what")] == [("a", "b"), ("a", "c")]


def test_a_feature_declared_twice_is_refused_naming_both_plugins():
    class Dup:
        @microspeed.hookimpl
        def microspeed_features(self):
            return [Feature("zero-1", "my ZeRO", "dup.enabled")]

    with pytest.raises(PluginError, match=r"'zero-1' is declared twice: by the plugin '(zero|dup)' and by the "
                                          r"plugin '(zero|dup)'") as info:
        composition_matrix(_manager(("dup", Dup())))
    assert "'zero'" in str(info.value) and "'dup'" in str(info.value)


@pytest.mark.parametrize("features, match", [
    (("kit-compress", "zero-4"), r"'kit' refuses 'kit-compress' with 'zero-4', but no installed plugin declares "
                                 r"the feature 'zero-4'"),
    (("zero-1", "tensor-parallel"), r"'kit' refuses 'zero-1' with 'tensor-parallel', neither of which it declares"),
    (("kit-compress", "kit-compress"), r"two different features"),
])
def test_a_refusal_naming_an_unknown_or_foreign_pair_is_refused(features, match):
    class Kit(ThirdParty):
        @microspeed.hookimpl
        def microspeed_refusals(self):
            return [Refusal(features, "because", "do otherwise")]

    with pytest.raises(PluginError, match=match):
        composition_matrix(_manager(("kit", Kit())))


def test_a_refusal_about_a_plugin_not_installed_is_set_apart_unless_strict(capsys):
    pm = PluginManager()
    pm.load_all(disabled=["zero"], extra=[("kit", ThirdParty())])
    with pytest.raises(PluginError, match=r"no installed plugin declares the feature 'zero-\d'"):
        composition_matrix(pm)
    m = composition_matrix(pm, strict=False)
    assert [(r.plugin, r.features) for r in m.absent if r.plugin == "kit"] == [("kit", ("kit-compress", "zero-3"))]
    assert "zero-3" not in {f.name for f in m.features} and m.status("kit-compress", "moe") is None
    assert "  kit-compress x zero-3 [plugin kit]" in m.text()
    assert cli.main(["plugins", "--matrix", "--disable", "zero"]) == 0  # comm's refusals with ZeRO are set apart
    out = capsys.readouterr().out
    assert out.startswith("composition matrix: 14 features") and "  zero-1 " not in out


def test_a_hook_answer_that_is_not_a_list_of_declarations_is_refused():
    class Bad:
        @microspeed.hookimpl
        def microspeed_features(self):
            return ["zero-9"]

    with pytest.raises(PluginError, match=r"'bad': microspeed_features must return a list of Feature"):
        composition_matrix(_manager(("bad", Bad())))


def test_a_third_party_feature_and_refusal_show_up(matrix):
    m = composition_matrix(_manager(("kit", ThirdParty())))
    assert m.feature("kit-compress").plugin == "kit"
    refusal = m.status("zero-3", "kit-compress")
    assert refusal is not None and refusal.plugin == "kit"
    assert m.status("kit-compress", "zero-2") is None
    assert len(m.pairs()) == len(matrix.pairs()) + len(matrix.features)
    assert refusal.message() in m.text() and "`kit-compress`" in m.markdown()


def _install_kit_distribution(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "ms_kit_matrix.py").write_text(textwrap.dedent("""
        import microspeed
        from microspeed.plugin_api import Feature, Refusal

        class Plugin:
            @microspeed.hookimpl
            def microspeed_features(self):
                return [Feature("kit-compress", "Kit compression", '"kit": {"enabled": true}')]

            @microspeed.hookimpl
            def microspeed_refusals(self):
                return [Refusal(("kit-compress", "moe"), "kit compresses over the whole data-parallel group, "
                                "where experts differ", "turn kit off for MoE models")]
    """))
    dist = site / "ms_kit_matrix-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ms-kit-matrix\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[microspeed.plugins]\nkit_matrix = ms_kit_matrix:Plugin\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()


def test_plugins_matrix_prints_every_feature_and_refusal(matrix, capsys, tmp_path, monkeypatch):
    assert cli.main(["plugins", "--matrix"]) == 0
    out = capsys.readouterr().out
    s = matrix.summary()
    assert out.startswith(f"composition matrix: 19 features, {s['pairs']} pairs: {s['supported']} supported")
    for f in matrix.features:
        assert f"  {f.name} " in out and f.title in out
    for r in matrix.refusals:
        assert r.message() in out, r
    _install_kit_distribution(tmp_path, monkeypatch)
    assert cli.main(["plugins", "--matrix"]) == 0
    out = capsys.readouterr().out
    assert "kit-compress" in out and "kit compresses over the whole data-parallel group" in out
    assert "plugin kit_matrix" in out


def test_plugins_matrix_markdown_is_the_markdown_and_needs_matrix(matrix, capsys):
    assert cli.main(["plugins", "--matrix", "--markdown"]) == 0
    assert capsys.readouterr().out == matrix.markdown()
    assert cli.main(["plugins", "--markdown"]) == 2
    assert "--markdown goes with --matrix" in capsys.readouterr().err


def test_docs_and_plugin_readmes_equal_what_the_plugins_declare(matrix):
    """docs/compositions.md and each README's Compositions block are generated: regenerate, compare."""
    script = _script()
    files = script.expected()
    assert files[ROOT / "docs" / "compositions.md"] == matrix.markdown()
    stale = [str(p.relative_to(ROOT)) for p, text in files.items() if p.read_text() != text]
    assert not stale, f"{stale} differ from the declarations: run python scripts/update_compositions.py"
    readmes = [p for p in files if p.name == "README.md"]
    for r in matrix.refusals:  # every refusal is argued in its plugin's README
        assert any(r.message() in p.read_text() for p in readmes), r
    assert "docs/compositions.md" in (ROOT / "README.md").read_text()


def _moe_model():
    from microspeed_moe.layer import MoE

    torch.manual_seed(0)
    return MoE(8, torch.nn.Linear(8, 8), num_experts=2)


NVME = "<nvme>"
ONEBIT = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}
ADAM = {"type": "Adam", "params": {"lr": 1e-3}}

SINGLE_PROCESS_PAIRS = [
    (("onebit-adam", "zero-1"), None, {"optimizer": ONEBIT, "zero_optimization": {"stage": 1}}),
    (("onebit-lamb", "zero-2"), None, {"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 2}},
                                       "zero_optimization": {"stage": 2}}),
    (("moe", "zero-3"), _moe_model, {"optimizer": ADAM, "zero_optimization": {"stage": 3}}),
    (("onebit-adam", "moe"), _moe_model, {"optimizer": ONEBIT}),
    (("zero-one-adam", "zero-1"), None, {"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3}},
                                         "zero_optimization": {"stage": 1}}),
    (("onebit-adam", "offload-cpu"), None, {"optimizer": ONEBIT, "zero_optimization": {
        "stage": 1, "offload_optimizer": {"device": "cpu"}}}),
    (("onebit-adam", "offload-nvme"), None, {"optimizer": ONEBIT, "zero_optimization": {
        "stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": NVME}}}),
    (("zero-one-adam", "offload-nvme"), None, {"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3}},
                                               "zero_optimization": {"stage": 1, "offload_optimizer": {
                                                   "device": "nvme", "nvme_path": NVME}}}),
    (("moe", "bf16"), _moe_model, {"optimizer": ADAM, "bf16": {"enabled": True},
                                   "data_types": {"grad_accum_dtype": "fp32"}}),
]


@pytest.mark.parametrize("pair, model, config", SINGLE_PROCESS_PAIRS, ids=lambda v: "x".join(v) if
                         isinstance(v, tuple) else None)
def test_a_declared_refusal_is_what_initialize_raises(matrix, pair, model, config, tmp_path):
    """Pairs one process can build: refused with the declared message exactly when declared (here: conditions met)."""
    refusal = matrix.status(*pair) or next(iter(matrix.conditions(*pair)), None)
    if config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "nvme":
        config = {**config, "zero_optimization": {**config["zero_optimization"], "offload_optimizer": {
            **config["zero_optimization"]["offload_optimizer"], "nvme_path": str(tmp_path)}}}
    model = model() if model else torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {"train_batch_size": 2, "steps_per_print": 10**6, **config}
    if refusal is None:
        engine, *_ = microspeed.initialize(model=model, config=config)
        assert engine.optimizer is not None
    else:
        with pytest.raises(ConfigError) as info:
            microspeed.initialize(model=model, config=config)
        assert refusal.message() in str(info.value)


IN_A_PIPELINE = {
    "pld": ("progressive_layer_drop.enabled", {"progressive_layer_drop": {"enabled": True, "theta": 0.5,
                                                                        "gamma": 0.001}}),
    "random-ltd": ("data_efficiency.data_routing.random_ltd.enabled", {"data_efficiency": {
        "enabled": True, "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 1, "random_ltd_layer_id": [1],
            "random_ltd_schedule": {"min_value": 2, "max_value": 4, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 2, "seq_per_step": 2}}}}}}),
    "curriculum": ("curriculum_learning.enabled", {"curriculum_learning": {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 2, "max_difficulty": 4,
        "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 2}}}),
}
"""Features refused in a pipeline: the key their refusal names, and the config that turns them on."""


def _in_a_pipeline(configs: dict) -> dict[str, str | None]:
    """On each of 2 ranks: a 2-stage PipelineModule with each feature on; the refusal's text, or None."""
    from microspeed_pipeline.module import PipelineModule

    out = {}
    for feature, extra in configs.items():
        torch.manual_seed(0)
        model = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=2,
                               loss_fn=torch.nn.functional.mse_loss)
        try:
            microspeed.initialize(model=model, config={"train_batch_size": 2, "steps_per_print": 10**6,
                                                       "optimizer": ADAM, **extra})
            out[feature] = None
        except ConfigError as exc:
            out[feature] = str(exc)
    return out


@pytest.mark.slow
def test_efficiency_features_in_a_pipeline_are_refused_as_declared(matrix):
    """Progressive layer drop, random-LTD and curriculum, where declared refused in a pipeline: a 2-stage pipeline on
    2 ranks (one job) raises the declared message, naming the key."""
    from microspeed.testing import run_distributed

    # only the declared refusals: a supported pair needs a model the feature can act on (tests/matrix runs those)
    configs = {feature: extra for feature, (_, extra) in IN_A_PIPELINE.items()
               if matrix.status(feature, "pipeline-1f1b") is not None}
    if not configs:
        pytest.skip("no efficiency feature is refused in a pipeline (tests/matrix checks that they train)")
    for results in run_distributed(_in_a_pipeline, world_size=2, args=(configs,), timeout=180):
        for feature, message in results.items():
            refusal = matrix.status(feature, "pipeline-1f1b")
            assert message is not None and refusal.message() in message, (feature, message)
            key = IN_A_PIPELINE[feature][0]
            assert message.startswith(f"{key} with a pipeline of 2 stages (PipelineModule): "), message
