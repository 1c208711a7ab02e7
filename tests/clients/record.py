"""Regenerate the reference figures in ``fixtures/`` from real DeepSpeed 0.19.8 (CPU, gloo, 2 ranks).

Usage: ``python tests/clients/record.py [hf] [accelerate] [lightning] [examples]`` (no argument: all). Needs real
DeepSpeed installed (the ``reference`` extra); the runs take a few minutes on 2 cores. The tests compare
microspeed, through its ``deepspeed`` stand-in, with what this writes.
"""

from __future__ import annotations

import sys
import tempfile

import clientrun as c


def main(which: list[str]) -> None:
    """Record the chosen clients' figures."""
    which = which or ["hf", "accelerate", "lightning", "examples"]
    with tempfile.TemporaryDirectory() as d:
        if "hf" in which:
            for stage in (2, 3):
                c.save_fixture(f"hf_trainer_zero{stage}", c.run_hf_trainer(stage, "deepspeed", d))
            c.save_fixture("hf_trainer_zero2_offload", c.run_hf_trainer(2, "deepspeed", d, offload=True))
            c.save_fixture("hf_trainer_zero2_bf16", c.run_hf_trainer(2, "deepspeed", d, bf16=True))
        if "accelerate" in which:
            for stage in (2, 3):
                c.save_fixture(f"accelerate_zero{stage}", c.run_accelerate(stage, "deepspeed", d))
            c.save_fixture("accelerate_zero2_resume", c.run_accelerate_resume(2, "deepspeed", d))
        if "lightning" in which:
            c.save_fixture("lightning_zero2", c.run_lightning(2, "deepspeed", d))
        if "examples" in which:
            import examples_run

            for name, case in examples_run.CASES.items():
                try:
                    result = examples_run.run_case(case, "deepspeed", d)
                except c.ClientRunError as exc:  # e.g. fp16 on a CPU without fp16 kernels: recorded as refused
                    result = {"refused": c.error_lines(str(exc))}
                c.save_fixture(f"example_{name}", result)


if __name__ == "__main__":
    main(sys.argv[1:])
