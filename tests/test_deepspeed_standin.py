"""The ``deepspeed`` stand-in (compat/deepspeed): what clients see, every mapped path, mixing refused, --as-deepspeed.

Everything that imports the stand-in runs in a subprocess with its source folder first on
``PYTHONPATH``: this test process may import real DeepSpeed (the parity tests do), and the stand-in
refuses to run beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

import microspeed
from microspeed import cli
from microspeed.compat import standin
from microspeed.compat.accelerator import Accelerator
from microspeed.compat.tensor_utils import clone_tensors_for_torch_save, move_to_device
from microspeed.ops.cpu_optimizers import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion
from microspeed.testing import distributed

STANDIN = str(standin.source_folder())
SITE_DS = None  # where real DeepSpeed is installed (None when it is not)
try:
    import importlib.util

    _spec = importlib.util.find_spec("deepspeed")
    if _spec is not None and _spec.origin and not standin.is_standin_file(_spec.origin):
        SITE_DS = os.path.dirname(_spec.origin)
except (ImportError, ValueError):
    pass

needs_real_deepspeed = pytest.mark.skipif(SITE_DS is None, reason="real DeepSpeed is not installed")

#: Prints the real-DeepSpeed modules loaded, as JSON, at the end of a snippet.
REAL_MODULES = textwrap.dedent("""
    import sys as _sys
    _real = sorted(k for k, m in _sys.modules.items() if (k == "deepspeed" or k.startswith("deepspeed."))
                   and "site-packages" in (getattr(m, "__file__", "") or ""))
    print("REAL " + __import__("json").dumps(_real))
""")


def _run(code: str, *, standin_first: bool = True, env: dict | None = None, timeout: int = 240,
         report_real: bool = False) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", **(env or {})}
    if standin_first:
        full_env["PYTHONPATH"] = STANDIN + os.pathsep + full_env.get("PYTHONPATH", "")
    code = textwrap.dedent(code) + (REAL_MODULES if report_real else "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=os.path.dirname(STANDIN))


def _line(out: str, prefix: str) -> object:
    for line in out.splitlines():
        if line.startswith(prefix + " "):
            return json.loads(line[len(prefix) + 1:])
    raise AssertionError(f"no {prefix!r} line in output:\n{out}")


# ------------------------------------------------------------------------------------ what clients see


@pytest.mark.slow
def test_clients_availability_checks_see_the_standin():
    """transformers', accelerate's and Lightning's own checks find deepspeed 0.19.8+microspeed (not the real one)."""
    proc = _run("""
        import importlib.metadata, json
        from transformers.utils.import_utils import _is_package_available
        from transformers.integrations.deepspeed import is_deepspeed_available as hf_available
        from accelerate.utils import is_deepspeed_available as acc_available
        from accelerate.utils.versions import compare_versions
        from lightning_utilities.core.imports import RequirementCache
        import deepspeed
        print("OUT " + json.dumps({
            "hf": list(_is_package_available("deepspeed", return_version=True)), "hf_integration": hf_available(),
            "accelerate": acc_available(), "acc_ge_0_16_4": compare_versions("deepspeed", ">=", "0.16.4"),
            "acc_lt_0_14": compare_versions("deepspeed", "<", "0.14.0"),
            "lightning": bool(RequirementCache("deepspeed>=0.16.0")),
            "metadata": importlib.metadata.version("deepspeed"), "version": deepspeed.__version__,
            "file": deepspeed.__file__}))
    """, report_real=True)
    assert proc.returncode == 0, proc.stderr
    out = _line(proc.stdout, "OUT")
    assert out["hf"] == [True, "0.19.8+microspeed"]
    assert out["hf_integration"] is True and out["accelerate"] is True and out["lightning"] is True
    assert out["acc_ge_0_16_4"] is True and out["acc_lt_0_14"] is False
    assert out["metadata"] == out["version"] == "0.19.8+microspeed"
    assert out["file"] == os.path.join(STANDIN, "deepspeed", "__init__.py")
    assert _line(proc.stdout, "REAL") == []
    assert "deepspeed -> microspeed" in proc.stderr and "stand-in" in proc.stderr
    if SITE_DS:
        assert f"real DeepSpeed at {SITE_DS} is shadowed" in proc.stderr


