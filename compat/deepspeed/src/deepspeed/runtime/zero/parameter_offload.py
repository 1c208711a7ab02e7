"""``deepspeed.runtime.zero.parameter_offload``: DeepSpeed's ZeRO-3 parameter hooks module.

microspeed's ZeRO-3 gathers parameters from module hooks and from uses of released parameters (a torch
function mode), not through a ``ZeROOrderedDict`` in each module's ``_parameters``; so this module's
classes are not mapped and importing one raises an ``ImportError`` giving the reason (see :data:`ABSENT`).
The hook handles are :attr:`microspeed.zero.ZeroOptimizerStage3.forward_hooks`.
"""

from __future__ import annotations

from typing import Any

__all__: list[str] = []

_HOOKS = ("microspeed's ZeRO-3 gathers on module hooks and on uses of released parameters, not through a "
          "ZeROOrderedDict in module._parameters")

ABSENT: dict[str, str] = {
    "DeepSpeedZeRoOffload": "DeepSpeed's ZeRO-3 hook manager; microspeed's is internal to its ZeRO plugin (the "
                            "optimizer's forward_hooks lists its hooks)",
    "ZeROOrderedDict": _HOOKS,
    "ensure_zero_ordered_dict": _HOOKS,
    "print_rank_0": "DeepSpeed's internal logging helper",
}
"""DeepSpeed names of this module microspeed does not provide, with the reason."""


def __getattr__(name: str) -> Any:
    from deepspeed.runtime.zero import absent_name

    return absent_name(__name__, name, ABSENT)
