"""DeepSpeed 0.19.8's ``zero.Init`` parameter attributes that DeepSpeed's own unit tests rely on.

Found by ``benchmarks/deepspeed_unit_tests.py`` (``tests/unit/runtime/zero/test_zero_context_ancestry.py``):
right after a module is built inside ``deepspeed.zero.Init``, DeepSpeed's tests read ``param.ds_status ==
ZeroParamStatus.NOT_AVAILABLE`` (and ``AVAILABLE`` inside ``GatheredParameters``), before any engine exists.
Here on one process (world size 1, gloo started by ``Init``).
"""

from __future__ import annotations

import microspeed_zero as zero
import torch
from microspeed_zero import ZeroParamStatus

_CONFIG = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}


class _Parent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.param_parent = torch.nn.Parameter(torch.ones(5))
        self.param_parent.data = (self.param_parent.data + 1).data  # written before partitioning


class _Child(_Parent):
    def __init__(self) -> None:
        super().__init__()
        self.param = torch.nn.Parameter(torch.ones(5))
        self.param.data = (self.param.data + 1).data
        self.param_parent.data = (self.param_parent.data + 1).data  # the parent's parameter, touched again


def _build() -> _Child:
    with zero.Init(config=_CONFIG):
        return _Child()


def test_subclass_params_partitioned_with_values_kept():
    """What already agrees: every level's parameters are partitioned and keep the values the constructors wrote."""
    model = _build()
    assert [p.numel() for p in model.parameters()] == [0, 0]
    assert [tuple(p.ds_shape) for p in model.parameters()] == [(5,), (5,)]
    with zero.GatheredParameters(list(model.parameters())):
        assert torch.equal(model.param_parent.data, torch.full((5,), 3.0))
        assert torch.equal(model.param.data, torch.full((5,), 2.0))


def test_ds_status_follows_gathering():
    """DeepSpeed sets ds_status (and ds_id) when zero.Init partitions a parameter, before any engine."""
    model = _build()
    params = list(model.parameters())
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)
    assert len({p.ds_id for p in params}) == len(params)
    with zero.GatheredParameters(params):
        assert all(p.ds_status == ZeroParamStatus.AVAILABLE for p in params)
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)
