"""Models that microspeed's plugins, examples, benchmarks and tests share (import name ``microspeed.models``).

* :mod:`microspeed.models.gpt`: a small GPT-2-style decoder (:class:`GPT`, :class:`GPTConfig`,
  :class:`Block`, :class:`MLP`, :class:`CausalSelfAttention`, :data:`AttentionFactory`), the model
  ``microspeed demo`` trains. ``microspeed.demo.model`` is the same module under its old name.
* :mod:`microspeed.models.torch_blocks`: models of torch's own layers (:class:`TorchBlocksGPT` of
  ``nn.TransformerEncoderLayer`` blocks, :class:`WideMLP`), for engines that must handle code they do not control.

Library code (plugins) imports models from here, never from :mod:`microspeed.demo`, which is the
demo application (its data and training script).
"""

from __future__ import annotations

from microspeed.models.gpt import GPT, MLP, AttentionFactory, Block, CausalSelfAttention, GPTConfig

__all__ = ["GPT", "MLP", "AttentionFactory", "Block", "CausalSelfAttention", "GPTConfig"]
