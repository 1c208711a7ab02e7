"""``deepspeed.runtime.activation_checkpointing``: ``checkpointing`` is :mod:`microspeed.checkpointing`."""
