"""``microspeed checkpoint export-deepspeed``: DeepSpeed's own ``zero_to_fp32`` and HF read what we saved.

Checkpoints of ZeRO stage 0, 1 and 2 runs (fp32 and bf16), written by 1 rank in this process and by
2 ranks (one spawn), are exported; DeepSpeed 0.19.8's ``get_fp32_state_dict_from_zero_checkpoint``
(the real package, ``DS_ACCELERATOR=cpu``) must return exactly our consolidated fp32 weights. The
export imported back (``import-deepspeed``) loads into an engine with the same weights and Adam
state and trains on. A tiny GPT-2 (tied embeddings) goes through DeepSpeed's
``convert_zero_checkpoint_to_fp32_state_dict`` into ``pytorch_model.bin`` and transformers'
``from_pretrained``. Also: a DeepSpeed CPU-Adam checkpoint (``step`` saved as a Python int) imports
with a tensor ``step`` and the first step after resume works.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import microspeed
from microspeed.checkpoint import get_fp32_state_dict
from microspeed.cli.checkpoint import main as checkpoint_cli
from microspeed.testing import run_distributed

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="needs deepspeed 0.19.8 (the reference)")
VARIANTS = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16")]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # odd sizes: the flat groups need padding at 2 ranks; a buffer too
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3),
                                torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    return model


def _config(stage: int, precision: str, world: int) -> dict:
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // world, "steps_per_print": 1000,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train_and_save(root: str, variants: list, world: int) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for stage, precision in variants:
        engine = microspeed.initialize(model=_model(), config=_config(stage, precision, world))[0]
        dtype = next(engine.module.parameters()).dtype
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 7, generator=g), torch.randn(4, 1, generator=g)
            n = 4 // world
            out = engine(x[rank * n:(rank + 1) * n].to(dtype))
            engine.backward(torch.nn.functional.mse_loss(out.float(), y[rank * n:(rank + 1) * n]))
            engine.step()
        engine.save_checkpoint(os.path.join(root, f"{world}_{stage}_{precision}"), client_state={"epoch": 3})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Microspeed checkpoints of every variant at world size 1 (here) and 2 (spawned)."""
    root = str(tmp_path_factory.mktemp("ms"))
    _train_and_save(root, VARIANTS, 1)
    run_distributed(_train_and_save, world_size=2, args=(root, VARIANTS, 2), timeout=240)
    return root


def _ds_fp32(path: str) -> dict[str, torch.Tensor]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(path)


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage,precision", VARIANTS)
def test_zero_to_fp32_reads_our_export(saved, tmp_path, world, stage, precision):
    """DeepSpeed's zero_to_fp32 returns exactly our fp32 weights (buffers and all); stage 0 keeps `module`."""
    src = os.path.join(saved, f"{world}_{stage}_{precision}")
    dst = str(tmp_path / "ds")
    assert checkpoint_cli(["export-deepspeed", src, dst]) == 0
    assert (tmp_path / "ds" / "latest").read_text() == "global_step3"
    ours = get_fp32_state_dict(src)
    tag_dir = os.path.join(dst, "global_step3")
    files = sorted(os.listdir(tag_dir))
    states = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), weights_only=False)
    assert states["global_steps"] == 3 and states["epoch"] == 3 and states["dp_world_size"] == world
    assert states["buffer_names"] == ["3.running_mean", "3.running_var", "3.num_batches_tracked"]
    if stage == 0:
        assert files == ["mp_rank_00_model_states.pt"]
        assert list(states["module"]) == list(ours)
        for k, v in ours.items():
            assert torch.equal(states["module"][k].float(), v), k
        assert sorted(states["optimizer"]["state"]) == list(range(10))
        return
    assert files == ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                                      for r in range(world)]
    theirs = _ds_fp32(dst)
    assert sorted(theirs) == sorted(ours)
    for k, v in ours.items():
        assert theirs[k].dtype == v.dtype and torch.equal(theirs[k], v), k
    if precision == "bf16":  # the masters, not the bf16 weights
        assert not torch.equal(theirs["0.weight"], states["module"]["0.weight"].float())


