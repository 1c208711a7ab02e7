"""Tests for microspeed.builtin.lr_schedules: formulas, state dicts, factory errors, DeepSpeed parity."""

from __future__ import annotations

import math
import os

import pytest
import torch

from microspeed.builtin.lr_schedules import (
    SCHEDULER_NAMES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)
from microspeed.errors import ConfigError


def make_opt(kind: str = "sgd", lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999))
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


def lr_at(sched, opt, t: int) -> float:
    """Step ``sched`` until last_batch_iteration == t and return group 0's lr."""
    while sched.last_batch_iteration < t:
        sched.step()
    assert sched.last_batch_iteration == t
    return opt.param_groups[0]["lr"]


# ---------------------------------------------------------------------------------- WarmupLR


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr_formula(warmup_type):
    lo, hi, w = 0.01, 0.1, 10
    opt = make_opt()
    sched = WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w, warmup_type=warmup_type)
    assert lrs(opt) == [lo]  # constructing writes the min lr
    assert sched.get_last_lr() == [lo]

    def expected(t):
        if t >= w:
            return hi
        frac = math.log(t + 1) / math.log(w) if warmup_type == "log" else t / w
        return lo + (hi - lo) * frac

    for t in (0, 1, 5, w - 1, w, w + 7):
        assert lr_at(sched, opt, t) == pytest.approx(expected(t), rel=1e-12)
    assert sched.get_last_lr() == [pytest.approx(hi)]


def test_warmup_lr_first_step_is_batch_zero_and_log_reaches_max_at_last_warmup_step():
    opt = make_opt()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4)
    sched.step()
    assert sched.last_batch_iteration == 0
    assert lrs(opt) == [0.0]  # log(0 + 1) == 0
    assert lr_at(sched, opt, 3) == pytest.approx(1.0)


def test_warmup_lr_per_group_and_min_two_warmup_steps():
    opt = make_opt(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.2], warmup_num_steps=1)
    assert lrs(opt) == [0.0, 0.01]
    sched.step(1)  # warmup_num_steps below 2 acts as 2 (linear would divide by it, log by log(1) == 0)
    assert lrs(opt) == pytest.approx([0.1 * math.log(2) / math.log(2), 0.01 + 0.19])
    sched.step(5)
    assert lrs(opt) == pytest.approx([0.1, 0.2])


def test_warmup_lr_resume_does_not_touch_optimizer():
    opt = make_opt(lr=0.5)  # WarmupLR.warmup_max_lr defaults to this lr
    sched = WarmupLR(opt, warmup_num_steps=10, last_batch_iteration=4)
    assert lrs(opt) == [0.5]
    with pytest.raises(RuntimeError, match="step"):
        sched.get_last_lr()
    sched.step()
    assert sched.last_batch_iteration == 5
    assert lrs(opt) == pytest.approx([0.5 * math.log(6) / math.log(10)])


def test_tensor_lr_is_updated_in_place_and_wrapper_is_unwrapped():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.1))
    lr_tensor = opt.param_groups[0]["lr"]

    class Wrapper:
        optimizer = opt

    sched = WarmupLR(
        Wrapper(), warmup_min_lr=0.0, warmup_max_lr=0.2, warmup_num_steps=4, warmup_type="linear"
    )
    sched.step(2)
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.1)


# ---------------------------------------------------------------------------------- WarmupDecayLR


def test_warmup_decay_lr_formula():
    lo, hi, w, total = 0.01, 0.1, 10, 30
    opt = make_opt()
    sched = WarmupDecayLR(
        opt,
        total_num_steps=total,
        warmup_min_lr=lo,
        warmup_max_lr=hi,
        warmup_num_steps=w,
        warmup_type="linear",
    )
    assert lrs(opt) == [lo]
    assert lr_at(sched, opt, 0) == pytest.approx(lo)
    assert lr_at(sched, opt, 5) == pytest.approx(lo + (hi - lo) * 5 / w)
    assert lr_at(sched, opt, w) == pytest.approx(hi)  # warmup end == decay start
    assert lr_at(sched, opt, 20) == pytest.approx(lo + (hi - lo) * (total - 20) / (total - w))
    assert lr_at(sched, opt, 29) == pytest.approx(lo + (hi - lo) * 1 / (total - w))
    assert lr_at(sched, opt, total) == pytest.approx(lo)
    assert lr_at(sched, opt, total + 10) == pytest.approx(lo)


