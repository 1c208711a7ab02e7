"""Accelerate with ``DeepSpeedPlugin`` on a tiny model, synthetic data; launched by ``accelerate launch``.

Run as ``accelerate launch --num_processes 2 --use_deepspeed accelerate_run.py --stage N --json OUT``.
The training loop is the one Accelerate's docs show: ``accelerator.prepare`` then ``accelerator.accumulate``
with gradient accumulation 2, ``accelerator.backward``, ``clip_grad_norm_``, ``optimizer.step``,
``scheduler.step``, ``zero_grad``. With ``--state-dir`` the run calls ``accelerator.save_state`` after
``--save-at`` micro-steps; ``--resume`` starts from there instead (``load_state``, ``skip_first_batches``) and
records the remaining micro-steps only. Rank 0 writes the per-micro-step losses (averaged over ranks), the
learning rates and the final weights' norm (from ``accelerator.get_state_dict``) as JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json

import torch


class Net(torch.nn.Module):
    """A small MLP regression model."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                       torch.nn.GELU(), torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Predict one value per row."""
        return self.net(x)


def main() -> None:
    """Train with Accelerate + DeepSpeedPlugin and write rank 0's figures."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--json", required=True)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps")
    p.add_argument("--state-dir", default=None, help="save_state here after --save-at micro-steps")
    p.add_argument("--save-at", type=int, default=6, help="micro-steps before save_state / after load_state")
    p.add_argument("--resume", action="store_true", help="load_state(--state-dir), skip --save-at micro-batches")
    a = p.parse_args()

    plugin = DeepSpeedPlugin(zero_stage=a.stage, gradient_accumulation_steps=2, gradient_clipping=1.0,
                             zero3_save_16bit_model=True)
    # On a machine without an accelerator, Accelerate only counts the launched processes when it is told the
    # process-group backend (else it takes "no backend" for "one process"): gloo, as HF Trainer's ddp_backend.
    accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    set_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(256, 1, generator=g))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    losses, lrs = [], []
    start = 0
    if a.resume:
        accelerator.load_state(a.state_dir)
        loader = accelerator.skip_first_batches(loader, a.save_at)
        start = a.save_at
    for i, (xb, yb) in enumerate(loader, start=start):
        if i >= 2 * a.steps:
            break
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(accelerator.gather(loss.detach().reshape(1)).mean().item())
        lrs.append(sched.get_last_lr()[0])
        if a.state_dir and not a.resume and i + 1 == a.save_at:
            accelerator.save_state(a.state_dir)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        from clientrun import imported_deepspeed

        norm = torch.sqrt(sum((v.float() ** 2).sum() for v in state.values())).item()
        with open(a.json, "w") as f:
            json.dump({"loss": losses, "lr": lrs, "weight_norm": norm, **imported_deepspeed()}, f, indent=1)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
