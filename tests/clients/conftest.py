"""Client tests: real libraries (HF Trainer, Accelerate, Lightning, DeepSpeedExamples) on microspeed's stand-in."""

from __future__ import annotations

import clientrun as c
import pytest


@pytest.fixture
def standin():
    """The stand-in folder (``compat/deepspeed/src``); skips when this checkout has none."""
    if not (c.STANDIN / "deepspeed" / "__init__.py").exists():
        pytest.skip(f"no deepspeed stand-in at {c.STANDIN}")
    return c.STANDIN
