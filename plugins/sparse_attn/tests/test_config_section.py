"""The ds_config ``"sparse_attention"`` section → SparsityConfig: modes, DeepSpeed's defaults, strict refusals."""

from __future__ import annotations

import pytest
import torch
from microspeed_sparse_attn.config import (
    SPARSE_ATTENTION_KEYS,
    parse_sparse_attention_section,
    sparsity_config_from_section,
)
from microspeed_sparse_attn.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    VariableSparsityConfig,
)

from microspeed.errors import ConfigError

#: DeepSpeed's section defaults (deepspeed/runtime/constants.py, "Sparse attention", up to 0.16.x), per mode.
DS_DEFAULTS = {
    "dense": (DenseSparsityConfig, {"block": 16}),
    "fixed": (FixedSparsityConfig, {
        "block": 16, "different_layout_per_head": False, "num_local_blocks": 4, "num_global_blocks": 1,
        "attention": "bidirectional", "horizontal_global_attention": False, "num_different_global_patterns": 1}),
    "variable": (VariableSparsityConfig, {
        "block": 16, "different_layout_per_head": False, "num_random_blocks": 0, "local_window_blocks": [4],
        "global_block_indices": [0], "global_block_end_indices": None, "attention": "bidirectional",
        "horizontal_global_attention": False}),
    "bigbird": (BigBirdSparsityConfig, {
        "block": 16, "different_layout_per_head": False, "num_random_blocks": 0, "num_sliding_window_blocks": 3,
        "num_global_blocks": 1}),
    "bslongformer": (BSLongformerSparsityConfig, {
        "block": 16, "different_layout_per_head": False, "num_sliding_window_blocks": 3,
        "global_block_indices": [0], "global_block_end_indices": None}),
}
#: Keys we read beyond DeepSpeed's, with their defaults.
EXTENSIONS = {
    "variable": {"seed": None},
    "bigbird": {"attention": "bidirectional", "seed": None},
    "bslongformer": {"attention": "bidirectional"},
}


@pytest.mark.parametrize("mode", list(DS_DEFAULTS))
def test_each_mode_builds_its_class_with_deepspeed_defaults(mode):
    cls, defaults = DS_DEFAULTS[mode]
    cfg = sparsity_config_from_section({"mode": mode}, num_heads=4)
    assert type(cfg) is cls and cfg.num_heads == 4
    for key, value in defaults.items():
        assert getattr(cfg, key) == value, key
    assert SPARSE_ATTENTION_KEYS[mode] == {**defaults, **EXTENSIONS.get(mode, {})}
    parsed = parse_sparse_attention_section({"mode": mode})
    assert parsed == {"mode": mode, **defaults, **EXTENSIONS.get(mode, {})}


def test_missing_mode_means_fixed():
    cfg = sparsity_config_from_section({}, num_heads=2)
    assert type(cfg) is FixedSparsityConfig and cfg.num_local_blocks == 4 and cfg.num_global_blocks == 1
    assert type(sparsity_config_from_section({"block": 32}, 2)) is FixedSparsityConfig


def test_bigbird_section_default_has_no_random_blocks():
    # DeepSpeed's section default (0) differs from BigBirdSparsityConfig's own default (1).
    assert sparsity_config_from_section({"mode": "bigbird"}, 2).num_random_blocks == 0
    assert BigBirdSparsityConfig(2).num_random_blocks == 1


FULL_SECTIONS = [
    ({"mode": "dense", "block": 32}, DenseSparsityConfig(3, 32)),
    ({"mode": "fixed", "block": 32, "different_layout_per_head": True, "num_local_blocks": 6, "num_global_blocks": 2,
      "attention": "bidirectional", "horizontal_global_attention": True, "num_different_global_patterns": 3},
     FixedSparsityConfig(3, 32, True, 6, 2, "bidirectional", True, 3)),
    ({"mode": "fixed", "attention": "unidirectional", "num_local_blocks": 2},
     FixedSparsityConfig(3, 16, False, 2, 1, "unidirectional")),
    ({"mode": "variable", "block": 16, "different_layout_per_head": True, "num_random_blocks": 2,
      "local_window_blocks": [2, 4], "global_block_indices": [0, 6], "global_block_end_indices": [2, 8],
      "attention": "bidirectional", "horizontal_global_attention": True, "seed": 4},
     VariableSparsityConfig(3, 16, True, 2, [2, 4], [0, 6], [2, 8], "bidirectional", True, seed=4)),
    ({"mode": "bigbird", "block": 16, "different_layout_per_head": True, "num_random_blocks": 2,
      "num_sliding_window_blocks": 5, "num_global_blocks": 2, "attention": "unidirectional", "seed": 9},
     BigBirdSparsityConfig(3, 16, True, 2, 5, 2, "unidirectional", seed=9)),
    ({"mode": "bslongformer", "block": 32, "different_layout_per_head": False, "num_sliding_window_blocks": 5,
      "global_block_indices": [1, 4], "global_block_end_indices": [2, 6], "attention": "unidirectional"},
     BSLongformerSparsityConfig(3, 32, False, 5, [1, 4], [2, 6], "unidirectional")),
]


@pytest.mark.parametrize("section,direct", FULL_SECTIONS, ids=[s["mode"] for s, _ in FULL_SECTIONS])
def test_section_values_reach_the_config(section, direct):
    cfg = sparsity_config_from_section(section, num_heads=3)
    assert repr(cfg) == repr(direct)
    assert torch.equal(cfg.make_layout(512), direct.make_layout(512))


