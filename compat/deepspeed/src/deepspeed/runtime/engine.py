"""``deepspeed.runtime.engine``: :class:`microspeed.Engine` under DeepSpeed's name."""

from microspeed import Engine

DeepSpeedEngine = Engine
"""DeepSpeed's name for the engine class."""

#: DeepSpeed's optimizer type names (the ``optimizer.type`` values of a ds_config).
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"

__all__ = ["DeepSpeedEngine", "Engine"]
