"""The leaf rule: which dimension of a parameter leaf ZeRO shards, and why one stays whole.

Decisions:

* A leaf is sharded over the data axis on its *leading* dimension that the data-axis size
  divides, so that every shard is one contiguous block of the row-major array (FSDP2's dim-0
  sharding, DeepSpeed's flat partitions). Collectives on a major dimension need no layout
  copies around them; the former rule (largest dimension, last on a tie) made XLA gather and
  reduce-scatter along minor dimensions with copies of gradient and parameter size around each
  (160 ``copy`` ops in a stage-1 GPT step, measured). Where parameters are sharded at rest
  (stage 3), a stacked-layer dimension that a ``scan`` consumes (``layer_dims``, found by
  tracing the loss: :func:`jzero.replay.gather.layer_dims`) is skipped, so the scan's per-layer
  slice stays whole and is gathered one layer at a time; each layer's shard is then contiguous
  within the layer. A leaf with no divisible dimension stays replicated.
* At stage 3 a parameter with fewer elements than ``stage3_param_persistence_threshold`` stays
  replicated (DeepSpeed's persistent parameters); its gradient and optimizer state are still
  sharded, as in DeepSpeed.
* A user's own ``PartitionSpec`` on other mesh axes is kept; the data axis goes on a dimension
  that the user left free.
* Every :class:`LeafPlan` says why ZeRO could not shard its leaf (``note``), so the plan's
  table (:meth:`jzero.plan.Plan.describe`) can list the leaves left whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax.sharding import PartitionSpec as P

from jzero.plan.stages import StageSpec

__all__ = ["LeafPlan", "axis_entry", "is_contiguous", "shard_dim"]


def shard_dim(
    shape: Sequence[int],
    num_shards: int,
    free: Sequence[bool] | None = None,
    skip: Sequence[int] = (),
) -> int | None:
    """The dimension a leaf is sharded on: the leading one ``num_shards`` divides, else ``None``.

    Args:
      shape: the leaf's shape.
      num_shards: the size of the data axis.
      free: per dimension, whether it is free for the data axis (not used by another axis).
      skip: dimensions that must stay whole (a stacked-layer dimension a scan consumes).

    Returns:
      The first dimension in order that fits, or ``None`` when none fits or there is only one
      shard.
    """
    if num_shards <= 1:
        return None
    for d, n in enumerate(shape):
        if (free is not None and not free[d]) or d in skip:
            continue
        if n >= num_shards and n % num_shards == 0:
            return d
    return None


def is_contiguous(shape: Sequence[int], dim: int | None, layer_dims: Sequence[int] = ()) -> bool:
    """Whether sharding ``shape`` on ``dim`` gives each device one contiguous block of the
    row-major array (per layer slice when ``layer_dims`` lead): every dimension before ``dim``,
    other than the stacked-layer ones, has size 1."""
    if dim is None:
        return True
    return all(shape[d] == 1 or d in layer_dims for d in range(dim))


def axis_entry(axes: str | Sequence[str]) -> str | tuple[str, ...]:
    """One ``PartitionSpec`` entry for a dimension split over ``axes`` (major first)."""
    if isinstance(axes, str):
        return axes
    return axes[0] if len(axes) == 1 else tuple(axes)


def _spec_with(base: P, ndim: int, dim: int | None, axis: str | Sequence[str]) -> P:
    entries = list(base) + [None] * (ndim - len(base))
    if dim is not None:
        entries[dim] = axis_entry(axis)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


@dataclass(frozen=True)
class LeafPlan:
    """How one parameter leaf is laid out.

    Attributes:
      path: the leaf's path in the params tree, dotted.
      shape: the full shape.
      dtype: the dtype.
      param_dim: the dimension sharded over the data axis at rest, or ``None`` (replicated).
      state_dim: the dimension that gradients and optimizer state are sharded on, or ``None``.
      note: why ZeRO could not shard this leaf, empty when it could.
      layer_dim: the stacked-layer dimension a ``scan`` consumes, or ``None``.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    param_dim: int | None
    state_dim: int | None
    note: str = ""
    layer_dim: int | None = None


def _leaf_plan(
    path: str,
    x: Any,
    base: P,
    num_shards: int,
    stage: StageSpec,
    persistence_threshold: int,
    layer_dim: int | None = None,
) -> LeafPlan:
    shape = tuple(x.shape)
    free = [d >= len(base) or base[d] is None for d in range(len(shape))]
    # At rest-sharded stages the scan's per-layer slice must stay whole.
    skip = (layer_dim,) if layer_dim is not None and stage.shard_params else ()
    dim = shard_dim(shape, num_shards, free, skip)
    note = ""
    if not stage.shard_opt_state:
        return LeafPlan(path, shape, x.dtype, None, None, "", layer_dim)
    if dim is None:
        note = (
            f"no dimension of {shape} is divisible by the data axis size {num_shards}"
            if num_shards > 1
            else "the data axis has one device"
        )
        if skip and shard_dim(shape, num_shards, free) is not None:
            note += f" apart from its stacked-layer dimension {layer_dim}, which stays whole"
    param_dim = dim if stage.shard_params else None
    if param_dim is not None and math.prod(shape) < persistence_threshold:
        param_dim = None
        note = (
            f"parameter kept whole: {math.prod(shape):,} elements is below "
            f"stage3_param_persistence_threshold={persistence_threshold:,}"
        )
    return LeafPlan(path, shape, x.dtype, param_dim, dim, note, layer_dim)
