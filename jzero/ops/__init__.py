"""Memory-lean building blocks for long sequences, usable by any model: attention that never
holds a ``[T, T]`` score matrix, and the output head's loss and the MLP computed over sequence
chunks.

Import direction: imports JAX and NumPy only (nothing of jzero's), so any package, the built-in
GPT (:mod:`jzero.demo.gpt`) and a user's model may import it.

* :mod:`~jzero.ops.attention`: the online-softmax primitive (:class:`Partial`,
  :func:`empty_partial`, :func:`attend_block`, :func:`merge`, :func:`finish`,
  :func:`block_mask`) that blockwise and ring attention are loops of.
"""

from jzero.ops.attention import Partial as Partial
from jzero.ops.attention import attend_block as attend_block
from jzero.ops.attention import block_mask as block_mask
from jzero.ops.attention import empty_partial as empty_partial
from jzero.ops.attention import finish as finish
from jzero.ops.attention import merge as merge

__all__ = [
    "Partial",
    "attend_block",
    "block_mask",
    "empty_partial",
    "finish",
    "merge",
]
