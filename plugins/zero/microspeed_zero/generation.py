"""Generation under ZeRO-3: :func:`unwrap_model_for_generation` (DeepSpeed's, as TRL's RLHF trainers call it).

A ``generate()`` call runs the model's forward once per new token. Under ZeRO-3 each forward gathers every
module's parameters and releases them after, so a generation of ``n`` tokens would gather the model ``n``
times. Inside :func:`unwrap_model_for_generation` the whole model is gathered once (every data-parallel rank
enters it: the gather is collective) and the stage-3 module hooks are removed, so the forwards of the block
use the whole parameters as they are; on exit the hooks are installed again and the parameters released
(partitioned as before: changes made inside the block are discarded, as with ``GatheredParameters``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from microspeed_zero.init import GatheredParameters, _stage3_runtime


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Yield ``model`` (an engine or a module) with all its parameters whole for the block, gathered once.

    DeepSpeed's signature and result: the object passed in is yielded. For parameters that are not
    partitioned (stages 0-2) the block costs nothing. Memory: the whole model is held on every rank for
    the block, as in DeepSpeed.
    """
    params = list(model.parameters())
    partitioners: dict[int, Any] = {}
    for p in params:
        rt = _stage3_runtime(p)
        if rt is not None:
            partitioners.setdefault(id(rt.stage3), rt.stage3)
    with GatheredParameters(params), contextlib.ExitStack() as hooks_off:
        for partitioner in partitioners.values():
            hooks_off.enter_context(partitioner.without_hooks())
        yield model
