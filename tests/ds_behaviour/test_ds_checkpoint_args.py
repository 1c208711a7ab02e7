"""DeepSpeed 0.19.8's ``save_checkpoint`` / ``load_checkpoint`` argument rules and ``checkpoint.tag_validation``.

Found by ``benchmarks/deepspeed_unit_tests.py`` (``tests/unit/checkpoint/test_tag_validation.py``):

- ``save_checkpoint(save_dir="")`` hung until the test's timeout on 2 ranks (rank 0 failed after writing into the
  current directory while rank 1 waited in a collective) and ``save_dir=None`` was a ``TypeError`` from deep inside;
  DeepSpeed raises ``ValueError`` at once. Both folders are now refused on every rank before any collective, and
  ``load_checkpoint`` and ``save_16bit_model`` likewise.
- ``checkpoint.tag_validation`` (``Ignore`` / ``Warn`` / ``Fail``, any case; DeepSpeed's default ``Warn``) was
  accepted with a notice and differing tags always failed. DeepSpeed: ``Fail`` asserts, ``Warn`` logs, ``Ignore``
  says nothing; a value outside the three is a config error. Where ranks differ and the save goes on, microspeed
  saves one whole checkpoint under rank 0's tag (the tag ``latest`` names in DeepSpeed too).
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

import microspeed
from microspeed import ConfigError
from microspeed.checkpoint import CheckpointError, CheckpointTagMismatchError, CheckpointWarning
from microspeed.testing import distributed


def _engine(**checkpoint):
    torch.manual_seed(0)
    config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if checkpoint:
        config["checkpoint"] = checkpoint
    return microspeed.initialize(model=torch.nn.Linear(4, 1), config=config)[0]


def _refused_at_once(engine) -> None:
    """``''`` and ``None`` as the folder to save or load: a ``ValueError`` naming the argument, nothing written."""
    for folder in ("", None):
        for call, argument in (("save_checkpoint", "save_dir"), ("load_checkpoint", "load_dir"),
                               ("save_16bit_model", "save_dir")):
            start = time.monotonic()
            with pytest.raises(CheckpointError) as info:
                getattr(engine, call)(folder)
            assert isinstance(info.value, ValueError)  # what DeepSpeed raises and its tests catch
            assert f"{call}: {argument} must name a folder" in str(info.value) and repr(folder) in str(info.value)
            assert time.monotonic() - start < 5.0
    assert os.listdir(".") == []  # '' never meant the current directory


@pytest.fixture
def _empty_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.mark.usefixtures("_empty_cwd")
def test_empty_or_none_checkpoint_folder_is_refused_on_one_process():
    _refused_at_once(_engine())


@pytest.mark.slow
@distributed(world_size=2, timeout=60)  # the hang this stops took the whole timeout: fail, never block
def test_empty_or_none_checkpoint_folder_is_refused_on_two_ranks_without_waiting(tmp_path):
    os.makedirs(tmp_path / "cwd", exist_ok=True)
    os.chdir(tmp_path / "cwd")
    engine = _engine()
    _refused_at_once(engine)
    engine.save_checkpoint(str(tmp_path / "ckpt"))  # the ranks are still in step: the next save works
    assert engine.load_checkpoint(str(tmp_path / "ckpt"))[0].endswith("global_step0")


def test_tag_validation_accepts_deepspeeds_modes_in_any_case_and_refuses_others():
    with pytest.raises(ConfigError) as info:
        _engine(tag_validation="foo")
    msg = str(info.value)
    assert "checkpoint.tag_validation: got 'foo'" in msg and all(m in msg for m in ("'Ignore'", "'Warn'", "'Fail'"))
    assert _engine().checkpoint_tag_validation_enabled()  # default Warn, as DeepSpeed's
    assert not _engine().checkpoint_tag_validation_fail()
    assert _engine(tag_validation="fail").checkpoint_tag_validation_fail()
    assert not _engine(tag_validation="IGNORE").checkpoint_tag_validation_enabled()


@pytest.mark.slow
@distributed(world_size=2, timeout=90)
def test_tag_validation_modes_when_ranks_pass_different_tags(tmp_path):
    rank = torch.distributed.get_rank()
    mine = f"tag-{rank}"
    for mode in ("Fail", "Warn", "Ignore"):
        engine = _engine(tag_validation=mode)
        folder = str(tmp_path / mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode == "Fail":
                with pytest.raises(CheckpointTagMismatchError) as info:
                    engine.save_checkpoint(folder, tag=mine)
                assert isinstance(info.value, AssertionError)  # DeepSpeed asserts; its tests catch that
                assert "rank 0: 'tag-0', rank 1: 'tag-1'" in str(info.value)
                assert "checkpoint.tag_validation" in str(info.value)
                assert not os.path.exists(os.path.join(folder, "latest"))
                engine.save_checkpoint(folder, tag="same")  # the same tag still saves under Fail
                assert engine.load_checkpoint(folder)[0].endswith("same")
                continue
            engine.save_checkpoint(folder, tag=mine)
        said = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
        if mode == "Warn":
            assert len(said) == 1 and "rank 0: 'tag-0', rank 1: 'tag-1'" in said[0] and "rank 0's tag" in said[0]
        else:
            assert said == []
        # one whole checkpoint under rank 0's tag (DeepSpeed's `latest` names rank 0's tag too)
        torch.distributed.barrier()
        assert sorted(os.listdir(folder)) == ["latest", "tag-0"]
        assert engine.load_checkpoint(folder)[0].endswith("tag-0")
        assert engine.load_checkpoint(folder, tag="tag-0")[0].endswith("tag-0")
