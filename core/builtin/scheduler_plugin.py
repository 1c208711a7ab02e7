"""The ``scheduler`` section: DeepSpeed's LR schedules by name, or any torch scheduler."""

from __future__ import annotations

from typing import Any

from microspeed.config import Field, Section
from microspeed.hookspecs import hookimpl


class SchedulerPlugin:
    """Builds the LR scheduler (:mod:`microspeed.builtin.lr_schedules`)."""

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``scheduler``: ``type`` and ``params`` (checked against the schedule's signature)."""
        return {"scheduler": Section({
            "type": Field((str,), None, "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, "
                          "or a torch.optim.lr_scheduler name", required=True),
            "params": Section(open=True, doc="keyword arguments of the schedule"),
        }, doc="learning-rate schedule")}

    @hookimpl(trylast=True)
    def microspeed_make_scheduler(self, optimizer: Any, config) -> Any:
        """Build the schedule the ``scheduler`` section names."""
        from microspeed.builtin.lr_schedules import build_scheduler

        return build_scheduler(optimizer, config["scheduler"])
