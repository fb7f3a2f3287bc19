"""The loss rewritten: the traced loss replayed with stage 3's gathers, prefetch and remat.

Import direction: imports :mod:`jzero.comm` (the collectives it emits); imported by
:mod:`jzero.step` and the engine. It knows nothing of configs or plans beyond the partition
it is given.

* :mod:`~jzero.replay.trace`: jaxpr tools, the layers of a Python loop, remat per layer.
* :mod:`~jzero.replay.interpreter`: the interpreter that replays a jaxpr equation by equation.
* :mod:`~jzero.replay.pending`: a parameter pending its gather, and the all-gather that resolves
  it.
* :mod:`~jzero.replay.gather`: :func:`gathered`, the entry point, and :func:`layer_dims`.
* :mod:`~jzero.replay.layer_split`: the loss cut at its layer scan into the unit each pipeline
  stage runs.
* :mod:`~jzero.replay.backward_split`: a stage unit's backward pass split into input- and
  weight-gradient passes (the zero-bubble schedule's).
* :mod:`~jzero.replay.overlap`: stage 3's ``overlap_comm``, the layer scan that gathers one layer
  ahead.
* :mod:`~jzero.replay.prefetch`: DeepSpeed's prefetch and reuse knobs on the gather order.
* :mod:`~jzero.replay.remat`: rematerialisation (activation checkpointing) policies.

The package exports what is used outside it; the jaxpr tools and the remat constants are read
from their modules (``jzero.replay.trace.tie_to``). Those names, ``Event`` (now
:class:`~jzero.replay.prefetch.GatherEvent`: :mod:`jzero.monitor` has an ``Event`` of its own)
and the modules ``param_gather`` (now ``pending``) and ``overlapped_scan`` (now ``overlap``;
``jzero.replay.overlapped_scan`` is the function) still work here for a release, with a
``DeprecationWarning`` naming the new import.
"""

from typing import Any

from jzero._util import moved, renamed_module
from jzero.replay import trace as _trace
from jzero.replay.backward_split import split_backward as split_backward
from jzero.replay.gather import GatherOptions as GatherOptions
from jzero.replay.gather import gathered as gathered
from jzero.replay.gather import layer_dims as layer_dims
from jzero.replay.gather import remat_scans as remat_scans
from jzero.replay.gather import replay as replay
from jzero.replay.interpreter import GATHERED as GATHERED
from jzero.replay.interpreter import PARTITIONED as PARTITIONED
from jzero.replay.interpreter import remat_save_policy as remat_save_policy
from jzero.replay.layer_split import NoLayerScan as NoLayerScan
from jzero.replay.layer_split import split_at_layers as split_at_layers
from jzero.replay.layer_split import stage_unit as stage_unit
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
    "NoLayerScan",
    "overlapped_scan",
    "parse_policy",
    "Partition",
    "PARTITIONED",
    "prefetch_anchors",
    "RematPolicy",
    "remat_save_policy",
    "remat_scans",
    "replay",
    "split_at_layers",
    "split_backward",
    "stage_unit",
]

# Names this package exported once, read from their modules now (old name -> new dotted path).
_MOVED = {
    "Event": "jzero.replay.prefetch.GatherEvent",
    "ACTIVATION": "jzero.replay.remat.ACTIVATION",
    "LAYER_INPUT": "jzero.replay.remat.LAYER_INPUT",
    "POLICIES": "jzero.choices.POLICIES",
    "LayerSplit": "jzero.replay.layer_split.LayerSplit",
    # trace's own names, but the one this package still exports
    **{name: f"jzero.replay.trace.{name}" for name in _trace.__all__ if name not in __all__},
}

_PARAM_GATHER = renamed_module(f"{__name__}.param_gather", f"{__name__}.pending")
renamed_module(f"{__name__}.overlapped_scan", f"{__name__}.overlap")


def __getattr__(name: str) -> Any:
    """A name in ``_MOVED``: its new home, with a ``DeprecationWarning`` (for a release); the
    module ``param_gather``: its alias, whose names warn when read."""
    if name in _MOVED:
        return moved(f"{__name__}.{name}", _MOVED[name])
    if name == "param_gather":
        return _PARAM_GATHER
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
