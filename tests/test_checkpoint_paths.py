"""Paths a checkpoint's files name stay inside their folder; checksums are required; tags load back; a re-save
never leaves ``latest`` naming nothing.

Each test is the attack or the fault it stops: a hostile tag in the manifest ``export-deepspeed`` reads, a
tampered ``relative_path`` in the tensor index (``..``, absolute, a symlink out), a ``latest`` that climbs out,
a manifest stripped of its checksums, a tag with whitespace around it, and a process killed between the two
renames of a publish.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

import microspeed
from microspeed import checkpoint
from microspeed.checkpoint import LATEST, MANIFEST, CheckpointError
from microspeed.checkpoint.export import export_deepspeed
from microspeed.checkpoint.layout import _write_bytes
from microspeed.checkpoint.manifest import pack
from microspeed.checkpoint.resume import find_resume_tag
from microspeed.cli.checkpoint import main as checkpoint_cli

DATA = "__0_0.distcp"
INDEX = ".metadata"


def _engine(seed: int, **checkpoint_section):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {"train_batch_size": 2, "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    if checkpoint_section:
        config["checkpoint"] = checkpoint_section
    return microspeed.initialize(model=model, config=config)[0]


def _step(engine) -> None:
    g = torch.Generator().manual_seed(engine.global_steps)
    engine.backward(torch.nn.functional.mse_loss(engine(torch.randn(2, 4, generator=g)), torch.zeros(2, 1)))
    engine.step()


def _saved(save_dir: str, tag: str = "t", steps: int = 1) -> str:
    """A checkpoint of an engine after ``steps`` steps, as ``save_dir/tag``; returns the tag folder."""
    engine = _engine(0)
    for _ in range(steps):
        _step(engine)
    engine.save_checkpoint(save_dir, tag=tag)
    return os.path.join(save_dir, tag)


def _rewrite_manifest(tag_dir: str, **changes) -> dict:
    manifest = checkpoint.read_manifest(tag_dir)
    manifest.update(changes)
    manifest = {k: v for k, v in manifest.items() if v is not None}
    _write_bytes(os.path.join(tag_dir, MANIFEST), pack(manifest))
    return manifest


def _files_under(root) -> set[str]:
    return {os.path.join(d, n) for d, dirs, names in os.walk(root) for n in names + dirs}


# ------------------------------------------------------------------ export-deepspeed: the manifest's tag


@pytest.mark.parametrize("tag", ["../../..", "../escape", "ABSOLUTE", "sub/../../x", ".."])
def test_export_deepspeed_refuses_a_hostile_tag_in_the_manifest(tmp_path, tag):
    """A crafted manifest's ``tag`` is joined into the output path: ``../../..`` wrote DeepSpeed's files and
    ``latest`` outside the output folder. Refused naming the manifest and the tag; nothing is written."""
    if tag == "ABSOLUTE":
        tag = str(tmp_path / "elsewhere")
    tag_dir = _saved(str(tmp_path / "ckpt"))
    _rewrite_manifest(tag_dir, tag=tag)
    out = tmp_path / "a" / "b" / "out"
    before = _files_under(tmp_path)
    with pytest.raises(CheckpointError, match="names the tag") as info:
        export_deepspeed(str(tmp_path / "ckpt"), str(out))
    assert info.value.path == os.path.join(tag_dir, MANIFEST) and repr(tag) in str(info.value)
    assert _files_under(tmp_path) == before


def test_export_deepspeed_cli_refuses_a_hostile_tag(tmp_path, capsys):
    tag_dir = _saved(str(tmp_path / "ckpt"))
    _rewrite_manifest(tag_dir, tag="../../..")
    assert checkpoint_cli(["export-deepspeed", str(tmp_path / "ckpt"), str(tmp_path / "a" / "b" / "out")]) == 1
    err = capsys.readouterr().err
    assert os.path.join(tag_dir, MANIFEST) in err and "'../../..'" in err
    assert not (tmp_path / LATEST).exists() and not (tmp_path / "mp_rank_00_model_states.pt").exists()


# ------------------------------------------------------------------ the tensor index's relative_path


def _point_index_at(tag_dir: str, rel: str) -> None:
    """Tamper the tensor index so that the data file's items are read from ``rel``; the manifest's checksums
    are moved along (a crafted checkpoint carries whichever checksums match the bytes it points at)."""
    metadata = checkpoint.read_tensor_index(tag_dir)
    metadata.storage_data = {k: dataclasses.replace(v, relative_path=rel) for k, v in metadata.storage_data.items()}
    _write_bytes(os.path.join(tag_dir, INDEX), pickle.dumps(metadata))
    files = checkpoint.read_manifest(tag_dir)["tensor_files"]
    _rewrite_manifest(tag_dir, tensor_files={rel: files[DATA]})


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_a_tampered_relative_path_is_refused_naming_the_index(tmp_path, how):
    """``.metadata`` names the file each tensor's bytes are read from: ``../outside``, an absolute path or a data
    file that is a symlink out read another file's bytes back as weights. Refused before any byte is read."""
    save_dir = str(tmp_path / "ckpt")
    tag_dir = _saved(save_dir)
    outside = tmp_path / "outside.distcp"  # stands for any file of the machine (same bytes: checksums pass)
    rel = {"dotdot": "../../outside.distcp", "absolute": str(outside), "symlink": DATA}[how]
    if how != "symlink":
        _point_index_at(tag_dir, rel)
    os.replace(os.path.join(tag_dir, DATA), outside)
    if how == "symlink":
        os.symlink(outside, os.path.join(tag_dir, DATA))
    index = os.path.join(tag_dir, INDEX)
    with pytest.raises(CheckpointError, match="must stay inside") as info:
        _engine(1).load_checkpoint(save_dir, tag="t")
    assert info.value.path == index and repr(rel) in str(info.value)
    with pytest.raises(CheckpointError, match="must stay inside"):  # checksums or not
        _engine(1).load_checkpoint(save_dir, tag="t", verify=False)
    with pytest.raises(CheckpointError, match="must stay inside"):
        checkpoint.get_fp32_state_dict(save_dir, tag="t")
    assert checkpoint_cli(["info", save_dir, "--tag", "t"]) == 1


