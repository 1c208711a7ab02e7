"""A checkpoint is data: a crafted file never runs code, whichever entry point reads it (issue 31).

Each attack plants, in one checkpoint file, a pickle whose loading would run ``touch MARKER`` (``os.system``
through ``__reduce__``): in the manifest (msgpack extension type 4, which microspeed used to unpickle), in the
tensor index ``.metadata`` (DCP's pickle), in a rank's ``__0_0.index`` (msgpack, read while a save is published)
and in DeepSpeed's ``mp_rank_00_model_states.pt`` / ``zero_pp_rank_0_mp_rank_00_optim_states.pt``. Every entry
point that reads the file must refuse it with a :class:`CheckpointError` that names the file and says it is not
data, and the marker must never appear. The fuzz test puts random and truncated bytes in place of each file
kind and expects a clear :class:`CheckpointError`, never another exception, a hang or an execution. All of it runs
in this process on single-process engines (no ranks).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import random
import shlex
import shutil
from collections import OrderedDict
from pathlib import Path

import msgpack
import pytest
import torch

import microspeed
from microspeed.checkpoint import storage
from microspeed.checkpoint.deepspeed_format import read_deepspeed
from microspeed.checkpoint.errors import CheckpointError
from microspeed.checkpoint.manifest import pack, unpack
from microspeed.checkpoint.resume import find_resume_tag
from microspeed.cli.checkpoint import main as checkpoint_cli
from microspeed.compat import standin

TAGS = ("global_step1", "global_step2")
NOT_DATA = "is not data"


class _Touch:
    """Unpickling this runs ``touch <marker>``: the payload every crafted file carries."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def _config(**checkpoint) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01}}}
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    return cfg


