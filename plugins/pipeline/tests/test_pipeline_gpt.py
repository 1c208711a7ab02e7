"""The demo GPT as a pipeline (microspeed_pipeline.gpt, examples/pipeline/train_gpt.py)."""

from __future__ import annotations

import pathlib
import runpy

import pytest
import torch
from pipeline_models import BASE_SEED, build_reference

from microspeed.testing import run_distributed

CONFIG = dict(vocab_size=32, seq_len=8, n_layer=4, n_head=2, d_model=16, dropout=0.0)
EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "pipeline" / "train_gpt.py"


def _batches(step: int, count: int = 2, micro: int = 2):
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, CONFIG["vocab_size"], (count, micro, CONFIG["seq_len"] + 1), generator=g)
    return [(ids[i, :, :-1], ids[i, :, 1:]) for i in range(count)]


def _cfg():
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 3e-3}}}


def _pipeline_gpt(chunks: int) -> dict:
    from microspeed_pipeline.gpt import gpt_pipeline

    import microspeed
    from microspeed.demo.model import GPTConfig

    model = gpt_pipeline(GPTConfig(**CONFIG), num_stages=2, num_chunks=chunks, seed_layers=True, base_seed=BASE_SEED)
    engine, *_ = microspeed.initialize(model=model, config=_cfg())
    out = {"losses": [engine.train_batch(iter(_batches(step))).item() for step in range(3)]}
    if chunks == 1:
        out["example"] = runpy.run_path(str(EXAMPLE))["main"](["--steps", "2"])
    return out


@pytest.mark.slow
def test_gpt_pipeline_equals_the_same_layers_in_one_process():
    from microspeed_pipeline.gpt import gpt_layers, lm_loss

    from microspeed.demo.model import GPTConfig

    model = build_reference(gpt_layers(GPTConfig(**CONFIG)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    expected = []
    for step in range(3):
        loss = torch.stack([lm_loss(model(x), y) for x, y in _batches(step)]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    for chunks in (1, 2):
        for r in run_distributed(_pipeline_gpt, world_size=2, args=(chunks,), timeout=180):
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
            if chunks == 1:
                assert len(r["example"]) == 2 and all(loss > 0 for loss in r["example"])


def _tied_with_extra_parameters() -> str:
    from microspeed_pipeline import PipelineModule, TiedLayerSpec

    import microspeed

    layers = [TiedLayerSpec("lin", torch.nn.Linear, 4, 4), torch.nn.GELU(), TiedLayerSpec("lin", torch.nn.Linear, 4, 4)]
    try:
        PipelineModule(layers, num_stages=2)
    except microspeed.ConfigError as exc:
        return str(exc)
    return "accepted"


def test_a_tied_module_with_untied_parameters_across_stages_is_refused():
    for message in run_distributed(_tied_with_extra_parameters, world_size=2, timeout=60):
        assert "['bias']" in message and "tied_weight_attr" in message