#: ``from <module> import <names>`` that transformers, accelerate, Lightning and DeepSpeed's examples write.
CLIENT_IMPORTS = {
    "deepspeed": ["DeepSpeedEngine", "initialize", "init_distributed", "add_config_arguments", "comm", "zero",
                  "get_accelerator", "__version__", "checkpointing", "PipelineModule"],
    "deepspeed.accelerator": ["get_accelerator"],
    "deepspeed.comm": ["init_distributed", "is_initialized", "get_rank", "get_world_size", "barrier", "all_reduce",
                       "new_group", "get_world_group", "inference_all_reduce", "ReduceOp", "send", "recv"],
    "deepspeed.utils": ["logger", "groups", "log_dist", "RepeatingLoader", "is_initialized"],
    "deepspeed.utils.logging": ["logger"],
    "deepspeed.utils.groups": ["_get_data_parallel_group", "_get_sequence_parallel_world_size",
                               "_get_expert_parallel_group"],
    "deepspeed.utils.zero_to_fp32": ["get_fp32_state_dict_from_zero_checkpoint",
                                     "load_state_dict_from_zero_checkpoint",
                                     "convert_zero_checkpoint_to_fp32_state_dict"],
    "deepspeed.runtime.lr_schedules": ["VALID_LR_SCHEDULES", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                       "OneCycle", "LRRangeTest", "WARMUP_MIN_LR", "CYCLE_MIN_LR", "TOTAL_NUM_STEPS",
                                       "LR_RANGE_TEST_STEP_SIZE", "COS_MIN_RATIO", "DECAY_MOM_RATE"],
    "deepspeed.runtime.zero": ["GatheredParameters", "Init", "partition_parameters"],
    "deepspeed.runtime.zero.partition_parameters": ["Init", "GatheredParameters", "_orig_torch_arange",
                                                    "zero_wrapper_for_fp_tensor_constructor"],
    "deepspeed.zero": ["Init", "GatheredParameters"],
    "deepspeed.runtime.utils": ["move_to_device", "clone_tensors_for_torch_save", "set_random_seed",
                                "partition_uniform", "partition_balanced", "prefix_sum_inc", "see_memory_usage"],
    "deepspeed.runtime.base_optimizer": ["DeepSpeedOptimizer", "ZeROOptimizer"],
    "deepspeed.runtime.engine": ["DeepSpeedEngine"],
    "deepspeed.runtime.dataloader": ["RepeatingLoader"],
    "deepspeed.ops.adam": ["DeepSpeedCPUAdam", "FusedAdam"],
    "deepspeed.ops.adagrad": ["DeepSpeedCPUAdagrad"],
    "deepspeed.ops.lion": ["DeepSpeedCPULion", "FusedLion"],
    "deepspeed.ops.lamb": ["FusedLamb"],
    "deepspeed.launcher.runner": ["DEEPSPEED_ENVIRONMENT_NAME"],
    "deepspeed.checkpoint.utils": ["clone_tensors_for_torch_save"],
    "deepspeed.pipe": ["PipelineModule", "LayerSpec", "TiedLayerSpec"],
    "deepspeed.runtime.pipe": ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology"],
    "deepspeed.runtime.pipe.topology": ["PipeModelDataParallelTopology", "ProcessTopology", "PipelineParallelGrid",
                                        "_prime_factors"],
    "deepspeed.runtime.pipe.module": ["PipelineModule"],
    "deepspeed.utils.comms_logging": ["CommsLogger", "calc_bw_log", "convert_size"],
    "deepspeed.utils.timer": ["trim_mean"],
    "deepspeed.utils.torch": ["required_torch_version"],
    "deepspeed.runtime.pipe.schedule": ["TrainSchedule", "InferenceSchedule"],
    "deepspeed.moe.layer": ["MoE"],
    "deepspeed.moe.utils": ["split_params_into_different_moe_groups_for_optimizer", "is_moe_param"],
    "deepspeed.moe.sharded_moe": ["top1gating", "top2gating", "TopKGate"],
    "deepspeed.runtime.activation_checkpointing.checkpointing": ["checkpoint", "configure"],
    "deepspeed.checkpointing": ["checkpoint", "configure"],
    "deepspeed.ops.sparse_attention": ["FixedSparsityConfig", "BigBirdSparsityConfig", "SparseSelfAttention",
                                       "BertSparseSelfAttention", "SparseAttentionUtils"],
    "deepspeed.profiling.flops_profiler": ["FlopsProfiler", "get_model_profile"],
}


@pytest.mark.slow
def test_every_mapped_module_imports_from_microspeed():
    """Each DeepSpeed path clients import resolves, with the names they take, to microspeed (nothing real loaded)."""
    proc = _run(f"""
        import importlib, json, sys
        from deepspeed import _aliases
        wanted = {CLIENT_IMPORTS!r}
        missing, origins = [], {{}}
        for mod, names in wanted.items():
            m = importlib.import_module(mod)
            origins[mod] = getattr(m, "__file__", "") or ""
            missing += [f"{{mod}}.{{n}}" for n in names if not hasattr(m, n)]
        aliased = {{}}
        for alias, target in _aliases.ALIASES.items():
            a = importlib.import_module(alias)
            aliased[alias] = a is importlib.import_module(target)
        import deepspeed.moe.layer, microspeed_moe.layer
        print("OUT " + json.dumps({{"missing": missing, "origins": origins, "aliased": aliased,
                                    "same_moe": deepspeed.moe.layer.MoE is microspeed_moe.layer.MoE}}))
    """, report_real=True)
    assert proc.returncode == 0, proc.stderr
    out = _line(proc.stdout, "OUT")
    assert out["missing"] == []
    assert all(out["aliased"].values()), out["aliased"]
    assert out["same_moe"] is True
    assert not [f for f in out["origins"].values() if "site-packages/deepspeed/" in f]
    assert _line(proc.stdout, "REAL") == []


#: Attribute chains clients evaluate after a bare ``import deepspeed`` (DeepSpeed imports its submodules eagerly).
CLIENT_CHAINS = ["deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES", "deepspeed.utils.logging.logger.setLevel",
                 "deepspeed.zero.GatheredParameters", "deepspeed.zero.Init",
                 "deepspeed.runtime.zero.GatheredParameters",
                 "deepspeed.runtime.engine.DeepSpeedEngine", "deepspeed.checkpointing.configure",
                 "deepspeed.checkpointing.checkpoint", "deepspeed.comm.get_rank", "deepspeed.utils.is_initialized",
                 "deepspeed.DeepSpeedEngine.backward", "deepspeed.ops.adam.DeepSpeedCPUAdam",
                 "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
                 "deepspeed.runtime.zero.partition_parameters._orig_torch_arange",
                 "deepspeed.accelerator.real_accelerator.get_accelerator", "deepspeed.moe.layer.MoE",
                 "deepspeed.runtime.utils.move_to_device", "deepspeed.checkpoint.utils.clone_tensors_for_torch_save"]