# ------------------------------------------------------------------ latest


@pytest.mark.parametrize("how", ["../other/x", "absolute", "symlink"])
def test_latest_naming_a_folder_outside_is_refused(tmp_path, how):
    """``latest`` that names ``../other/x``, an absolute path, or a folder that is a symlink out loaded a
    checkpoint from outside the save folder. Refused naming ``latest``; auto-resume skips it with a note."""
    save_dir = tmp_path / "ckpt"
    _saved(str(save_dir), tag="inside", steps=1)
    outside = _saved(str(tmp_path / "other"), tag="x", steps=2)
    value = {"../other/x": "../other/x", "absolute": outside, "symlink": "lnk"}[how]
    if how == "symlink":
        os.symlink(outside, save_dir / "lnk")
    (save_dir / LATEST).write_text(value)
    with pytest.raises(CheckpointError, match="must stay inside") as info:
        _engine(1).load_checkpoint(str(save_dir))
    assert info.value.path == str(save_dir / LATEST) and repr(value) in str(info.value)
    with pytest.raises(CheckpointError, match="must stay inside"):
        checkpoint.get_fp32_state_dict(str(save_dir))
    tag, notes = find_resume_tag(str(save_dir))
    assert tag == "inside" and str(save_dir / LATEST) in notes[0]
    skipped = [f"{save_dir / 'lnk'} leads outside {save_dir} (a symlink); it is skipped"] if how == "symlink" else []
    assert notes[1:] == skipped


# ------------------------------------------------------------------ checksums are required


def test_a_manifest_stripped_of_checksums_is_refused_unless_unverified(tmp_path, capsys):
    """Without ``tensor_files`` nothing verifies the tensor bytes: refused naming the manifest and the switch,
    loaded with ``verify=False`` / ``--no-verify``."""
    save_dir = str(tmp_path / "ckpt")
    tag_dir = _saved(save_dir, steps=2)
    _rewrite_manifest(tag_dir, tensor_files=None)
    engine = _engine(1)
    with pytest.raises(CheckpointError, match=r"no checksums.*verify=False.*--no-verify") as info:
        engine.load_checkpoint(save_dir)
    assert info.value.path == os.path.join(tag_dir, MANIFEST) and engine.global_steps == 0
    engine.load_checkpoint(save_dir, verify=False)
    assert engine.global_steps == 2
    with pytest.raises(CheckpointError, match="no checksums"):
        checkpoint.get_fp32_state_dict(save_dir)
    assert set(checkpoint.get_fp32_state_dict(save_dir, verify=False)) == set(engine.module.state_dict())
    for command in (["consolidate", save_dir, str(tmp_path / "w.pt")], ["export-deepspeed", save_dir,
                                                                          str(tmp_path / "ds")]):
        assert checkpoint_cli(command) == 1
        err = capsys.readouterr().err
        assert os.path.join(tag_dir, MANIFEST) in err and "--no-verify" in err
        assert checkpoint_cli([*command, "--no-verify"]) == 0
    assert (tmp_path / "w.pt").is_file() and (tmp_path / "ds" / LATEST).read_text() == "t"