def _engine(**checkpoint):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return microspeed.initialize(model=model, config=_config(**checkpoint))[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A save folder with two complete checkpoints (``latest``: the second) written by a single-process engine."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    engine = _engine()
    for tag in TAGS:
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
        engine.save_checkpoint(str(root), tag=tag, client_state={"epoch": 1})
    return root


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A fresh copy of :func:`saved` for one test to tamper with."""
    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _raw_ext(code: int, data: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(code, data)


def plant_manifest(tag_dir: Path, marker: Path) -> Path:
    """The manifest with a pickled payload in its client state (extension type 4, as microspeed once wrote)."""
    path = tag_dir / "manifest.msgpack"
    doc = msgpack.unpackb(path.read_bytes(), ext_hook=_raw_ext, raw=False, strict_map_key=False)
    doc["client_state"]["epoch"] = msgpack.ExtType(4, pickle.dumps(_Touch(marker)))
    path.write_bytes(msgpack.packb(doc, use_bin_type=True))
    return path


def plant_metadata(tag_dir: Path, marker: Path) -> Path:
    """The tensor index, still a valid DCP ``Metadata``, with the payload in its planner data."""
    path = tag_dir / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own file, written by the fixture
    metadata.planner_data = {**metadata.planner_data, "note": _Touch(marker)}
    path.write_bytes(pickle.dumps(metadata))
    return path


PLANTS = {"manifest": plant_manifest, "metadata": plant_metadata}


def _refused(exc: BaseException | str, path: Path) -> None:
    text = str(exc)
    assert str(path) in text and NOT_DATA in text, text


def _standin_zero_to_fp32():
    """The stand-in's ``deepspeed.utils.zero_to_fp32`` module, loaded from its file (real DeepSpeed may be
    importable as ``deepspeed`` in this process)."""
    path = standin.source_folder() / "deepspeed" / "utils" / "zero_to_fp32.py"
    spec = importlib.util.spec_from_file_location("standin_zero_to_fp32", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _zero_to_fp32_modules():
    from microspeed.checkpoint import zero_to_fp32

    return [zero_to_fp32, _standin_zero_to_fp32()]


def _each_zero_to_fp32_call(folder: Path, out: Path):
    """Every ``zero_to_fp32`` function of microspeed and of the stand-in, over ``folder``."""
    for module in _zero_to_fp32_modules():
        yield lambda m=module: m.get_fp32_state_dict_from_zero_checkpoint(str(folder))
        yield lambda m=module: m.convert_zero_checkpoint_to_fp32_state_dict(str(folder), str(out))
        yield lambda m=module: m.load_state_dict_from_zero_checkpoint(torch.nn.Linear(4, 3), str(folder))


# ------------------------------------------------------------------ a microspeed checkpoint's files


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_load_checkpoint_refuses_a_payload(ckpt, tmp_path, kind):
    marker = tmp_path / "MARKER"
    planted = PLANTS[kind](ckpt / TAGS[1], marker)
    with pytest.raises(CheckpointError) as err:
        _engine().load_checkpoint(str(ckpt))
    _refused(err.value, planted)
    assert not marker.exists()


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_auto_resume_skips_a_payload_and_resumes_from_the_checkpoint_before(ckpt, tmp_path, capsys, kind):
    """``latest`` names the crafted tag: auto-resume refuses it (a warning naming the file) and loads the other."""
    marker = tmp_path / "MARKER"
    planted = PLANTS[kind](ckpt / TAGS[1], marker)
    tag, notes = find_resume_tag(str(ckpt))
    assert tag == TAGS[0] and not marker.exists()
    _refused(" ".join(notes), planted)
    engine = _engine(auto_resume_dir=str(ckpt))
    assert engine.resumed_from == str(ckpt / TAGS[0]) and engine.global_steps == 1
    _refused(capsys.readouterr().err, planted)
    assert not marker.exists()


@pytest.mark.parametrize("kind", sorted(PLANTS))
@pytest.mark.parametrize("command", ["info", "consolidate", "export-deepspeed"])
def test_checkpoint_cli_refuses_a_payload(ckpt, tmp_path, capsys, kind, command):
    marker = tmp_path / "MARKER"
    planted = PLANTS[kind](ckpt / TAGS[1], marker)
    out = {"info": [], "consolidate": [str(tmp_path / "out.pt")], "export-deepspeed": [str(tmp_path / "ds")]}
    assert checkpoint_cli([command, str(ckpt), *out[command]]) == 1
    _refused(capsys.readouterr().err, planted)
    assert not marker.exists()


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_zero_to_fp32_functions_refuse_a_payload(ckpt, tmp_path, kind):
    """microspeed's ``zero_to_fp32`` functions and the stand-in's ``deepspeed.utils.zero_to_fp32`` alike."""
    marker = tmp_path / "MARKER"
    planted = PLANTS[kind](ckpt / TAGS[1], marker)
    for call in _each_zero_to_fp32_call(ckpt, tmp_path / "out"):
        with pytest.raises(CheckpointError) as err:
            call()
        _refused(err.value, planted)
    assert not marker.exists()


def test_an_older_dcp_checkpoint_reaches_dcps_reader_only_through_the_checked_index(ckpt, monkeypatch):
    """A per-tensor checkpoint (DCP's own writer, before checksums) loads with ``verify=False`` without DCP
    unpickling ``.metadata`` itself: its reader is handed the index the restricted unpickler read."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    from microspeed import checkpoint

    tag_dir = str(ckpt / TAGS[1])
    manifest = checkpoint.read_manifest(tag_dir)
    reader = checkpoint.Reader(tag_dir, checkpoint.read_tensor_index(tag_dir), manifest)
    tensors = {k: reader.fresh(k) for k in reader.metadata.state_dict_metadata}
    reader.run(no_dist=True)
    old = ckpt / "old"
    old.mkdir()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(old)), no_dist=True)
    del manifest["tensor_files"]
    (old / "manifest.msgpack").write_bytes(pack(manifest))

    def refuse(*args, **kwargs):
        raise AssertionError("DCP unpickled .metadata with pickle.load")

    monkeypatch.setattr(dcp_filesystem.pickle, "load", refuse)
    engine = _engine()
    engine.load_checkpoint(str(ckpt), tag="old", verify=False)
    assert all(torch.equal(engine.module.state_dict()[k], tensors[f"model/{k}"]) for k in engine.module.state_dict())


