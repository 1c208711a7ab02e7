"""MoE layers inside a pipeline: the auxiliary loss travels with the activations.

A pipeline stage passes tensors (or tuples of tensors) to the next, and only the last stage computes
the loss, while every :class:`~microspeed_moe.layer.MoE` layer returns ``(output, l_aux, exp_counts)``.
microspeed carries the load-balancing losses *with the activations*: from the first MoE layer on, the
activation is the pair ``(hidden, aux)``, ``aux`` a 0-d float32 tensor, the running sum of
``coef · l_aux`` of the MoE layers so far. The pipeline sends it like any activation (it needs a
gradient, so its gradient comes back to the stage that made it), and :func:`aux_loss` adds it to the
task loss on the last stage — the same sum a single-process model adds to its loss.

* :class:`MoEPipeLayer` — ``MoE`` as a pipeline layer: ``hidden`` or ``(hidden, aux)`` in,
  ``(output, aux + coef · l_aux)`` out;
* :class:`CarryAux` — any other layer after an MoE one: applies the layer to ``hidden`` and passes
  ``aux`` along unchanged (a plain tensor in, a plain tensor out);
* :func:`aux_loss` — wraps the PipelineModule's ``loss_fn``: ``loss_fn(hidden, labels) + aux``.

Expert parallelism then runs across each stage's data axis (the groups are made per stage). The
layers do not depend on the pipeline plugin: they are ordinary modules, usable in ``LayerSpec``
(``LayerSpec(MoEPipeLayer, hidden, expert, num_experts=4, ep_size=2)``, ``LayerSpec(CarryAux,
nn.Linear, 8, 8)``) or in a plain ``nn.Sequential``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from microspeed_moe.layer import MoE

Activation = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A hidden state, or ``(hidden, aux)`` once an MoE layer has run."""


def split_aux(inputs: Activation) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hidden, aux)`` of an activation; ``aux`` is ``None`` before the first MoE layer."""
    if isinstance(inputs, tuple):
        if len(inputs) != 2:
            raise TypeError(f"MoE pipeline layers pass (hidden, aux); got a tuple of {len(inputs)} tensors. Wrap "
                            f"the layers between MoE layers in CarryAux and give the MoE layers one hidden tensor.")
        return inputs[0], inputs[1]
    return inputs, None


class MoEPipeLayer(nn.Module):
    """:class:`~microspeed_moe.layer.MoE` for a pipeline: ``hidden | (hidden, aux) -> (output, aux + coef·l_aux)``.

    Args:
        *args, **kwargs: :class:`~microspeed_moe.layer.MoE`'s (``hidden_size, expert, num_experts,
            ep_size, k, ...``).
        aux_loss_coef: the weight of this layer's load-balancing loss in the total loss.
    """

    def __init__(self, *args: Any, aux_loss_coef: float = 0.01, **kwargs: Any) -> None:
        super().__init__()
        self.moe = MoE(*args, **kwargs)
        self.aux_loss_coef = aux_loss_coef
        self.exp_counts: torch.Tensor | None = None

    def forward(self, inputs: Activation) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE's output and the running auxiliary loss (``exp_counts`` is kept on the layer)."""
        hidden, aux = split_aux(inputs)
        out, l_aux, self.exp_counts = self.moe(hidden)
        term = self.aux_loss_coef * l_aux.float()
        return out, term if aux is None else aux + term


class CarryAux(nn.Module):
    """A layer that passes the running auxiliary loss along: ``(hidden, aux) -> (layer(hidden), aux)``.

    ``CarryAux(module)`` wraps a module; ``CarryAux(cls, *args, **kwargs)`` builds ``cls(*args, **kwargs)``
    (so ``LayerSpec(CarryAux, nn.Linear, 8, 8)`` draws the same initial weights as ``LayerSpec(nn.Linear, 8,
    8)``). A plain tensor input (no MoE layer before) gives a plain tensor output.
    """

    def __init__(self, layer: nn.Module | type | Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        super().__init__()
        if isinstance(layer, nn.Module):
            if args or kwargs:
                raise TypeError("CarryAux(module): pass either a built module or a class with its arguments.")
            self.layer = layer
        else:
            self.layer = layer(*args, **kwargs)

    def forward(self, inputs: Activation) -> Activation:
        """``layer(hidden)``, with ``aux`` passed along when there is one."""
        hidden, aux = split_aux(inputs)
        out = self.layer(hidden)
        return out if aux is None else (out, aux)


def aux_loss(loss_fn: Callable[[torch.Tensor, Any], torch.Tensor]) -> Callable[[Activation, Any], torch.Tensor]:
    """A pipeline ``loss_fn`` that adds the carried auxiliary loss: ``loss_fn(hidden, labels) + aux``."""

    def loss(outputs: Activation, labels: Any) -> torch.Tensor:
        hidden, aux = split_aux(outputs)
        value = loss_fn(hidden, labels)
        return value if aux is None else value + aux.to(value.dtype)

    loss.__doc__ = f"{getattr(loss_fn, '__name__', type(loss_fn).__name__)} plus the MoE layers' auxiliary losses."
    return loss
