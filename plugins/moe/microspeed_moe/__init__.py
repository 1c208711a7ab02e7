"""microspeed-moe: Mixture-of-Experts layers, gating, expert parallelism and routing kernels.

``import microspeed as deepspeed`` scripts reach it as ``deepspeed.moe`` (``deepspeed.moe.layer.MoE``,
``deepspeed.moe.sharded_moe.top1gating``, ``deepspeed.moe.utils.is_moe_param``, ...).
"""

from microspeed_moe import experts, gating, groups, layer, pipe, routing, sharded_moe, utils
from microspeed_moe.layer import MoE
from microspeed_moe.pipe import CarryAux, MoEPipeLayer, aux_loss
from microspeed_moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["CarryAux", "MoE", "MoEPipeLayer", "aux_loss", "experts", "gating", "groups", "is_moe_param", "layer",
           "pipe", "routing", "sharded_moe", "split_params_into_different_moe_groups_for_optimizer", "utils"]