def test_warmup_decay_lr_reaches_zero_with_default_min():
    opt = make_opt()
    sched = WarmupDecayLR(opt, total_num_steps=20, warmup_num_steps=5)
    assert lr_at(sched, opt, 4) == pytest.approx(0.001)  # log warmup ends exactly at max
    assert lr_at(sched, opt, 12) == pytest.approx(0.001 * 8 / 15)
    assert lr_at(sched, opt, 20) == 0.0


# ---------------------------------------------------------------------------------- WarmupCosineLR


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr_formula(warmup_type):
    base, r0, w, total, rmin = 0.2, 0.1, 8, 40, 0.01
    opt = make_opt(lr=base)
    sched = WarmupCosineLR(
        opt,
        total_num_steps=total,
        warmup_min_ratio=r0,
        warmup_num_steps=w,
        cos_min_ratio=rmin,
        warmup_type=warmup_type,
    )
    assert lrs(opt) == [0.0]  # DeepSpeed starts WarmupCosineLR at lr 0 before the first step()

    def expected(t):
        if t < w:
            frac = math.log(t + 1) / math.log(w) if warmup_type == "log" else t / w
            return base * (r0 + (1 - r0) * frac)
        p = min(1.0, (t - w + 1) / (total - w))
        return base * (rmin + (1 - rmin) * 0.5 * (1 + math.cos(math.pi * p)))

    assert lr_at(sched, opt, 0) == pytest.approx(base * r0)
    for t in (3, w - 1, w, 20, total - 1, total, total + 25):
        assert lr_at(sched, opt, t) == pytest.approx(expected(t), rel=1e-12), t
    assert lrs(opt) == pytest.approx([base * rmin])  # stays at the floor after the end
    assert sched.get_lr_ratio() == pytest.approx(rmin)


# ---------------------------------------------------------------------------------- OneCycle


def test_one_cycle_lr_and_adam_momentum():
    lo, hi, s1, s2 = 0.01, 0.1, 4, 6
    mlo, mhi, dss, dlr, dmom = 0.8, 0.9, 2, 0.5, 0.1
    opt = make_opt("adam")
    sched = OneCycle(
        opt,
        cycle_min_lr=lo,
        cycle_max_lr=hi,
        decay_lr_rate=dlr,
        cycle_first_step_size=s1,
        cycle_second_step_size=s2,
        decay_step_size=dss,
        cycle_min_mom=mlo,
        cycle_max_mom=mhi,
        decay_mom_rate=dmom,
    )
    # Construction: lr = cycle_min_lr and momentum = cycle_min_mom (DeepSpeed's choice); beta2 is kept.
    assert lrs(opt) == [lo]
    assert opt.param_groups[0]["betas"] == (mlo, 0.999)
    with pytest.raises(RuntimeError):
        sched.get_last_lr()

    def expected(t):
        b = t + 1
        if t < s1 + s2:
            scale = b / s1 if b <= s1 else (s1 + s2 - b) / s2
            return lo + (hi - lo) * scale, mhi - (mhi - mlo) * scale
        d = (t - (s1 + s2) + 1) / dss
        return lo / (1 + dlr * d), mhi * (1 + dmom * d)

    for t in (0, 2, s1 - 1, s1 + 2, s1 + s2 - 1, s1 + s2, s1 + s2 + 3):
        exp_lr, exp_mom = expected(t)
        assert lr_at(sched, opt, t) == pytest.approx(exp_lr, rel=1e-12), t
        assert opt.param_groups[0]["betas"][0] == pytest.approx(exp_mom, rel=1e-12), t
        assert opt.param_groups[0]["betas"][1] == 0.999
    # Spot checks of the shape: the peak and the end of the cycle.
    sched.step(s1 - 1)
    assert lrs(opt) == pytest.approx([hi]) and opt.param_groups[0]["betas"][0] == pytest.approx(mlo)
    sched.step(s1 + s2 - 1)
    assert lrs(opt) == pytest.approx([lo]) and opt.param_groups[0]["betas"][0] == pytest.approx(mhi)
    assert sched.get_last_lr() == pytest.approx([lo])


def test_one_cycle_get_mom_is_beta_pairs_per_group():
    """As DeepSpeed's: get_mom() gives (beta1, beta2) per group for Adam-style optimizers; beta2 is the group's."""
    param = torch.nn.Parameter(torch.zeros(2))
    other = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([{"params": [param]}, {"params": [other], "betas": (0.5, 0.95)}], lr=0.1)
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4, cycle_min_mom=[0.8, 0.85],
                     cycle_max_mom=[0.9, 0.95])
    assert sched.get_mom() == [(0.9, 0.999), (0.95, 0.95)]  # batch -1: the top of the momentum cycle
    sched.step(3)  # the peak of the lr, the bottom of momentum
    assert sched.get_mom() == [pytest.approx((0.8, 0.999)), pytest.approx((0.85, 0.95))]
    assert [g["betas"] for g in opt.param_groups] == sched.get_mom()
    assert all(isinstance(m, tuple) for m in sched.get_mom())


