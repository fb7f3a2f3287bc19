"""What jzero's step tells an optimizer while it traces the update: where each leaf rests.

The step (:mod:`jzero.step.train_step`) traces ``optimizer.update`` inside :func:`update_layout`,
with the plan's update layout; an optimizer that does better knowing it (Muon,
:mod:`jzero.optim.muon_optimizer`, orthogonalises each matrix whole on the devices its leaf is
sharded over) reads it with :func:`current_update_layout`. The step and the optimizers import this
module and not each other, so the generic step depends on no optimizer.

Decisions:

* A context variable, not an argument: optax's ``update(updates, state, params)`` has no room
  for shardings, and every other transformation ignores them.
* Leaves are keyed by their ``jax.tree_util.keystr`` path. Outside the step (a plain
  ``jax.jit``, the leafwise check, the streamed update of ``sub_group_size``) there is no
  layout, and :func:`current_update_layout` is empty.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding

__all__ = ["current_update_layout", "update_layout"]

_UPDATE_LAYOUT: contextvars.ContextVar[dict[str, NamedSharding] | None] = contextvars.ContextVar(
    "jzero_update_layout", default=None
)


@contextlib.contextmanager
def update_layout(shardings: Any) -> Iterator[None]:
    """While tracing an update inside it, optimizers know where each leaf rests: ``shardings``
    is a tree of ``NamedSharding`` with the params' structure (jzero's step passes the plan's
    update layout)."""
    flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
    token = _UPDATE_LAYOUT.set({jax.tree_util.keystr(p): s for p, s in flat})
    try:
        yield
    finally:
        _UPDATE_LAYOUT.reset(token)


def current_update_layout() -> dict[str, NamedSharding]:
    """The sharding of each leaf of the update being traced, by ``keystr`` path; empty outside
    :func:`update_layout`."""
    return _UPDATE_LAYOUT.get() or {}
