"""Lightning's ``DeepSpeedStrategy(stage=2)`` on CPU, 2 processes, through a checkpoint save and resume.

Lightning refuses DeepSpeed off CUDA in its own code; ``lightning_run.py`` lifts exactly those checks (see its
docstring). Each micro-batch loss of 2 epochs (accumulation 2, clipping, AdamW + StepLR per step), the checkpoint
``ModelCheckpoint`` writes at the end of epoch 0 (engine ``save_checkpoint`` with Lightning's client state, the
optimizer's ``state_dict``), and a second ``fit(ckpt_path=...)`` that resumes there: losses, learning rates and
final weights' norm equal real DeepSpeed 0.19.8's recorded run (``fixtures/lightning_zero2.json``).
"""

from __future__ import annotations

import clientrun as c
import pytest

pytestmark = [pytest.mark.slow, c.needs("lightning"), pytest.mark.timeout(600)]


def test_lightning_zero2_save_resume_matches_deepspeed(tmp_path, standin):
    ref = c.load_fixture("lightning_zero2")
    got = c.run_lightning(2, "microspeed", tmp_path)
    for phase in ("full", "resume"):
        c.assert_microspeed_imported(got[phase])
        assert got[phase]["global_step"] == ref[phase]["global_step"]
        c.close(got[phase]["loss"], ref[phase]["loss"], f"{phase} loss")
        c.close(got[phase]["lr"], ref[phase]["lr"], f"{phase} learning rate")
        c.close(got[phase]["weight_norm"], ref[phase]["weight_norm"], f"{phase} final weights' norm")
