"""``deepspeed.runtime``: the engine, ZeRO, LR schedules, pipeline and activation checkpointing, from microspeed."""
