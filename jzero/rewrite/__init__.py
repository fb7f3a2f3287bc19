"""The traced loss rewritten: stage 3's gathers placed at their use, prefetch, remat per layer.

Import direction: imports :mod:`jzero.comm` (the collectives it emits); imported by
:mod:`jzero.parallel` (ZeRO's and the pipeline's parts of the step), :mod:`jzero.step` and the
engine. It knows nothing of configs or plans beyond the partition it is given.

* :mod:`~jzero.rewrite.trace`: jaxpr tools, the layers of a Python loop, remat per layer.
* :mod:`~jzero.rewrite.interpreter`: the interpreter that replays a jaxpr equation by equation.
* :mod:`~jzero.rewrite.pending`: a parameter pending its gather, and the all-gather that resolves
  it.
* :mod:`~jzero.rewrite.gather`: the entry points: :func:`gather_at_use` (stage 3),
  :func:`remat_layers` and :func:`remat_scans` (activation checkpointing), :func:`layer_dims`.
* :mod:`~jzero.rewrite.megatron`: Megatron's tensor-parallel pairs read from the traced loss
  (AutoTP for a model with its own names).
* :mod:`~jzero.rewrite.overlap`: stage 3's ``overlap_comm``, the layer scan that gathers one layer
  ahead.
* :mod:`~jzero.rewrite.prefetch`: DeepSpeed's prefetch and reuse knobs on the gather order.
* :mod:`~jzero.rewrite.remat`: rematerialisation (activation checkpointing) policies.

The package exports what is used outside it; the jaxpr tools and the remat constants are read
from their modules (``jzero.rewrite.trace.tie_to``). A gather's record is
:class:`~jzero.rewrite.prefetch.GatherEvent` (:mod:`jzero.monitor` has an ``Event`` of its own);
``jzero.rewrite.overlapped_scan`` is the function, its module ``overlap``.
"""

from jzero.rewrite.gather import GatherOptions as GatherOptions
from jzero.rewrite.gather import gather_at_use as gather_at_use
from jzero.rewrite.gather import layer_dims as layer_dims
from jzero.rewrite.gather import remat_layers as remat_layers
from jzero.rewrite.gather import remat_scans as remat_scans
from jzero.rewrite.interpreter import GATHERED as GATHERED
from jzero.rewrite.interpreter import PARTITIONED as PARTITIONED
from jzero.rewrite.interpreter import remat_save_policy as remat_save_policy
from jzero.rewrite.megatron import ProgramSplit as ProgramSplit
from jzero.rewrite.megatron import program_splits as program_splits
from jzero.rewrite.overlap import can_overlap as can_overlap
from jzero.rewrite.overlap import overlapped_scan as overlapped_scan
from jzero.rewrite.pending import all_gather as all_gather
from jzero.rewrite.prefetch import GatherEvent as GatherEvent
from jzero.rewrite.prefetch import kept_leaves as kept_leaves
from jzero.rewrite.prefetch import prefetch_anchors as prefetch_anchors
from jzero.rewrite.remat import RematPolicy as RematPolicy
from jzero.rewrite.remat import parse_policy as parse_policy
from jzero.rewrite.trace import Partition as Partition

__all__ = [
    "GatherOptions",
    "all_gather",
    "can_overlap",
    "GatherEvent",
    "GATHERED",
    "gather_at_use",
    "kept_leaves",
    "layer_dims",
    "overlapped_scan",
    "parse_policy",
    "Partition",
    "PARTITIONED",
    "ProgramSplit",
    "program_splits",
    "prefetch_anchors",
    "RematPolicy",
    "remat_save_policy",
    "remat_scans",
    "remat_layers",
]