@pytest.mark.parametrize("cls", ["WarmupLR", "WarmupCosineLR"])
def test_unknown_warmup_type_falls_back_to_log_with_a_warning(cls, caplog, ds):
    """DeepSpeed warns and uses 'log' for an unknown warmup_type; so do we (the same lrs step by step)."""
    params = {"warmup_num_steps": 10} | ({"total_num_steps": 30} if cls == "WarmupCosineLR" else {})
    ours_opt, ref_opt, log_opt = make_opt(), make_opt(), make_opt()
    with caplog.at_level("WARNING", logger="microspeed.builtin.lr_schedules"):
        ours = build_scheduler(ours_opt, {"type": cls, "params": {**params, "warmup_type": "cosine"}})
    assert ours.warmup_type == "log"
    assert "unknown warmup_type 'cosine'" in caplog.text and "'log'" in caplog.text
    ref = getattr(ds, cls)(ref_opt, **params, warmup_type="cosine")
    log = getattr(ds, cls)(log_opt, **params, warmup_type="log")
    for t in range(15):
        for s in (ours, ref, log):
            s.step()
        assert lrs(ours_opt) == pytest.approx(lrs(ref_opt), rel=1e-12) == lrs(log_opt), t


def test_deepspeed_module_names(ds):
    """The public constants DeepSpeed's lr_schedules module has (clients test configs against them)."""
    import microspeed.builtin.lr_schedules as ours

    assert ours.VALID_LR_SCHEDULES == ds.VALID_LR_SCHEDULES
    for name in [n for n in dir(ds) if n.isupper() and isinstance(getattr(ds, n), str)]:
        assert getattr(ours, name) == getattr(ds, name), name


def test_one_cycle_sgd_momentum_no_decay_and_defaults():
    opt = make_opt("sgd")
    sched = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=10)
    assert opt.param_groups[0]["momentum"] == 0.8
    sched.step(9)  # batch 10 of a symmetric 20-batch cycle: the peak
    assert lrs(opt) == pytest.approx([1.0]) and opt.param_groups[0]["momentum"] == pytest.approx(0.8)
    sched.step(14)
    assert lrs(opt) == pytest.approx([0.5]) and opt.param_groups[0]["momentum"] == pytest.approx(0.85)
    sched.step(100)  # decay_step_size 0: no decay, stays at cycle_min_lr / cycle_max_mom
    assert lrs(opt) == [0.0] and opt.param_groups[0]["momentum"] == 0.9


def test_one_cycle_stairs_and_no_momentum_optimizer():
    opt = make_opt("adagrad")
    sched = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2)
    assert sched.cycle_momentum is False and sched.get_mom() is None
    # Rising half in 2 stairs: floor(b * 2 / 4) / 2 for b = t + 1; falling half mirrors it.
    got = []
    for _ in range(8):
        sched.step()
        got.append(lrs(opt)[0])
    assert got == pytest.approx([0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0])


# ---------------------------------------------------------------------------------- LRRangeTest


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_formula(staircase):
    lo, size, rate = 0.01, 4, 2.0
    opt = make_opt()
    sched = LRRangeTest(
        opt,
        lr_range_test_min_lr=lo,
        lr_range_test_step_size=size,
        lr_range_test_step_rate=rate,
        lr_range_test_staircase=staircase,
    )
    assert lrs(opt) == [lo] and sched.get_last_lr() == [lo]
    for t in (0, 2, 3, 6, 10):
        units = (t + 1) / size
        if staircase:
            units = math.floor(units)
        assert lr_at(sched, opt, t) == pytest.approx(lo * (1 + rate * units), rel=1e-12), t
    sched.step(batch_iteration=2)  # DeepSpeed's keyword for this class
    assert sched.last_batch_iteration == 2


# ---------------------------------------------------------------------------------- state dicts

