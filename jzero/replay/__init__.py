"""The loss rewritten: the traced loss replayed with stage 3's gathers, prefetch and remat.

Import direction: imports :mod:`jzero.comm` (the collectives it emits); imported by
:mod:`jzero.step` and the engine. It knows nothing of configs or plans beyond the partition
it is given.

* :mod:`~jzero.replay.trace`: jaxpr tools, the layers of a Python loop, remat per layer.
* :mod:`~jzero.replay.interpreter`: the interpreter that replays a jaxpr equation by equation.
* :mod:`~jzero.replay.param_gather`: one parameter's gather and its pending form.
* :mod:`~jzero.replay.gather`: :func:`gathered`, the entry point, and :func:`layer_dims`.
* :mod:`~jzero.replay.layer_split`: the loss cut at its layer scan into the unit each pipeline
  stage runs.
* :mod:`~jzero.replay.overlapped_scan`: the layer scan that gathers one layer ahead.
* :mod:`~jzero.replay.prefetch`: DeepSpeed's prefetch and reuse knobs on the gather order.
* :mod:`~jzero.replay.remat`: rematerialisation (activation checkpointing) policies.
"""

from jzero.replay.gather import gathered as gathered
from jzero.replay.gather import layer_dims as layer_dims
from jzero.replay.gather import remat_scans as remat_scans
from jzero.replay.gather import replay as replay
from jzero.replay.interpreter import GATHERED as GATHERED
from jzero.replay.interpreter import PARTITIONED as PARTITIONED
from jzero.replay.interpreter import remat_save_policy as remat_save_policy
from jzero.replay.layer_split import LayerSplit as LayerSplit
from jzero.replay.layer_split import NoLayerScan as NoLayerScan
from jzero.replay.layer_split import split_at_layers as split_at_layers
from jzero.replay.layer_split import stage_unit as stage_unit
from jzero.replay.overlapped_scan import can_overlap as can_overlap
from jzero.replay.overlapped_scan import overlapped_scan as overlapped_scan
from jzero.replay.param_gather import all_gather as all_gather
from jzero.replay.prefetch import Event as Event
from jzero.replay.prefetch import kept_leaves as kept_leaves
from jzero.replay.prefetch import prefetch_anchors as prefetch_anchors
from jzero.replay.remat import ACTIVATION as ACTIVATION
from jzero.replay.remat import LAYER_INPUT as LAYER_INPUT
from jzero.replay.remat import POLICIES as POLICIES
from jzero.replay.remat import RematPolicy as RematPolicy
from jzero.replay.remat import parse_policy as parse_policy
from jzero.replay.trace import Partition as Partition
from jzero.replay.trace import Segment as Segment
from jzero.replay.trace import bind as bind
from jzero.replay.trace import eval_tagged as eval_tagged
from jzero.replay.trace import find_layers as find_layers
from jzero.replay.trace import first_element as first_element
from jzero.replay.trace import has_scan as has_scan
from jzero.replay.trace import inline_calls as inline_calls
from jzero.replay.trace import inner_jaxpr as inner_jaxpr
from jzero.replay.trace import is_floating as is_floating
from jzero.replay.trace import layer_keys as layer_keys
from jzero.replay.trace import named as named
from jzero.replay.trace import remat_layer as remat_layer
from jzero.replay.trace import tie_all as tie_all
from jzero.replay.trace import tie_to as tie_to
from jzero.replay.trace import tied as tied

__all__ = [
    "ACTIVATION",
    "all_gather",
    "bind",
    "remat_save_policy",
    "remat_scans",
    "remat_layer",
    "eval_tagged",
    "Event",
    "find_layers",
    "LayerSplit",
    "NoLayerScan",
    "split_at_layers",
    "stage_unit",
    "first_element",
    "GATHERED",
    "gathered",
    "has_scan",
    "inline_calls",
    "inner_jaxpr",
    "is_floating",
    "kept_leaves",
    "layer_dims",
    "LAYER_INPUT",
    "layer_keys",
    "named",
    "parse_policy",
    "Partition",
    "PARTITIONED",
    "POLICIES",
    "prefetch_anchors",
    "RematPolicy",
    "replay",
    "Segment",
    "tie_all",
    "tie_to",
    "tied",
    "can_overlap",
    "overlapped_scan",
]
