"""Cross entropy over vocabulary-parallel logits, without ever gathering the full vocabulary (Megatron's).

The logits of a language-model head built from a :class:`~microspeed_pipeline.tensor_parallel.ColumnParallelLinear`
with ``gather_output=False`` are split along the vocabulary: rank ``r`` of ``tp`` holds classes
``[r * V/tp, (r + 1) * V/tp)``. The loss needs three numbers per token from the whole vocabulary,
obtained with two all-reduces of per-token scalars instead of an all-gather of the logits:

1. the maximum logit (all-reduce MAX), subtracted for numerical stability;
2. the sum of ``exp`` of the shifted logits, the target's shifted logit (found on the one rank that
   holds the target, zero elsewhere) and, for label smoothing, the sum of the shifted logits (one
   all-reduce SUM of the three stacked).

The backward is local: ``softmax - (1 - a) * one_hot(target) - a / V`` on this rank's shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from microspeed.plugin_api import comm
from microspeed_pipeline.tensor_parallel import get_tensor_model_parallel_group

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits: torch.Tensor, target: torch.Tensor, label_smoothing: float,
                group: Any) -> torch.Tensor:
        world, rank = comm.get_world_size(group), comm.get_rank(group)
        compute_dtype = torch.promote_types(vocab_parallel_logits.dtype, torch.float32)
        logits = vocab_parallel_logits.to(compute_dtype)
        partition_vocab = logits.size(-1)
        vocab_size = partition_vocab * world

        logits_max = logits.max(dim=-1).values
        comm.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)

        start = rank * partition_vocab
        target = target.long()
        outside = (target < start) | (target >= start + partition_vocab)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp_logits = logits.exp()
        sums = [exp_logits.sum(dim=-1), predicted]
        if label_smoothing > 0.0:
            sums.append(logits.sum(dim=-1))
        stacked = torch.stack(sums)
        comm.all_reduce(stacked, group=group)
        sum_exp, predicted = stacked[0], stacked[1]

        log_z = sum_exp.log()
        loss = log_z - predicted  # -log softmax[target]
        if label_smoothing > 0.0:
            mean_logit = stacked[2] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - mean_logit)

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing, ctx.vocab_size, ctx.input_dtype = label_smoothing, vocab_size, vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        alpha = ctx.label_smoothing
        grad = softmax - alpha / ctx.vocab_size if alpha > 0.0 else softmax.clone()
        hit = (~outside).to(grad.dtype) * (1.0 - alpha)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_output.unsqueeze(-1).to(grad.dtype))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, group: Any = None) -> torch.Tensor:
    """Per-token cross entropy of logits split along the vocabulary over the tensor-parallel group.

    Equals ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), reduction="none",
    label_smoothing=label_smoothing).view_as(target)`` where ``full_logits`` is the concatenation of
    every rank's shard along the last dimension (PyTorch's label smoothing: the target distribution
    is ``(1 - a) * one_hot + a / V`` over the whole vocabulary ``V``).

    Args:
        vocab_parallel_logits: ``[..., V / tp]``, this rank's contiguous slice of the vocabulary (rank
            ``r`` holds classes ``r * V/tp`` up to ``(r + 1) * V/tp``); any floating dtype.
        target: ``[...]`` class indices in ``[0, V)``, the same on every rank of the group.
        label_smoothing: ``a`` in ``[0, 1)``.
        group: the tensor-parallel group (default: the default grid's; see
            :func:`~microspeed_pipeline.tensor_parallel.get_tensor_model_parallel_group`).

    Returns:
        The loss of every token, shape of ``target``, in float32 (or float64 for float64 logits); the
        gradient flows back to ``vocab_parallel_logits`` in its dtype.

    As in Megatron there is **no** ``ignore_index``: every target must be a valid class (an id
    outside ``[0, V)`` is not checked, to avoid a device sync, and gives a meaningless loss). To
    leave tokens out (padding), give them any valid id and multiply the returned per-token loss by
    a 0/1 mask before reducing it, like Megatron's ``loss_mask``.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1), got {label_smoothing}.")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(vocab_parallel_logits.shape)} do not match "
                         f"target {tuple(target.shape)}; logits must be target's shape plus the vocabulary slice.")
    group = get_tensor_model_parallel_group(group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing), group)
