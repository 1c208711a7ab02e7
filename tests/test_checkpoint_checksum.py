"""Checksums of checkpoint tensor files: flipped bytes or a truncated shard are refused naming the file.

Every item a rank writes gets a crc32 in the manifest (``tensor_files``), checked on every read; older
checkpoints written by DCP's per-tensor writer (no ``tensor_files``) load only with ``verify=False``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint_async import _train  # the same few steps of the same tiny model

import microspeed
from microspeed import checkpoint
from microspeed.checkpoint import MANIFEST, CheckpointError, storage
from microspeed.checkpoint.layout import _write_bytes
from microspeed.checkpoint.manifest import pack


def _engine(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    return microspeed.initialize(model=model, config=cfg)[0]


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def test_every_item_has_a_checksum_and_an_intact_checkpoint_loads(tmp_path):
    engine = _engine(0)
    _train(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path), tag="t")
    manifest = checkpoint.read_manifest(str(tmp_path / "t"))
    files = manifest["tensor_files"]
    assert list(files) == ["__0_0.distcp"] and files["__0_0.distcp"]["checksum"] == "crc32"
    index = checkpoint.read_tensor_index(str(tmp_path / "t"))
    assert len(files["__0_0.distcp"]["items"]) == len(index.storage_data) == 12  # 4 weights, 8 Adam moments
    assert files["__0_0.distcp"]["bytes"] == os.path.getsize(tmp_path / "t" / "__0_0.distcp")
    other = _engine(1)
    other.load_checkpoint(str(tmp_path), tag="t")
    for a, b in zip(_params(engine), _params(other), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_shard_is_refused_naming_the_file(tmp_path, damage):
    engine = _engine(0)
    _train(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path), tag="t")
    data = tmp_path / "t" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    if damage == "flip":
        for at in (17, len(raw) // 2):  # random bytes inside a weight: loaded silently before checksums
            raw[at] ^= 0xFF
    else:
        raw = raw[: len(raw) - 100]
    data.write_bytes(bytes(raw))
    victim = _engine(1)
    with pytest.raises(CheckpointError, match="checksum mismatch" if damage == "flip" else "truncated") as info:
        victim.load_checkpoint(str(tmp_path), tag="t")
    assert str(data) in str(info.value) and info.value.path == str(data)
    if damage == "flip":
        assert "The file is corrupted" in str(info.value)


def test_checkpoints_without_checksums_load_only_unverified(tmp_path):
    """The layout before checksums: DCP's per-tensor files and a manifest without ``tensor_files``: refused by
    default (nothing to verify them with), loaded with ``verify=False``."""
    engine = _engine(0)
    _train(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path), tag="new")
    manifest = checkpoint.read_manifest(str(tmp_path / "new"))
    reader = checkpoint.Reader(str(tmp_path / "new"), checkpoint.read_tensor_index(str(tmp_path / "new")), manifest)
    tensors = {k: reader.fresh(k) for k in reader.metadata.state_dict_metadata}
    reader.run(no_dist=True)
    old = tmp_path / "old"
    old.mkdir()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(old)), no_dist=True)
    del manifest["tensor_files"]
    _write_bytes(str(old / MANIFEST), pack(manifest))
    assert not storage.is_raw(checkpoint.read_tensor_index(str(old)))
    other = _engine(1)
    with pytest.raises(CheckpointError, match="no checksums.*verify=False") as info:
        other.load_checkpoint(str(tmp_path), tag="old")
    assert info.value.path == str(old / MANIFEST)
    other.load_checkpoint(str(tmp_path), tag="old", verify=False)
    for a, b in zip(_params(engine), _params(other), strict=True):
        assert torch.equal(a, b)
    assert _train(engine, 0, 2) == _train(other, 0, 2)
