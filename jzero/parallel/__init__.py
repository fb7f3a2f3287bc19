"""The parallelisms, one room each: where its axis splits leaves and activations, its step part.

Import direction: imports :mod:`jzero.distributed` (the mesh's axes), :mod:`jzero.choices`
(the schedule names), :mod:`jzero.plan`, :mod:`jzero.rewrite` and :mod:`jzero.comm` (what its
part of the step reads and emits); imported by :mod:`jzero.step`, which runs the one
data-parallel step and calls each room's hooks, the engine and the demo's model. As in
torchtitan's ``distributed/``, one module per technique:

* :mod:`~jzero.parallel.zero`: ZeRO's part of the step: the loss with stage 3's gathers at
  their use (:func:`~jzero.parallel.zero.local_loss`), the gradient reductions each stage
  makes, the ``shard_map`` over the data axis, and its leaf rule
  (:mod:`jzero.parallel.zero.leaf_rule`), which the plan is made from.
* :mod:`~jzero.parallel.hybrid`: hybrid sharding and ZeRO++ hpZ, the gradient shards summed
  over the ``replica`` axis.
* :mod:`~jzero.parallel.tensor`: AutoTP, Megatron-style ``model``-axis specs from the
  parameters' names and shapes.
* :mod:`~jzero.parallel.sequence`: attention over a sequence split across devices:
  DeepSpeed-Ulysses on the ``seq`` axis by two all-to-alls, ring attention on the
  ``context`` axis (zig-zag chunks, keys and values passed around the ring), and both.
* :mod:`~jzero.parallel.pipeline`: pipeline parallelism's schedules (GPipe, 1F1B,
  interleaved, zero-bubble), the engine that runs one over the ``pipe`` axis, the loss cut
  into stage units, and its part of the step.
* :mod:`~jzero.parallel.expert`: mixture of experts, a top-k router and dispatch to experts
  split over the ``expert`` axis by one all-to-all each way (``jzero.moe``).
"""

from typing import TYPE_CHECKING

from jzero._util import lazy_exports

if TYPE_CHECKING:
    from jzero.parallel import expert as expert
    from jzero.parallel import hybrid as hybrid
    from jzero.parallel import pipeline as pipeline
    from jzero.parallel import sequence as sequence
    from jzero.parallel import tensor as tensor
    from jzero.parallel import zero as zero
    from jzero.parallel.pipeline import SCHEDULES as SCHEDULES
    from jzero.parallel.pipeline import Schedule as Schedule
    from jzero.parallel.pipeline import bubble_fraction as bubble_fraction
    from jzero.parallel.pipeline import make_schedule as make_schedule
    from jzero.parallel.sequence import context_chunk as context_chunk
    from jzero.parallel.sequence import context_parallel_attention as context_parallel_attention
    from jzero.parallel.sequence import ring_attention as ring_attention
    from jzero.parallel.sequence import sequence_chunk as sequence_chunk
    from jzero.parallel.sequence import sequence_offset as sequence_offset
    from jzero.parallel.sequence import sequence_parallel_attention as sequence_parallel_attention
    from jzero.parallel.sequence import sequence_positions as sequence_positions
    from jzero.parallel.tensor import MODEL_AXIS as MODEL_AXIS
    from jzero.parallel.tensor import TPChoice as TPChoice
    from jzero.parallel.tensor import autotp_specs as autotp_specs

__all__ = [
    "autotp_specs",
    "bubble_fraction",
    "context_chunk",
    "context_parallel_attention",
    "expert",
    "hybrid",
    "make_schedule",
    "MODEL_AXIS",
    "pipeline",
    "ring_attention",
    "Schedule",
    "SCHEDULES",
    "sequence",
    "sequence_chunk",
    "sequence_offset",
    "sequence_parallel_attention",
    "sequence_positions",
    "tensor",
    "TPChoice",
    "zero",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "expert": "jzero.parallel.expert",
        "hybrid": "jzero.parallel.hybrid",
        "pipeline": "jzero.parallel.pipeline",
        "sequence": "jzero.parallel.sequence",
        "tensor": "jzero.parallel.tensor",
        "zero": "jzero.parallel.zero",
        "SCHEDULES": "jzero.parallel.pipeline.SCHEDULES",
        "Schedule": "jzero.parallel.pipeline.Schedule",
        "bubble_fraction": "jzero.parallel.pipeline.bubble_fraction",
        "make_schedule": "jzero.parallel.pipeline.make_schedule",
        "context_chunk": "jzero.parallel.sequence.context_chunk",
        "context_parallel_attention": "jzero.parallel.sequence.context_parallel_attention",
        "ring_attention": "jzero.parallel.sequence.ring_attention",
        "sequence_chunk": "jzero.parallel.sequence.sequence_chunk",
        "sequence_offset": "jzero.parallel.sequence.sequence_offset",
        "sequence_parallel_attention": "jzero.parallel.sequence.sequence_parallel_attention",
        "sequence_positions": "jzero.parallel.sequence.sequence_positions",
        "MODEL_AXIS": "jzero.parallel.tensor.MODEL_AXIS",
        "TPChoice": "jzero.parallel.tensor.TPChoice",
        "autotp_specs": "jzero.parallel.tensor.autotp_specs",
    },
)
