"""What the ``moe`` plugin declares to the composition matrix (``microspeed plugins --matrix``).

The refusals are module-level constants: the plugin raises with their
:meth:`~microspeed.plugin_api.Refusal.message` and ``microspeed_refusals`` declares the same objects, so
the text a user reads at ``initialize()`` is the text the matrix shows. Lifting a refusal means deleting
its constant here together with the code that raises it (MoE with pipeline or tensor parallelism and
MoE with ZeRO-3 were lifted: expert groups are cut inside each data-parallel group, and ZeRO-3 partitions
an expert over its expert-data-parallel group).
"""

from __future__ import annotations

from microspeed.plugin_api import Feature, refuse_pairs

FEATURES = (
    Feature("moe", "mixture of experts (expert parallelism)",
            "MoE layers in the model (deepspeed.moe.layer.MoE / microspeed_moe.MoE), ep_size > 1 for expert "
            "parallelism"),
)
"""The ``moe`` plugin's feature."""

MOE_WITH_FP32_ACCUMULATION = refuse_pairs(
    ("moe",), ("bf16",),
    reason="fp32 gradient accumulation sums the micro-batches in a separate fp32 buffer, while expert gradients "
           "are reduced over their own groups from the parameters' own gradients, which that buffer bypasses",
    instead="remove data_types.grad_accum_dtype (bf16 training accumulates in the parameters' gradients)",
    when="data_types.grad_accum_dtype is fp32")
"""MoE with bf16 and fp32 gradient accumulation (a condition, not the whole pair)."""

REFUSALS = MOE_WITH_FP32_ACCUMULATION
"""Everything the ``moe`` plugin refuses."""
