"""Memory-lean building blocks for long sequences, for the built-in GPT and any model.

Attention that never holds a ``[T, T]`` score matrix, the output head's loss and the MLP
computed over sequence chunks, and rotary positions (no per-token parameters).

Import direction: imports JAX only (nothing of jzero's), so any package, the built-in GPT
(:mod:`jzero.demo.gpt`) and a user's model may import it.

* :mod:`~jzero.ops.attention`: :func:`blockwise_attention` (flash-style, online softmax over key
  blocks, packed documents and grouped-query attention, cuDNN's fused kernel on GPU where it
  applies), its body for queries and keys of any lengths (:func:`blockwise_partial`, each
  ring attention step's), and the online-softmax primitive both are loops of
  (:class:`Partial`, :func:`empty_partial`, :func:`attend_block`, :func:`merge`,
  :func:`finish`, :func:`block_mask`).
* :mod:`~jzero.ops.tiled`: :func:`tiled_cross_entropy` (the output head and the loss without
  ``[B, T, V]`` logits) and :func:`tiled_mlp` (a position-wise function over sequence chunks).
* :mod:`~jzero.ops.rotary`: :func:`rotary` (rotary position embeddings of queries and keys at
  given positions: no position table).
"""

from jzero.ops.attention import Partial as Partial
from jzero.ops.attention import attend_block as attend_block
from jzero.ops.attention import block_mask as block_mask
from jzero.ops.attention import blockwise_attention as blockwise_attention
from jzero.ops.attention import blockwise_partial as blockwise_partial
from jzero.ops.attention import empty_partial as empty_partial
from jzero.ops.attention import finish as finish
from jzero.ops.attention import merge as merge
from jzero.ops.rotary import rotary as rotary
from jzero.ops.tiled import tiled_cross_entropy as tiled_cross_entropy
from jzero.ops.tiled import tiled_mlp as tiled_mlp

__all__ = [
    "Partial",
    "attend_block",
    "block_mask",
    "blockwise_attention",
    "blockwise_partial",
    "empty_partial",
    "finish",
    "merge",
    "rotary",
    "tiled_cross_entropy",
    "tiled_mlp",
]
