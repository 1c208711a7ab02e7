"""HF ``Trainer`` with ``TrainingArguments(deepspeed=...)`` on a tiny GPT-2, synthetic data, CPU/gloo.

Run under ``torchrun --nproc_per_node 2``. Two phases, chosen with ``--phase``:

* ``full``: train ``--max-steps`` optimizer steps, saving a checkpoint every ``--save-steps``;
* ``resume``: the same run, resumed from ``<out-dir>/checkpoint-<save-steps>`` (written by ``full``).

Rank 0 writes ``{"loss": {step: loss}, "grad_norm": {step: norm}, "deepspeed": <module file>}`` as
JSON to ``--json``. Whichever ``deepspeed`` is first on ``sys.path`` is used: real DeepSpeed to record
the reference figures, microspeed's stand-in to compare.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def ds_config(stage: int, client_optimizer: bool, offload: bool = False) -> dict:
    """A DeepSpeed config as HF users write it ("auto" values filled in by the Trainer)."""
    cfg: dict = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": "auto"},
    }
    if stage == 3:
        cfg["zero_optimization"].update(
            {"stage3_gather_16bit_weights_on_model_save": True, "stage3_param_persistence_threshold": 0}
        )
    if offload:  # optimizer states and step on the CPU: DeepSpeedCPUAdam (torch_adam off)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if not client_optimizer:
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                       "torch_adam": not offload},
        }
        cfg["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                       "total_num_steps": "auto"},
        }
    return cfg


class TokenData(torch.utils.data.Dataset):
    """Seeded token sequences with a learnable rule (each token = previous + a per-row stride), labels = inputs."""

    def __init__(self, n: int = 64, seq: int = 16, vocab: int = 128) -> None:
        g = torch.Generator().manual_seed(1234)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    """Parse arguments, train, write rank 0's figures."""
    from clientrun import imported_deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--phase", choices=["full", "resume"], required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--client-optimizer", action="store_true", help="let the Trainer build the optimizer")
    p.add_argument("--offload", action="store_true", help="offload_optimizer to the CPU (DeepSpeedCPUAdam)")
    p.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True), config bf16 'auto'")
    a = p.parse_args()

    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = TrainingArguments(
        output_dir=a.out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-2, warmup_steps=2, max_steps=a.max_steps, max_grad_norm=1.0, weight_decay=0.01,
        logging_steps=1, save_steps=a.save_steps, save_strategy="steps", seed=0, data_seed=0,
        use_cpu=True, ddp_backend="gloo", report_to=[], deepspeed=ds_config(a.stage, a.client_optimizer, a.offload),
        dataloader_num_workers=0, disable_tqdm=True, save_only_model=False, bf16=a.bf16,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenData())
    resume = os.path.join(a.out_dir, f"checkpoint-{a.save_steps}") if a.phase == "resume" else None
    trainer.train(resume_from_checkpoint=resume)
    if int(os.environ.get("RANK", "0")) == 0:
        loss, gn = {}, {}
        for rec in trainer.state.log_history:
            if "loss" in rec:
                loss[rec["step"]] = rec["loss"]
                if rec.get("grad_norm") is not None:
                    gn[rec["step"]] = float(rec["grad_norm"])
        engine = trainer.model_wrapped
        with open(a.json, "w") as f:
            json.dump({"loss": loss, "grad_norm": gn, "bf16_enabled": bool(engine.bfloat16_enabled()),
                       "param_dtype": str(next(engine.module.parameters()).dtype), **imported_deepspeed()}, f, indent=1)


if __name__ == "__main__":
    main()
