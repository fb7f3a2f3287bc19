"""The sharding plan: one ``NamedSharding`` per leaf of params, gradients, optimizer state, batch.

Decisions:

* The plan is computed from abstract values only (``jax.ShapeDtypeStruct``), so it exists before
  any parameter is allocated and works for meshes larger than the machine (an abstract mesh).
* Leaf rule: a leaf is sharded over the data axis on the largest dimension that the data-axis
  size divides; on a tie the *last* such dimension wins, so a leading stacked-layer dimension
  stays whole and stage 3 can gather one layer at a time. A leaf with no divisible dimension
  stays replicated. At stage 3 a parameter with fewer elements than
  ``stage3_param_persistence_threshold`` stays replicated (DeepSpeed's persistent parameters);
  its gradient and optimizer state are still sharded, as in DeepSpeed.
* A user's own ``PartitionSpec`` on other mesh axes is kept; the data axis goes on a dimension
  that the user left free.
* Optimizer-state shardings come from ``optax.tree_map_params``, so any optax chain works;
  a state leaf whose shape differs from its parameter's (e.g. factored moments) gets the leaf
  rule applied to its own shape, and non-parameter state (counts) is replicated.
* The stage decides which category is sharded by reading :mod:`jzero.stages`; nothing here
  branches on the stage number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.stages import StageSpec, stage_spec

__all__ = ["DATA_AXIS", "LeafPlan", "Plan", "make_plan", "shard_dim"]

DATA_AXIS = "data"
PyTree = Any


def shard_dim(
    shape: Sequence[int], num_shards: int, free: Sequence[bool] | None = None
) -> int | None:
    """The dimension a leaf is sharded on: the largest one ``num_shards`` divides, else ``None``.

    Args:
      shape: the leaf's shape.
      num_shards: the size of the data axis.
      free: per dimension, whether it is free for the data axis (not used by another axis).

    Returns:
      The chosen dimension (the last one on a tie), or ``None`` when no dimension fits or there
      is only one shard.
    """
    if num_shards <= 1:
        return None
    best = None
    for d, n in enumerate(shape):
        if free is not None and not free[d]:
            continue
        if n >= num_shards and n % num_shards == 0 and (best is None or n >= shape[best]):
            best = d
    return best


def _spec_with(base: P, ndim: int, dim: int | None, axis: str) -> P:
    entries = list(base) + [None] * (ndim - len(base))
    if dim is not None:
        entries[dim] = axis
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _path_str(path: Any) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".") or "<root>"


def _nbytes(x: Any) -> int:
    return int(math.prod(x.shape)) * np.dtype(x.dtype).itemsize


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
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    param_dim: int | None
    state_dim: int | None
    note: str = ""


@dataclass(frozen=True)
class Plan:
    """Shardings for every tree a training step touches, derived from one stage.

    Attributes:
      stage: the stage table row.
      mesh: the device mesh (``axis`` is its data-parallel axis).
      axis: the data-parallel axis name.
      abstract_params: the params as ``jax.ShapeDtypeStruct``.
      leaves: one :class:`LeafPlan` per parameter leaf, in ``jax.tree.leaves`` order.
      params: shardings of the params at rest.
      grads: shardings of the reduced gradients, as the optimizer update sees them.
      update: shardings the optimizer update runs in (params are cut to these for the update).
      abstract_opt_state: the optimizer state as ``jax.ShapeDtypeStruct``.
      opt_state: shardings of the optimizer state.
      batch: sharding of every batch leaf (leading dim over the data axis).
      replicated: a replicated sharding (scalars, metrics).
    """

    stage: StageSpec
    mesh: Mesh
    axis: str
    abstract_params: PyTree
    leaves: tuple[LeafPlan, ...]
    params: PyTree
    grads: PyTree
    update: PyTree
    abstract_opt_state: PyTree
    opt_state: PyTree
    batch: NamedSharding
    replicated: NamedSharding
    base_specs: tuple[P, ...] = field(default=())

    @property
    def num_shards(self) -> int:
        """The size of the data axis."""
        return int(self.mesh.shape[self.axis])

    @property
    def param_dims(self) -> list[int | None]:
        """Per parameter leaf, the dimension sharded at rest (``None`` if replicated)."""
        return [leaf.param_dim for leaf in self.leaves]

    @property
    def state_dims(self) -> list[int | None]:
        """Per parameter leaf, the dimension gradients and optimizer state are sharded on."""
        return [leaf.state_dim for leaf in self.leaves]

    def grad_dims(self) -> list[int | None]:
        """Per leaf, the dimension the reduced gradient is sharded on (``None``: all-reduced)."""
        return self.state_dims if self.stage.reduce_scatter else [None] * len(self.leaves)

    def per_device_bytes(self, tree: PyTree, shardings: PyTree) -> int:
        """Bytes one device holds of ``tree`` (abstract or concrete) laid out by ``shardings``."""
        total = 0
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
            shard = s.shard_shape(tuple(x.shape))
            total += int(math.prod(shard)) * np.dtype(x.dtype).itemsize
        return total

    def model_state_bytes(self) -> dict[str, int]:
        """Per-device bytes of params, gradient accumulator and optimizer state.

        The gradient accumulator is full-size at stages 0-1 and one shard at stages 2-3.
        """
        grad_acc = self.grads if self.stage.shard_grads else self.params_replicated()
        return {
            "params": self.per_device_bytes(self.abstract_params, self.params),
            "grads": self.per_device_bytes(self.abstract_params, grad_acc),
            "opt_state": self.per_device_bytes(self.abstract_opt_state, self.opt_state),
        }

    def params_replicated(self) -> PyTree:
        """Shardings that keep every parameter whole (other mesh axes still honoured)."""
        treedef = jax.tree.structure(self.abstract_params)
        return treedef.unflatten(
            [
                NamedSharding(self.mesh, _spec_with(b, len(leaf.shape), None, self.axis))
                for leaf, b in zip(self.leaves, self._bases(), strict=True)
            ]
        )

    def _bases(self) -> tuple[P, ...]:
        return self.base_specs or tuple(P() for _ in self.leaves)

    def describe(self) -> str:
        """A table of every leaf: shape, spec per category, per-device bytes, what stayed whole."""
        n = self.num_shards
        rows = [("leaf", "shape", "dtype", "params", "grads", "opt state", "bytes/device")]
        flat_p = jax.tree.leaves(self.params)
        flat_g = jax.tree.leaves(self.grads)
        for leaf, sp, sg in zip(self.leaves, flat_p, flat_g, strict=True):
            nbytes = math.prod(sp.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
            rows.append(
                (
                    leaf.path,
                    "x".join(map(str, leaf.shape)) or "()",
                    np.dtype(leaf.dtype).name,
                    str(tuple(sp.spec)),
                    str(tuple(sg.spec)),
                    str(tuple(sg.spec)) if self.stage.shard_opt_state else "()",
                    f"{nbytes:,}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            f"ZeRO stage {self.stage.stage} ({self.stage.description}) over "
            f"{self.axis}={n} of mesh {dict(self.mesh.shape)}",
        ]
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        totals = self.model_state_bytes()
        lines.append("")
        lines.append(
            "per-device model state: "
            + ", ".join(f"{k} {v:,} B" for k, v in totals.items())
            + f", total {sum(totals.values()):,} B"
        )
        whole = [leaf for leaf in self.leaves if leaf.note]
        if whole:
            lines.append("leaves ZeRO left whole on every device:")
            lines.extend(f"  {leaf.path}: {leaf.note}" for leaf in whole)
        return "\n".join(lines)


def _leaf_plan(
    path: str,
    x: Any,
    base: P,
    num_shards: int,
    stage: StageSpec,
    axis: str,
    persistence_threshold: int,
) -> LeafPlan:
    shape = tuple(x.shape)
    free = [d >= len(base) or base[d] is None for d in range(len(shape))]
    # Dims a user already split over other axes count at their per-device size.
    dim = shard_dim(shape, num_shards, free)
    note = ""
    if not stage.shard_opt_state:
        return LeafPlan(path, shape, x.dtype, None, None, "")
    if dim is None:
        note = (
            f"no dimension of {shape} is divisible by the data axis size {num_shards}"
            if num_shards > 1
            else "the data axis has one device"
        )
    param_dim = dim if stage.shard_params else None
    if param_dim is not None and math.prod(shape) < persistence_threshold:
        param_dim = None
        note = (
            f"parameter kept whole: {math.prod(shape):,} elements is below "
            f"stage3_param_persistence_threshold={persistence_threshold:,}"
        )
    return LeafPlan(path, shape, x.dtype, param_dim, dim, note)


def make_plan(
    abstract_params: PyTree,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    stage: int | StageSpec,
    *,
    axis: str = DATA_AXIS,
    persistence_threshold: int = 100_000,
    param_specs: PyTree | None = None,
) -> Plan:
    """Derives the sharding plan for a stage from abstract params, an optax transform and a mesh.

    Args:
      abstract_params: a pytree of arrays or ``jax.ShapeDtypeStruct`` (only shapes are read).
      optimizer: the optax transformation whose state is to be sharded.
      mesh: the device mesh; ``axis`` must be one of its axes.
      stage: a ZeRO stage (0-3) or its :class:`~jzero.stages.StageSpec`.
      axis: the data-parallel mesh axis.
      persistence_threshold: stage 3 keeps parameters with fewer elements whole
        (DeepSpeed's ``stage3_param_persistence_threshold``).
      param_specs: optional ``PartitionSpec`` per parameter leaf on *other* mesh axes, kept.

    Returns:
      The :class:`Plan`.
    """
    spec = stage if isinstance(stage, StageSpec) else stage_spec(stage)
    if axis not in mesh.shape:
        raise ValueError(
            f"The mesh has no axis {axis!r}; its axes are {list(mesh.shape)}. "
            f"Build the mesh with jzero.make_mesh or name its data-parallel axis {axis!r}."
        )
    abstract_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), abstract_params
    )
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    if param_specs is None:
        bases = tuple(P() for _ in flat)
    else:
        bases = tuple(treedef.flatten_up_to(param_specs))
        for (path, _), b in zip(flat, bases, strict=True):
            if axis in jax.tree.leaves(tuple(b)):
                raise ValueError(
                    f"The partition spec {b} of {_path_str(path)} already uses the data axis "
                    f"{axis!r}; jzero places the data axis itself. Remove {axis!r} from it."
                )
    n = int(mesh.shape[axis])
    leaves = tuple(
        _leaf_plan(_path_str(path), x, b, n, spec, axis, persistence_threshold)
        for (path, x), b in zip(flat, bases, strict=True)
    )

    def shardings(dims: list[int | None]) -> PyTree:
        return treedef.unflatten(
            [
                NamedSharding(mesh, _spec_with(b, len(leaf.shape), d, axis))
                for leaf, b, d in zip(leaves, bases, dims, strict=True)
            ]
        )

    state_dims = [leaf.state_dim for leaf in leaves]
    params_sh = shardings([leaf.param_dim for leaf in leaves])
    update_sh = shardings(state_dims)
    grads_sh = update_sh if spec.reduce_scatter else shardings([None] * len(leaves))
    replicated = NamedSharding(mesh, P())

    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)

    def fit(state_leaf: Any, sharding: NamedSharding, index: int) -> NamedSharding:
        if tuple(state_leaf.shape) == leaves[index].shape:
            return sharding
        if not spec.shard_opt_state:
            return replicated
        d = shard_dim(tuple(state_leaf.shape), n)
        return NamedSharding(mesh, _spec_with(P(), len(state_leaf.shape), d, axis))

    opt_sh = optax.tree_map_params(
        optimizer,
        fit,
        abstract_opt_state,
        update_sh,
        treedef.unflatten(list(range(len(leaves)))),
        transform_non_params=lambda _: replicated,
    )
    # Any leaf that is not an array (e.g. optax's MaskedNode) needs no sharding; keep structure.
    opt_sh = jax.tree.map(
        lambda s, x: s if hasattr(x, "shape") else replicated,
        opt_sh,
        abstract_opt_state,
    )
    return Plan(
        stage=spec,
        mesh=mesh,
        axis=axis,
        abstract_params=abstract_params,
        leaves=leaves,
        params=params_sh,
        grads=grads_sh,
        update=update_sh,
        abstract_opt_state=abstract_opt_state,
        opt_state=opt_sh,
        batch=NamedSharding(mesh, P(axis)),
        replicated=replicated,
        base_specs=bases,
    )
