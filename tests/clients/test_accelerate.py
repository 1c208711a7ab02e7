"""Accelerate's ``DeepSpeedPlugin`` under ``accelerate launch --use_deepspeed`` (2 processes, CPU) on microspeed.

Gradient accumulation 2 through ``accelerator.accumulate`` (which drives ``set_gradient_accumulation_boundary``),
clipping, a client torch AdamW and LambdaLR scheduler handed to ``deepspeed.initialize``: every micro-step's loss,
learning rate and the final weights' norm (``accelerator.get_state_dict``) equal real DeepSpeed 0.19.8's recorded
run (``fixtures/accelerate_zero*.json``, ``record.py accelerate``) within ``clientrun.RTOL``.
"""

from __future__ import annotations

import clientrun as c
import pytest

pytestmark = [pytest.mark.slow, c.needs("accelerate"), pytest.mark.timeout(400)]


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_matches_deepspeed(stage, tmp_path, standin):
    ref = c.load_fixture(f"accelerate_zero{stage}")
    got = c.run_accelerate(stage, "microspeed", tmp_path)
    c.assert_microspeed_imported(got)
    c.close(got["lr"], ref["lr"], f"ZeRO-{stage} learning rate")
    c.close(got["loss"], ref["loss"], f"ZeRO-{stage} loss")
    c.close(got["weight_norm"], ref["weight_norm"], f"ZeRO-{stage} final weights' norm")


def test_accelerate_save_state_resume_matches_deepspeed(tmp_path, standin):
    """``accelerator.save_state`` after 6 micro-steps (ZeRO-2), then a new launch that ``load_state``s and runs
    micro-steps 7-12: both runs' figures equal real DeepSpeed's (``fixtures/accelerate_zero2_resume.json``)."""
    ref = c.load_fixture("accelerate_zero2_resume")
    got = c.run_accelerate_resume(2, "microspeed", tmp_path)
    for phase in ("full", "resume"):
        c.assert_microspeed_imported(got[phase])
        c.close(got[phase]["lr"], ref[phase]["lr"], f"{phase} learning rate")
        c.close(got[phase]["loss"], ref[phase]["loss"], f"{phase} loss")
        c.close(got[phase]["weight_norm"], ref[phase]["weight_norm"], f"{phase} final weights' norm")