# ------------------------------------------------------------------ tags that would not load back


@pytest.mark.parametrize("tag", [" step1 ", "step1\n", "\tstep1"])
def test_a_tag_with_whitespace_around_it_is_refused_at_save(tmp_path, tag):
    """``latest`` is read back stripped, so such a tag saved and then failed to load. Refused before anything is
    written, naming the tag and the tag to use instead."""
    engine = _engine(0)
    _step(engine)
    with pytest.raises(CheckpointError, match="whitespace around it") as info:
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag=tag)
    assert repr(tag) in str(info.value) and "tag='step1'" in str(info.value)
    assert not (tmp_path / "ckpt").exists() or not os.listdir(tmp_path / "ckpt")


# ------------------------------------------------------------------ a crash between the publish renames


class _Killed(BaseException):
    """Stands for the process dying (the in-process variant of the crash)."""


def _arm(final: str, mode: str, die, patch=setattr) -> None:
    """Make the process die right after the first move of the published folder ``final`` in the publish:
    between the two renames (``two renames``: the atomic exchange unavailable), or after the exchange."""
    from microspeed.checkpoint import layout

    real_rename = os.rename

    def rename(a, b, *args, **kwargs):
        real_rename(a, b, *args, **kwargs)
        if final in (os.fspath(a), os.fspath(b)):
            die()

    patch(os, "rename", rename)
    if hasattr(layout, "_exchange"):
        real_exchange = layout._exchange

        def exchange(a, b):
            if mode == "two renames" or not real_exchange(a, b):
                return False
            die()

        patch(layout, "_exchange", exchange)


def _resave_dying(save_dir: str, mode: str, die, patch=setattr) -> None:
    """Save tag ``ckpt`` at step 1, then again at step 2, dying in the middle of the second publish."""
    engine = _engine(0)
    _step(engine)
    engine.save_checkpoint(save_dir, tag="ckpt")
    _step(engine)
    _arm(os.path.join(save_dir, "ckpt"), mode, die, patch)
    engine.save_checkpoint(save_dir, tag="ckpt")


def _assert_recovers(save_dir: str, mode: str, capsys) -> None:
    """``latest`` loads the new checkpoint, auto-resume picks it (with a warning when it had to look past
    ``latest``), and the next save of the tag clears what the crash left."""
    fresh = _engine(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_checkpoint(save_dir)
    assert fresh.global_steps == 2  # the new save: complete before its publish began
    assert any("interrupted" in str(w.message) for w in caught) == (mode == "two renames")
    capsys.readouterr()
    resumed = _engine(2, auto_resume_dir=save_dir)
    err = capsys.readouterr().err
    assert resumed.global_steps == 2 and "resumed from" in err
    if mode == "two renames":
        assert "names 'ckpt', which is incomplete (the folder does not exist)" in err
        assert "the newest complete checkpoint is" in err
    assert [n for n in os.listdir(save_dir) if n.startswith("ckpt.tmp-")]  # the crash's leftovers ...
    resumed.save_checkpoint(save_dir, tag="ckpt")
    assert sorted(os.listdir(save_dir)) == ["ckpt", LATEST]  # ... go with the next save of the tag
    assert find_resume_tag(save_dir) == ("ckpt", [])


@pytest.mark.parametrize("mode", ["exchange", "two renames"])
def test_a_crash_inside_the_publish_of_a_resaved_tag_keeps_it_loadable(tmp_path, monkeypatch, capsys, mode):
    """Re-saving a tag moved the old folder away and then the new one in: a crash between left ``latest`` naming
    no folder, the load failed and auto-resume started from step 0. (The crash as an exception, in-process.)"""
    save_dir = str(tmp_path / "ckpt")

    def die():
        raise _Killed

    with pytest.raises(_Killed):
        _resave_dying(save_dir, mode, die, monkeypatch.setattr)
    monkeypatch.undo()
    assert os.path.isdir(os.path.join(save_dir, "ckpt")) == (mode == "exchange")
    _assert_recovers(save_dir, mode, capsys)


_KILLED_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
import test_checkpoint_paths as t
t._resave_dying({save_dir!r}, {mode!r}, lambda: os._exit(17))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exchange", "two renames"])
def test_a_process_killed_inside_the_publish_leaves_a_loadable_checkpoint(tmp_path, capsys, mode):
    """The same crash as a real process exit (``os._exit``: no cleanup, no ``finally``) between the renames."""
    save_dir = str(tmp_path / "ckpt")
    script = _KILLED_SCRIPT.format(tests=os.path.dirname(__file__), save_dir=save_dir, mode=mode)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 17, done.stderr[-2000:]
    _assert_recovers(save_dir, mode, capsys)
