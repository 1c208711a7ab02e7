"""Lightning ``DeepSpeedStrategy(stage=2)`` on CPU, 2 processes, through a checkpoint save and resume.

Run under ``torchrun --nproc_per_node 2``. ``--phase full`` trains 2 epochs (3 optimizer steps each, gradient
accumulation 2) and saves a checkpoint at the end of epoch 0 (``ModelCheckpoint``); ``--phase resume`` fits
again from that checkpoint (``ckpt_path=``) and trains epoch 1. Rank 0 writes its per-micro-batch losses
(keyed by the global step they were computed at), the learning rates and the final weights' norm to ``--json``.

Lightning refuses DeepSpeed on anything but CUDA in its own code: ``DeepSpeedStrategy.setup_environment``
raises "The DeepSpeed strategy is only supported on CUDA GPUs", and ``setup_distributed`` validates CUDA device
indices ("The selected device indices [None, None] don't match ..."), and ``_setup_model_and_optimizer`` passes
``args=Namespace(device_rank=root_device.index)``, ``None`` on CPU, which DeepSpeed's engine compares with 0
(``TypeError``). The one change made here is a subclass that lifts those three (device_rank = the local rank,
nothing else), so the rest of Lightning's DeepSpeed path (config, ``deepspeed.initialize``, engine
``backward``/``step``, ``save_checkpoint``/``load_checkpoint``) runs as written.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import torch


def main() -> None:
    """Parse arguments, fit, write rank 0's figures."""
    import lightning.pytorch as pl
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """DeepSpeedStrategy without its CUDA-only checks (the only change)."""

        def setup_environment(self) -> None:  # noqa: D102 - see class docstring
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:  # noqa: D102 - as Lightning's, minus the CUDA device-index check
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):  # noqa: D102
            import argparse as ap

            import deepspeed

            engine, ds_opt, _, _ = deepspeed.initialize(
                args=ap.Namespace(device_rank=self.local_rank), config=self.config, model=model,
                model_parameters=filter(lambda q: q.requires_grad, model.parameters()), optimizer=optimizer,
                lr_scheduler=lr_scheduler, dist_init_required=False)
            return engine, ds_opt

    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["full", "resume"], required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--stage", type=int, default=2)
    a = p.parse_args()

    class Module(pl.LightningModule):
        """A small MLP regressor; records its losses."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
            self.record: dict[int, list[float]] = {}
            self.lrs: dict[int, float] = {}

        def training_step(self, batch, batch_idx):  # noqa: D102
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.record.setdefault(self.global_step, []).append(loss.item())
            self.lrs[self.global_step] = self.trainer.optimizers[0].param_groups[0]["lr"]
            return loss

        def configure_optimizers(self):  # noqa: D102
            opt = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    pl.seed_everything(0)
    model = Module()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 8, generator=g)
    y = x[:, :1] - 0.5 * x[:, 2:3]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)
    ckpt_dir = os.path.join(a.out_dir, "ckpt")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=CPUDeepSpeedStrategy(stage=a.stage, process_group_backend="gloo"),
        max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)],
    )
    ckpt = None
    if a.phase == "resume":
        ckpt = sorted(glob.glob(os.path.join(ckpt_dir, "epoch=0-*.ckpt")))[0]
    trainer.fit(model, loader, ckpt_path=ckpt)
    if trainer.global_rank == 0:
        from clientrun import imported_deepspeed

        norm = torch.sqrt(sum((q.detach().float() ** 2).sum() for q in model.parameters())).item()
        with open(a.json, "w") as f:
            json.dump({"loss": model.record, "lr": model.lrs, "weight_norm": norm, "global_step": trainer.global_step,
                       **imported_deepspeed()}, f, indent=1)


if __name__ == "__main__":
    main()
