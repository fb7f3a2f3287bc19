"""Host memory on shardings: which memory kind a leaf rests in, and which leaves go to host.

Decisions:

* Offload is a memory kind on a ``NamedSharding`` (``pinned_host`` or ``unpinned_host``), not a
  separate placement: :func:`is_host` reads it, :func:`on_device` gives the device-memory
  shardings the step computes on.
* ``offload_optimizer.ratio < 1`` offloads whole parameter leaves' optimizer state and masters,
  the largest first, each taken when it brings the offloaded elements closer to the fraction
  (:func:`_offloaded_leaves`); a leaf is never split, and every leaf goes at ratio 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from jzero.plan.leaf_rule import LeafPlan

__all__ = ["HOST_MEMORY_KINDS", "is_host", "on_device"]

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")
PyTree = Any


def is_host(sharding: Any) -> bool:
    """Whether a sharding places its array in host memory (offload)."""
    return getattr(sharding, "memory_kind", None) in HOST_MEMORY_KINDS


def on_device(shardings: PyTree) -> PyTree:
    """The same shardings in device memory (how the step computes on offloaded state)."""
    return jax.tree.map(
        lambda s: s.with_memory_kind("device") if is_host(s) else s,
        shardings,
        is_leaf=lambda s: isinstance(s, NamedSharding),
    )


def _offloaded_leaves(leaves: Sequence[LeafPlan], ratio: float) -> frozenset[int]:
    """The parameter leaves whose optimizer state and masters are offloaded for ``ratio``:
    largest first, each taken when it brings the offloaded elements closer to ``ratio`` of all
    (a leaf is never split); every leaf at ``ratio`` 1."""
    if ratio >= 1.0:
        return frozenset(range(len(leaves)))
    sizes = [math.prod(leaf.shape) for leaf in leaves]
    target, taken, chosen = ratio * sum(sizes), 0, set()
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if abs(taken + sizes[i] - target) < abs(taken - target):
            chosen.add(i)
            taken += sizes[i]
    return frozenset(chosen)


def _with_kind(shardings: PyTree, memory_kind: str | None) -> PyTree:
    if memory_kind is None:
        return shardings
    return jax.tree.map(
        lambda s: s.with_memory_kind(memory_kind),
        shardings,
        is_leaf=lambda s: isinstance(s, NamedSharding),
    )