def test_parsed_section_does_not_share_lists_with_the_defaults():
    parsed = parse_sparse_attention_section({"mode": "variable"})
    parsed["local_window_blocks"].append(99)
    assert SPARSE_ATTENTION_KEYS["variable"]["local_window_blocks"] == [4]
    given = [2, 2]
    cfg = sparsity_config_from_section({"mode": "variable", "local_window_blocks": given}, 1)
    given.append(7)
    assert cfg.local_window_blocks == [2, 2]


def test_unknown_key_names_the_path_and_lists_valid_keys():
    with pytest.raises(ConfigError) as info:
        sparsity_config_from_section({"mode": "fixed", "window": 4}, 2)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith("sparse_attention.window: unknown key for mode 'fixed'.")
    for key in ("mode", *SPARSE_ATTENTION_KEYS["fixed"]):
        assert key in message


def test_typo_gets_a_suggestion():
    with pytest.raises(ConfigError, match="sparse_attention.num_local_block: .*Did you mean 'num_local_blocks'"):
        sparsity_config_from_section({"num_local_block": 4}, 2)


@pytest.mark.parametrize("mode,key,owner", [
    ("bigbird", "num_local_blocks", "'fixed'"),
    ("fixed", "num_sliding_window_blocks", "'bigbird' / 'bslongformer'"),
    ("bslongformer", "num_random_blocks", "'variable' / 'bigbird'"),
    ("dense", "different_layout_per_head", "'fixed'"),
    ("fixed", "seed", "'variable' / 'bigbird'"),
    ("bigbird", "horizontal_global_attention", "'fixed' / 'variable'"),
])
def test_key_of_another_mode_is_refused(mode, key, owner):
    with pytest.raises(ConfigError, match=rf"sparse_attention\.{key}: unknown key for mode '{mode}'\. "
                                          rf"It is read by mode {owner}"):
        sparsity_config_from_section({"mode": mode, key: 1}, 2)


@pytest.mark.parametrize("key,value,mode", [
    ("block", "16", "fixed"),
    ("block", 24, "dense"),
    ("block", True, "fixed"),
    ("different_layout_per_head", 1, "fixed"),
    ("num_local_blocks", 4.0, "fixed"),
    ("num_global_blocks", "1", "fixed"),
    ("num_random_blocks", True, "bigbird"),
    ("num_sliding_window_blocks", None, "bslongformer"),
    ("num_different_global_patterns", 2.5, "fixed"),
    ("attention", "causal", "fixed"),
    ("attention", 1, "bigbird"),
    ("horizontal_global_attention", "yes", "variable"),
    ("local_window_blocks", 4, "variable"),
    ("local_window_blocks", ["4"], "variable"),
    ("global_block_indices", (0,), "bslongformer"),
    ("global_block_end_indices", 5, "variable"),
    ("seed", "1", "bigbird"),
    ("seed", 1.0, "variable"),
])
def test_wrong_types_are_refused(key, value, mode):
    with pytest.raises(ConfigError, match=rf"sparse_attention\.{key}: expected"):
        sparsity_config_from_section({"mode": mode, key: value}, 2)


@pytest.mark.parametrize("mode", ["sparse", "local_sliding_window", "Fixed", 3, None])
def test_bad_mode_is_refused(mode):
    with pytest.raises(ConfigError, match=r"sparse_attention\.mode: got .*accepted modes: dense, fixed, variable, "
                                          r"bigbird, bslongformer"):
        sparsity_config_from_section({"mode": mode}, 2)


@pytest.mark.parametrize("section", [[], "fixed", None])
def test_section_must_be_an_object(section):
    with pytest.raises(ConfigError, match="sparse_attention: expected an object"):
        sparsity_config_from_section(section, 2)


@pytest.mark.parametrize("section,match", [
    ({"num_local_blocks": 4, "num_global_blocks": 3}, r"sparse_attention\.num_local_blocks \(4\) must be divisible"),
    ({"num_different_global_patterns": 2}, r"sparse_attention\.num_different_global_patterns=2 needs "
                                           r"different_layout_per_head=True"),
    ({"attention": "unidirectional", "horizontal_global_attention": True},
     r"sparse_attention\.horizontal_global_attention=True needs attention='bidirectional'"),
    ({"mode": "variable", "global_block_indices": [0, 2], "global_block_end_indices": [1]},
     r"sparse_attention\.global_block_end_indices has 1 entries"),
    ({"mode": "bslongformer", "global_block_indices": [2], "global_block_end_indices": [2]},
     r"sparse_attention\.global_block_end_indices\[0\] \(2\) must be larger"),
    ({"mode": "variable", "local_window_blocks": []}, r"sparse_attention\.local_window_blocks must list"),
    ({"mode": "bigbird", "num_sliding_window_blocks": 0}, r"sparse_attention\.num_sliding_window_blocks must be"),
])
def test_bad_values_are_refused_at_parse_time(section, match):
    with pytest.raises(ConfigError, match=match):
        parse_sparse_attention_section(section)
    with pytest.raises(ConfigError, match=match):
        sparsity_config_from_section(section, 4)


def test_bad_num_heads_is_refused():
    with pytest.raises(ConfigError, match=r"sparse_attention \(mode 'fixed'\): num_heads must be an integer >= 1"):
        sparsity_config_from_section({}, 0)


def test_seeded_section_gives_the_same_layout_twice():
    section = {"mode": "bigbird", "num_random_blocks": 2, "different_layout_per_head": True, "seed": 3}
    first = sparsity_config_from_section(section, 2).make_layout(256)
    assert torch.equal(first, sparsity_config_from_section(section, 2).make_layout(256))
