"""Curriculum (seqlen), progressive layer drop and random-LTD in a 2-stage pipeline, 1F1B and interleaved.

Each configuration trains 3 steps of a tiny causal token model in fp32 on 2 ranks (pp2, one job for all of them)
and its per-step losses equal (relative 1e-5) the single-process run of the same layers with the same feature on:

* curriculum and progressive layer drop: the same layers as one plain module under the plain engine (``engine(x)``
  per micro-batch), where the curriculum cuts the forward's arguments and PLD passes its keywords to the model;
* random-LTD: the same layers as a one-stage ``PipelineModule`` in one process. In a pipeline, random-LTD draws each
  layer's tokens from a generator keyed by (seed, step, micro-batch, layer), which a plain module does not use (it
  keeps torch's global generator), so the one-process reference is the pipeline's own form.

The layers mix tokens causally (a running mean), so cutting sequences or dropping tokens changes every loss; the
blocks scale their branch by progressive layer drop's keep probability ``1 - (i + 1) / L * (1 - theta)`` (no
random draw), so a stage that saw another theta, or none, would change the losses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from microspeed_efficiency.random_ltd import KeyedTokenSampler, convert_to_random_ltd
from microspeed_efficiency.random_ltd_plugin import pipeline_layer_list
from torch import nn

from microspeed.testing import run_distributed

VOCAB, SEQ, WIDTH, BLOCKS, MICRO, GAS, STEPS = 16, 8, 8, 3, 2, 4, 3
BASE_SEED = 777


class Embed(nn.Module):
    """Token plus position embedding: ``(B, T)`` ids -> ``(B, T, W)``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embed ``ids``."""
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))


class Block(nn.Module):
    """``x + keep * mlp(x + running_mean(x))``: mixes tokens causally; reads progressive layer drop's theta."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.mix, self.fc = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, progressive_layer_drop: bool = False, pld_theta: float = 1.0) -> torch.Tensor:
        """Transform ``(B, T, W)``."""
        keep = 1.0 - (self.index + 1) / BLOCKS * (1.0 - pld_theta) if progressive_layer_drop else 1.0
        counts = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        mixed = torch.cumsum(self.mix(x), dim=1) / counts
        return x + keep * torch.tanh(self.fc(x + mixed))