SCHEDULES = {
    "WarmupLR": lambda o: WarmupLR(o, 0.01, 0.1, 8, "linear"),
    "WarmupDecayLR": lambda o: WarmupDecayLR(o, 30, 0.0, 0.1, 8),
    "WarmupCosineLR": lambda o: WarmupCosineLR(o, 30, 0.1, 8),
    "OneCycle": lambda o: OneCycle(o, 0.01, 0.1, 0.5, 5, 7, decay_step_size=3, decay_mom_rate=0.1),
    "LRRangeTest": lambda o: LRRangeTest(o, 0.01, 3, 0.5, True),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_state_dict_round_trip(name):
    build = SCHEDULES[name]
    opt_a = make_opt("adam")
    a = build(opt_a)
    for _ in range(6):
        a.step()
    sd = a.state_dict()
    assert sd == {"last_batch_iteration": 5}

    opt_b = make_opt("adam")
    b = build(opt_b)
    b.load_state_dict(sd)
    assert b.last_batch_iteration == 5
    for _ in range(30):
        a.step()
        b.step()
        assert lrs(opt_b) == lrs(opt_a)
        assert opt_b.param_groups[0]["betas"] == opt_a.param_groups[0]["betas"]


# ---------------------------------------------------------------------------------- factory


def test_factory_builds_deepspeed_and_torch_schedulers():
    opt = make_opt()
    sched = build_scheduler(
        opt, {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.2}}
    )
    assert isinstance(sched, WarmupLR) and sched.warmup_num_steps == 5
    assert isinstance(
        build_scheduler(opt, {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1}}), OneCycle
    )
    assert isinstance(build_scheduler(make_opt(), {"type": "LRRangeTest"}), LRRangeTest)  # params optional

    opt = make_opt(lr=1.0)
    step_lr = build_scheduler(opt, {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}})
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR)
    for _ in range(4):
        opt.step()
        step_lr.step()
    assert lrs(opt) == [0.25]
    cos = build_scheduler(make_opt(), {"type": "CosineAnnealingLR", "params": {"T_max": 10}})
    assert isinstance(cos, torch.optim.lr_scheduler.CosineAnnealingLR)
    assert SCHEDULER_NAMES == ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _error(section) -> str:
    with pytest.raises(ConfigError) as info:
        build_scheduler(make_opt(groups=2), section)
    return str(info.value)


def test_factory_unknown_type_suggests_and_lists_names():
    msg = _error({"type": "WarmupLr", "params": {}})
    assert "scheduler.type" in msg and "'WarmupLr'" in msg
    assert "did you mean 'WarmupLR'?" in msg
    assert all(name in msg for name in SCHEDULER_NAMES)
    assert "did you mean 'StepLR'?" in _error({"type": "SteppLR"})
    assert "scheduler.type" in _error({"params": {}})


def test_factory_unknown_parameter_suggests_closest():
    msg = _error({"type": "WarmupLR", "params": {"warmup_max": 0.1}})
    assert "scheduler.params.warmup_max" in msg and "did you mean 'warmup_max_lr'?" in msg
    msg = _error({"type": "StepLR", "params": {"step_sise": 3}})
    assert "scheduler.params.step_sise" in msg and "did you mean 'step_size'?" in msg
    assert "scheduler.param" in _error({"type": "StepLR", "param": {}})
    assert "did you mean 'params'?" in _error({"type": "StepLR", "param": {}})


def test_factory_missing_required_parameter():
    msg = _error({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}})
    assert "scheduler.params.total_num_steps" in msg and "missing" in msg
    assert "scheduler.params.cycle_max_lr" in _error({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}})
    assert "scheduler.params.step_size" in _error({"type": "StepLR", "params": {}})


@pytest.mark.parametrize(
    ("params", "key", "value", "accepted"),
    [
        ({"warmup_num_steps": -5}, "warmup_num_steps", "-5", "integer >= 1"),
        ({"warmup_max_lr": "0.1"}, "warmup_max_lr", "'0.1'", "number >= 0"),
        ({"warmup_max_lr": [0.1, 0.2, 0.3]}, "warmup_max_lr", "3 values", "one value per param group"),
        ({"last_batch_iteration": -3}, "last_batch_iteration", "-3", "integer >= -1"),
    ],
)
def test_factory_bad_values(params, key, value, accepted):
    msg = _error({"type": "WarmupLR", "params": params})
    assert f"scheduler.params.{key}" in msg and value in msg and accepted in msg


