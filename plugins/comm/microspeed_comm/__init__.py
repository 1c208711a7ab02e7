"""microspeed-comm: compressed collectives and the 1-bit optimizers, on any ``torch.distributed`` backend.

* :class:`CompressedAllReduce` — the error-feedback 1-bit all-reduce (:mod:`microspeed_comm.compressed`),
  with its sign-packing kernels in :mod:`microspeed_comm.bitpack` (Triton on GPU, PyTorch elsewhere);
* :class:`OneBitAdam`, :class:`ZeroOneAdam`, :class:`OneBitLamb` — DeepSpeed's communication-efficient
  optimizers, selected by ``optimizer.type`` in a ds_config once this distribution is installed
  (the ``comm`` plugin, :mod:`microspeed_comm.plugin`).
"""

from microspeed_comm.adam import OneBitAdam
from microspeed_comm.compressed import CompressedAllReduce
from microspeed_comm.lamb import OneBitLamb
from microspeed_comm.zero_one_adam import ZeroOneAdam

__all__ = ["CompressedAllReduce", "OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