@pytest.mark.slow
def test_attribute_chains_after_a_bare_import():
    proc = _run(f"""
        import json
        import deepspeed
        bad = []
        for chain in {CLIENT_CHAINS!r}:
            try:
                eval(chain)
            except Exception as e:
                bad.append(f"{{chain}}: {{type(e).__name__}}: {{e}}")
        print("OUT " + json.dumps(bad))
    """, report_real=True)
    assert proc.returncode == 0, proc.stderr
    assert _line(proc.stdout, "OUT") == []
    assert _line(proc.stdout, "REAL") == []


@pytest.mark.slow
def test_zero_names_follow_the_zero_plugin():
    """ZeRO-3 helpers (leaf modules, external parameters) resolve lazily, exactly when microspeed.zero has them."""
    names = ["set_z3_leaf_modules", "get_z3_leaf_modules", "unset_z3_leaf_modules", "register_external_parameter",
             "unregister_external_parameter", "ZeroParamStatus", "safe_get_full_fp32_param"]
    proc = _run(f"""
        import json
        import deepspeed, deepspeed.utils, microspeed.zero
        names = {names!r}
        print("OUT " + json.dumps({{n: [hasattr(microspeed.zero, n), hasattr(deepspeed.utils, n),
                                        hasattr(deepspeed.zero, n)] for n in names}}))
    """)
    assert proc.returncode == 0, proc.stderr
    out = _line(proc.stdout, "OUT")
    for name, (in_zero, in_utils, in_ds_zero) in out.items():
        assert in_zero == in_utils == in_ds_zero, name
    assert out["safe_get_full_fp32_param"] == [True, True, True]


def test_unknown_path_and_name_are_plain_errors():
    """A DeepSpeed path microspeed does not provide is not found (clients probing with find_spec get None)."""
    proc = _run("""
        import importlib.util, deepspeed
        print("SPEC", importlib.util.find_spec("deepspeed.inference"))
        try:
            deepspeed.init_inference
        except AttributeError as e:
            print("ATTR", e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "SPEC None" in proc.stdout
    assert "ATTR module 'deepspeed' (microspeed 0.1.0 stand-in) has no attribute 'init_inference'" in proc.stdout


# ------------------------------------------------------------------------------------------- mixing


@needs_real_deepspeed
@pytest.mark.slow
def test_mixing_refused_when_real_deepspeed_was_imported_first():
    proc = _run(f"""
        import sys
        import deepspeed  # real DeepSpeed
        assert "site-packages" in deepspeed.__file__
        del sys.modules["deepspeed"]
        sys.path.insert(0, {STANDIN!r})
        from microspeed.compat.standin import StandinConflictError
        try:
            import deepspeed
        except StandinConflictError as e:
            print("REFUSED", e)
    """, standin_first=False)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REFUSED"))
    assert SITE_DS in line and os.path.join(STANDIN, "deepspeed", "__init__.py") in line


@needs_real_deepspeed
def test_initialize_refuses_a_real_module_loaded_after_the_standin():
    real_file = os.path.join(SITE_DS, "constants.py")
    proc = _run(f"""
        import importlib.util, sys, torch
        import deepspeed
        spec = importlib.util.spec_from_file_location("deepspeed.constants", {real_file!r})
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        sys.modules["deepspeed.constants"] = mod
        try:
            deepspeed.initialize(model=torch.nn.Linear(2, 2), config={{"train_micro_batch_size_per_gpu": 1}})
        except deepspeed.PluginError as e:
            print("REFUSED", e)
    """)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REFUSED"))
    assert real_file in line and os.path.join(STANDIN, "deepspeed", "__init__.py") in line


@pytest.mark.slow
def test_mixing_refused_for_a_merged_install(tmp_path):
    """Real DeepSpeed's files inside the stand-in's folder (two pip installs merged) are refused, naming both."""
    import shutil

    target = tmp_path / "deepspeed"
    shutil.copytree(os.path.join(STANDIN, "deepspeed"), target)
    (target / "git_version_info_installed.py").write_text("version = '0.19.8'\n")
    proc = _run(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        try:
            import deepspeed
        except ImportError as e:
            print("REFUSED", type(e).__name__, e)
    """, standin_first=False)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED StandinConflictError" in proc.stdout
    assert str(target / "git_version_info_installed.py") in proc.stdout and str(target / "__init__.py") in proc.stdout


# --------------------------------------------------------------------------------- launching with it

TRAIN = """
import json, os, sys
import torch
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed import comm as dist

deepspeed.init_distributed(get_accelerator().communication_backend_name())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 2}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
g = torch.Generator().manual_seed(1 + dist.get_rank())
losses = []
for _ in range(4):
    x = torch.randn(4, 8, generator=g)
    loss = ((engine(x) - x.sum(1, keepdim=True)) ** 2).mean()
    engine.backward(loss)
    engine.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    losses.append(t.item() / dist.get_world_size())
real = sorted(k for k, m in sys.modules.items() if (k == "deepspeed" or k.startswith("deepspeed."))
              and "site-packages" in (getattr(m, "__file__", "") or ""))
print("RESULT " + json.dumps({"file": deepspeed.__file__, "version": deepspeed.__version__,
                              "engine": type(engine).__module__, "real": real, "losses": losses,
                              "rank": dist.get_rank()}), flush=True)
"""


