"""The core's own ds_config keys: the batch triad and the ``plugins`` section."""

from __future__ import annotations

from microspeed.config import Field, Section, positive
from microspeed.hookspecs import hookimpl


class CoreConfigPlugin:
    """Claims the keys the engine itself reads; the triad is resolved in :mod:`microspeed.config`."""

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """The batch triad and ``plugins.disable``."""
        return {
            "train_batch_size": Field((int,), None, "samples per optimizer step, all ranks", positive, auto=True),
            "train_micro_batch_size_per_gpu": Field((int,), None, "samples per forward on one rank",
                                                    positive, auto=True),
            "gradient_accumulation_steps": Field((int,), None, "micro-steps per optimizer step",
                                                 positive, auto=True),
            "plugins": Section({"disable": Field((list,), [], "plugin names not to load")},
                               doc="plugin selection"),
        }
