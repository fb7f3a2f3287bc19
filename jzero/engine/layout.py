"""The layout the loss asks for: the stacked-layer dimensions its scans consume, found once by
tracing it, and which leaves a re-plan for them moves.

Decisions:

* **Traced, never run.** The loss is traced on a micro-batch of the batch's shapes (the
  config's micro batch, or before the first train batch sets it, the batch's rows over the
  data axis): :func:`jzero.rewrite.layer_dims` finds the dimension each scan consumes, and
  under pipelining :func:`jzero.parallel.pipeline.split_at_layers` the leaves its layer scan
  splits into stages.
* **A leaf moves when its resting layout changes**: the dimension its parameter or its
  optimizer state is split on, its resting (padded) shape, or its base spec. That happens only
  to a state created before the batch's shapes were known (read before the first batch, with no
  ``initialize(batch=...)``); the engine then moves the leaves that changed, once.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from jzero.plan import Plan

__all__ = ["log_moved", "moved_leaves", "shardings_differ", "traced_layers"]

logger = logging.getLogger(__name__)
PyTree = Any


def traced_layers(setup: Any, batch: PyTree) -> tuple[Any, dict[str, Any]]:
    """The stacked-layer dimensions the loss of ``setup`` (a :class:`jzero.engine.resolve.Setup`)
    consumes in its scans (traced on a micro-batch of ``batch``'s shapes), and under pipelining
    the leaves its layer scan splits (``{"pipe_leaves": ...}``, the keywords a re-plan takes;
    else empty)."""
    from jzero.parallel.pipeline import split_at_layers
    from jzero.rewrite import layer_dims

    plan = setup.plan
    rows = setup.micro_batch_size  # before the first train batch (all "auto"): this one's
    if rows is None:
        rows = max(1, np.shape(jax.tree.leaves(batch)[0])[0] // plan.data_parallel_size)
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *np.shape(x)[1:]), x.dtype), batch)
    args = (setup.extra, micro) if setup.takes_extra else (micro,)
    dims = layer_dims(setup.loss_fn, plan.abstract_params, *args)
    piped = {}
    if plan.options.parallel.pipe_axis:  # the leaves the layer scan consumes split into stages
        split = split_at_layers(setup.loss_fn, plan.compute_params, *args)
        piped = {"pipe_leaves": split.scanned}
    return dims, piped


def _layout(plan: Plan) -> list[Any]:
    """Where each leaf is split, and its resting shape."""
    return [
        (x.param_dim, x.state_dim, x.stored_shape(), spec)
        for x, spec in zip(plan.leaves, plan.base_specs or [()] * len(plan.leaves), strict=True)
    ]


def moved_leaves(old: Plan, new: Plan) -> list[str]:
    """The paths of the leaves whose resting layout differs between ``old`` and ``new``
    (empty: the state stays as it is)."""
    return [
        leaf.path
        for leaf, a, b in zip(new.leaves, _layout(new), _layout(old), strict=True)
        if a != b
    ]


def shardings_differ(old: Plan, new: Plan) -> bool:
    """Whether a state resting under ``old`` rests elsewhere under ``new``: another mesh, stage
    or memory kind, though no leaf's split changed."""
    from jzero.step import state_shardings

    return jax.tree.leaves(state_shardings(old)) != jax.tree.leaves(state_shardings(new))


def log_moved(moved: list[str]) -> None:
    """The one log line of a state moved to its layer scan's layout."""
    logger.info(
        "jzero: %d stacked-layer parameters (%s) are now laid out for their layer scan: "
        "split into pipeline stages, and at stage 3 sharded beside the dimension the scan "
        "consumes, so each layer is gathered on its own",
        len(moved),
        ", ".join(moved[:4]) + (" ..." if len(moved) > 4 else ""),
    )