def _reference_losses(world: int = 2, steps: int = 4) -> list[float]:
    """The same training in plain torch: data parallelism = Adam on the mean of the ranks' losses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gens = [torch.Generator().manual_seed(1 + r) for r in range(world)]
    out = []
    for _ in range(steps):
        xs = [torch.randn(4, 8, generator=g) for g in gens]
        loss = sum(((model(x) - x.sum(1, keepdim=True)) ** 2).mean() for x in xs) / world
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.slow
def test_run_as_deepspeed_trains_with_microspeed(tmp_path):
    """``microspeed run --as-deepspeed``, 2 ranks: ``import deepspeed`` is the stand-in, real DeepSpeed stays out."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["DS_ACCELERATOR"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "microspeed.cli", "run", "--as-deepspeed", "--nproc-per-node", "2",
                           "--standalone", str(script)], capture_output=True, text=True, env=env, timeout=240,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    decoder = json.JSONDecoder()  # the ranks share stdout: one rank's line may run into the other's
    results = [decoder.raw_decode(chunk)[0] for chunk in proc.stdout.split("RESULT ")[1:]]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["file"] == os.path.join(STANDIN, "deepspeed", "__init__.py")
        assert r["version"] == "0.19.8+microspeed" and r["engine"] == "microspeed.engine"
        assert r["real"] == []
        assert r["losses"] == pytest.approx(_reference_losses(), rel=1e-4)
    assert proc.stderr.count("deepspeed -> microspeed") == 1  # rank 0 says which deepspeed it imported


def test_take_flag_only_before_the_script():
    args = ["--as-deepspeed", "--nproc-per-node", "2", "train.py", "--as-deepspeed"]
    assert cli._take_flag(args, "--as-deepspeed") is True
    assert args == ["--nproc-per-node", "2", "train.py", "--as-deepspeed"]  # the script's own flag stays
    assert cli._take_flag(args, "--as-deepspeed") is False


def test_deepspeed_path_command(capsys, monkeypatch, tmp_path):
    assert cli.main(["deepspeed-path"]) == 0
    assert capsys.readouterr().out.strip() == STANDIN
    monkeypatch.setenv(standin.ENV_VAR, str(tmp_path))
    if not standin.installed_standin():
        assert cli.main(["deepspeed-path"]) == 1
        assert f"{standin.ENV_VAR}={tmp_path}: no deepspeed/__init__.py there" in capsys.readouterr().err
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("")
    assert cli.main(["deepspeed-path"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path)


@pytest.mark.slow
def test_path_recipe_with_plain_python():
    """The documented recipe: PYTHONPATH=$(microspeed deepspeed-path):$PYTHONPATH makes `import deepspeed` ours."""
    folder = subprocess.run([sys.executable, "-m", "microspeed.cli", "deepspeed-path"], capture_output=True,
                            text=True, check=True).stdout.strip()
    env = {**os.environ, "PYTHONPATH": folder + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", "import deepspeed, importlib.metadata as m; "
                          "print(deepspeed.__file__, m.version('deepspeed'))"], capture_output=True, text=True,
                         env=env, check=True, cwd=os.path.dirname(STANDIN)).stdout.split()
    assert out == [os.path.join(folder, "deepspeed", "__init__.py"), "0.19.8+microspeed"]


# ------------------------------------------------------------------------------- gap-fillers in microspeed


def test_get_accelerator_cpu_answers():
    acc = Accelerator("cpu")
    assert acc.device_name() == acc.current_device_name() == "cpu" and acc.device_name(3) == "cpu"
    assert acc.device() == torch.device("cpu") and acc.current_device() == 0 and acc.device_count() == 1
    assert acc.is_available() and acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() and acc.is_fp16_supported()  # microspeed trains fp16 on the CPU
    assert acc.supported_dtypes() == [torch.float, torch.bfloat16, torch.half]
    assert acc.on_accelerator(torch.zeros(1)) and not acc.on_accelerator(torch.zeros(1, device="meta"))
    t = torch.ones(3)
    assert acc.pin_memory(t) is t and not acc.is_pinned(t)
    before = acc.memory_allocated()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, written so the pages are resident
    assert acc.memory_allocated() >= before + 60 * 2**20
    assert acc.max_memory_allocated() >= acc.memory_allocated() - 4096
    del big
    assert acc.total_memory() > acc.available_memory() > 0
    assert acc.memory_stats()["allocated_bytes.all.current"] > 0
    acc.manual_seed(7)
    a = torch.randn(4)
    acc.manual_seed(7)
    assert torch.equal(a, torch.randn(4))
    state = acc.get_rng_state()
    b = torch.randn(2)
    acc.set_rng_state(state)
    assert torch.equal(b, torch.randn(2))
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    start.record()
    end.record()
    assert start.elapsed_time(end) >= 0.0
    with acc.stream(acc.Stream()):
        acc.synchronize()
    assert acc.FloatTensor(2, 3).shape == (2, 3) and acc.LongTensor([1, 2]).dtype == torch.long
    with pytest.raises(NotImplementedError, match="microspeed builds no DeepSpeed ops"):
        acc.create_op_builder("CPUAdamBuilder")


def test_cpu_device_count_follows_local_size(monkeypatch):
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert Accelerator("cpu").device_count() == 1
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert Accelerator("cpu").device_count() == 4
    monkeypatch.setenv("LOCAL_SIZE", "x")
    assert Accelerator("cpu").device_count() == 1


