"""Tracing: per-rank JSON-lines events (hooks, plugins, collectives, steps), the summary and Perfetto export."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch

import microspeed
from microspeed import cli, comm
from microspeed.cli import trace as trace_cli
from microspeed.observe import trace
from microspeed.plugins import PluginManager
from microspeed.testing import run_distributed

STEPS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _config(**extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000,
           "data_parallel": {"reduce_bucket_size": 100}}  # several buckets, launched during backward
    cfg.update(extra)
    return cfg


def _traced_rank_body():
    """Train STEPS steps with MICROSPEED_TRACE set (by the test) and the comms logger on, plus a few collectives."""
    import torch.distributed as dist

    engine, *_ = microspeed.initialize(model=_model(), config=_config(comms_logger={"enabled": True}))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS * 2):
        loss = torch.nn.functional.mse_loss(engine(torch.randn(2, 6, generator=g)), torch.randn(2, 1, generator=g))
        engine.backward(loss)
        engine.step()
    raw = comm.comms_logger.get_raw_data()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        comms_summary = comm.log_summary(show_straggler=True, return_dict=True)
    comm.configure(enabled=False)
    comm.reset_log()

    out = [torch.zeros(3) for _ in range(2)]
    comm.all_gather(out, torch.full((3,), float(dist.get_rank())))
    flat = torch.zeros(6)
    comm.all_gather_into_tensor(flat, torch.full((3,), float(dist.get_rank())))
    comm.barrier()
    trace.stop()
    reducer = engine.plugins.get_plugin("data_parallel").reducer
    return {"gathered": [t.tolist() for t in out], "flat": flat.tolist(), "buckets": len(reducer.buckets),
            "bucket_bytes": sorted(sum(t.numel() * 4 for t in b.tensors) for b in reducer.buckets),
            "rank": dist.get_rank(), "raw": raw, "comms_summary": comms_summary, "printed": printed.getvalue(),
            "observers": [type(o).__name__ for o in comm.observers()]}


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """One 2-rank traced run shared by the tests below (starting ranks is the slow part)."""
    directory = str(tmp_path_factory.mktemp("trace"))
    results = run_distributed(_traced_rank_body, world_size=2, timeout=90, env={trace.ENV_VAR: directory})
    return directory, results


def _events(directory, rank, kind=None):
    with open(os.path.join(directory, f"rank{rank}.jsonl")) as f:
        events = [json.loads(line) for line in f]
    return [e for e in events if kind is None or e["event"] == kind]


@pytest.mark.slow
def test_two_rank_trace_files_hold_hooks_collectives_and_steps(traced_run):
    directory, results = traced_run
    assert sorted(os.listdir(directory)) == ["rank0.jsonl", "rank1.jsonl"]
    assert results[0]["gathered"] == [[0.0] * 3, [1.0] * 3] and results[0]["flat"] == [0.0] * 3 + [1.0] * 3
    seqs = {}
    for rank in (0, 1):
        events = _events(directory, rank)
        assert events[0]["event"] == "trace_start" and events[0]["world_size"] == 2
        assert events[-1]["event"] == "trace_end"
        assert all(e["rank"] == rank and isinstance(e["t_ns"], int) and isinstance(e["wall"], float) for e in events)

        hooks = [e for e in events if e["event"] == "hook"]
        names = {e["hook"] for e in hooks}
        assert {"config_sections", "make_topology", "configure", "setup", "after_model_ready", "before_forward",
                "backward", "scale_loss", "reduce_gradients", "before_step", "optimizer_step", "clip_gradients",
                "after_global_step"} <= names
        for e in hooks:
            assert e["dur_ns"] > 0 and len(e["plugins"]) == len(e["plugin_ns"]) == len(e["plugin_off_ns"])
            assert e["exc"] is None
            assert sum(e["plugin_ns"]) <= e["dur_ns"]
        reduce = [e for e in hooks if e["hook"] == "reduce_gradients"]
        # the zero plugin (installed, inactive at stage 0) is asked first and passes
        assert len(reduce) == STEPS and all(e["plugins"][-1] == "data_parallel" for e in reduce)
        assert all(e["plugins"] == ["gradient_accumulation"] for e in hooks if e["hook"] == "backward")
        assert [e["micro_step"] for e in hooks if e["hook"] == "before_forward"] == list(range(STEPS * 2))
        clip = [e for e in hooks if e["hook"] == "clip_gradients"]
        assert all(e["depth"] == 1 for e in clip)  # called from inside optimizer_step
        chains = [e for e in hooks if e.get("chain")]
        # a chain is one pluggy call: one event listing every plugin that passed the value on
        assert {e["hook"] for e in chains} >= {"scale_loss", "transform_model", "wrap_optimizer"}
        assert all("gradient_accumulation" in e["plugins"] for e in chains if e["hook"] == "scale_loss")

        colls = _events(directory, rank, "collective")
        by_op = {}
        for e in colls:
            by_op.setdefault(e["op"], []).append(e)
        # initialize(): the rank agreement, then one after each of its 5 phases (an error on one rank reaches all)
        assert len(by_op["all_gather_object"]) == 6
        n_params = len(list(_model().parameters()))
        assert [e["bytes"] for e in by_op["broadcast"]] == [p.numel() * 4 for p in _model().parameters()]
        assert len(by_op["broadcast"]) == n_params
        reduces = by_op["all_reduce"]
        assert all(e["async"] and e["group"] == "world" and e["group_size"] == 2 for e in reduces)
        assert len(reduces) == STEPS * results[rank]["buckets"]
        assert sorted(e["bytes"] for e in reduces[:results[rank]["buckets"]]) == results[rank]["bucket_bytes"]
        assert all(e["hook"] == "backward" and e["plugin"] == "gradient_accumulation" for e in reduces)
        for e in reduces:  # completion (from the work's future) comes before wait() returns
            assert 0 < e["launch_ns"] and 0 < e["dur_ns"] <= e["wait_off_ns"] + e["wait_ns"] and e["wait_ns"] >= 0
        launches = _events(directory, rank, "collective_launch")
        assert [e["seq"] for e in launches] == [e["seq"] for e in reduces]
        begins = _events(directory, rank, "collective_begin")  # every blocking op announces itself
        assert [e["seq"] for e in begins] == [e["seq"] for e in colls if not e["async"]]
        assert by_op["all_gather"][0]["bytes"] == 12 and by_op["all_gather_into_tensor"][0]["bytes"] == 12
        assert by_op["barrier"][0]["bytes"] == 0
        seqs[rank] = [(e["op"], e["seq"], e["bytes"]) for e in colls]

        steps = _events(directory, rank, "step")
        assert [e["step"] for e in steps] == [1, 2, 3] and all(e["dur_ns"] > 0 for e in steps)
        assert [e["samples"] for e in steps] == [8, 16, 24]
        step_bytes = sum(e["bytes"] for e in reduces[:results[rank]["buckets"]])  # one step's gradient all-reduces
        assert [e["comm_bytes"] for e in steps[1:]] == [step_bytes] * 2  # step 1 also counts set-up collectives
        assert [e["wire_bytes"] for e in steps[1:]] == [step_bytes] * 2  # 2 ranks: 2 (n-1)/n S = S
    assert seqs[0] == seqs[1]  # both ranks saw the same collectives in the same order


@pytest.mark.slow
def test_summary_cli(traced_run, capsys):
    directory, _ = traced_run
    assert cli.main(["trace", "summary", directory]) == 0
    out = capsys.readouterr().out
    assert "rank 0: 3 steps" in out and "rank 1: 3 steps" in out
    assert "last completed: barrier #" in out and "UNFINISHED" not in out
    for text in ("reduce_gradients", "data_parallel", "optimizer_step", "optimizers", "all_reduce", "broadcast",
                 "all_gather_object", "calls", "total ms", "mean us"):
        assert text in out
    summary = trace_cli.summarize(trace_cli.load(directory))
    assert summary[0]["hooks"]["reduce_gradients"]["plugins"]["data_parallel"]["calls"] == STEPS
    n_bytes = sum(p.numel() * 4 for p in _model().parameters())
    assert summary[1]["collectives"][("broadcast", "world")]["bytes"] == n_bytes


def _check_nesting(slices):
    """Complete events on one track must nest (what Perfetto needs to draw them as a tree)."""
    open_ends = []
    for s in sorted(slices, key=lambda s: (s["ts"], -s["dur"])):
        end = s["ts"] + s["dur"]
        while open_ends and open_ends[-1] <= s["ts"] + 1e-3:
            open_ends.pop()
        assert not open_ends or end <= open_ends[-1] + 1e-3, f"{s['name']} crosses its parent"
        open_ends.append(end)


def test_export_is_a_valid_chrome_trace(traced_run, tmp_path):
    directory, _ = traced_run
    out = tmp_path / "trace.json"
    assert trace_cli.main(["export", directory, "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    meta = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert sorted((e["pid"], e["args"]["name"]) for e in meta) == [(0, "rank 0"), (1, "rank 1")]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    for e in slices:
        assert isinstance(e["name"], str) and isinstance(e["ts"], float | int) and e["dur"] >= 0
        assert isinstance(e["tid"], int) and isinstance(e["args"], dict)
    assert {e["cat"] for e in slices} == {"hook", "plugin", "collective", "step"}
    for pid in (0, 1):
        for tid in (trace_cli.TID_STEPS, trace_cli.TID_HOOKS):
            _check_nesting([e for e in slices if e["pid"] == pid and e["tid"] == tid])
    # ranks are aligned on wall time: both ranks' first steps start within a second of each other
    first = {pid: min(e["ts"] for e in slices if e["pid"] == pid and e["cat"] == "step") for pid in (0, 1)}
    assert abs(first[0] - first[1]) < 1e6


def test_comms_logger_counts_bytes_and_bandwidth(traced_run):
    """The ``comms_logger`` section on the same 2-rank run: counts and sizes match the model and the trace."""
    directory, results = traced_run
    param_bytes = [p.numel() * 4 for p in _model().parameters()]  # 768, 128, 128, 4
    for r in results:
        raw = r["raw"]
        # initial weights, the gradient buckets, and initialize()'s agreement after each phase
        assert set(raw) == {"broadcast", "all_reduce", "all_gather_object"}
        assert {size: e[0] for size, e in raw["broadcast"].items()} == {768: 1, 128: 2, 4: 1}
        assert {size: e[0] for size, e in raw["all_reduce"].items()} == {b: STEPS for b in r["bucket_bytes"]}
        assert sum(size * e[0] for size, e in raw["broadcast"].items()) == sum(param_bytes)
        for op, by_size in raw.items():
            for size, (count, lats, algbws, busbws) in by_size.items():
                assert len(lats) == len(algbws) == len(busbws) == count and all(t > 0 for t in lats)
                for lat, alg, bus in zip(lats, algbws, busbws, strict=True):
                    assert (alg, bus) == pytest.approx(comm.calc_bw_log(op, size, lat, 2))
                    # 2 ranks: all-reduce and all-gather bus bandwidth is half the algbw; broadcast: equal
                    assert bus == pytest.approx(alg / 2 if op in ("all_reduce", "all_gather_object") else alg)
        # the comms logger and the trace saw the same all-reduces
        traced = [e for e in _events(directory, r["rank"], "collective") if e["op"] == "all_reduce"]
        logged = sorted(size for size, e in raw["all_reduce"].items() for _ in range(e[0]))
        assert sorted(e["bytes"] for e in traced) == logged
        s = r["comms_summary"]
        big = max(r["bucket_bytes"])
        assert s["summary"]["all_reduce"][big]["count"] == STEPS
        assert s["summary"]["all_reduce"][big]["total_latency_ms"] == pytest.approx(sum(raw["all_reduce"][big][1]))
        assert s["straggler_analysis"]["all_reduce"][big]["count"] == STEPS
        assert s["metadata"]["world_size"] == 2 and s["metadata"]["rank"] == r["rank"]
        assert r["observers"] == ["Probe"]  # tracing stopped, comms logger disabled; the default watchdog watches
    printed = results[0]["printed"]
    for text in ("Comm. Op", "Message Size", "busbw_avg (Gbps)", "all_reduce", "broadcast", "768.0 B",
                 "Breakdown with straggler effect"):
        assert text in printed
    assert results[1]["printed"] == ""  # only rank 0 prints


# ------------------------------------------------------------------------------ single process


@pytest.fixture
def clean_trace():
    yield
    trace.stop()


def test_tracing_off_writes_nothing_and_attaches_nothing(tmp_path, monkeypatch, tiny_model, base_config, clean_trace):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(trace.ENV_VAR, raising=False)
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config)
    loss = engine(torch.randn(4, 8), torch.randn(4, 1))
    engine.backward(loss)
    engine.step()
    assert os.listdir(tmp_path) == []
    assert trace.active() is None and not trace.probe.is_attached(engine.plugins)
    assert engine.plugins._inner_hookexec is PluginManager._exec  # no hook-call monitor: the plain call loop
    assert comm.observers() == ()
    impls = [i for c in vars(engine.plugins.hook).values() if hasattr(c, "get_hookimpls") for i in c.get_hookimpls()]
    assert impls and not any("timed_impl" in getattr(i.function, "__qualname__", "") for i in impls)
    for name in ("tracing", "watchdog"):  # no per-step hook: nothing to dispatch when off (destroy: once, at the end)
        assert set(engine.plugins.hooks_of(name)) <= {"microspeed_plugins_loaded", "microspeed_config_sections",
                                                 "microspeed_configure", "microspeed_destroy"}
    # comms_logger makes its engine's comm context current at each entry: one assignment, no observer
    assert set(engine.plugins.hooks_of("comms_logger")) == {
        "microspeed_plugins_loaded", "microspeed_config_sections", "microspeed_configure", "microspeed_setup",
        "microspeed_before_forward", "microspeed_before_backward", "microspeed_before_step",
        "microspeed_before_checkpoint_save", "microspeed_load_checkpoint", "microspeed_destroy"}
    assert comm.current() is engine.plugin_state("comms_logger") is comm.context_for(engine.plugins)


class Bomb:
    """Raises in ``before_step`` (when armed) and in the ``scale_loss`` chain (when armed)."""

    def __init__(self):
        self.step_armed = False
        self.chain_armed = False

    @microspeed.hookimpl
    def microspeed_before_step(self):
        if self.step_armed:
            raise RuntimeError("boom in before_step")

    @microspeed.hookimpl(tryfirst=True)
    def microspeed_scale_loss(self, loss):
        if self.chain_armed:
            raise ValueError("boom in scale_loss")
        return None


def test_config_enabled_trace_records_exceptions(tmp_path, tiny_model, base_config, clean_trace, monkeypatch):
    monkeypatch.delenv(trace.ENV_VAR, raising=False)
    bomb = Bomb()
    cfg = dict(base_config, trace={"enabled": True, "output_path": str(tmp_path / "t")})
    engine, *_ = microspeed.initialize(model=tiny_model, config=cfg, plugins=[("bomb", bomb)])
    probe = trace.probe_for(comm.context_for(engine.plugins))
    assert trace.active() is probe.tracer is not None and probe.is_attached(engine.plugins)
    assert not trace.probe.is_attached(engine.plugins)  # the default context's probe is not this engine's
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    engine.backward(engine(x, y))
    engine.step()
    bomb.step_armed = True
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="boom in before_step"):
        engine.step()
    bomb.step_armed, bomb.chain_armed = False, True
    with pytest.raises(ValueError, match="boom in scale_loss"):
        engine.backward(engine(x, y))
    bomb.chain_armed = False
    engine.backward(engine(x, y))  # the probe's stacks are balanced again after the failures
    engine.step()
    trace.stop()
    assert not probe.is_attached(engine.plugins) and comm.observers() == ()

    events = _events(str(tmp_path / "t"), 0)
    hooks = [e for e in events if e["event"] == "hook"]
    failed = [e for e in hooks if e["exc"]]
    assert [(e["hook"], e["exc"], e.get("exc_plugin")) for e in failed] == [
        ("before_step", "RuntimeError: boom in before_step", "bomb"),
        ("scale_loss", "ValueError: boom in scale_loss", "bomb"),
    ]
    assert failed[1]["chain"] is True
    on_exc = [e for e in hooks if e["hook"] == "on_exception"]
    assert len(on_exc) == 2 and [e["depth"] for e in on_exc] == [0, 0]
    assert all(e["depth"] in (0, 1) for e in hooks)  # nothing left dangling on the stack
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2]
    assert probe.main_stack == []
