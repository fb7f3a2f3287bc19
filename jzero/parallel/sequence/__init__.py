"""Attention over a sequence split across devices: Ulysses over the ``seq`` axis, ring
attention over the ``context`` axis, both together, and the token layout they share.

* :mod:`~jzero.parallel.sequence.ulysses`: DeepSpeed-Ulysses, two all-to-alls around an
  unchanged attention function (:func:`sequence_parallel_attention`); splits the heads, so
  ``seq`` stops at the (key/value) head count.
* :mod:`~jzero.parallel.sequence.ring`: ring attention (:func:`ring_attention`), keys and
  values passed around ``context`` with an online softmax, zig-zag load balancing; and
  :func:`context_parallel_attention`, Ulysses within each ring member and the ring across.
* :mod:`~jzero.parallel.sequence.layout`: which tokens each device holds
  (:func:`sequence_chunk`, :func:`context_chunk`) and their places in the row
  (:func:`sequence_positions`, :func:`sequence_offset`).
"""

from jzero.distributed.mesh import CONTEXT_AXIS as CONTEXT_AXIS
from jzero.distributed.mesh import SEQ_AXIS as SEQ_AXIS
from jzero.parallel.sequence.layout import bound_axis_size as bound_axis_size
from jzero.parallel.sequence.layout import context_chunk as context_chunk
from jzero.parallel.sequence.layout import sequence_chunk as sequence_chunk
from jzero.parallel.sequence.layout import sequence_offset as sequence_offset
from jzero.parallel.sequence.layout import sequence_positions as sequence_positions
from jzero.parallel.sequence.ring import context_parallel_attention as context_parallel_attention
from jzero.parallel.sequence.ring import ring_attention as ring_attention
from jzero.parallel.sequence.ulysses import (
    sequence_parallel_attention as sequence_parallel_attention,
)

__all__ = [
    "bound_axis_size",
    "CONTEXT_AXIS",
    "context_chunk",
    "context_parallel_attention",
    "ring_attention",
    "SEQ_AXIS",
    "sequence_chunk",
    "sequence_offset",
    "sequence_parallel_attention",
    "sequence_positions",
]
