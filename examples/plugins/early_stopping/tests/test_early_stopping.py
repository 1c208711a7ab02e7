"""Tests of microspeed-early-stopping, written with microspeed's plugin-author kit."""

from __future__ import annotations

from importlib import metadata

import microspeed
import pytest
import torch
from microspeed import cli
from microspeed.plugins import PluginManager
from microspeed.testing import run_distributed, tiny_batch, tiny_engine, train_steps

from microspeed_early_stopping import EarlyStoppingPlugin, EarlyStoppingState


def _state(engine) -> EarlyStoppingState:
    return engine.plugin_state("early_stopping")


def _stopped(engine) -> bool:
    return _state(engine).should_stop


def _rising(engine):
    """Micro-step -> batch whose targets drift away: the loss rises from step to step."""
    x, y = tiny_batch(engine)
    return lambda micro_step: (x, y + 0.5 * micro_step)


# ----------------------------------------------------------------------------- installed, configured


def test_discovered_through_its_entry_point(capsys):
    pm = PluginManager()
    pm.load_all()
    info = pm.infos["early_stopping"]
    assert isinstance(info.plugin, EarlyStoppingPlugin)
    assert info.version == metadata.version("microspeed-early-stopping")
    assert info.source == "entry point microspeed_early_stopping.plugin:EarlyStoppingPlugin"

    cli.main(["plugins"])
    out = capsys.readouterr().out
    assert "early_stopping" in out and info.version in out
    cli.main(["plugins", "--hooks"])
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    for hook in ("config_sections", "conflicts", "setup", "before_backward", "after_global_step", "checkpoint_state"):
        assert "early_stopping" in lines[hook]
    assert "early_stopping" not in lines["before_forward"]


def test_config_section_is_claimed_with_defaults_and_checked(ms_engine_factory):
    engine = ms_engine_factory({"early_stopping": {"enabled": True}})
    assert engine.config["early_stopping"] == {"enabled": True, "patience": 5, "min_delta": 0.0, "monitor": "loss"}
    assert _state(engine).patience == 5 and _state(engine).enabled

    engine = ms_engine_factory()  # section absent: defaults, disabled, state still attached
    assert engine.config["early_stopping"]["enabled"] is False and not _stopped(engine)

    for section, message in [
        ({"patience": 0}, "early_stopping.patience: got 0; expected a number > 0"),
        ({"min_delta": -1}, "early_stopping.min_delta: got -1; expected a number >= 0"),
        ({"monitor": "accuracy"}, "early_stopping.monitor: got 'accuracy'; accepted values: 'loss', 'reported'"),
        ({"patiense": 3}, "early_stopping.patiense: unknown key. Did you mean 'patience'?"),
    ]:
        with pytest.raises(microspeed.ConfigError, match=message.replace(".", r"\.").replace("?", r"\?")):
            ms_engine_factory({"early_stopping": section})


def test_without_the_plugin_the_section_is_refused(ms_engine_factory, monkeypatch):
    cfg = {"early_stopping": {"enabled": True}, "plugins": {"disable": ["early_stopping"]}}
    with pytest.raises(microspeed.ConfigError, match="early_stopping: unknown key"):
        ms_engine_factory(cfg)
    monkeypatch.setenv("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("MICROSPEED_PLUGINS", raising=False)
    with pytest.raises(microspeed.ConfigError, match="early_stopping: unknown key"):
        ms_engine_factory({"early_stopping": {"enabled": True}})
    monkeypatch.setenv("MICROSPEED_PLUGINS", "early_stopping")  # autoload off, this one plugin on
    assert _state(ms_engine_factory({"early_stopping": {"enabled": True}})).enabled


# ----------------------------------------------------------------------------- stopping


def test_stops_after_patience_checks_without_improvement(ms_engine_factory):
    engine = ms_engine_factory({"early_stopping": {"enabled": True, "patience": 3}})
    losses = train_steps(engine, 20, batch=_rising(engine), until=_stopped)
    assert len(losses) == 4 and engine.global_steps == 4  # best at step 1, then 3 bad checks
    assert min(losses[1:]) > losses[0]  # the loss rose after the first step
    state = _state(engine)
    assert (state.best, state.best_step, state.bad_checks, state.checks, state.stopped_at) == (
        pytest.approx(losses[0]), 1, 3, 4, 4)
    assert state.last == pytest.approx(losses[-1])


def test_keeps_going_while_the_loss_falls_and_min_delta_counts(ms_engine_factory):
    engine = ms_engine_factory({"early_stopping": {"enabled": True, "patience": 2}})
    losses = train_steps(engine, 8, until=_stopped)  # the same batch every step: the loss falls
    assert len(losses) == 8 and not _stopped(engine)
    assert (_state(engine).best, _state(engine).best_step) == (pytest.approx(losses[-1]), 8)

    engine = ms_engine_factory({"early_stopping": {"enabled": True, "patience": 2, "min_delta": 100.0}})
    losses = train_steps(engine, 8, until=_stopped)  # falls, but never by 100
    assert len(losses) == 3 and _state(engine).stopped_at == 3


def test_one_check_per_optimizer_step_on_the_mean_micro_step_loss(ms_engine_factory, hook_recorder):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
           "early_stopping": {"enabled": True, "patience": 10}}
    engine = ms_engine_factory(cfg, plugins=[hook_recorder])
    hook_recorder.clear()
    losses = train_steps(engine, 2, batch=_rising(engine))
    assert hook_recorder.names("before_backward", "after_global_step") == ["before_backward"] * 3 + [
        "after_global_step"] + ["before_backward"] * 3 + ["after_global_step"]
    last_step = [c.kwargs["ctx"].loss.item() for c in hook_recorder.of("before_backward")[3:]]
    assert _state(engine).checks == 2
    assert _state(engine).last == pytest.approx(sum(last_step) / 3) == pytest.approx(losses[-1])


