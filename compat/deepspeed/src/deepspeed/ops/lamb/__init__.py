"""``deepspeed.ops.lamb``: ``FusedLamb`` is microspeed's LAMB (:class:`microspeed.builtin.lamb.Lamb`)."""

from microspeed.builtin.lamb import Lamb as FusedLamb

__all__ = ["FusedLamb"]
