"""``deepspeed.ops.op_builder``: which of DeepSpeed's ops exist here, and where microspeed implements them.

DeepSpeed compiles its ops (C++/CUDA extensions) through builder classes; code asks a builder whether its
op works on this system (``is_compatible()``, or ``deepspeed.ops.__compatible_ops__[Builder.NAME]``) and
``load()``s it. microspeed compiles nothing: the optimizers DeepSpeed ships as ops are torch code in
microspeed, so their builders here answer "compatible" and ``load()`` returns microspeed's module that
implements them. Every other DeepSpeed op (inference kernels, transformer kernels, async I/O, quantizers,
...) is not provided: :data:`COMPATIBLE_OPS` lists it as ``False`` and no builder class exists for it.
"""

from __future__ import annotations

import importlib
import types

__all__ = ["ALL_OPS", "COMPATIBLE_OPS", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder", "FusedAdamBuilder",
           "FusedLambBuilder", "FusedLionBuilder", "OpBuilder", "get_default_compute_capabilities"]


class OpBuilder:
    """A DeepSpeed op that microspeed implements in torch: ``NAME``, and the module that implements it."""

    NAME = ""
    MODULE = ""  # the microspeed module implementing the op

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        """DeepSpeed's dotted name of the op."""
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether the op works here: always (it is torch code, on the CPU and on CUDA)."""
        del verbose
        return True

    def load(self, verbose: bool = True) -> types.ModuleType:
        """microspeed's module implementing the op (nothing is compiled)."""
        del verbose
        return importlib.import_module(self.MODULE)

    def builder(self) -> None:
        """DeepSpeed returns a torch extension to compile; there is nothing to compile here."""
        raise NotImplementedError(f"{self.NAME}: microspeed implements this op in torch ({self.MODULE}); "
                                  "there is no extension to build. Use load().")


class FusedAdamBuilder(OpBuilder):
    """DeepSpeed's fused Adam: :class:`microspeed.ops.fused_adam.FusedAdam`."""

    NAME = "fused_adam"
    MODULE = "microspeed.ops.fused_adam"


class CPUAdamBuilder(OpBuilder):
    """DeepSpeed's CPU Adam: :class:`microspeed.ops.cpu_optimizers.DeepSpeedCPUAdam`."""

    NAME = "cpu_adam"
    MODULE = "microspeed.ops.cpu_optimizers"


class CPUAdagradBuilder(OpBuilder):
    """DeepSpeed's CPU Adagrad: :class:`microspeed.ops.cpu_optimizers.DeepSpeedCPUAdagrad`."""

    NAME = "cpu_adagrad"
    MODULE = "microspeed.ops.cpu_optimizers"


class CPULionBuilder(OpBuilder):
    """DeepSpeed's CPU Lion: :class:`microspeed.ops.cpu_optimizers.DeepSpeedCPULion`."""

    NAME = "cpu_lion"
    MODULE = "microspeed.ops.cpu_optimizers"


class FusedLionBuilder(OpBuilder):
    """DeepSpeed's fused Lion: :class:`microspeed.ops.cpu_optimizers.FusedLion`."""

    NAME = "fused_lion"
    MODULE = "microspeed.ops.cpu_optimizers"


class FusedLambBuilder(OpBuilder):
    """DeepSpeed's fused LAMB: microspeed's LAMB (:class:`microspeed.builtin.lamb.Lamb`)."""

    NAME = "fused_lamb"
    MODULE = "microspeed.builtin.lamb"


#: Builders of the ops microspeed implements, by op name.
ALL_OPS: dict[str, OpBuilder] = {b.NAME: b() for b in (FusedAdamBuilder, CPUAdamBuilder, CPUAdagradBuilder,
                                                        CPULionBuilder, FusedLionBuilder, FusedLambBuilder)}

#: DeepSpeed's ops microspeed does not provide (no builder here).
NOT_PROVIDED = ("async_io", "gds", "pin_memory", "transformer", "stochastic_transformer", "transformer_inference",
                "inference_core_ops", "cutlass_ops", "ragged_device_ops", "ragged_ops", "quantizer", "fp_quantizer",
                "random_ltd", "spatial_inference", "evoformer_attn", "sparse_attn", "dc", "utils",
                "deepspeed_not_implemented", "deepspeed_ccl_comm", "deepspeed_shm_comm")

#: Op name -> whether it works here (DeepSpeed's ``deepspeed.ops.__compatible_ops__``).
COMPATIBLE_OPS: dict[str, bool] = {**{name: True for name in ALL_OPS}, **dict.fromkeys(NOT_PROVIDED, False)}


def get_default_compute_capabilities() -> str:
    """DeepSpeed's default CUDA arch list for builds; microspeed builds nothing, so it is empty."""
    return ""