def test_ds_accelerator_env_is_checked(monkeypatch):
    from microspeed.compat import accelerator

    monkeypatch.setattr(accelerator, "_accelerator", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'"):
        accelerator.get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert accelerator.get_accelerator().device_name() == "cpu"


def test_init_distributed_without_group_and_not_required_raises():
    proc = _run("""
        import microspeed
        try:
            microspeed.init_distributed("gloo", dist_init_required=False)
        except AssertionError as e:
            print("RAISED", type(e).__name__, e)
    """, standin_first=False)
    assert proc.returncode == 0, proc.stderr
    assert "RAISED DistributedNotInitializedError init_distributed(dist_init_required=False)" in proc.stdout


@pytest.mark.slow
@distributed(world_size=2)
def test_comm_deepspeed_names():
    from microspeed import comm

    assert comm.is_initialized() and comm.get_world_group() is torch.distributed.group.WORLD
    solo = comm.new_group([0])
    pair = comm.new_group([0, 1])
    assert comm.get_all_ranks_from_group(pair) == [0, 1] and comm.get_global_rank(pair, 1) == 1
    t = torch.tensor([float(comm.get_rank() + 1)])
    comm.inference_all_reduce(t, group=pair)
    assert t.item() == 3.0
    if comm.get_rank() == 0:
        assert comm.get_world_size(solo) == 1
    assert comm.get_local_rank() == comm.get_rank()


@pytest.mark.slow
@distributed(world_size=3)
def test_partitioned_tensor_splits_and_gathers():
    from microspeed import comm
    from microspeed.compat.tensor_utils import PartitionedTensor

    full = torch.arange(35.0).view(7, 5)  # 35 elements over 3 ranks: slices of 12, 12, 11
    part = PartitionedTensor(full, group=None)
    rank = comm.get_rank()
    assert part.local_size() == torch.Size([[12, 12, 11][rank]])
    assert torch.equal(part.data(), full.view(-1)[[0, 12, 24][rank]:[12, 24, 35][rank]])
    assert torch.equal(part.full(), full)
    meta = part.to_meta()
    assert meta.tolist() == [2, 7, 5, 3, 0, 12, 24, 35]
    rebuilt = PartitionedTensor.from_meta(meta, part.local_data, None)
    assert torch.equal(rebuilt.full(), full) and rebuilt.local_size() == part.local_size()
    with pytest.raises(ValueError, match="describes 2 parts"):
        PartitionedTensor.from_meta(torch.tensor([1, 4, 2, 0, 2, 4]), part.local_data, None)


def test_git_version_info_reports_the_standin():
    proc = _run("""
        import json, torch
        import deepspeed.git_version_info as g
        print("OUT " + json.dumps([g.version, g.git_hash, sorted(set(g.installed_ops.values())), g.accelerator_name,
                                   g.torch_info]))
    """)
    assert proc.returncode == 0, proc.stderr
    version, git_hash, ops, acc, info = _line(proc.stdout, "OUT")
    assert version == "0.19.8+microspeed" and git_hash == "[none]" and ops == [False] and acc == "cpu"
    assert info["version"] == ".".join(torch.__version__.split(".")[:2]) and info["cuda_version"] == "0.0"
    assert info["nccl_version"] == "0.0" and info["bf16_support"] is True


CONFIG_OBJECTS = """
import json, os, sys, tempfile
import pydantic
from deepspeed.runtime.config import DeepSpeedConfig, BatchSizeError, ADAM_OPTIMIZER
from deepspeed.runtime.config_utils import DeepSpeedConfigModel, get_config_default
from deepspeed.runtime.zero.config import (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig,
                                           DeepSpeedZeroOffloadParamConfig, ZeroStageEnum)
from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
from microspeed.compat.deepspeed_config import default_of
out = {}

class Conf(DeepSpeedConfigModel):
    a: int = 0
    old: str | None = pydantic.Field(None, json_schema_extra={"deprecated": True, "new_param": "new",
                                                                "new_param_fn": lambda v: [v]})
    new: list[str] | None = None
    c: int = pydantic.Field(0, alias="c_alias")

out["model"] = [Conf(a=3).a, Conf(old="x").new, Conf(c_alias=4).c, Conf(c=5).c, Conf(a="auto").a,
                get_config_default(Conf, "a")]
for bad in ({"a": "x"}, {"typo": 1}):
    try:
        Conf(**bad)
    except pydantic.ValidationError:
        out.setdefault("refused", []).append(sorted(bad))
try:
    Conf(old="x", new=["y"])
except AssertionError as e:
    out["both"] = "not both" in str(e)

z = DeepSpeedZeroConfig(cpu_offload=True, stage3_prefetch_bucket_size=123, stage=2)
out["zero"] = [isinstance(z.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig), z.offload_optimizer.device,
               z.offload_param, z.prefetch_bucket_size, z.stage == ZeroStageEnum.gradients,
               z.overlap_comm == default_of("zero_optimization.overlap_comm"),
               z.reduce_bucket_size == default_of("zero_optimization.reduce_bucket_size")]
out["zero_param"] = type(DeepSpeedZeroConfig(cpu_offload_param=True).offload_param).__name__
out["pipeline"] = [DeepSpeedZeroOffloadOptimizerConfig(pipeline_read=True).pipeline,
                   DeepSpeedZeroOffloadOptimizerConfig().pipeline]
try:
    DeepSpeedZeroConfig(stag=1)
except pydantic.ValidationError as e:
    out["zero_typo"] = "zero_optimization.stag: unknown key. Did you mean 'stage'?" in str(e)

c = DeepSpeedConfig({"train_batch_size": 8, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                     "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
                     "csv_monitor": {"enabled": True, "output_path": "x", "job_name": "j"}})
out["config"] = [c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps,
                 c.zero_optimization_stage, c.zero_enabled, c.bfloat16_enabled, c.fp16_enabled,
                 c.optimizer_name == ADAM_OPTIMIZER, c.optimizer_params, c.monitor_config.enabled,
                 c.monitor_config.csv_monitor.job_name, c._param_dict["train_batch_size"]]
c.world_size = 2
for triad in ((32, 8, None), (None, 8, 2), (33, 17, None), (None, None, 2)):
    c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps = triad
    try:
        c._configure_train_batch_size()
        out.setdefault("triads", []).append([c.train_batch_size, c.train_micro_batch_size_per_gpu,
                                             c.gradient_accumulation_steps])
    except AssertionError as e:
        out.setdefault("triads", []).append(type(e).__name__)
path = os.path.join(tempfile.mkdtemp(), "c.json")
with open(path, "w") as f:
    f.write('{"train_batch_size": 4, // comment\\n "train_batch_size": 4,}')
try:
    DeepSpeedConfig(path)
except ValueError as e:
    out["dup"] = "duplicate keys ['train_batch_size']" in str(e)
try:
    DeepSpeedConfig({"train_batch_size": 4, "fp16": {"enabled": True, "loss_scal": 0}})
except ValueError as e:
    out["typo"] = "fp16.loss_scal: unknown key" in str(e)
try:
    DeepSpeedConfig({"train_batch_size": 4, "gradient_allreduce_op": "max"})
except ValueError as e:
    out["op"] = str(e).startswith("Invalid gradient_allreduce_op 'max'")
try:
    DeepSpeedConfig({"train_batch_size": 4, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})
except ValueError as e:
    out["op"] = out["op"] and "'sum' is not supported with ZeRO stage 3" in str(e)
out["fp16"] = [get_float16_config({"fp16": {"enabled": True}}).enabled,
               get_float16_config({}).loss_scale_window == default_of("fp16.loss_scale_window"),
               get_bfloat16_config({"bf16": {"enabled": True}}).enabled]
print("OUT " + json.dumps(out))
"""


@pytest.mark.slow
def test_deepspeed_config_objects_read_with_microspeeds_parser():
    proc = _run(CONFIG_OBJECTS)
    assert proc.returncode == 0, proc.stderr
    out = _line(proc.stdout, "OUT")
    assert out["model"] == [3, ["x"], 4, 5, 0, 0] and out["refused"] == [["a"], ["typo"]] and out["both"]
    assert out["zero"] == [True, "cpu", None, 123, True, True, True]
    assert out["zero_param"] == "DeepSpeedZeroOffloadParamConfig" and out["pipeline"] == [True, False]
    assert out["zero_typo"] and out["dup"] and out["typo"] and out["op"]
    assert out["config"] == [8, 8, 1, 1, True, True, False, True, {"lr": 0.1}, True, "j", 8]
    assert out["triads"] == [[32, 8, 2], [32, 8, 2], "BatchSizeError", "BatchSizeError"]
    assert out["fp16"] == [True, True, True]


MONITORS_AND_OPS = """
import json, os, sys, tempfile
import deepspeed
from deepspeed.monitor.config import DeepSpeedMonitorConfig, get_monitor_config
from deepspeed.monitor.monitor import MonitorMaster
from deepspeed.monitor.wandb import WandbMonitor
from deepspeed.ops.op_builder import FusedAdamBuilder, CPUAdamBuilder
from deepspeed.utils.groups import _get_expert_parallel_ranks
out = {}
root = tempfile.mkdtemp()
cfg = get_monitor_config({"csv_monitor": {"enabled": True, "output_path": root, "job_name": "job"}})
master = MonitorMaster(cfg)
master.write_events([("Train/Samples/loss", 1.5, 4), ("Train/Samples/loss", 1.25, 8)])
with open(os.path.join(root, "job", "Train_Samples_loss.csv")) as f:
    out["csv"] = f.read().splitlines()
out["defaults"] = [DeepSpeedMonitorConfig().enabled, DeepSpeedMonitorConfig().tensorboard.job_name]
try:
    WandbMonitor(get_monitor_config({"wandb": {"enabled": True}}).wandb)
except ValueError as e:
    out["wandb"] = "does not log to Weights & Biases" in str(e)
out["ops"] = [deepspeed.ops.__compatible_ops__[FusedAdamBuilder.NAME], deepspeed.ops.__compatible_ops__["async_io"],
              FusedAdamBuilder().load().FusedAdam is deepspeed.ops.adam.FusedAdam,
              CPUAdamBuilder().load().DeepSpeedCPUAdam is deepspeed.ops.adam.DeepSpeedCPUAdam]
out["ranks"] = [_get_expert_parallel_ranks(8, 1, 2), _get_expert_parallel_ranks(8, 2, 2)]
import torch
for args, kwargs in (((), {"model": None}), ((torch.nn.Linear(2, 2),), {})):
    try:
        deepspeed.initialize(*args, config={"train_batch_size": 1}, **kwargs)
    except AssertionError as e:
        out.setdefault("no_model", []).append([type(e).__name__, "pass the model as initialize(model=...)" in str(e)])
from deepspeed.runtime.zero.partition_parameters import MultipleAllGatherHandles, partitioned_param_data_shape
class Handle:
    def __init__(self):
        self.seen = []
    def wait(self, *, handle_dependency=True):
        self.seen.append(handle_dependency)
handles = [Handle(), Handle()]
MultipleAllGatherHandles(handles).wait(handle_dependency=False)
out["handles"] = [h.seen for h in handles] + [partitioned_param_data_shape]
print("OUT " + json.dumps(out))
"""


@pytest.mark.slow
def test_monitors_op_builders_and_expert_rank_layout():
    proc = _run(MONITORS_AND_OPS)
    assert proc.returncode == 0, proc.stderr
    out = _line(proc.stdout, "OUT")
    assert out["csv"] == ["step,loss", "4,1.5", "8,1.25"]
    assert out["defaults"] == [False, "DeepSpeedJobName"] and out["wandb"]
    assert out["ops"] == [True, False, True, True]
    assert out["ranks"][0] == [[[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]]
    assert out["ranks"][1] == [[[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]]]
    assert out["no_model"] == [["InitializeArgumentError", False], ["InitializeArgumentError", True]]
    assert out["handles"] == [[False], [False], [0]]


UNFUSED = """
import json, torch
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
torch.manual_seed(0)
w = torch.randn(4, 3)
low = torch.nn.Parameter(w.to(torch.bfloat16))
opt = FP16_UnfusedOptimizer(torch.optim.SGD([low], lr=0.5), static_loss_scale=8.0,
                            low_precision_dtype=torch.bfloat16)
x = torch.randn(2, 4)
loss = (x.to(torch.bfloat16) @ low).float().pow(2).sum()
opt.backward(loss)
grad_low = low.grad.float() / 8.0
master_before = w.to(torch.bfloat16).float()
overflowed = opt.step()
want = (master_before - 0.5 * grad_low).to(torch.bfloat16)
out = {"static": [overflowed, torch.equal(low.detach(), want), low.grad is None,
                  opt.loss_scale_config.dynamic_loss_scale, opt.loss_scale_config.cur_scale]}
half = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
dyn = FP16_UnfusedOptimizer(torch.optim.SGD([half], lr=0.1), dynamic_loss_scale=True,
                            dynamic_loss_args={"init_scale": 1024.0, "delayed_shift": 1})
half.grad = torch.tensor([1.0, float("inf"), 0.0], dtype=torch.float16)
out["overflow"] = [dyn.step(), dyn.cur_scale, half.detach().tolist(), half.grad is None]
print("OUT " + json.dumps(out))
"""


def test_fp16_unfused_optimizer_steps_fp32_masters_and_skips_overflow():
    proc = _run(UNFUSED)
    assert proc.returncode == 0, proc.stderr
    out = _line(proc.stdout, "OUT")
    assert out["static"] == [False, True, True, False, 8.0]
    assert out["overflow"] == [True, 512.0, [1.0, 1.0, 1.0], True]


def test_deepspeed_config_helper_uses_the_plugins_schema():
    import base64

    from microspeed.compat import deepspeed_config

    assert deepspeed_config.default_of("zero_optimization.stage") == 0
    assert deepspeed_config.default_of("fp16.loss_scale_window") == 1000
    with pytest.raises(KeyError, match="zero_optimization.nope"):
        deepspeed_config.default_of("zero_optimization.nope")
    cfg = deepspeed_config.parse_config({"train_batch_size": 4, "zero_optimization": {"stage": 2}})
    assert cfg.get("zero_optimization.stage") == 2 and cfg.get("zero_optimization.reduce_bucket_size") == 500_000_000
    with pytest.raises(microspeed.ConfigError, match="zero_optimization.stag: unknown key"):
        deepspeed_config.parse_config({"zero_optimization": {"stag": 2}})
    encoded = base64.urlsafe_b64encode(b'{"train_batch_size": 8}').decode()
    assert deepspeed_config.read_config(encoded) == {"train_batch_size": 8}


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g, dtype=dtype)),
            torch.nn.Parameter(torch.randn(7, generator=g, dtype=dtype))]