def test_factory_bad_values_other_schedules_and_constructors():
    msg = _error({"type": "WarmupDecayLR", "params": {"total_num_steps": 0}})
    assert "scheduler.params.total_num_steps" in msg and "integer >= 1" in msg
    msg = _error({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}})
    assert "scheduler.params.lr_range_test_step_size" in msg
    msg = _error(
        {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_first_step_size": 0}}
    )
    assert "scheduler.params.cycle_first_step_size" in msg and "> 0" in msg
    msg = _error({"type": "StepLR", "params": {"step_size": 2, "last_epoch": 3}})
    assert "scheduler.params" in msg and "StepLR" in msg  # torch's own error, wrapped
    with pytest.raises(ConfigError, match="warmup_num_steps"):
        WarmupCosineLR(make_opt(), total_num_steps=10, warmup_num_steps=0)
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------------------------- parity


@pytest.fixture(scope="module")
def ds():
    """DeepSpeed's lr_schedules module, or skip when DeepSpeed is not (fully) installed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        return pytest.importorskip("deepspeed.runtime.lr_schedules")
    except pytest.skip.Exception:
        raise
    except Exception as exc:  # a half-installed deepspeed can fail with anything
        pytest.skip(f"deepspeed not importable: {exc!r}")


PARITY = [
    ("WarmupLR", "sgd", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 20}),
    (
        "WarmupLR",
        "sgd",
        {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 20, "warmup_type": "linear"},
    ),
    ("WarmupDecayLR", "sgd", {"total_num_steps": 40, "warmup_max_lr": 0.1, "warmup_num_steps": 10}),
    (
        "WarmupDecayLR",
        "sgd",
        {
            "total_num_steps": 40,
            "warmup_min_lr": 0.02,
            "warmup_max_lr": 0.1,
            "warmup_num_steps": 10,
            "warmup_type": "linear",
        },
    ),
    ("WarmupCosineLR", "sgd", {"total_num_steps": 40, "warmup_num_steps": 10}),
    (
        "WarmupCosineLR",
        "sgd",
        {
            "total_num_steps": 40,
            "warmup_min_ratio": 0.1,
            "warmup_num_steps": 10,
            "cos_min_ratio": 0.05,
            "warmup_type": "linear",
        },
    ),
    (
        "OneCycle",
        "adam",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 10,
            "cycle_second_step_size": 15,
            "decay_step_size": 4,
            "decay_lr_rate": 0.3,
            "decay_mom_rate": 0.05,
        },
    ),
    (
        "OneCycle",
        "adam",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 9,
            "cycle_second_step_size": 12,
            "cycle_first_stair_count": 3,
            "cycle_second_stair_count": 4,
        },
    ),
    ("OneCycle", "sgd", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10}),
    (
        "LRRangeTest",
        "sgd",
        {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 7, "lr_range_test_step_rate": 0.5},
    ),
    (
        "LRRangeTest",
        "sgd",
        {
            "lr_range_test_min_lr": 0.01,
            "lr_range_test_step_size": 7,
            "lr_range_test_step_rate": 0.5,
            "lr_range_test_staircase": True,
        },
    ),
]


@pytest.mark.parametrize(("name", "kind", "params"), PARITY)
def test_parity_with_deepspeed(ds, name, kind, params):
    ours_opt, ref_opt = make_opt(kind), make_opt(kind)
    ours = build_scheduler(ours_opt, {"type": name, "params": params})
    ref = getattr(ds, name)(ref_opt, **params)
    assert lrs(ours_opt) == pytest.approx(lrs(ref_opt), rel=1e-12, abs=1e-15)
    # DeepSpeed cycles momentum only for optimizers with betas (and then forces beta2 to 0.99);
    # we also cycle SGD's momentum and keep beta2, so compare beta1 for Adam only.
    compare_mom = name == "OneCycle" and kind == "adam"
    if compare_mom:  # construction sets beta1 to cycle_min_mom in both
        assert ours_opt.param_groups[0]["betas"][0] == ref_opt.param_groups[0]["betas"][0]
    for t in range(50):
        ours.step()
        ref.step()
        assert ours.last_batch_iteration == ref.last_batch_iteration == t
        assert lrs(ours_opt) == pytest.approx(lrs(ref_opt), rel=1e-12, abs=1e-15), t
        assert ours.get_last_lr() == pytest.approx(ref.get_last_lr(), rel=1e-12, abs=1e-15), t
        if compare_mom:
            ours_b1 = ours_opt.param_groups[0]["betas"][0]
            assert ours_b1 == pytest.approx(ref_opt.param_groups[0]["betas"][0], rel=1e-12), t
            (b1, b2), (ref_b1, ref_b2) = ours.get_mom()[0], ref.get_mom()[0]  # (beta1, beta2) tuples, both
            assert b1 == pytest.approx(ref_b1, rel=1e-12) and b2 == 0.999 and ref_b2 == 0.99, t
    assert ours.state_dict() == ref.state_dict()
