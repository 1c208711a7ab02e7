"""ZeRO-Infinity NVMe offload of the optimizer (``microspeed_zero.swap.OptimizerSwapper``) on 2 ranks.

Spawning ranks is the slow part (each rank imports torch, DCP and the plugins), so one spawn
(``_all_checks``, 2 ranks, gloo) runs every distributed check and returns plain numbers; the
tests below assert on them:

* equivalence: stage 2 fp32 (config Adam, i.e. fused AdamW), stage 3 fp32 (a client
  ``torch.optim.Adam`` with two param groups — different lr and weight decay, AMSGrad in one) and
  stage 2 bf16 (AdamW, 2 micro-steps per step), each with a WarmupLR schedule and gradient
  clipping, run with ``offload_optimizer`` none and nvme: per-step losses, whole fp32 weights,
  this rank's masters and every Adam state tensor agree within 1e-5 relative; the sub-groups
  both span segments and split them; ``resident()`` discards changes and
  ``resident(writeback=True)`` keeps them;
* memory: a 4.2M-parameter bf16 model at stage 2 whose fp32 optimizer state (12 bytes per
  element of the rank's partition) is >= 4x the in-memory budget (``buffer_count`` slots of the
  largest sub-group) trains; resident optimizer bytes stay within the budget, the files hold the
  state and the bf16 gradient partition, and the peak RSS growth over 3 steps stays below
  budget + model + ``RSS_SLACK``;
* checkpoint: 4 steps with nvme offload, save, then a no-offload engine and an nvme engine load
  it and run 4 more steps: losses equal the uninterrupted 8-step run;
* bad input: nvme without nvme_path, SGD with nvme -> ConfigError naming the key.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import microspeed
from microspeed.errors import ConfigError
from microspeed.testing import run_distributed

RTOL = 1e-5
RSS_SLACK = 8 << 20
"""Peak-RSS allowance beyond budget + model: activations and the autograd graph of a step, gloo's
transfer buffers, the I/O threads' stacks and allocator rounding (measured: 2-5 MiB)."""

VARIANTS = {  # name: (stage, precision, optimizer, micro-steps per step)
    "stage2_fp32": (2, "fp32", "section", 1),
    "stage3_fp32": (3, "fp32", "client", 1),
    "stage2_bf16": (2, "bf16", "section_adamw", 2),
}
STEPS = 6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Net(torch.nn.Module):
    """A small MLP; ``forward(x, y)`` returns the MSE loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 48)
        self.fc2 = torch.nn.Linear(48, 24)
        self.fc3 = torch.nn.Linear(24, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))), y)


def _config(stage: int, precision: str, optimizer: str, gas: int, nvme: str | None) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 500, "sub_group_size": 300,
            "stage3_param_persistence_threshold": 0}
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}
    cfg = {"train_batch_size": 8 * gas, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
           "gradient_clipping": 0.5, "zero_optimization": zero,
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.002, "warmup_max_lr": 0.02,
                                                        "warmup_num_steps": 4, "warmup_type": "linear"}}}
    if optimizer == "section":
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01}}
    elif optimizer == "section_adamw":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.05, "betas": [0.8, 0.99]}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(variant: str, nvme: str | None):
    stage, precision, optimizer, gas = VARIANTS[variant]
    torch.manual_seed(0)
    model = Net()
    client = None
    if optimizer == "client":
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        client = torch.optim.Adam([{"params": weights, "lr": 0.02, "weight_decay": 0.01},
                                   {"params": biases, "lr": 0.01, "weight_decay": 0.0, "amsgrad": True}])
    return microspeed.initialize(model=model, optimizer=client,
                                 config=_config(stage, precision, optimizer, gas, nvme))[0]


def _train(engine, steps: int, start: int = 0) -> list[float]:
    """``steps`` optimizer steps on batches fixed by (step, micro-step, rank); this rank's mean loss per step."""
    dtype = next(engine.module.parameters()).dtype
    rank = torch.distributed.get_rank()
    gas = engine.gradient_accumulation_steps()
    losses = []
    for step in range(start, start + steps):
        total = 0.0
        for micro in range(gas):
            g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
            x, y = torch.randn(4, 12, generator=g), torch.randn(4, 1, generator=g)
            loss = engine(x.to(dtype), y.to(dtype))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / gas)
    return losses


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