def _steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], n: int = 3) -> list[torch.Tensor]:
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_equals_torch(adamw_mode):
    mine, ref = _params(), _params()
    got = _steps(DeepSpeedCPUAdam(mine, lr=0.01, weight_decay=0.1, adamw_mode=adamw_mode), mine)
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    want = _steps(torch_cls(ref, lr=0.01, weight_decay=0.1), ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_cpu_adagrad_equals_torch():
    mine, ref = _params(), _params()
    got = _steps(DeepSpeedCPUAdagrad(mine, lr=0.05, weight_decay=0.01), mine)
    want = _steps(torch.optim.Adagrad(ref, lr=0.05, weight_decay=0.01), ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_cpu_lion_follows_its_formula():
    mine, ref = _params(), _params()
    got = _steps(DeepSpeedCPULion(mine, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1), mine)
    ms = [torch.zeros_like(p) for p in ref]
    for i in range(3):
        g = torch.Generator().manual_seed(100 + i)
        for p, m in zip(ref, ms, strict=True):
            grad = torch.randn(p.shape, generator=g)
            with torch.no_grad():
                p.mul_(1 - 0.01 * 0.1)
                p.sub_(0.01 * torch.sign(0.9 * m + 0.1 * grad))
            m.mul_(0.99).add_(0.01 * grad)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b.detach())


def test_cpu_optimizers_refuse_half_params_for_fp32_states():
    with pytest.raises(ValueError, match="fp32_optimizer_states=True.*torch.bfloat16"):
        DeepSpeedCPUAdam(_params(dtype=torch.bfloat16))
    DeepSpeedCPUAdam(_params(dtype=torch.bfloat16), fp32_optimizer_states=False)
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdagrad(_params(), amsgrad=True)


def test_small_deepspeed_helpers():
    proc = _run("""
        import json, torch
        from deepspeed.runtime.utils import prefix_sum_inc, partition_uniform
        from deepspeed.runtime.pipe.topology import _prime_factors
        from deepspeed.utils.torch import required_torch_version
        print("OUT " + json.dumps([prefix_sum_inc([1, 2, 3]), _prime_factors(12), _prime_factors(13),
                                   partition_uniform(10, 3), required_torch_version(min_version="1.0"),
                                   required_torch_version(max_version="1.0")]))
    """)
    assert proc.returncode == 0, proc.stderr
    assert _line(proc.stdout, "OUT") == [[1, 3, 6], [2, 2, 3], [13], [0, 4, 7, 10], True, False]


def test_tensor_helpers():
    base = torch.arange(10.0)
    view = base[2:4]
    cloned = clone_tensors_for_torch_save({"a": [view, (base,)], "n": 3})
    assert cloned["n"] == 3 and torch.equal(cloned["a"][0], view)
    assert cloned["a"][0].untyped_storage().nbytes() == 2 * 4  # only the view's data, not the whole storage
    assert cloned["a"][0].data_ptr() != view.data_ptr()
    moved = move_to_device({"x": [torch.ones(1)], "y": "s"}, "meta")
    assert moved["x"][0].device.type == "meta" and moved["y"] == "s"
    kept = move_to_device([torch.ones(1), torch.ones(1, dtype=torch.long)], "meta", lambda t: t.is_floating_point())
    assert kept[0].device.type == "meta" and kept[1].device.type == "cpu"


def test_zero_to_fp32_over_a_microspeed_checkpoint(tmp_path):
    from microspeed.checkpoint.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    engine = microspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                                        "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})[0]
    loss = engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    masters = {n: p.detach().float().clone() for n, p in zip(
        [n for n, _ in model.named_parameters()], [p for g in engine.optimizer.param_groups for p in g["params"]],
        strict=True)}
    sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    assert list(sd) == list(model.state_dict())
    for name, t in sd.items():
        assert t.dtype == torch.float32
        torch.testing.assert_close(t, masters[name])  # fp32 masters, not the bf16 weights
    path = convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert path.endswith("pytorch_model.bin")
    loaded = torch.load(path)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    load_state_dict_from_zero_checkpoint(fresh, str(tmp_path / "ckpt"))
    assert all(torch.equal(fresh.state_dict()[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="exclude_frozen_parameters"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), exclude_frozen_parameters=True)
    with pytest.raises(ValueError, match="max_shard_size"):
        convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "o2"), max_shard_size=10)


