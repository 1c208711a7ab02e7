"""ZeRO-3 leaf modules and DeepSpeed's ``safe_set_*`` / ``safe_*_local_*`` functions, as DeepSpeed's users call them.

A leaf module (``set_z3_leaf_modules``) is gathered whole when its forward starts, so a Mixture-of-Experts block
whose forward skips experts depending on the data trains under ZeRO-3 exactly as without ZeRO, with no gather
inside it. ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` write a whole value into every rank's
partition at stages 1-3: ``safe_get_full_*`` reads it back and the next step starts from it. The API reaches
``deepspeed.utils`` through the stand-in with DeepSpeed 0.19.8's signatures.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import microspeed
from microspeed.compat import standin
from microspeed.testing import run_distributed

GLOBAL_BATCH = 8
D = 6
NAMES = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter",
         "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
         "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_set_full_grad",
         "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
         "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
         "safe_update_full_grad_vectorized")


class MoE(nn.Module):
    """A gate and three experts; an expert runs only when the gate routes a sample of this batch to it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, 3)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each sample through the expert its gate picks (experts nobody picked do not run)."""
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():  # data-dependent: which experts run differs between ranks and steps
                out = out.index_add(0, rows, expert(x[rows]))
        return out + x


def _model(moe: bool = True) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), MoE() if moe else nn.Linear(D, D), nn.Linear(D, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(GLOBAL_BATCH, D, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)


def _mine(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(microspeed.comm.get_world_size())[microspeed.comm.get_rank()]


def _train_step(engine, step: int) -> float:
    """One step on this rank's share of batch ``step``; the global mean loss."""
    x, y = _batch(step)
    loss = nn.functional.mse_loss(engine(_mine(x)), _mine(y))
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    microspeed.comm.all_reduce(total)
    return total.item() / microspeed.comm.get_world_size()


def _config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // microspeed.comm.get_world_size(),
            "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 0.05}}, "zero_optimization": zero}


def _reference(steps: int, edit: dict | None = None) -> tuple[list[float], nn.Module, torch.optim.Optimizer]:
    """Plain torch on the global batch; ``edit`` (name -> (value, exp_avg, exp_avg_sq)) applied after step 1 (to the
    model without experts)."""
    model = _model(moe=not edit)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    params = dict(model.named_parameters())
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # an expert no sample was routed to: a zero gradient, as ZeRO reduces it
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        if step == 0 and edit:
            for name, (value, m, v) in edit.items():
                with torch.no_grad():
                    params[name].copy_(value)
                opt.state[params[name]]["exp_avg"].copy_(m)
                opt.state[params[name]]["exp_avg_sq"].copy_(v)
    return losses, model, opt


def _count_gathers(moe: nn.Module, stage3) -> tuple[list[int], list[bool]]:
    """Record, for each forward of ``moe``: the gathers started inside it, and whether it was whole at entry."""
    fetches, entry, inside, whole_at_entry = [], [], [], []
    real_fetch = stage3.fetch

    def counting_fetch(index, *a, **k):
        fetches.append(index)
        return real_fetch(index, *a, **k)

    def enter(_m, _a):
        entry.append(len(fetches))
        whole_at_entry.append(all(p.ds_status.name == "AVAILABLE" for p in moe.parameters()))

    stage3.fetch = counting_fetch
    moe.register_forward_pre_hook(enter)  # after stage 3's own hook: the leaf's gather is done
    moe.register_forward_hook(lambda _m, _a, _o: inside.append(len(fetches) - entry[-1]))
    return inside, whole_at_entry


def _leaf_part() -> dict:
    from microspeed.zero import get_z3_leaf_modules, set_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter

    out = {}
    for leaf in (True, False):
        model = _model()
        moe = model[2]
        if leaf:
            assert set_z3_leaf_modules(model, [MoE]) == [moe] and z3_leaf_module(moe) and not z3_leaf_module(model)
            assert get_z3_leaf_modules(model) == [moe]
        engine, *_ = microspeed.initialize(model=model, config=_config(3))
        rt = engine.plugin_state("zero")
        inside, whole_at_entry = _count_gathers(moe, rt.stage3)
        losses = []
        for step in range(3 if leaf else 1):
            x, y = _batch(step)
            if not leaf:  # without the flag ranks would reduce the experts' gradients in different orders (as with
                with torch.no_grad():  # DeepSpeed, which asks for the flag): a forward only, the gathers counted
                    engine(x)
                break
            losses.append(_train_step(engine, step))
        out[leaf] = {"losses": losses, "fetches_inside": inside, "whole_at_entry": whole_at_entry,
                     "leaf_params": [z3_leaf_parameter(p) for p in moe.parameters()]}
        engine.destroy()
    return out