def _engine(stage: int, precision: str):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3),
                                torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    return microspeed.initialize(model=model, config=_config(stage, precision, 1))[0]


def _state(engine, p: torch.Tensor, key: str) -> torch.Tensor:
    from microspeed.zero import safe_get_full_optimizer_state

    if not hasattr(p, "_zero"):  # not a ZeRO-managed parameter
        index = [id(q) for q in engine.module.parameters()].index(id(p))
        return engine.optimizer.state_dict()["state"][index][key]
    return safe_get_full_optimizer_state(p, key)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (2, "fp32"), (1, "bf16")])
def test_export_then_import_round_trip(saved, tmp_path, stage, precision):
    """Exported at 2 ranks and imported back: weights, masters and Adam state equal the original's."""
    src = os.path.join(saved, f"2_{stage}_{precision}")
    assert checkpoint_cli(["export-deepspeed", src, str(tmp_path / "ds")]) == 0
    assert checkpoint_cli(["import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "back")]) == 0
    original, back = _engine(stage, precision), _engine(stage, precision)
    original.load_checkpoint(src)
    _, client = back.load_checkpoint(str(tmp_path / "back"))
    assert client == {"epoch": 3} and back.global_steps == 3
    for (n, a), b in zip(original.module.state_dict().items(), back.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    for a, b in zip(original.module.parameters(), back.module.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_state(original, a, key), _state(back, b, key)), key
    for e in (original, back):
        e.backward(e(torch.ones(4, 7, dtype=next(e.module.parameters()).dtype)).float().sum())
        e.step()
    for a, b in zip(original.module.parameters(), back.module.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_adam_int_step_imports_as_a_tensor_and_resumes(saved, tmp_path):
    """DeepSpeedCPUAdam saves ``state['step']`` as a Python int; the imported step is a tensor torch Adam takes."""
    dst = tmp_path / "ds"
    assert checkpoint_cli(["export-deepspeed", os.path.join(saved, "2_2_fp32"), str(dst)]) == 0
    for r in range(2):  # what a ZeRO-Offload (CPU Adam) run writes
        path = dst / "global_step3" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        sd = torch.load(path, weights_only=False)
        for st in sd["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            st["step"] = 3
        torch.save(sd, path)
    assert checkpoint_cli(["import-deepspeed", str(dst), str(tmp_path / "back")]) == 0
    from microspeed.checkpoint.export import read_microspeed

    imported = read_microspeed(str(tmp_path / "back"))["optimizer"]["state"]
    assert all(isinstance(s["step"], torch.Tensor) and float(s["step"]) == 3.0 for s in imported.values())
    engine = _engine(2, "fp32")
    engine.load_checkpoint(str(tmp_path / "back"))
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(engine(torch.ones(4, 7)).sum())
    engine.step()  # failed in torch.optim.Adam before: "state_steps argument must contain ... singleton tensors"
    assert not torch.equal(before[0], next(engine.module.parameters()))


def test_export_refuses_stage0_masters_and_bad_stage(tmp_path):
    """A stage-0 bf16 run cannot go into the stage-0 layout (names the fix); stage 3 is not a layout written."""
    root = str(tmp_path / "ms")
    _train_and_save(root, [(0, "bf16")], 1)
    with pytest.raises(microspeed.checkpoint.CheckpointError, match="--zero-stage 1"):
        from microspeed.checkpoint.export import export_deepspeed

        export_deepspeed(os.path.join(root, "1_0_bf16"), str(tmp_path / "ds"))
    with pytest.raises(microspeed.checkpoint.CheckpointError, match="stage-2 layout"):
        export_deepspeed(os.path.join(root, "1_0_bf16"), str(tmp_path / "ds"), zero_stage=3)
    assert "ZeRO stage 1" in export_deepspeed(os.path.join(root, "1_0_bf16"), str(tmp_path / "ds1"), zero_stage=1)


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_transformers_loads_zero_to_fp32_output(tmp_path):
    """A tiny GPT-2 (tied embeddings) trained at ZeRO-2, exported, converted by DeepSpeed, loaded by HF."""
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    engine = microspeed.initialize(model=model, config=_config(2, "fp32", 1))[0]
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(str(tmp_path / "ms"))
    assert checkpoint_cli(["export-deepspeed", str(tmp_path / "ms"), str(tmp_path / "ds")]) == 0
    out = tmp_path / "hf"
    convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ds"), str(out))
    assert (out / "pytorch_model.bin").is_file()
    config.save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    for name, p in engine.module.named_parameters():
        assert torch.equal(loaded.get_parameter(name), p.detach()), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    engine.module.eval()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, engine.module(input_ids=ids).logits)


def _deepspeed_save(root: str) -> None:
    """Real DeepSpeed 0.19.8 (1 rank, CPU) saves the same model at ZeRO 0 and 2, for the layout comparison."""
    import deepspeed

    for stage in (0, 2):
        model = _model()
        cfg = {**_config(stage, "fp32", 1), "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engine.backward(engine(torch.randn(4, 7)).pow(2).mean())
        engine.step()
        engine.save_checkpoint(os.path.join(root, f"ds{stage}"), tag="global_step1", client_state={"epoch": 3})


def _keys(tree, depth: int = 0) -> dict:
    """The nested key structure of a checkpoint dict (values' kinds, not their numbers)."""
    if isinstance(tree, dict) and depth < 3:
        return {str(k): _keys(v, depth + 1) for k, v in tree.items()
                if not (isinstance(k, int) or str(k).isdigit())}
    if isinstance(tree, torch.Tensor):
        return "tensor"
    return type(tree).__name__ if tree is not None else "None"


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_export_has_deepspeeds_keys(saved, tmp_path):
    """The exported files hold the keys DeepSpeed 0.19.8's own save writes (same names, same kinds of values)."""
    root = str(tmp_path)
    run_distributed(_deepspeed_save, world_size=1, args=(root,), timeout=300, env={"DS_ACCELERATOR": "cpu"})
    for stage in (0, 2):
        assert checkpoint_cli(["export-deepspeed", os.path.join(saved, f"1_{stage}_fp32"), f"{root}/ms{stage}"]) == 0
        ours_dir, theirs_dir = f"{root}/ms{stage}/global_step3", f"{root}/ds{stage}/global_step1"
        theirs_files = sorted(f for f in os.listdir(theirs_dir) if f.endswith(".pt"))
        assert sorted(os.listdir(ours_dir)) == theirs_files
        for name in theirs_files:
            ours = torch.load(os.path.join(ours_dir, name), weights_only=False)
            theirs = torch.load(os.path.join(theirs_dir, name), weights_only=False)
            mine, ref = _keys(ours), _keys(theirs)
            if name.startswith("mp_rank"):
                assert set(mine) == set(ref) - {"checkpoint_parallel_dimensions"}, (name, set(ref) ^ set(mine))
                for key in ("module", "buffer_names", "param_shapes", "shared_params", "global_steps", "ds_version"):
                    assert mine[key] == ref[key], key
                assert list(ours["module"]) == list(theirs["module"])
            else:
                osd, ref_osd = mine["optimizer_state_dict"], ref["optimizer_state_dict"]
                assert set(osd) <= set(ref_osd), set(osd) - set(ref_osd)
                missing = set(ref_osd) - set(osd)  # fragment addresses for ds_to_universal: DeepSpeed objects
                assert missing <= {"param_slice_mappings"}, missing
                assert osd["base_optimizer_state"] == ref_osd["base_optimizer_state"]