class Head(nn.Module):
    """Output projection to the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, VOCAB)``."""
        return self.out(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _layer(i: int) -> nn.Module:
    torch.manual_seed(BASE_SEED + i)
    return Embed() if i == 0 else Head() if i == BLOCKS + 1 else Block(i - 1)


class Stack(nn.Module):
    """The layers as one module: ``forward((ids, targets))`` is the loss; PLD's keywords reach the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_layer(i) for i in range(BLOCKS + 2))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor], progressive_layer_drop: bool = False,
                pld_theta: float = 1.0) -> torch.Tensor:
        """The loss of one micro-batch."""
        ids, targets = batch
        x = self.layers[0](ids)
        for block in self.layers[1:-1]:
            x = block(x, progressive_layer_drop=progressive_layer_drop, pld_theta=pld_theta)
        return lm_loss(self.layers[-1](x), targets)


def _pipeline(stages: int, chunks: int, checkpoint: bool) -> nn.Module:
    from microspeed_pipeline import LayerSpec, PipelineModule

    specs = [LayerSpec(Embed), *[LayerSpec(Block, i) for i in range(BLOCKS)], LayerSpec(Head)]
    return PipelineModule(specs, num_stages=stages, loss_fn=lm_loss, seed_layers=True, base_seed=BASE_SEED,
                          partition_method="uniform", num_chunks=chunks,
                          activation_checkpoint_interval=1 if checkpoint else 0)


def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``GAS`` micro-batches of ``step``: counting sequences from random starts (a learnable next token)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(GAS):
        ids = (torch.randint(0, VOCAB, (MICRO, 1), generator=g) + torch.arange(SEQ + 1)) % VOCAB
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


FEATURES = {
    "curriculum": {"curriculum_learning": {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4, "max_difficulty": 8,
        "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 3, "difficulty_step": 2}}},
    "pld": {"progressive_layer_drop": {"enabled": True, "theta": 0.3, "gamma": 0.8}},
    # blocks 0 and 2 are random-LTD layers: on stage 0 and stage 1 of the 1F1B split, in chunks 0 and 1 interleaved
    "random-ltd": {"data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True, "total_layer_num": BLOCKS, "random_ltd_layer_num": 2, "random_ltd_layer_id": [0, 2],
        "random_ltd_schedule": {"min_value": 2, "max_value": 6, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": 4, "seq_per_step": 2}}}}}},
}
"""Each feature's config (the pipeline's and the reference's)."""


def _config(feature: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, **FEATURES[feature]}


def _train(runs: list[tuple[str, str, int, int, bool]]) -> dict[str, dict]:
    """Train every ``(name, feature, stages, chunks, checkpoint)`` run in this job; losses and what was seen.

    ``stages == 0`` is the plain module (one process).
    """
    import microspeed

    out = {}
    for name, feature, stages, chunks, checkpoint in runs:
        model = Stack() if stages == 0 else _pipeline(stages, chunks, checkpoint)
        engine, *_ = microspeed.initialize(model=model, config=_config(feature))
        seen = []
        losses = []
        for step in range(STEPS):
            losses.append(float(engine.train_batch(iter(micro_batches(step)))))
            seen.append({k: engine.metrics.get(k) for k in ("curriculum_seqlen", "pld_theta", "random_ltd_tokens")})
        out[name] = {"losses": losses, "seen": seen,
                     "ltd_layers": [layer.name for layer in getattr(engine.plugin_state("random_ltd"), "layers", [])]}
    return out


RUNS = [(f"{feature}-{schedule}{'-ac' if ac else ''}", feature, 2, 2 if schedule == "interleaved" else 1, ac)
        for feature in FEATURES for schedule in ("1f1b", "interleaved") for ac in (False, True)
        if not ac or feature == "random-ltd"]
"""The pipeline runs: each feature under 1F1B and interleaved; random-LTD also under activation checkpointing."""

REFERENCES = [("curriculum", "curriculum", 0, 1, False), ("pld", "pld", 0, 1, False),
              ("random-ltd", "random-ltd", 1, 1, False)]
"""The single-process runs (plain module; a one-stage pipeline for random-LTD)."""


# -- the pipeline runs (two spawned jobs, about a minute on a loaded 2-core machine: slow) -------------------------


@pytest.fixture(scope="module")
def results() -> tuple[list[dict], dict]:
    """The pipeline runs on 2 ranks and the references in one process (two jobs)."""
    ranks = run_distributed(_train, world_size=2, args=(RUNS,), timeout=240)
    (reference,) = run_distributed(_train, world_size=1, args=(REFERENCES,), timeout=120)
    return ranks, reference


@pytest.mark.slow
@pytest.mark.parametrize("run", [r[0] for r in RUNS])
def test_pipeline_losses_equal_the_single_process_run(run: str, results) -> None:
    ranks, reference = results
    feature = run.split("-1f1b")[0].split("-interleaved")[0]
    expected = reference[feature]["losses"]
    for rank in ranks:  # the pipeline broadcasts the batch's loss to every stage
        torch.testing.assert_close(torch.tensor(rank[run]["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
    # what each stage's plugin set is what the one process set, step by step (the same length, theta, tokens)
    for rank in ranks:
        assert rank[run]["seen"] == reference[feature]["seen"], (run, rank[run]["seen"])


@pytest.mark.slow
def test_the_features_act(results) -> None:
    """The references really cut, drop and scale (a feature silently off would pass the equalities above)."""
    _, reference = results
    assert [s["curriculum_seqlen"] for s in reference["curriculum"]["seen"]] == [4, 6, 8]
    thetas = [s["pld_theta"] for s in reference["pld"]["seen"]]
    assert thetas[0] == 1.0 > thetas[1] > thetas[2], thetas  # theta(0) = 1, then it decays
    assert [s["random_ltd_tokens"] for s in reference["random-ltd"]["seen"]] == [2, 2, 4]
    ranks, _ = results
    # 1F1B: block 0 (layer 1) on stage 0, block 2 (layer 3) on stage 1; each stage hooks only its own
    assert [r["random-ltd-1f1b"]["ltd_layers"] for r in ranks] == [["1"], ["3"]]


# -- the pieces, in this process ---------------------------------------------------------------------------------


def test_the_pipeline_layer_list_is_the_one_run_of_total_layer_num_layers_of_a_class() -> None:
    names = ["Embed", "Block", "Block", "Block", "Head"]
    assert pipeline_layer_list(names, 3) == [1, 2, 3]  # a single-process config's total_layer_num carries over
    assert pipeline_layer_list(names, 5) == [0, 1, 2, 3, 4]  # or the whole pipeline
    with pytest.raises(ValueError, match=r"no run\(s\) of 2 .*Embed x1, Block x3, Head x1"):
        pipeline_layer_list(names, 2)
    with pytest.raises(ValueError, match="several"):
        pipeline_layer_list(["A", "B", "C"], 1)


def test_keyed_draws_depend_on_step_micro_batch_and_layer_only() -> None:
    one, other = KeyedTokenSampler(5), KeyedTokenSampler(5)
    first = [one.draw(1, 3, 8, 2, torch.device("cpu")) for _ in range(2)]  # micro-batches 0 and 1 of layer 1
    torch.rand(100)  # the global generator plays no part
    other.draw(7, 3, 8, 2, torch.device("cpu"))  # another layer first: it does not shift layer 1's count
    again = [other.draw(1, 3, 8, 2, torch.device("cpu")) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1])
    other.start_step(1)
    assert not torch.equal(other.draw(1, 3, 8, 2, torch.device("cpu")), first[0])
    assert sorted(first[0][0].tolist()) == first[0][0].tolist() and len(set(first[0][0].tolist())) == 3


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_recompute_redraws_its_forwards_tokens(reentrant: bool) -> None:
    """Two micro-batches forward, then their backwards recompute: gradients equal those without checkpointing."""

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Block(0), nn.Linear(WIDTH, WIDTH))
        sampler = KeyedTokenSampler(3)
        convert_to_random_ltd(model, ["1"], 3, sampler=sampler)
        xs = [torch.randn(2, SEQ, WIDTH, generator=torch.Generator().manual_seed(i)).requires_grad_()
              for i in range(2)]
        outs = []
        for x in xs:  # both forwards first, as a pipeline stage runs them
            if checkpointed:
                outs.append(torch.utils.checkpoint.checkpoint(model, x, use_reentrant=reentrant))
            else:
                outs.append(model(x))
        for out in outs:
            out.pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(False), grads(True), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
