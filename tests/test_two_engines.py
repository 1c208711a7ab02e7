"""Two engines with different configs in one process keep their own counts, observers, loggers and losses.

Each engine is also trained alone (the reference, in the same process before): trained side by side,
step for step interleaved, each must reproduce its reference exactly: its losses, its communication
counts, its comms logger's records, its trace's steps, and nothing of the other's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import microspeed
from microspeed import comm
from microspeed.observe import trace, watchdog
from microspeed.testing import run_distributed

STEPS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _config_a(trace_dir):
    """comms logger and tracing on, two micro-steps per step, SGD."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "data_parallel": {"reduce_bucket_size": 100},
            "comms_logger": {"enabled": True}, "trace": {"enabled": True, "output_path": trace_dir}}


def _config_b():
    """Nothing observed, one micro-step per step, Adam."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}


class _Run:
    """One engine and its data stream; ``micro()`` runs one micro-step and records the loss."""

    def __init__(self, config, seed):
        self.engine, *_ = microspeed.initialize(model=_model(), config=config)
        self.gen = torch.Generator().manual_seed(seed + 100 * comm.get_rank())
        self.losses = []

    def micro(self):
        x, y = torch.randn(2, 6, generator=self.gen), torch.randn(2, 1, generator=self.gen)
        loss = torch.nn.functional.mse_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        self.losses.append(loss.item())

    def train(self):
        for _ in range(STEPS * self.engine.gradient_accumulation_steps()):
            self.micro()

    def summary(self):
        ctx = self.engine.plugin_state("comms_logger")
        logger = ctx.comms_logger
        weights = [p.detach().clone() for p in self.engine.module.parameters()]
        return {"losses": list(self.losses), "calls": dict(ctx.stats.calls), "bytes": dict(ctx.stats.bytes),
                "wire": dict(ctx.stats.wire), "logger_on": logger.enabled,
                "logged": {name: {size: e[0] for size, e in by_size.items()}
                           for name, by_size in logger.comms_dict.items()},
                "observers": sorted(type(o).__name__ for o in ctx.observers), "seq": dict(ctx.seq),
                "weights": [w.tolist() for w in weights], "steps": self.engine.global_steps}


def _steps_traced(directory):
    path = os.path.join(directory, f"rank{comm.get_rank()}.jsonl")
    with open(path) as f:
        events = [json.loads(line) for line in f]
    return [e["step"] for e in events if e["event"] == "step"]


def _two_engines_body(root):
    """References (each engine alone), then both engines side by side, interleaved micro-step by micro-step."""
    out = {}
    a = _Run(_config_a(os.path.join(root, "ref_a")), seed=1)
    a.train()
    trace.stop(a.engine.plugin_state("comms_logger"))
    b = _Run(_config_b(), seed=2)
    b.train()
    out["ref_a"], out["ref_b"] = a.summary(), b.summary()
    del a, b

    a = _Run(_config_a(os.path.join(root, "a")), seed=1)
    b = _Run(_config_b(), seed=2)
    ctx_a, ctx_b = a.engine.plugin_state("comms_logger"), b.engine.plugin_state("comms_logger")
    switches = []
    for i in range(STEPS * 2):
        a.micro()
        switches.append(comm.current() is ctx_a and comm.stats is ctx_a.stats
                        and comm.comms_logger is ctx_a.comms_logger)
        if i % 2 == 0:  # B has one micro-step per step: it trains STEPS steps over the same span
            b.micro()
            switches.append(comm.current() is ctx_b and comm.stats is ctx_b.stats)
    trace.stop(ctx_a)
    out["a"], out["b"] = a.summary(), b.summary()
    out["switches"] = switches
    out["distinct"] = ctx_a is not ctx_b and ctx_a.stats is not ctx_b.stats and ctx_a.probe is not ctx_b.probe
    out["default_untouched"] = (comm.default_context().stats.total_bytes(), comm.default_context().observers)
    out["traced_steps"] = {"ref_a": _steps_traced(os.path.join(root, "ref_a")),
                           "a": _steps_traced(os.path.join(root, "a"))}
    out["watchdogs"] = [watchdog.current(ctx_a) is not None, watchdog.current(ctx_b) is not None,
                        watchdog.current(ctx_a) is not watchdog.current(ctx_b)]
    # DeepSpeed's module-level calls act on the current (last active) engine
    b.micro()
    out["log_summary_b"] = comm.log_summary(return_dict=True)
    a.micro()
    out["log_summary_a_ops"] = sorted(comm.log_summary(return_dict=True)["summary"])
    return out


def _check(out, world_size):
    for name in ("a", "b"):
        ref, got = out[f"ref_{name}"], out[name]
        assert got["losses"] == ref["losses"], name  # the same loss curve as trained alone
        assert got["weights"] == ref["weights"] and got["steps"] == ref["steps"] == STEPS
        for key in ("calls", "bytes", "wire", "logged", "seq", "observers", "logger_on"):
            assert got[key] == ref[key], (name, key, got[key], ref[key])
    assert out["a"]["losses"] != out["b"]["losses"]
    assert all(out["switches"]) and out["distinct"]
    assert out["a"]["logger_on"] and not out["b"]["logger_on"] and out["b"]["logged"] == {}
    assert out["traced_steps"]["a"] == out["traced_steps"]["ref_a"] == list(range(1, STEPS + 1))
    assert out["default_untouched"] == (0, ())
    if world_size > 1:
        # A's reductions were counted in A (with its comms logger), B's in B; and nothing of B's in A
        assert out["a"]["calls"].get("all_reduce", 0) > 0 and out["b"]["calls"].get("all_reduce", 0) > 0
        assert sum(v[s] for v in out["a"]["logged"].values() for s in v) > 0
        assert out["watchdogs"] == [True, True, True]  # each engine has its own (on by default, 2 ranks)
        assert out["a"]["observers"] == ["CommsLogger", "Probe"] and out["b"]["observers"] == ["Probe"]
        assert out["log_summary_b"]["summary"] == {}  # B's logger is off: nothing recorded
        assert "all_reduce" in out["log_summary_a_ops"]
    else:
        assert out["a"]["calls"] == {} and out["watchdogs"][:2] == [False, False]  # one rank: no default watchdog
        assert out["a"]["observers"] == ["CommsLogger"] and out["b"]["observers"] == []


def test_two_engines_one_process(tmp_path, monkeypatch):
    monkeypatch.delenv(trace.ENV_VAR, raising=False)
    monkeypatch.delenv(watchdog.ENV_VAR, raising=False)
    _check(_two_engines_body(str(tmp_path)), world_size=1)
    assert comm.current() is not comm.default_context()  # the last engine's, until another runs


@pytest.mark.slow
def test_two_engines_one_process_two_ranks(tmp_path):
    results = run_distributed(_two_engines_body, world_size=2, args=(str(tmp_path),), timeout=120,
                              env={trace.ENV_VAR: "", watchdog.ENV_VAR: ""})
    for out in results:
        _check(out, world_size=2)