def _local_state(engine) -> list[dict[str, torch.Tensor]]:
    """This rank's master slice and Adam state of each run (read through ``resident()`` with NVMe)."""
    rt = engine.plugin_state("zero")
    with rt.swapper.resident() if rt.swapper is not None else contextlib.nullcontext():
        out = []
        for (seg, _g, start, end, _view), st in zip(rt.optimizer.runs, rt.optimizer.run_states(), strict=True):
            entry = {k: v.detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
            entry["master"] = rt.masters[seg.index][start:end].clone()
            out.append(entry)
    return out


def _resident_roundtrip(engine) -> dict:
    """``resident()`` discards changes, ``resident(writeback=True)`` keeps them; nothing stays resident after."""
    rt = engine.plugin_state("zero")
    swapper, opt = rt.swapper, rt.optimizer
    view = opt.runs[0][4]
    with swapper.resident():
        before = opt.inner.state[view]["exp_avg"].clone()
        opt.inner.state[view]["exp_avg"].fill_(7.0)
    with swapper.resident(writeback=True):
        discarded = torch.equal(opt.inner.state[view]["exp_avg"], before)
        opt.inner.state[view]["exp_avg"].copy_(before * 2)
    with swapper.resident(writeback=True):
        written = torch.equal(opt.inner.state[view]["exp_avg"], before * 2)
        opt.inner.state[view]["exp_avg"].copy_(before)
    released = (not rt.masters and view not in opt.inner.state
                and all(v.untyped_storage().nbytes() <= 4 for *_, v in opt.runs))
    return {"discarded": discarded, "written": written, "released": released}


def _equivalence(root: str) -> dict:
    out = {}
    for variant in VARIANTS:
        ref, nvme = _engine(variant, None), _engine(variant, os.path.join(root, "equiv"))
        losses_ref, losses_nvme = _train(ref, STEPS), _train(nvme, STEPS)
        weights = [_rel(microspeed.zero.safe_get_full_fp32_param(p), microspeed.zero.safe_get_full_fp32_param(q))
                   for p, q in zip(nvme.module.parameters(), ref.module.parameters(), strict=True)]
        states_ref, states_nvme = _local_state(ref), _local_state(nvme)
        state_rel, keys = 0.0, set()
        for a, b in zip(states_nvme, states_ref, strict=True):
            keys |= set(b)
            for k in b:
                state_rel = max(state_rel, _rel(a[k], b[k]))
        swapper = nvme.plugin_state("zero").swapper
        subgroups = swapper.subgroups
        owners = [s for sg in subgroups for s in sg.segments]  # a segment listed twice is split
        out[variant] = {
            "losses_ref": losses_ref, "losses_nvme": losses_nvme, "weights_rel": max(weights),
            "state_rel": state_rel, "state_keys": sorted(keys),
            "spans": any(len(sg.segments) > 1 for sg in subgroups),
            "splits": len(owners) > len(set(owners)),
            "subgroups": len(subgroups), "masters_after": len(nvme.plugin_state("zero").masters),
            "roundtrip": _resident_roundtrip(nvme),
        }
    return out


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _memory(root: str) -> dict:
    """A 4.2M-parameter bf16 model at stage 2 whose optimizer state is >= 4x the in-memory budget."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "sub_group_size": 200_000, "reduce_bucket_size": 1_000_000,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": os.path.join(root, "memory"),
                                                       "buffer_count": 2}}}
    engine = microspeed.initialize(model=model, config=cfg)[0]
    rt = engine.plugin_state("zero")
    swapper = rt.swapper
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(torch.distributed.get_rank())).bfloat16()
    losses = []

    def step() -> None:
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    step()  # warm-up: lazy allocations of the engine, autograd and gloo
    try:  # reset VmHWM to the current RSS (Linux >= 4.0); else the growth is measured from the old peak
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status()["VmRSS"]
    except OSError:
        before = _status()["VmHWM"]
    for _ in range(3):
        step()
    peak = _status()["VmHWM"]
    folder = swapper.store.folder
    files = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    elements = sum(end - start for _s, _g, start, end, _v in rt.optimizer.runs)
    result = {
        "losses": losses, "growth": peak - before, "budget": swapper.budget_bytes(),
        "resident": swapper.resident_bytes(), "breakdown": rt.memory_breakdown(),
        "on_disk": swapper.bytes_on_disk(), "files": files, "state_bytes": 12 * elements,
        "model_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters()),
    }
    swapper.close()
    result["folder_removed"] = not os.path.exists(folder)
    return result


def _checkpoint(root: str) -> dict:
    variant, nvme = "stage2_fp32", os.path.join(root, "ckpt_nvme")
    ckpt = os.path.join(root, "ckpt")
    reference = _train(_engine(variant, None), 8)
    saving = _engine(variant, nvme)
    first = _train(saving, 4)
    saving.save_checkpoint(ckpt)
    resumed = {}
    for name, path in (("none", None), ("nvme", nvme)):
        engine = _engine(variant, path)
        engine.load_checkpoint(ckpt)
        resumed[name] = _train(engine, 4, start=4)
    return {"reference": reference, "first": first, "resumed": resumed}


def _bad_input(root: str) -> dict:
    out = {}
    cfg = _config(2, "fp32", "section", 1, None)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme"}
    with pytest.raises(ConfigError) as info:
        microspeed.initialize(model=Net(), config=cfg)
    out["no_path"] = str(info.value)
    for force in (True, False):
        cfg = _config(2, "fp32", "section", 1, os.path.join(root, "bad"))
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
        cfg["zero_force_ds_cpu_optimizer"] = force
        with pytest.raises(ConfigError) as info:
            microspeed.initialize(model=Net(), config=cfg)
        out[f"sgd_force_{force}"] = str(info.value)
    return out


def _all_checks(root: str) -> dict:
    return {"bad_input": _bad_input(root), "equivalence": _equivalence(root), "memory": _memory(root),
            "checkpoint": _checkpoint(root)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Every rank's results of :func:`_all_checks` (one spawn of 2 ranks)."""
    root = str(tmp_path_factory.mktemp("nvme_offload"))
    # a fixed mmap threshold: large tensors are returned to the OS when freed, so RSS follows live memory
    return run_distributed(_all_checks, world_size=2, args=(root,), timeout=240,
                           env={"MALLOC_MMAP_THRESHOLD_": "65536"})


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_in_memory_optimizer(results, variant):
    """Losses, weights, masters and Adam state with NVMe offload equal the in-memory run's."""
    for rank, res in enumerate(results):
        r = res["equivalence"][variant]
        assert _close(r["losses_nvme"], r["losses_ref"]), (rank, r["losses_nvme"], r["losses_ref"])
        assert r["weights_rel"] <= RTOL, (rank, r["weights_rel"])
        assert r["state_rel"] <= RTOL, (rank, r["state_rel"])
        assert {"step", "exp_avg", "exp_avg_sq"} <= set(r["state_keys"])
        assert r["spans"] and r["splits"] and r["subgroups"] > 2, r
        assert r["masters_after"] == 0  # masters are not resident between steps
        assert r["roundtrip"] == {"discarded": True, "written": True, "released": True}, r["roundtrip"]
    if variant == "stage3_fp32":
        assert any("max_exp_avg_sq" in res["equivalence"][variant]["state_keys"] for res in results)


def test_state_larger_than_memory_budget(results):
    """State >= 4x the budget trains; resident bytes <= budget; files hold the state; RSS growth is bounded."""
    for rank, r in enumerate(results):
        m = r["memory"]
        assert m["state_bytes"] >= 4 * m["budget"], m
        assert all(map(lambda v: v == v and v < 1e3, m["losses"]))  # finite
        assert m["resident"] <= m["budget"]
        assert m["breakdown"]["optimizer_states"] <= m["budget"], m["breakdown"]
        assert m["breakdown"]["optimizer_states_nvme"] == m["on_disk"] == m["state_bytes"], m
        grads = m["breakdown"]["gradients_nvme"]  # the gradient partition (bf16) lives in the same folder
        assert grads == m["state_bytes"] // 6 and m["files"] == m["state_bytes"] + grads, m
        bound = m["budget"] + m["model_bytes"] + RSS_SLACK
        assert m["growth"] <= bound, (rank, m["growth"], bound)
        assert bound < m["state_bytes"]  # the bound excludes holding the optimizer state in memory
        assert m["folder_removed"]


def test_checkpoint_from_nvme_resumes_without_offload(results):
    """Save with NVMe offload; a no-offload engine and an NVMe engine resume as the uninterrupted run."""
    for rank, r in enumerate(results):
        c = r["checkpoint"]
        assert _close(c["first"], c["reference"][:4]), (rank, c)
        for name, losses in c["resumed"].items():
            assert _close(losses, c["reference"][4:]), (rank, name, losses, c["reference"][4:])


def test_bad_input_names_the_key(results):
    """nvme without nvme_path, or an optimizer other than Adam/AdamW, is a ConfigError naming the key."""
    b = results[0]["bad_input"]
    assert "zero_optimization.offload_optimizer.nvme_path" in b["no_path"]
    assert "zero_optimization.offload_optimizer" in b["sgd_force_True"] and "SGD" in b["sgd_force_True"]
    assert "zero_optimization.offload_optimizer.device='nvme'" in b["sgd_force_False"]
    assert "SGD" in b["sgd_force_False"]
