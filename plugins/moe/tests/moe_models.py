"""A small model with one MoE layer, its data, and the single-process reference the tests compare with."""

from __future__ import annotations

import torch
from torch import nn

HIDDEN, EXPERTS, MICRO, TOKENS = 8, 4, 2, 6


class Net(nn.Module):
    """Linear → MoE (experts are 2-layer MLPs) → Linear; the loss adds the MoE's auxiliary loss."""

    def __init__(self, ep_size: int = 1, k: int = 1, drop_tokens: bool = True, capacity_factor: float = 1.0,
                 use_residual: bool = False) -> None:
        super().__init__()
        from microspeed_moe.layer import MoE

        torch.manual_seed(0)
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=k, capacity_factor=capacity_factor,
                       min_capacity=2, drop_tokens=drop_tokens, use_rts=False, use_residual=use_residual,
                       top2_2nd_expert_sampling=False)
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return nn.functional.mse_loss(self.out(h).squeeze(-1), y) + 0.01 * l_aux


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch at ``step``: ``[MICRO, TOKENS, HIDDEN]`` inputs, ``[MICRO, TOKENS]`` targets."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO, TOKENS, HIDDEN, generator=g), torch.randn(MICRO, TOKENS, generator=g)


def config(extra: dict | None = None) -> dict:
    """Adam, no clipping unless asked."""
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, **(extra or {})}


def reference_losses(world: int, steps: int, clip: float = 0.0, **net_kwargs) -> list[float]:
    """ep_size 1 in one process: every rank's micro-batch through the same experts, losses averaged."""
    net = Net(ep_size=1, **net_kwargs)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        loss = torch.stack([net(batch(step, r)) for r in range(world)]).mean()
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        out.append(loss.item())
    return out
