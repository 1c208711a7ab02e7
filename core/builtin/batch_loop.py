"""The default whole-batch loop behind ``engine.train_batch()`` and ``engine.eval_batch()``.

A batch is ``gradient_accumulation_steps`` micro-batches drawn from ``data_iter``. Each one goes
through the engine exactly as a hand-written loop would (``engine(...)``, ``engine.backward``,
``engine.step()``), so every micro-step hook fires. How a micro-batch becomes a loss:

* a ``(inputs, labels)`` pair and a module with a ``loss_fn`` attribute (DeepSpeed's
  ``PipelineModule`` convention): ``loss_fn(engine(inputs), labels)``;
* anything else: ``engine(batch)`` must return the loss (the demo GPT takes its ``(x, y)`` pair).
"""

from __future__ import annotations

from typing import Any

import torch

from microspeed.hookspecs import hookimpl


def micro_batch_loss(engine: Any, batch: Any, compute_loss: bool = True) -> tuple[torch.Tensor | None, Any]:
    """Run one micro-batch through ``engine``; return ``(loss, outputs)`` (``loss`` ``None`` when not computed)."""
    loss_fn = getattr(engine.module, "loss_fn", None)
    if loss_fn is not None and isinstance(batch, (tuple, list)) and len(batch) == 2:
        outputs = engine(batch[0])
        return (loss_fn(outputs, batch[1]) if compute_loss else None), outputs
    outputs = engine(batch)
    if not compute_loss:
        return None, outputs
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 0:
        raise TypeError("engine.train_batch(): the model must return a scalar loss for a micro-batch, or have a "
                        "`loss_fn` attribute and receive (inputs, labels) pairs; it returned "
                        f"{type(outputs).__name__}{tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else ''}.")
    return outputs, outputs


def _next(data_iter: Any, i: int, n: int) -> Any:
    try:
        return next(data_iter)
    except StopIteration:
        raise RuntimeError(f"train_batch/eval_batch: the data iterator ran out at micro-batch {i + 1} of {n}; "
                           f"pass a longer (or repeating: microspeed.RepeatingLoader) iterator.") from None


def reduce_losses(losses: list[torch.Tensor], reduce_output: str | None) -> Any:
    """``"avg"``: the mean as a 0-d tensor; ``None``: the list as given."""
    if reduce_output is None:
        return losses
    if reduce_output != "avg":
        raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): expected 'avg' or None.")
    return torch.stack([loss.float() for loss in losses]).mean()


class BatchLoopPlugin:
    """Default answers to ``microspeed_train_batch`` and ``microspeed_eval_batch``."""

    @hookimpl(trylast=True)
    def microspeed_train_batch(self, engine: Any, data_iter: Any) -> torch.Tensor:
        """``gradient_accumulation_steps`` forward/backward/step micro-steps; the mean loss."""
        n = engine.gradient_accumulation_steps()
        losses = []
        for i in range(n):
            loss, _ = micro_batch_loss(engine, _next(data_iter, i, n))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        return reduce_losses(losses, "avg")

    @hookimpl(trylast=True)
    def microspeed_eval_batch(self, engine: Any, data_iter: Any, return_logits: bool, compute_loss: bool,
                              reduce_output: str | None, num_micro_batches: int | None) -> Any:
        """The micro-batch loop under ``torch.no_grad()``; no gradients, no step."""
        n = num_micro_batches or engine.gradient_accumulation_steps()
        losses, outputs = [], []
        with torch.no_grad():
            for i in range(n):
                loss, out = micro_batch_loss(engine, _next(data_iter, i, n), compute_loss)
                if loss is not None:
                    losses.append(loss.detach())
                outputs.append(out)
        result = reduce_losses(losses, reduce_output) if compute_loss else None
        return (result, outputs) if return_logits else result