def test_publishing_a_save_refuses_a_payload_in_a_rank_index(tmp_path):
    """Rank 0 merges the ranks' ``__<r>_0.index`` files (msgpack) into the index: read as data too."""
    marker = tmp_path / "MARKER"
    tmp = tmp_path / "global_step1.tmp-1"
    tmp.mkdir()
    planted = tmp / storage.index_file(0)
    planted.write_bytes(msgpack.packb({"file": storage.data_file(0), "bytes": 0, "items": [],
                                       "rng": msgpack.ExtType(4, pickle.dumps(_Touch(marker)))}, use_bin_type=True))
    with pytest.raises(CheckpointError) as err:
        storage.finalize(str(tmp), 1, {"format": "microspeed.checkpoint"}, timeout_s=5.0)
    _refused(err.value, planted)
    assert not marker.exists()


def test_a_state_that_is_not_plain_data_is_refused_at_save_naming_its_path(tmp_path):
    """Nothing is pickled into a manifest any more: a set in the client state is an error before any file."""
    engine = _engine()
    with pytest.raises(CheckpointError, match=r"client_state/seen.*builtins\.set.*plain values"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"seen": {1, 2}})
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


@pytest.mark.parametrize("code", [4, 8, 99])
def test_a_pickle_or_unknown_extension_in_the_manifest_is_not_data(ckpt, code):
    """Extension 4 (a pickle, here a harmless one) and codes microspeed never writes are refused, not passed on."""
    path = ckpt / TAGS[1] / "manifest.msgpack"
    doc = msgpack.unpackb(path.read_bytes(), ext_hook=_raw_ext, raw=False, strict_map_key=False)
    doc["client_state"]["epoch"] = msgpack.ExtType(code, pickle.dumps({"epoch": 1}) if code == 4 else b"\x00")
    path.write_bytes(msgpack.packb(doc, use_bin_type=True))
    with pytest.raises(CheckpointError) as err:
        _engine().load_checkpoint(str(ckpt))
    _refused(err.value, path)
    assert f"extension type {code}" in str(err.value)


def test_a_manifest_written_before_keeps_loading(ckpt):
    """Older manifests held ``torch.__version__`` as a pickle (extension 4): recognised by its opcodes, not run."""
    path = ckpt / TAGS[1] / "manifest.msgpack"
    doc = msgpack.unpackb(path.read_bytes(), ext_hook=_raw_ext, raw=False, strict_map_key=False)
    doc["torch_version"] = msgpack.ExtType(4, pickle.dumps(torch.__version__, protocol=pickle.HIGHEST_PROTOCOL))
    path.write_bytes(msgpack.packb(doc, use_bin_type=True))
    engine = _engine()
    tag_dir, client = engine.load_checkpoint(str(ckpt))
    assert tag_dir == str(ckpt / TAGS[1]) and client == {"epoch": 1} and engine.global_steps == 2
    assert unpack(path.read_bytes())["torch_version"] == str(torch.__version__)


def test_state_values_round_trip_as_data():
    """What real states hold (tuples, dtypes, tensors of any shape, numpy numbers) packs without pickle."""
    import numpy as np

    tree = {"betas": (0.9, 0.999), "dtype": torch.bfloat16, "step": torch.tensor(3.0), "v": torch.arange(6).view(2, 3),
            "empty": torch.empty(0, 2), "keys": np.arange(3, dtype=np.uint32), "n": np.float32(0.5),
            "ordered": OrderedDict(a=1), "version": torch.__version__}
    data = pack(tree)
    codes: list[int] = []

    def keep(code: int, payload: bytes) -> None:
        codes.append(code)
        if code in (1, 5, 6, 7):  # tuples, scalars, tensors, arrays: msgpack inside
            msgpack.unpackb(payload, ext_hook=keep, raw=False, strict_map_key=False)

    msgpack.unpackb(data, ext_hook=keep, raw=False, strict_map_key=False)
    assert codes and 4 not in codes  # nothing pickled
    back = unpack(data)
    assert back["betas"] == (0.9, 0.999) and back["dtype"] is torch.bfloat16 and back["n"] == 0.5
    assert torch.equal(back["step"], tree["step"]) and torch.equal(back["v"], tree["v"])
    assert back["empty"].shape == (0, 2) and back["keys"].tolist() == [0, 1, 2] and back["ordered"] == {"a": 1}
    assert back["version"] == str(torch.__version__) and type(back["version"]) is str


