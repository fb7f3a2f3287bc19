"""The loss rewritten: the traced loss replayed with stage 3's gathers, prefetch and remat.

Import direction: imports :mod:`jzero.comm` (the collectives it emits); imported by
:mod:`jzero.step` and the engine. It knows nothing of configs or plans beyond the partition
it is given.

* :mod:`~jzero.replay.trace`: jaxpr tools, the layers of a Python loop, remat per layer.
* :mod:`~jzero.replay.interpreter`: the interpreter that replays a jaxpr equation by equation.
* :mod:`~jzero.replay.pending`: a parameter pending its gather, and the all-gather that resolves
  it.
* :mod:`~jzero.replay.gather`: :func:`gathered`, the entry point, and :func:`layer_dims`.
* :mod:`~jzero.replay.overlap`: stage 3's ``overlap_comm``, the layer scan that gathers one layer
  ahead.
* :mod:`~jzero.replay.prefetch`: DeepSpeed's prefetch and reuse knobs on the gather order.
* :mod:`~jzero.replay.remat`: rematerialisation (activation checkpointing) policies.

The package exports what is used outside it; the jaxpr tools and the remat constants are read
from their modules (``jzero.replay.trace.tie_to``). A gather's record is
:class:`~jzero.replay.prefetch.GatherEvent` (:mod:`jzero.monitor` has an ``Event`` of its own);
``jzero.replay.overlapped_scan`` is the function, its module ``overlap``.
"""

from jzero.replay.gather import GatherOptions as GatherOptions
from jzero.replay.gather import gathered as gathered
from jzero.replay.gather import layer_dims as layer_dims
from jzero.replay.gather import remat_scans as remat_scans
from jzero.replay.gather import replay as replay
from jzero.replay.interpreter import GATHERED as GATHERED
from jzero.replay.interpreter import PARTITIONED as PARTITIONED
from jzero.replay.interpreter import remat_save_policy as remat_save_policy
from jzero.replay.overlap import can_overlap as can_overlap
from jzero.replay.overlap import overlapped_scan as overlapped_scan
from jzero.replay.pending import all_gather as all_gather
from jzero.replay.prefetch import GatherEvent as GatherEvent
from jzero.replay.prefetch import kept_leaves as kept_leaves
from jzero.replay.prefetch import prefetch_anchors as prefetch_anchors
from jzero.replay.remat import RematPolicy as RematPolicy
from jzero.replay.remat import parse_policy as parse_policy
from jzero.replay.trace import Partition as Partition

__all__ = [
    "GatherOptions",
    "all_gather",
    "can_overlap",
    "GatherEvent",
    "GATHERED",
    "gathered",
    "kept_leaves",
    "layer_dims",
    "overlapped_scan",
    "parse_policy",
    "Partition",
    "PARTITIONED",
    "prefetch_anchors",
    "RematPolicy",
    "remat_save_policy",
    "remat_scans",
    "replay",
]
