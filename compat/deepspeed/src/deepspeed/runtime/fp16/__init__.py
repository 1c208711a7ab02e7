"""``deepspeed.runtime.fp16``: ``loss_scaler`` is microspeed's (:mod:`microspeed.builtin.loss_scaler`)."""
