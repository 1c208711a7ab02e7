"""1-bit Adam, 0/1 Adam and 1-bit LAMB with ZeRO's NVMe optimizer offload: the same losses as CPU offload.

ZeRO's NVMe swapper streams the partition's masters and the optimizer's declared element-wise state
(``microspeed.plugin_api.ElementwiseState``) through two slots, in sub-groups of 200 elements that cut runs
(and parameters) apart, and steps each sub-group's pieces with the optimizer's own ``step()``; 1-bit LAMB
(``ParameterSums``) first streams every sub-group once for its whole-parameter sums. The same math as the
optimizer stepping the CPU partition ("zero_force_ds_cpu_optimizer": false), so each step's loss equals that
run's at rel 1e-5, through the warm-up and the compressed steps after ``freeze_step`` 2 (measured: equal to the
last bit). A checkpoint saved after the third step (a compressed one) resumes to the same losses, from the NVMe
run's checkpoint and from the CPU run's.
"""

from __future__ import annotations

import microspeed_comm
import pytest
import torch
from test_onebit_zero import MICRO, _data, _mlp  # the same MLP and data as 1-bit x ZeRO in memory

import microspeed
from microspeed.testing import run_distributed

pytest.importorskip("microspeed_zero")

STEPS, SAVE_AT = 5, 3
SUB_GROUP = 200
"""Elements per NVMe sub-group: each rank's ~820-element partition streams in five, cutting parameters apart."""

OPTIMIZERS = {
    "OneBitAdam": {"lr": 1e-3, "freeze_step": 2},
    "ZeroOneAdam": {"lr": 1e-3, "var_freeze_step": 2, "var_update_scaler": 1, "local_step_clipper": 1},
    "OneBitLamb": {"lr": 1e-2, "freeze_step": 2, "weight_decay": 0.01},
}


def _config(opt, stage, device, path):
    offload = {"device": device}
    if device == "nvme":
        offload.update(nvme_path=path, buffer_count=2)
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "gradient_clipping": 1.0,
            "zero_force_ds_cpu_optimizer": False, "optimizer": {"type": opt, "params": OPTIMIZERS[opt]},
            "zero_optimization": {"stage": stage, "offload_optimizer": offload, "sub_group_size": SUB_GROUP}}


def _train(engine, steps, x, y):
    """``steps`` steps: (losses averaged over ranks, whether each step's gradients were exchanged exactly)."""
    import torch.distributed as dist

    stepper = engine.plugin_state("comm").optimizer
    losses, exact = [], []
    for _ in range(steps):
        exact.append(stepper.full_precision_gradients_next())
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses, exact


def _streamed(engine):
    """What the NVMe swapper holds: (sub-groups, whether one cuts a run, its file tensors, in-memory state tensors)."""
    rt = engine.plugin_state("zero")
    sw = rt.swapper
    runs = {p.run for sg in sw.subgroups for p in sg.pieces}
    cut = len(runs) < sum(len(sg.pieces) for sg in sw.subgroups)
    in_memory = [k for st in rt.optimizer.inner.state.values() for k, v in st.items()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
    return len(sw.subgroups), cut, sw.tensor_names, in_memory


def _job(path, cases):
    """Per (optimizer, stage): CPU-offload and NVMe-offload losses; with ``resume``, save at SAVE_AT and resume."""
    import torch.distributed as dist

    rank = dist.get_rank()
    x, y = (t[rank * MICRO:(rank + 1) * MICRO] for t in _data(dist.get_world_size()))
    out = {}
    for opt, stage, resume in cases:
        runs = {}
        for device in ("cpu", "nvme"):
            tag = f"{opt}-{stage}-{device}"
            engine, *_ = microspeed.initialize(model=_mlp(), config=_config(opt, stage, device, f"{path}/swap-{tag}"))
            first, exact = _train(engine, SAVE_AT if resume else STEPS, x, y)
            if resume:
                engine.save_checkpoint(f"{path}/ckpt", tag=tag)
            rest, more = _train(engine, STEPS - len(first), x, y)
            runs[device] = {"losses": first + rest, "exact": exact + more}
            if device == "nvme":
                runs[device]["streamed"] = _streamed(engine)
        if resume:  # a fresh NVMe engine from each checkpoint: the same losses after the save
            for device in ("cpu", "nvme"):
                engine, *_ = microspeed.initialize(model=_mlp(),
                                                   config=_config(opt, stage, "nvme", f"{path}/resume-{device}"))
                engine.load_checkpoint(f"{path}/ckpt", tag=f"{opt}-{stage}-{device}")
                runs[f"resumed from {device}"] = _train(engine, STEPS - SAVE_AT, x, y)[0]
        out[(opt, stage)] = runs
    return out


def _check(results):
    for (opt, stage), runs in results.items():
        cpu, nvme = runs["cpu"], runs["nvme"]
        assert nvme["exact"] == cpu["exact"] and nvme["exact"][:2] == [True, True] and not any(nvme["exact"][2:]), \
            (opt, stage, nvme["exact"])  # two warm-up steps, then compressed ones
        assert nvme["losses"] == pytest.approx(cpu["losses"], rel=1e-5), (opt, stage, nvme["losses"], cpu["losses"])
        assert nvme["losses"][-1] != cpu["losses"][0]  # it trains
        subgroups, cut, names, in_memory = nvme["streamed"]
        declared = tuple(getattr(microspeed_comm, opt)([torch.zeros(1)]).elementwise_state())
        assert subgroups >= 4 and cut and names == ("master", *declared), (opt, stage, nvme["streamed"])
        assert in_memory == [], (opt, stage, in_memory)  # between steps only scalars stay in memory
        for source in ("cpu", "nvme"):
            resumed = runs.get(f"resumed from {source}")
            if resumed is not None:
                assert resumed == pytest.approx(nvme["losses"][SAVE_AT:], rel=1e-5), (opt, stage, source, resumed)


@pytest.mark.slow
def test_onebit_optimizers_on_nvme_equal_cpu_offload_and_resume(tmp_path):
    """ZeRO-2, each optimizer: NVMe equals CPU offload per step; checkpoints saved at step 3 resume exactly."""
    cases = [(opt, 2, True) for opt in OPTIMIZERS]
    _check(run_distributed(_job, world_size=2, args=(str(tmp_path), cases), timeout=300)[0])


@pytest.mark.slow
def test_onebit_optimizers_on_nvme_equal_cpu_offload_at_stages_1_and_3(tmp_path):
    """ZeRO-1 and ZeRO-3, each optimizer: NVMe equals CPU offload per step (warm-up and compressed steps)."""
    cases = [(opt, stage, False) for stage in (1, 3) for opt in OPTIMIZERS]
    _check(run_distributed(_job, world_size=2, args=(str(tmp_path), cases), timeout=300)[0])