def _safe_set_part(stage: int) -> dict:
    from microspeed.zero import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
    )

    model = _model(moe=False)
    engine, *_ = microspeed.initialize(model=model, config=_config(stage))
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(9)  # the same values on every rank
    edit = {name: (torch.randn(params[name].ds_shape if stage == 3 else params[name].shape, generator=g),
                   torch.randn(tuple(params[name].ds_shape if stage == 3 else params[name].shape), generator=g) * 0.1,
                   torch.rand(tuple(params[name].ds_shape if stage == 3 else params[name].shape), generator=g))
            for name in ("0.weight", "2.weight", "3.bias")}
    got, losses = {}, []
    for step in range(3):
        losses.append(_train_step(engine, step))
        if step == 0:
            for name, (value, m, v) in edit.items():
                safe_set_full_fp32_param(params[name], value)
                safe_set_full_optimizer_state(params[name], m, "exp_avg")
                safe_set_full_optimizer_state(params[name], v, "exp_avg_sq")
                got[name] = [safe_get_full_fp32_param(params[name]),
                             safe_get_full_optimizer_state(params[name], "exp_avg"),
                             safe_get_full_optimizer_state(params[name], "exp_avg_sq")]
    final = {n: safe_get_full_fp32_param(p) for n, p in params.items()}
    local = None
    p = params["0.weight"]
    if stage == 3:
        before = safe_get_full_fp32_param(p)
        assert all(q.ds_tensor.shape == safe_get_local_fp32_param(q).shape for q in params.values())  # DeepSpeed's
        safe_set_local_fp32_param(p, safe_get_local_fp32_param(p) + 1)  # tests size local values by ds_tensor
        local = safe_get_full_fp32_param(p) - before
    else:
        try:
            safe_get_local_fp32_param(p)
            local = "no error"
        except AssertionError as e:  # DeepSpeed asserts: the local API is for stage 3 only
            local = str(e)
    engine.destroy()
    return {"edit": edit, "got": got, "losses": losses, "final": final, "local": local}


def _fp16_part() -> dict:
    """fp16 at stage 2: DeepSpeed's optimizer.loss_scaler / dynamic_loss_scale, and an inf gradient set with
    safe_set_full_grad skips the step and halves the scale (DeepSpeed's test_zero_optim_overflow does this)."""
    from microspeed.zero import safe_get_full_grad, safe_set_full_grad

    cfg = {**_config(2), "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2,
                                       "hysteresis": 1}}
    model = _model(moe=False)
    engine, optimizer, *_ = microspeed.initialize(model=model, config=cfg)
    out = {"dynamic": optimizer.dynamic_loss_scale, "scale": [optimizer.loss_scaler.cur_scale]}
    x, y = _batch(0)
    engine.backward(nn.functional.mse_loss(engine(_mine(x).half()).float(), _mine(y)))
    for p in model.parameters():
        safe_set_full_grad(p, torch.full(p.shape, float("inf"), dtype=p.dtype))
    out["grad_read_back"] = all(torch.isinf(safe_get_full_grad(p)).all().item() for p in model.parameters())
    engine.step()
    out["scale"].append(optimizer.cur_scale)
    out["skipped"] = engine.skipped_steps
    engine.destroy()
    return out