def test_disabled_it_never_stops(ms_engine_factory):
    engine = ms_engine_factory({"early_stopping": {"enabled": False, "patience": 1}})
    assert len(train_steps(engine, 4, batch=_rising(engine), until=_stopped)) == 4
    assert _state(engine).checks == 0


def test_reported_values_are_checked_instead_of_the_training_loss(ms_engine_factory):
    engine = ms_engine_factory({"early_stopping": {"enabled": True, "monitor": "reported", "patience": 2}})
    train_steps(engine, 3, batch=_rising(engine))
    state = _state(engine)
    assert state.checks == 0  # the training loss is not watched
    assert [state.report(v) for v in (1.0, 1.0, 0.5, torch.tensor(0.6))] == [False, False, False, False]
    assert (state.best, state.best_step, state.bad_checks) == (0.5, 3, 1)
    assert state.report(0.7) is True and state.stopped_at == 3


# ----------------------------------------------------------------------------- checkpoints, conflicts


def test_state_goes_into_checkpoints(ms_engine_factory, tmp_path):
    cfg = {"early_stopping": {"enabled": True, "patience": 3}}
    engine = ms_engine_factory(cfg)
    train_steps(engine, 3, batch=_rising(engine))
    saved = _state(engine).state_dict()
    assert saved["bad_checks"] == 2
    engine.save_checkpoint(str(tmp_path))

    resumed = ms_engine_factory(cfg)
    resumed.load_checkpoint(str(tmp_path))
    assert _state(resumed).state_dict() == saved
    losses = train_steps(resumed, 10, batch=_rising(resumed), until=_stopped)
    assert len(losses) == 1 and _state(resumed).stopped_at == 4  # one more bad check was enough


def test_refuses_an_lr_range_test(ms_engine_factory):
    cfg = {"early_stopping": {"enabled": True}, "scheduler": {"type": "LRRangeTest", "params": {}}}
    with pytest.raises(microspeed.ConfigError,
                       match="scheduler.type: cannot be combined with the plugin 'early_stopping': an LR range"):
        ms_engine_factory(cfg)
    ms_engine_factory({**cfg, "early_stopping": {"enabled": False}})  # disabled: no conflict
    ms_engine_factory({**cfg, "early_stopping": {"enabled": True, "monitor": "reported"}})


# ----------------------------------------------------------------------------- two ranks


def _train_on_two_ranks(patience: int) -> dict:
    """Rank body (module level, so every spawned rank can import it): each rank has its own data."""
    engine = tiny_engine({"early_stopping": {"enabled": True, "patience": patience}})
    x, y = tiny_batch(engine)  # different samples on each rank
    drift = 1.0 if engine.topology.data_parallel_rank == 1 else 0.0  # only rank 1's targets drift away
    checked: list[float] = []

    def until(e) -> bool:
        checked.append(_state(e).last)
        return _stopped(e)

    losses = train_steps(engine, 30, batch=lambda i: (x, y + drift * i), until=until)
    return {"losses": losses, "checked": checked, "steps": engine.global_steps,
            "stopped_at": _state(engine).stopped_at}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_agree_on_the_loss_and_stop_at_the_same_step():
    rank0, rank1 = run_distributed(_train_on_two_ranks, world_size=2, args=(3,))
    assert rank0["steps"] == rank1["steps"] == rank0["stopped_at"] == rank1["stopped_at"] < 30
    assert rank0["checked"] == rank1["checked"]  # the same value on both ranks ...
    mean = [(a + b) / 2 for a, b in zip(rank0["losses"], rank1["losses"], strict=True)]
    assert rank0["checked"] == pytest.approx(mean)  # ... the mean of their local losses
    assert rank0["losses"][-1] < rank0["losses"][0]  # alone, rank 0 (falling loss) would not have stopped