def test_standin_metadata_matches_its_pyproject():
    """The static dist-info beside the package says what the distribution's pyproject says."""
    root = Path(STANDIN).parent
    pyproject = (root / "pyproject.toml").read_text()
    meta = (Path(STANDIN) / "deepspeed-0.19.8+microspeed.dist-info" / "METADATA").read_text()
    assert 'name = "deepspeed"' in pyproject and f'version = "{standin.STANDIN_VERSION}"' in pyproject
    assert "Name: deepspeed\n" in meta and f"Version: {standin.STANDIN_VERSION}\n" in meta
    requires = [line.split(": ", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
    assert requires == tomllib.loads(pyproject)["project"]["dependencies"] and "pydantic>=2" in requires
    core = (root.parent.parent / "pyproject.toml").read_text()
    assert not any("pydantic" in d for d in tomllib.loads(core)["project"]["dependencies"])  # only the stand-in's
    assert tomllib.loads(core)["project"]["optional-dependencies"]["standin"] == requires[1:]  # models use it


ZERO_TO_FP32_ON_DEEPSPEED = """
import json, sys, torch
import deepspeed  # real DeepSpeed writes the checkpoint (plain microspeed beside it is allowed)
from deepspeed.utils import zero_to_fp32 as ds_z
from microspeed.checkpoint import zero_to_fp32 as ms_z
root = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "steps_per_print": 1000,
       "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
for step in range(2):
    g = torch.Generator().manual_seed(step)
    engine.backward(engine(torch.randn(2, 7, generator=g)).pow(2).mean())
    engine.step()
engine.save_checkpoint(root)
theirs = ds_z.get_fp32_state_dict_from_zero_checkpoint(root)
ours = ms_z.get_fp32_state_dict_from_zero_checkpoint(root)
print("OUT " + json.dumps({"keys": [list(theirs), list(ours)],
                           "equal": [torch.equal(theirs[k].float(), ours[k]) for k in theirs]}))
"""


@needs_real_deepspeed
@pytest.mark.slow
def test_zero_to_fp32_reads_a_deepspeed_checkpoint_as_deepspeed_does(tmp_path):
    """On a checkpoint real DeepSpeed wrote (ZeRO-2), microspeed's function returns DeepSpeed's own result."""
    script = tmp_path / "ds.py"
    script.write_text(ZERO_TO_FP32_ON_DEEPSPEED)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(__import__("microspeed.testing").testing.free_port())}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], capture_output=True, text=True,
                          env=env, timeout=480, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = _line(proc.stdout, "OUT")
    assert out["keys"][0] == out["keys"][1] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert out["equal"] == [True] * 4