def _body() -> dict:
    return {"leaf": _leaf_part(), "fp16": _fp16_part(), **{stage: _safe_set_part(stage) for stage in (1, 2, 3)}}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_leaf_moe_trains_like_plain_torch_and_safe_set_full_is_read_back_and_stepped_from():
    """2 ranks: a leaf MoE (experts run data-dependently) trains with plain torch's losses, its whole sub-tree gathered
    at entry and nothing gathered inside it; safe_set_full_* at stages 1-3 read back and used by the next step."""
    per_rank = run_distributed(_body, world_size=2, timeout=220)
    ref_losses, *_ = _reference(3)
    for rank, res in enumerate(per_rank):
        leaf, plain = res["leaf"][True], res["leaf"][False]
        torch.testing.assert_close(leaf["losses"], ref_losses, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
        assert leaf["whole_at_entry"] and all(leaf["whole_at_entry"]), rank
        assert leaf["fetches_inside"] and not any(leaf["fetches_inside"]), (rank, leaf["fetches_inside"])
        assert all(leaf["leaf_params"]) and not any(plain["leaf_params"]), rank
        assert any(plain["fetches_inside"]), rank  # without the flag the experts gather their own
        assert res["fp16"] == {"dynamic": True, "scale": [256.0, 128.0], "grad_read_back": True, "skipped": 1}, rank
        for stage in (1, 2, 3):
            r = res[stage]
            for name, (value, m, v) in r["edit"].items():
                for want, got in zip((value, m, v), r["got"][name], strict=True):
                    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {rank} stage {stage} {name}")
            want_losses, ref_model, _ = _reference(3, r["edit"])
            torch.testing.assert_close(r["losses"], want_losses, rtol=1e-5, atol=1e-6, msg=f"{rank} {stage}")
            for name, p in ref_model.named_parameters():
                torch.testing.assert_close(r["final"][name], p.detach(), rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank} stage {stage} {name}")
            if stage == 3:
                torch.testing.assert_close(r["local"], torch.ones(D, D).where(r["local"] != 0, torch.zeros(())))
                assert (r["local"] == 1).any(), rank  # this rank's partition moved by +1, the rest not
            else:
                assert "only defined for ZeRO stage 3" in r["local"], r["local"]


# ---------------------------------------------------------------------------------------------- the API surface


def _real_signatures() -> dict[str, list]:
    """Parameter names and default values of DeepSpeed 0.19.8's functions, read from its source (not imported:
    the stand-in and DeepSpeed are both ``deepspeed``)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None or standin.is_standin_file(spec.origin):
        pytest.skip("real DeepSpeed is not installed")
    out = {}
    for file in ("tensor_fragment.py", "z3_leaf_module.py"):
        tree = ast.parse((Path(spec.origin).parent / "utils" / file).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in NAMES:
                args = node.args.args
                defaults = [None] * (len(args) - len(node.args.defaults)) + [ast.literal_eval(d)
                                                                             for d in node.args.defaults]
                out[node.name] = [[a.arg, d] for a, d in zip(args, defaults, strict=True)]
    return out


_PROBE = """
import inspect, json
import deepspeed.utils as u
from deepspeed.utils.tensor_fragment import safe_set_full_fp32_param
assert safe_set_full_fp32_param is u.safe_set_full_fp32_param
out = {}
for name in NAMES:
    sig = inspect.signature(getattr(u, name))
    out[name] = [[p.name, None if p.default is inspect.Parameter.empty else p.default]
                 for p in sig.parameters.values()]
print(json.dumps({"file": u.__file__, "sigs": out}))
"""


def test_the_names_reach_deepspeed_utils_through_the_standin_with_deepspeeds_signatures():
    """``from deepspeed.utils import safe_set_full_fp32_param, z3_leaf_module, ...`` through the stand-in: each name
    has DeepSpeed 0.19.8's parameter names and defaults (an import DeepSpeed's tests stopped at before)."""
    want = _real_signatures()
    assert sorted(want) == sorted(NAMES)
    env = {**os.environ, "PYTHONPATH": str(standin.source_folder()) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", f"NAMES = {NAMES!r}\n{_PROBE}"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(standin.source_folder())), got["file"]
    assert got["sigs"] == want


def test_leaf_module_config_takes_deepspeeds_defaults_and_a_single_string():
    """``zero_optimization.leaf_module``: by default DeepSpeed 0.19.8's leaf classes (Hugging Face's sparse MoE blocks,
    whose experts run data-dependently); ``"classes": "my.Class"`` is a list of one, as DeepSpeed reads it (was: []
    by default, and a string refused); a list holding a non-string is refused naming the key."""
    from microspeed_zero.config import ZeroConfig

    from microspeed.compat.deepspeed_config import parse_config
    from microspeed.errors import ConfigError

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None or standin.is_standin_file(spec.origin):
        pytest.skip("real DeepSpeed is not installed")
    tree = ast.parse((Path(spec.origin).parent / "runtime" / "zero" / "leaf_module_config.py").read_text())
    real = {t.target.id: ast.literal_eval(t.value) for t in tree.body
            if isinstance(t, ast.AnnAssign) and t.target.id.startswith("DEFAULT_LEAF_MODULE")}

    def zero(leaf: dict | None = None) -> ZeroConfig:
        z = {"stage": 3, **({"leaf_module": leaf} if leaf is not None else {})}
        return ZeroConfig.from_config(parse_config({"train_batch_size": 1, "zero_optimization": z}))

    default = zero()
    assert list(default.leaf_classes) == real["DEFAULT_LEAF_MODULE_CLASSES"]
    assert list(default.leaf_names) == real["DEFAULT_LEAF_MODULE_NAMES"]
    assert list(default.leaf_suffixes) == real["DEFAULT_LEAF_MODULE_NAME_SUFFIXES"]
    given = zero({"classes": "my.Class", "names": "submodule", "name_suffixes": ["tail", "tail"]})
    assert (given.leaf_classes, given.leaf_names, given.leaf_suffixes) == (("my.Class",), ("submodule",), ("tail",))
    with pytest.raises(ConfigError, match=r"zero_optimization\.leaf_module\.classes"):
        zero({"classes": ["ok", 3]})
