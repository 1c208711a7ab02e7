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
