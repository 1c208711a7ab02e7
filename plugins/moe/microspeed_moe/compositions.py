"""What the ``moe`` plugin declares to the composition matrix (``microspeed plugins --matrix``).

The refusals are module-level constants: the plugin raises with their
:meth:`~microspeed.plugin_api.Refusal.message` and ``microspeed_refusals`` declares the same objects, so
the text a user reads at ``initialize()`` is the text the matrix shows. Lifting a refusal means deleting
its constant here together with the code that raises it (MoE with pipeline or tensor parallelism and
MoE with ZeRO-3 were lifted: expert groups are cut inside each data-parallel group, and ZeRO-3 partitions
an expert over its expert-data-parallel group; MoE with bf16 and fp32 gradient accumulation too: experts
are reduced in the fp32 buffer mixed precision names through ``LossScaling.accumulated_grad``; and the 1-bit
optimizers with MoE, with or without ZeRO: their compressed exchanges run per replica group).
"""

from __future__ import annotations

from microspeed.plugin_api import Feature, Refusal

FEATURES = (
    Feature("moe", "mixture of experts (expert parallelism)",
            "MoE layers in the model (deepspeed.moe.layer.MoE / microspeed_moe.MoE), ep_size > 1 for expert "
            "parallelism"),
)
"""The ``moe`` plugin's feature."""

REFUSALS: tuple[Refusal, ...] = ()
"""Everything the ``moe`` plugin refuses."""