# ------------------------------------------------------------------ DeepSpeed's files


def _deepspeed_folder(root: Path, marker: Path | None, where: str) -> Path:
    """A minimal DeepSpeed ZeRO-1 checkpoint (``latest`` -> ``global_step1``), the payload in ``where``'s file."""
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    w = torch.arange(6, dtype=torch.float32).view(2, 3)
    model = {"module": OrderedDict(weight=w.clone()), "buffer_names": [], "param_shapes": [
        OrderedDict(weight=torch.Size([2, 3]))], "ds_version": "0.19.8", "global_steps": 1, "ds_config": {}}
    optim = {"optimizer_state_dict": {"zero_stage": 1, "partition_count": 1, "loss_scaler": None,
                                      "single_partition_of_fp32_groups": [w.reshape(-1)],
                                      "base_optimizer_state": {"state": {}, "param_groups": [{"lr": 0.1}]}}}
    if marker is not None:
        (model if where == "model" else optim["optimizer_state_dict"])["evil"] = _Touch(marker)
    torch.save(model, tag / "mp_rank_00_model_states.pt")
    torch.save(optim, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return tag / ("mp_rank_00_model_states.pt" if where == "model" else "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def test_the_deepspeed_folder_of_these_tests_imports(tmp_path):
    """The clean folder the attacks below tamper with is read (so their refusals are the payload's)."""
    _deepspeed_folder(tmp_path / "ds", None, "model")
    read = read_deepspeed(str(tmp_path / "ds"))
    assert read["stage"] == 1 and torch.equal(read["module"]["weight"], torch.arange(6.0).view(2, 3))
    assert checkpoint_cli(["import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "out")]) == 0


@pytest.mark.parametrize("where", ["model", "optim"])
def test_import_deepspeed_and_zero_to_fp32_refuse_a_payload(tmp_path, capsys, where):
    marker = tmp_path / "MARKER"
    planted = _deepspeed_folder(tmp_path / "ds", marker, where)
    assert checkpoint_cli(["import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "out")]) == 1
    _refused(capsys.readouterr().err, planted)
    for call in _each_zero_to_fp32_call(tmp_path / "ds", tmp_path / "fp32"):
        with pytest.raises(CheckpointError) as err:
            call()
        _refused(err.value, planted)
    assert not marker.exists() and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ fuzz


def _variants(original: bytes, rng: random.Random, n: int = 16) -> list[bytes]:
    """Random bytes (a few lengths, the original's among them) and truncations of ``original`` at random points."""
    out = [rng.randbytes(k) for k in (0, 1, 7, len(original) or 16)]
    return out + [original[:rng.randrange(max(1, len(original)))] for _ in range(n)]


def _expect_checkpoint_error(call, what: str) -> None:
    try:
        call()
    except CheckpointError:
        return
    except Exception as exc:  # noqa: BLE001 - the point: nothing else may escape
        raise AssertionError(f"{what}: {type(exc).__name__} instead of a CheckpointError: {exc}") from exc
    raise AssertionError(f"{what}: loaded without an error")


@pytest.mark.timeout(120)
def test_fuzzed_checkpoint_files_give_a_checkpoint_error(ckpt, tmp_path, capsys):
    rng = random.Random(31)
    engine = _engine()
    marker = tmp_path / "MARKER"
    files = {"manifest": ckpt / TAGS[1] / "manifest.msgpack", "index": ckpt / TAGS[1] / ".metadata",
             "data": ckpt / TAGS[1] / storage.data_file(0), "latest": ckpt / "latest"}
    for kind, path in files.items():
        original = path.read_bytes()
        for i, variant in enumerate(_variants(original, rng)):
            if variant == original:
                continue
            path.write_bytes(variant)
            what = f"{kind} variant {i} ({len(variant)} of {len(original)} bytes)"
            _expect_checkpoint_error(lambda: engine.load_checkpoint(str(ckpt)), what)
            if kind != "data":  # info reads no tensor bytes
                assert checkpoint_cli(["info", str(ckpt)]) == 1, what
                assert "error:" in capsys.readouterr().err, what
        path.write_bytes(original)
    index = pack({"file": storage.data_file(0), "bytes": 0, "items": [], "rng": None})
    for i, variant in enumerate(_variants(index, rng)):
        tmp = tmp_path / f"publish{i}.tmp-1"
        tmp.mkdir()
        (tmp / storage.index_file(0)).write_bytes(variant)
        _expect_checkpoint_error(lambda t=tmp: storage.finalize(str(t), 1, {}, timeout_s=2.0), f"rank index {i}")
    ds = _deepspeed_folder(tmp_path / "ds", None, "model")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        original = (ds.parent / name).read_bytes()
        for i, variant in enumerate(_variants(original, rng)):
            (ds.parent / name).write_bytes(variant)
            _expect_checkpoint_error(lambda: read_deepspeed(str(tmp_path / "ds")), f"{name} variant {i}")
        (ds.parent / name).write_bytes(original)
    assert not marker.exists()


# ------------------------------------------------------------------ real DeepSpeed's files pass the allowlist


def _deepspeed_saves(root: str) -> dict:
    """Real DeepSpeed 0.19.8 (1 rank, CPU) saves at ZeRO 0-3 in fp32, bf16 and fp16; returns, per folder, the
    globals its files name beyond torch's defaults and DeepSpeed's own ``zero_to_fp32`` result."""
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        for stage in (0, 1, 2, 3):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
            cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "steps_per_print": 1000,
                   "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
                   "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
            if precision != "fp32":
                cfg[precision] = {"enabled": True}
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
            for _ in range(2):
                engine.backward(engine(torch.randn(2, 7).to(dtype)).float().pow(2).mean())
                engine.step()
            folder = os.path.join(root, f"{precision}_{stage}")
            engine.save_checkpoint(folder, client_state={"epoch": 1})
            names = set()
            for dirpath, _dirs, files in os.walk(folder):
                for name in files:
                    if name.endswith(".pt"):
                        names |= set(torch.serialization.get_unsafe_globals_in_checkpoint(os.path.join(dirpath, name)))
            theirs = get_fp32_state_dict_from_zero_checkpoint(folder) if stage else None  # theirs needs ZeRO
            out[folder] = {"globals": sorted(names),
                           "fp32": theirs and {k: v.float().clone() for k, v in theirs.items()}}
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed 0.19.8 (the reference)")
def test_real_deepspeed_checkpoints_read_as_data_at_every_stage_and_precision(tmp_path):
    """Every global DeepSpeed's files hold is one of DEEPSPEED_GLOBALS; each folder reads with weights_only=True,
    imports, and gives DeepSpeed's own zero_to_fp32 result (which reads ZeRO stages 1-3 only)."""
    from microspeed.checkpoint.deepspeed_format import DEEPSPEED_GLOBALS
    from microspeed.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from microspeed.testing import run_distributed

    saves = run_distributed(_deepspeed_saves, world_size=1, args=(str(tmp_path),), timeout=540,
                            env={"DS_ACCELERATOR": "cpu"})[0]
    assert len(saves) == 12
    for folder, got in saves.items():
        assert set(got["globals"]) <= set(DEEPSPEED_GLOBALS), (folder, got["globals"])
        ours = get_fp32_state_dict_from_zero_checkpoint(folder)
        assert list(ours) == ["0.weight", "0.bias", "2.weight", "2.bias"], folder
        if got["fp32"] is not None:
            assert list(ours) == list(got["fp32"]), folder
            assert all(torch.equal(ours[k], got["fp32"][k]) for k in ours), folder
        assert checkpoint_cli(["import-deepspeed", folder, str(tmp_path / "imported" / os.path.basename(folder))]) == 0
