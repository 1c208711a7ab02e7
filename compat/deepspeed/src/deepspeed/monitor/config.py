"""``deepspeed.monitor.config``: the monitor sections of a ds_config as DeepSpeed's config models.

``tensorboard`` and ``csv_monitor`` are the sections microspeed's built-in monitor claims (same keys and
defaults, validated by microspeed's parser). ``wandb`` and ``comet`` carry DeepSpeed's keys and defaults
so a config that names them reads as in DeepSpeed, but microspeed does not log to them.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field as PydanticField

from deepspeed.runtime.config_utils import DeepSpeedConfigModel, schema_model

__all__ = ["CSVConfig", "CometConfig", "DeepSpeedMonitorConfig", "TensorBoardConfig", "WandbConfig",
           "get_monitor_config"]

TensorBoardConfig = schema_model("tensorboard", "TensorBoardConfig", "The ``tensorboard`` section.")
CSVConfig = schema_model("csv_monitor", "CSVConfig", "The ``csv_monitor`` section.")


class WandbConfig(DeepSpeedConfigModel):
    """The ``wandb`` section (DeepSpeed's keys; microspeed does not log to Weights & Biases)."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CometConfig(DeepSpeedConfigModel):
    """The ``comet`` section (DeepSpeed's keys; microspeed does not log to Comet)."""

    enabled: bool = False
    samples_log_interval: int = 100
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None


class DeepSpeedMonitorConfig(DeepSpeedConfigModel):
    """All monitor sections; ``enabled`` is true when any of them is."""

    tensorboard: TensorBoardConfig = PydanticField(default_factory=TensorBoardConfig)  # type: ignore[valid-type]
    wandb: WandbConfig = PydanticField(default_factory=WandbConfig)
    csv_monitor: CSVConfig = PydanticField(default_factory=CSVConfig)  # type: ignore[valid-type]
    comet: CometConfig = PydanticField(default_factory=CometConfig)

    @property
    def enabled(self) -> bool:
        """Whether any monitor is enabled."""
        return bool(self.tensorboard.enabled or self.wandb.enabled or self.csv_monitor.enabled or self.comet.enabled)


def get_monitor_config(param_dict: dict[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor sections of a ds_config dict (absent ones at their defaults)."""
    return DeepSpeedMonitorConfig(**{k: param_dict.get(k, {}) for k in ("tensorboard", "wandb", "csv_monitor",
                                                                         "comet")})
