"""initialize() refuses, on every rank and without hanging, ranks that disagree on config or plugins."""

from __future__ import annotations

import pytest
import torch

import microspeed
from microspeed import hookimpl
from microspeed.testing import run_distributed


class ExtraPlugin:
    """A plugin registered on one rank only."""

    @hookimpl
    def microspeed_after_global_step(self, engine):
        engine.metrics["extra"] = True


def _config(clipping=1.0):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": clipping, "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _disagreement_body():
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    messages = []

    with pytest.raises(microspeed.PluginError) as info:  # rank 1 has another gradient_clipping
        microspeed.initialize(model=model, config=_config(1.0 if rank == 0 else 2.0))
    messages.append(str(info.value))

    plugins = [("extra", ExtraPlugin())] if rank == 1 else []
    with pytest.raises(microspeed.PluginError) as info:
        microspeed.initialize(model=model, config=_config(), plugins=plugins)
    messages.append(str(info.value))

    # After both refusals the ranks are still in step: agreeing ranks initialize and train.
    engine, *_ = microspeed.initialize(model=model, config=_config())
    x = torch.full((2, 4), float(rank + 1))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return messages, [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_ranks_that_disagree_fail_on_every_rank():
    (msgs0, w0), (msgs1, w1) = run_distributed(_disagreement_body, world_size=2, timeout=100)
    config_msg, plugin_msg = msgs0
    assert msgs1 == msgs0  # both ranks raise the same error
    assert "rank 1 has a different ds_config than rank 0" in config_msg
    assert "ranks disagree at initialize()" in config_msg
    assert "loaded different plugins" not in config_msg  # only the config differs
    assert "rank 1 loaded different plugins than rank 0" in plugin_msg
    assert "only on rank 1: [('extra', '')]" in plugin_msg and "only on rank 0: []" in plugin_msg
    assert "different ds_config" not in plugin_msg  # the config agreed this time
    for a, b in zip(w0, w1, strict=True):
        torch.testing.assert_close(a, b)


def _bad_config_on_rank1():
    import torch.distributed as dist

    rank = dist.get_rank()
    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if rank == 1:
        cfg["gradient_clipingg"] = 1.0
    with pytest.raises((microspeed.ConfigError, microspeed.PluginError)) as info:
        microspeed.initialize(model=torch.nn.Linear(2, 2), config=cfg)
    return type(info.value).__name__, str(info.value)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_config_error_on_one_rank_is_raised_on_every_rank():
    (t0, m0), (t1, m1) = run_distributed(_bad_config_on_rank1, world_size=2, timeout=90)
    assert t1 == "ConfigError" and "gradient_clipingg" in m1
    assert t0 == "PluginError" and "rank 1: ConfigError: gradient_clipingg" in m0


class FailsOnRankOne:
    """Raises in one set-up hook, on rank 1 only (as a plugin that sees rank-local state may)."""

    def __init__(self, hook: str) -> None:
        self.hook = hook

    @hookimpl
    def microspeed_setup(self, engine):
        if self.hook == "setup" and engine.topology.rank == 1:
            raise ValueError("rank-local failure in setup")

    @hookimpl
    def microspeed_wrap_optimizer(self, engine, optimizer):
        if self.hook == "wrap_optimizer" and engine.topology.rank == 1:
            raise RuntimeError("rank-local failure in wrap_optimizer")
        return None

    @hookimpl
    def microspeed_config_sections(self):
        import torch.distributed as dist

        if self.hook == "config_sections" and dist.get_rank() == 1:
            raise KeyError("rank-local failure before the agreement")
        return {}


def _one_rank_fails_body():
    import torch.distributed as dist

    outcomes = []
    for hook in ("config_sections", "setup", "wrap_optimizer"):
        try:
            plugins = [("fails", FailsOnRankOne(hook))]
            microspeed.initialize(model=torch.nn.Linear(4, 1), config=_config(), plugins=plugins)
            outcomes.append(("returned", ""))
        except Exception as exc:  # noqa: BLE001 - the test records what each rank raised
            outcomes.append((type(exc).__name__, str(exc)))
    engine, *_ = microspeed.initialize(model=torch.nn.Linear(4, 1), config=_config())  # still in step
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    return dist.get_rank(), outcomes, engine.global_steps


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_error_on_one_rank_is_raised_on_every_rank():
    """Before and after the agreement: rank 1 raises its own error, rank 0 a PluginError naming it — no hang."""
    (_, out0, steps0), (_, out1, steps1) = run_distributed(_one_rank_fails_body, world_size=2, timeout=100)
    assert [kind for kind, _ in out1] == ["KeyError", "ValueError", "RuntimeError"]
    assert [kind for kind, _ in out0] == ["PluginError"] * 3
    for (_, theirs), (kind, _mine) in zip(out0, out1, strict=True):
        assert theirs.startswith("initialize() failed on other ranks: rank 1: ") and kind in theirs
    assert "rank-local failure in wrap_optimizer" in out0[2][1]
    assert steps0 == steps1 == 1
