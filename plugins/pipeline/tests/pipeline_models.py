"""Models and data shared by the pipeline tests: the same layers as a PipelineModule and as one module."""

from __future__ import annotations

import torch
from microspeed_pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

IN, HIDDEN, OUT = 8, 32, 4
BASE_SEED = 1234


def mlp_specs(depth: int = 8) -> list:
    """``depth`` layers alternating Linear and GELU, ending in a Linear to ``OUT``."""
    specs: list = [LayerSpec(nn.Linear, IN, HIDDEN)]
    while len(specs) < depth - 1:
        specs += [LayerSpec(nn.GELU), LayerSpec(nn.Linear, HIDDEN, HIDDEN)]
    specs.append(LayerSpec(nn.Linear, HIDDEN, OUT))
    return specs[:depth - 1] + [specs[-1]] if len(specs) > depth else specs


def build_reference(specs: list, base_seed: int = BASE_SEED) -> nn.Sequential:
    """The single-process model: each layer built after seeding with ``base_seed + index`` (as seed_layers)."""
    modules, tied = [], {}
    for idx, spec in enumerate(specs):
        torch.manual_seed(base_seed + idx)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            modules.append(_Tied(tied[spec.key], spec.forward_fn))
        else:
            modules.append(spec.build())
    return nn.Sequential(*modules)


class _Tied(nn.Module):
    def __init__(self, module: nn.Module, forward_fn) -> None:
        super().__init__()
        self.module, self.forward_fn = module, forward_fn

    def forward(self, x):
        return self.forward_fn(self.module, x) if self.forward_fn is not None else self.module(x)


def pipeline(specs: list, **kwargs) -> PipelineModule:
    """A PipelineModule of ``specs`` with seeded layers and an MSE loss unless given."""
    kwargs.setdefault("loss_fn", nn.MSELoss())
    return PipelineModule(specs, seed_layers=True, base_seed=BASE_SEED, **kwargs)


def micro_batches(step: int, count: int, micro: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (x, y) micro-batches of the step's global batch, in order."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    return [(torch.randn(micro, IN, generator=g), torch.randn(micro, OUT, generator=g)) for _ in range(count)]


VOCAB, SEQ = 16, 6


def lm_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output head that reuses the embedding's weight."""
    return x @ embedding.weight.t()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def tied_specs() -> list:
    """A small language model whose embedding and output head share one weight (first and last layer)."""
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN),
            LayerSpec(nn.Linear, HIDDEN, HIDDEN), LayerSpec(nn.GELU), LayerSpec(nn.Linear, HIDDEN, HIDDEN),
            TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN, forward_fn=lm_head)]


def token_batches(step: int, count: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (ids, next ids) micro-batches of the step's global batch."""
    g = torch.Generator().manual_seed(7 * 100003 + step)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (micro, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


class Block(nn.Module):
    """Linear → GELU → Linear; with ``tp`` its Linears are column- then row-parallel (same initial weights)."""

    def __init__(self, d_in: int, d_out: int, tp: bool = False) -> None:
        super().__init__()
        fc1, fc2 = nn.Linear(d_in, HIDDEN), nn.Linear(HIDDEN, d_out)
        if tp:
            from microspeed_pipeline.tensor_parallel import ColumnParallelLinear, RowParallelLinear

            fc1 = ColumnParallelLinear.from_dense(fc1, gather_output=False)
            fc2 = RowParallelLinear.from_dense(fc2, input_is_parallel=True)
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def block_specs(tp: bool) -> list:
    """Four layers: three (tensor-parallel when ``tp``) blocks and a plain output Linear."""
    return [LayerSpec(Block, IN, HIDDEN, tp=tp), LayerSpec(Block, HIDDEN, HIDDEN, tp=tp),
            LayerSpec(Block, HIDDEN, HIDDEN, tp=tp), LayerSpec(nn.Linear, HIDDEN, OUT)]
