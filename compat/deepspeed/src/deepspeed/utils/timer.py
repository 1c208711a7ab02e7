"""``deepspeed.utils.timer``: ``trim_mean`` (the comms logger's averaging, :func:`microspeed.comm.trim_mean`)."""

from microspeed.comm import trim_mean

__all__ = ["trim_mean"]
