"""The leaf rule: which dimension of a parameter leaf ZeRO shards, and why one stays whole.

Decisions:

* A leaf is sharded over the data axis on its *leading* dimension (of more than one element),
  so that every shard is one contiguous block of the row-major array (FSDP2's dim-0 sharding,
  DeepSpeed's flat partitions). Collectives on a major dimension need no layout copies around
  them; a minor dimension makes XLA gather and reduce-scatter with copies of gradient and
  parameter size around each (160 ``copy`` ops in a stage-1 GPT step, measured, under a
  former largest-dimension rule; 28 copies, 6.4 MiB, under a divisible-leading-dimension rule
  for a 4-layer stack on 8 devices). Where parameters are sharded at rest (stage 3), a
  stacked-layer dimension that a ``scan`` consumes (``layer_dims``, found by tracing the loss:
  :func:`jzero.rewrite.gather.layer_dims`) is skipped, so the scan's per-layer slice stays whole
  and is gathered one layer at a time; each layer's shard is then contiguous within the layer.
* **Padding.** When the shard count does not divide the dimension, the dimension is padded
  with zeros up to a multiple of it (FSDP2 pads its last dim-0 shard the same way), so every
  leaf is sharded at any device count: 50,257 rows on 8 devices rest as 50,264, 6,283 rows a
  device. The padding exists only where arrays rest (:mod:`jzero.plan.padding`): the loss,
  the optimizer update, ``engine.params``, checkpoints and exports see the logical shapes, and
  the padded elements are zeros that no gradient, norm or update reads.
* **Merged leading dimensions.** Where only the gradient and optimizer state are sharded (the
  parameter rests whole: stages 1-2, and stage 3's persistent parameters) and the leading
  dimension is a divisor of the shard count smaller than it, the state rests with its leading
  dimensions merged into one that divides evenly: a 4-layer stack (4, 128, 512) on 8 devices
  rests as (512, 512), half a layer a device, exact and contiguous, as DeepSpeed's flat
  partitions are (a leaf with another mesh axis in its spec is never merged: it is padded).
  Inside the step the merge is a reshape that XLA's partitioner lays out as
  4 x 2 tiles, no data moved (measured: an AdamW update through it compiles to no collective
  and no copy). Where no merge divides evenly the leading dimension is padded.
* The one exception to the leading dimension: when padding it would add more than half of it
  (4 rows padded to 8), no merge applies (the parameter is sharded at rest) and a later
  dimension divides evenly, that one is sharded instead (exact bytes, at the price of the
  copies above).
* At stage 3 a parameter with fewer elements than ``stage3_param_persistence_threshold`` stays
  replicated (DeepSpeed's persistent parameters); its gradient and optimizer state are still
  sharded, as in DeepSpeed.
* A user's own ``PartitionSpec`` on other mesh axes is kept; the data axis goes on a dimension
  that the user left free.
* Every :class:`LeafPlan` says why ZeRO could not shard its leaf (``note``), so the plan's
  table (:func:`jzero.plan.describe`) can list the leaves left whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jzero.choices.stages import StageSpec

__all__ = [
    "LeafPlan",
    "axis_entry",
    "divisible_dim",
    "is_contiguous",
    "pad_to",
    "padded_size",
    "shard_dim",
    "unpad_to",
]


def padded_size(n: int, shards: int) -> int:
    """``n`` rounded up to a multiple of ``shards``: a sharded dimension's length at rest."""
    return -(-n // shards) * shards


def divisible_dim(
    shape: Sequence[int],
    num_shards: int,
    free: Sequence[bool] | None = None,
    skip: Sequence[int] = (),
) -> int | None:
    """The leading dimension ``num_shards`` divides (and is free, not skipped), else ``None``:
    where a leaf can be split without padding."""
    if num_shards <= 1:
        return None
    for d, n in enumerate(shape):
        if (free is not None and not free[d]) or d in skip:
            continue
        if n >= num_shards and n % num_shards == 0:
            return d
    return None


def shard_dim(
    shape: Sequence[int],
    num_shards: int,
    free: Sequence[bool] | None = None,
    skip: Sequence[int] = (),
) -> int | None:
    """The dimension a leaf is sharded on: its leading one of more than one element, padded to
    a multiple of ``num_shards`` where that does not divide it.

    Args:
      shape: the leaf's shape.
      num_shards: the size of the data axis.
      free: per dimension, whether it is free for the data axis (not used by another axis).
      skip: dimensions that must stay whole (a stacked-layer dimension a scan consumes).

    Returns:
      The first free, unskipped dimension of more than one element; a later dimension that
      ``num_shards`` divides instead when padding the first would add more than half of it
      (4 rows padded to 8, say; 12 padded to 16 stays). ``None`` when there is no such dimension
      (a scalar, all ones) or only one shard.
    """
    if num_shards <= 1:
        return None
    for d, n in enumerate(shape):
        if (free is not None and not free[d]) or d in skip or n <= 1:
            continue
        if 2 * padded_size(n, num_shards) > 3 * n:  # padding would add over half of it
            later = divisible_dim(shape, num_shards, free, (*skip, *range(d + 1)))
            if later is not None:
                return later
        return d
    return None


def is_contiguous(shape: Sequence[int], dim: int | None, layer_dims: Sequence[int] = ()) -> bool:
    """Whether sharding ``shape`` on ``dim`` gives each device one contiguous block of the
    row-major array (per layer slice when ``layer_dims`` lead): every dimension before ``dim``,
    other than the stacked-layer ones, has size 1."""
    if dim is None:
        return True
    return all(shape[d] == 1 or d in layer_dims for d in range(dim))


def spec_axis_names(spec: Any) -> frozenset[str]:
    """The mesh axis names a ``PartitionSpec`` (or its entries) uses."""
    names: set[str] = set()
    for entry in tuple(spec):
        if entry is not None:
            names.update((entry,) if isinstance(entry, str) else entry)
    return frozenset(names)


def axis_entry(axes: str | Sequence[str]) -> str | tuple[str, ...]:
    """One ``PartitionSpec`` entry for a dimension split over ``axes`` (major first)."""
    if isinstance(axes, str):
        return axes
    return axes[0] if len(axes) == 1 else tuple(axes)


def spec_with(base: P, ndim: int, dim: int | None, axis: str | Sequence[str]) -> P:
    """``base`` with ``axis`` on ``dim``: ZeRO's axes there, less any the leaf's own spec uses
    already (expert parallelism's ``expert`` on an expert leaf's experts dimension)."""
    entries = list(base) + [None] * (ndim - len(base))
    if dim is not None:
        own = spec_axis_names(base)
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        axes = tuple(a for a in axes if a not in own)
        entries[dim] = axis_entry(axes) if axes else None
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
      padded: the length ``state_dim`` rests at (a multiple of the state's shard count), the
        logical length where no padding is needed; ``None`` without a ``state_dim``. With
        ``merged`` leading dimensions, the length of the one dimension they rest as.
      merged: how many leading dimensions the gradient and optimizer state rest merged into
        their first (1: none); only where the parameter rests whole, ``state_dim`` then 0.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    param_dim: int | None
    state_dim: int | None
    note: str = ""
    layer_dim: int | None = None
    padded: int | None = None
    merged: int = 1

    @property
    def padding(self) -> int:
        """Zero rows added along ``state_dim`` (after any merge) so that every shard has the
        same length."""
        if self.state_dim is None:
            return 0
        return self.padded - math.prod(self.shape[self.state_dim : self.state_dim + self.merged])

    def stored_shape(self, sharded: bool = True) -> tuple[int, ...]:
        """The shape this leaf rests at when ``sharded`` (its gradient, master and optimizer
        state; its parameter where ``param_dim`` is set): padded along ``state_dim``, with
        its ``merged`` leading dimensions as one."""
        if not sharded or self.state_dim is None or (not self.padding and self.merged == 1):
            return self.shape
        d = self.state_dim
        return (*self.shape[:d], self.padded, *self.shape[d + self.merged :])

    @property
    def param_shape(self) -> tuple[int, ...]:
        """The shape the parameter rests at: padded where it is sharded at rest."""
        return self.stored_shape(self.param_dim is not None)


def leaf_plan(
    path: str,
    x: Any,
    base: P,
    num_shards: int,
    stage: StageSpec,
    persistence_threshold: int,
    layer_dim: int | None = None,
    padding: bool = True,
) -> LeafPlan:
    shape = tuple(x.shape)
    free = [d >= len(base) or base[d] is None for d in range(len(shape))]
    # At rest-sharded stages the scan's per-layer slice must stay whole.
    skip = (layer_dim,) if layer_dim is not None and stage.shard_params else ()
    rule = shard_dim if padding else divisible_dim
    dim = rule(shape, num_shards, free, skip)
    note = ""
    if not stage.shard_opt_state:
        return LeafPlan(path, shape, x.dtype, None, None, "", layer_dim)
    if dim is None:
        note = (
            "the data axis has one device"
            if num_shards <= 1
            else f"no dimension of {shape} has more than one element"
            if padding
            else f"no dimension of {shape} is divisible by the data axis size {num_shards} "
            "(the NVMe tier does not pad)"
        )
        if skip and rule(shape, num_shards, free) is not None:
            note += f" apart from its stacked-layer dimension {layer_dim}, which stays whole"
    param_dim = dim if stage.shard_params else None
    if param_dim is not None and math.prod(shape) < persistence_threshold:
        param_dim = None
        note = (
            f"parameter kept whole: {math.prod(shape):,} elements is below "
            f"stage3_param_persistence_threshold={persistence_threshold:,}"
        )
    if param_dim is None and skip:  # the state of a whole parameter is never scanned
        dim = rule(shape, num_shards, free)
    merged = 1
    # A merge drops dimensions from the resting shape, so only a leaf with no other mesh axis
    # (whose spec would have to drop them too) is merged.
    if padding and param_dim is None and dim is not None and all(free):
        merged = _mergeable(shape, num_shards, free)
        dim = 0 if merged > 1 else dim
    length = math.prod(shape[dim : dim + merged]) if dim is not None else 0
    padded = None if dim is None else padded_size(length, num_shards)
    return LeafPlan(path, shape, x.dtype, param_dim, dim, note, layer_dim, padded, merged)


def _mergeable(shape: tuple[int, ...], num_shards: int, free: Sequence[bool]) -> int:
    """How many leading dimensions merge into one that ``num_shards`` divides with every shard
    a whole number of rows of the last merged dimension (so the merged view lays out as tiles
    of the leading dimensions): the first dimensions' sizes divide the shard count, the last
    takes what remains evenly. 1 when the leading dimension divides by itself, or nothing
    merges so."""
    rest = num_shards
    for m, n in enumerate(shape):
        if not free[m]:
            return 1
        if n % rest == 0:
            return m + 1 if m else 1
        if n > 1 and rest % n:
            return 1
        rest //= max(n, 1)
    return 1


def pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``x`` as it rests at ``shape``: its leading dimensions merged into one where ``shape``
    has fewer, then zeros appended along every dimension shorter than ``shape``'s."""
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    merged = x.ndim - len(shape) + 1
    if merged > 1:
        x = x.reshape((-1, *x.shape[merged:]))
    return jnp.pad(x, [(0, int(t) - int(n)) for n, t in zip(x.shape, shape, strict=True)])


def unpad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The logical array of shape ``shape`` that ``x`` rests as (:func:`pad_to` undone)."""
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    merged = len(shape) - x.ndim + 1
    block = (math.prod(shape[:merged]), *shape[merged:])
    y = jax.lax.slice(x, (0,) * x.ndim, block) if tuple(x.shape) != block else x
    return y.reshape(shape) if merged > 1 else y
