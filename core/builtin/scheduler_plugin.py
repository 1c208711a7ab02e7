"""The ``scheduler`` section: DeepSpeed's LR schedules by name, or any torch scheduler."""

from __future__ import annotations

from typing import Any

from microspeed.config import Field, Section
from microspeed.hookspecs import hookimpl


def _known_schedule(name: str) -> str | None:
    """Check at parse time that ``scheduler.type`` names a schedule (a typo is reported with the other problems)."""
    from microspeed.builtin.lr_schedules import SCHEDULER_NAMES, _suggest, _torch_scheduler_classes

    torch_names = list(_torch_scheduler_classes())
    if name in SCHEDULER_NAMES or name in torch_names:
        return None
    return (f"a schedule name.{_suggest(name, [*SCHEDULER_NAMES, *torch_names])} DeepSpeed's schedules: "
            f"{', '.join(SCHEDULER_NAMES)}; any torch.optim.lr_scheduler class (e.g. 'StepLR') is accepted too")


class SchedulerPlugin:
    """Builds the LR scheduler (:mod:`microspeed.builtin.lr_schedules`)."""

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``scheduler``: ``type`` and ``params`` (checked against the schedule's signature)."""
        return {"scheduler": Section({
            "type": Field((str,), None, "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, "
                          "or a torch.optim.lr_scheduler name", _known_schedule, required=True),
            "params": Section(open=True, doc="keyword arguments of the schedule"),
        }, doc="learning-rate schedule")}

    @hookimpl(trylast=True)
    def microspeed_make_scheduler(self, optimizer: Any, config) -> Any:
        """Build the schedule the ``scheduler`` section names."""
        from microspeed.builtin.lr_schedules import build_scheduler

        return build_scheduler(optimizer, config["scheduler"])
