"""DeepSpeed behaviours the pipeline keeps: an in-place first layer on a stage, ``dynamic_shape``, config keys.

One spawn of 2 ranks (2 stages) trains:

* a model whose second stage starts with ``nn.ReLU(inplace=True)`` (DeepSpeedExamples' AlexNet splits
  so): the received activation is a leaf that needs a gradient, and an in-place op on it raised before
  the runtime cloned it (as DeepSpeed does); losses equal the single-process model's, step by step;
* with ``PipelineModule(dynamic_shape=True)``, micro-batches of different sizes inside one batch (every
  transfer sends its shape header): the losses again equal the single-process model's; without it the
  same batch is refused naming ``dynamic_shape``.
"""

from __future__ import annotations

import pytest
import torch
from pipeline_models import build_reference, pipeline
from torch import nn

from microspeed.testing import run_distributed

STEPS, GAS = 3, 3
SIZES = (2, 3, 1)  # micro-batch sizes inside one batch (dynamic_shape)


def _specs(inplace: bool = True) -> list:
    from microspeed_pipeline.module import LayerSpec

    return [LayerSpec(nn.Linear, 6, 8), LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.ReLU, inplace=inplace),
            LayerSpec(nn.Linear, 8, 2)]


def _batches(step: int, sizes: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g)) for n in sizes]


def _config() -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}


def _reference(sizes: tuple[int, ...]) -> list[float]:
    model = build_reference(_specs())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = torch.stack([nn.functional.mse_loss(model(x), y) for x, y in _batches(step, sizes)]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _run() -> dict:
    import microspeed

    out = {}
    for name, sizes, dynamic in (("inplace", (2, 2, 2), False), ("dynamic", SIZES, True)):
        model = pipeline(_specs(), num_stages=2, partition_method="uniform", dynamic_shape=dynamic)
        assert model.parts == [0, 2, 4] and model.dynamic_shape is dynamic
        engine, *_ = microspeed.initialize(model=model, config=_config())
        out[name] = [engine.train_batch(iter(_batches(step, sizes))).item() for step in range(STEPS)]
    engine, *_ = microspeed.initialize(model=pipeline(_specs(), num_stages=2, partition_method="uniform"),
                                       config=_config())
    try:
        engine.train_batch(iter(_batches(0, SIZES)))
        out["static"] = "accepted"
    except (ValueError, RuntimeError) as exc:
        out["static"] = str(exc)
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_inplace_first_layer_and_dynamic_shapes():
    results = run_distributed(_run, world_size=2, timeout=150)
    for r in results:
        assert r["inplace"] == pytest.approx(_reference((2, 2, 2)), rel=1e-5, abs=1e-6)
        assert r["dynamic"] == pytest.approx(_reference(SIZES), rel=1e-5, abs=1e-6)
    assert "dynamic_shape=True" in results[0]["static"]  # the first stage sends; it names the way out


def test_deepspeeds_pipeline_keys_are_acted_on_or_noticed(caplog):
    """activation_checkpoint_interval / use_reentrant act (as DeepSpeed's engine); the other keys are noticed."""
    from microspeed_pipeline.checkpointing import non_reentrant_checkpoint

    import microspeed

    module = pipeline(_specs(inplace=False), num_stages=1)  # (an in-place op on a checkpoint's input breaks it)
    assert module.activation_checkpoint_interval == 0 and module.activation_checkpoint_func is None
    section = {"activation_checkpoint_interval": 2, "use_reentrant": False, "stages": "auto", "partition": "best",
               "seed_layers": False, "pipe_partitioned": True, "grad_partitioned": True}
    engine, *_ = microspeed.initialize(model=module, config={**_config(), "pipeline": section})
    assert module.activation_checkpoint_interval == 2 and module.activation_checkpoint_func is non_reentrant_checkpoint
    notices = " ".join(engine.config.notices)
    for key in ("stages", "partition", "seed_layers"):
        assert f"pipeline.{key}: accepted, no effect here" in notices, key
    assert "pipe_partitioned" not in notices and "grad_partitioned" not in notices  # they act (tensor parallel)
    assert "did you mean" not in notices
    loss = engine.train_batch(iter(_batches(0, (2, 2, 2))))
    assert loss.item() == pytest.approx(_reference((2, 2, 2))[0], rel=1e-5)  # checkpointed: same numbers
    with pytest.raises(microspeed.ConfigError, match="activation_checkpoint_interval"):
        microspeed.initialize(model=pipeline(_specs(), num_stages=1),
                              config={**_config(), "pipeline": {"activation_checkpoint_interval": -1}})


def test_train_batch_without_an_iterator_reads_training_data_in_order():
    """DeepSpeed's pipeline engine feeds ``train_batch()`` from its own unshuffled, repeating loader.

    The loader ``initialize()`` returns stays the shuffled one; ``train_batch()`` takes samples 0, 1, 2, ...
    (so the losses equal the reference fed in dataset order, and a shuffled feed would not).
    """
    import microspeed

    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(6, generator=g), torch.randn(2, generator=g)) for _ in range(12)]
    engine, _, loader, _ = microspeed.initialize(model=pipeline(_specs(inplace=False), num_stages=1),
                                                 config=_config(), training_data=data)
    losses = [engine.train_batch().item() for _ in range(2)]
    model = build_reference(_specs(inplace=False))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    expected = []
    for step in range(2):
        chunk = data[step * 6:(step + 1) * 6]
        micro = [(torch.stack([x for x, _ in chunk[i:i + 2]]), torch.stack([y for _, y in chunk[i:i + 2]]))
                 for i in range(0, 6, 2)]
        loss = torch.stack([nn.functional.mse_loss(model(x), y) for x, y in micro]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)
    first = next(iter(loader))[0]
    assert not torch.equal(first, torch.stack([x for x, _ in data[:2]]))  # the returned loader shuffles
