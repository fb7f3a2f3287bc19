"""The sharding plan: one ``NamedSharding`` per leaf of params, gradients, optimizer state, batch.

Decisions:

* The plan is computed from abstract values only (``jax.ShapeDtypeStruct``), so it exists before
  any parameter is allocated and works for meshes larger than the machine (an abstract mesh).
* Leaf rule: a leaf is sharded over the data axis on its *leading* dimension that the data-axis
  size divides, so that every shard is one contiguous block of the row-major array (FSDP2's
  dim-0 sharding, DeepSpeed's flat partitions). Collectives on a major dimension need no layout
  copies around them; the former rule (largest dimension, last on a tie) made XLA gather and
  reduce-scatter along minor dimensions with copies of gradient and parameter size around each
  (160 ``copy`` ops in a stage-1 GPT step, measured). Where parameters are sharded at rest
  (stage 3), a stacked-layer dimension that a ``scan`` consumes (``layer_dims``, found by
  tracing the loss: :func:`jzero.gather.layer_dims`) is skipped, so the scan's per-layer
  slice stays whole and is gathered one layer at a time; each layer's shard is then contiguous
  within the layer. A leaf with no divisible dimension stays replicated.
* At stage 3 a parameter with fewer elements than ``stage3_param_persistence_threshold`` stays
  replicated (DeepSpeed's persistent parameters); its gradient and optimizer state are still
  sharded, as in DeepSpeed.
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
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.mesh import DATA_AXIS
from jzero.precision import Precision, cast_floating
from jzero.stages import StageSpec, check_offload, stage_spec

__all__ = [
    "DATA_AXIS",
    "HOST_MEMORY_KINDS",
    "LeafPlan",
    "Plan",
    "is_host",
    "make_plan",
    "is_contiguous",
    "on_device",
    "shard_dim",
]

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
      layer_dim: the stacked-layer dimension a ``scan`` consumes, or ``None``.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    param_dim: int | None
    state_dim: int | None
    note: str = ""
    layer_dim: int | None = None


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
      update_layout: shardings the optimizer update runs in (params are cut to these for the
        update); :attr:`update` is its old name.
      abstract_opt_state: the optimizer state as ``jax.ShapeDtypeStruct``.
      opt_state: shardings of the optimizer state.
      batch: sharding of every batch leaf (leading dim over the data axis).
      replicated: a replicated sharding (scalars, metrics).
      precision: the run's dtypes (see :mod:`jzero.precision`).
      master: under mixed precision, shardings of the float32 master weights (the update
        layout, like the optimizer state, and in the same memory); ``None`` otherwise.
      base_specs: per leaf, the user's own ``PartitionSpec`` on other mesh axes.
      layers_traced: whether ``layer_dims`` came from tracing the loss (so a leaf without one
        is known not to be a scanned stack).
      reshard_after_forward: at stage 3, drop each gathered weight after its forward use and
        gather it again in the backward pass (3 Psi of traffic, about one layer live); ``False``
        keeps it until its backward use (2 Psi, all gathered weights live at the peak).
      prefetch_bucket_size: at stage 3, how many gathered elements a use's gather may run
        ahead of it (DeepSpeed's ``stage3_prefetch_bucket_size``; 0: at the use).
      max_reuse_distance: at stage 3, a parameter reused within this many elements of other
        gathered parameters is gathered once and kept (DeepSpeed's
        ``stage3_max_reuse_distance``); ``None``: every use gathers.
      max_live_parameters: at stage 3, the cap on gathered elements alive at once (DeepSpeed's
        ``stage3_max_live_parameters``): it bounds what reuse keeps; ``None``: no cap.

    Shardings of state that is offloaded carry a host memory kind (``pinned_host``); the step
    computes on :func:`on_device` copies of them.
    """

    stage: StageSpec
    mesh: Mesh
    axis: str
    abstract_params: PyTree
    leaves: tuple[LeafPlan, ...]
    params: PyTree
    grads: PyTree
    update_layout: PyTree
    abstract_opt_state: PyTree
    opt_state: PyTree
    batch: NamedSharding
    replicated: NamedSharding
    precision: Precision = field(default_factory=Precision)
    master: PyTree = None
    base_specs: tuple[P, ...] = field(default=())
    layers_traced: bool = False
    reshard_after_forward: bool = True
    prefetch_bucket_size: int = 0
    max_reuse_distance: int | None = None
    max_live_parameters: int | None = None

    @property
    def update(self) -> PyTree:
        """The old name of :attr:`update_layout`."""
        return self.update_layout

    @property
    def num_shards(self) -> int:
        """The size of the data axis."""
        return int(self.mesh.shape[self.axis])

    @property
    def param_dims(self) -> list[int | None]:
        """Per parameter leaf, the dimension sharded at rest (``None`` if replicated)."""
        return [leaf.param_dim for leaf in self.leaves]

    @property
    def layer_dims(self) -> tuple[int | None, ...]:
        """Per parameter leaf, the stacked-layer dimension a scan consumes (``None``: none)."""
        return tuple(leaf.layer_dim for leaf in self.leaves)

    @property
    def state_dims(self) -> list[int | None]:
        """Per parameter leaf, the dimension gradients and optimizer state are sharded on."""
        return [leaf.state_dim for leaf in self.leaves]

    def largest_gathered(self, in_bytes: bool = False) -> tuple[int, str]:
        """The most stage 3 gathers at once, and the leaf: a scanned leaf one layer slice at a
        time (its ``layer_dim``), any other sharded leaf whole; ``(0, "")`` when nothing is
        sharded at rest.

        Before the loss is traced (``layers_traced`` false) a stacked leaf is recognised by
        its siblings: two or more leaves of one parent with the same leading dimension (> 1)
        are taken for a layer stack, gathered one slice at a time.

        Args:
          in_bytes: count bytes of the compute dtype instead of elements.
        """
        dtypes = [np.dtype(x.dtype) for x in jax.tree.leaves(self.compute_params)]
        parents: dict[str, set[int | None]] = {}
        for leaf in self.leaves:
            lead = leaf.shape[0] if len(leaf.shape) >= 2 else None
            parents.setdefault(leaf.path.rpartition(".")[0], set()).add(lead)
        siblings = Counter(leaf.path.rpartition(".")[0] for leaf in self.leaves)
        best, path = 0, ""
        for leaf, dtype in zip(self.leaves, dtypes, strict=True):
            if leaf.param_dim is None:
                continue
            size = math.prod(leaf.shape)
            if self.layers_traced:  # from the traced loss: a scan gathers one slice at a time
                if leaf.layer_dim is not None and leaf.param_dim != leaf.layer_dim:
                    size //= leaf.shape[leaf.layer_dim]
            else:
                parent = leaf.path.rpartition(".")[0]
                leads = parents[parent]
                if siblings[parent] >= 2 and len(leads) == 1 and None not in leads:
                    if leaf.param_dim != 0 and leaf.shape[0] > 1:
                        size //= leaf.shape[0]
            size *= dtype.itemsize if in_bytes else 1
            if size > best:
                best, path = size, leaf.path
        return best, path

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

    @property
    def compute_params(self) -> PyTree:
        """The params as the step computes with them (``ShapeDtypeStruct``, compute dtype)."""
        if not self.precision.mixed:
            return self.abstract_params
        return cast_floating(self.abstract_params, self.precision.compute_dtype)

    def _state_trees(self, accumulation_steps: int) -> list[tuple[str, PyTree, PyTree]]:
        """(category, abstract tree, shardings) of everything a device keeps for training."""
        grad_acc = self.grads if self.stage.shard_grads else self.params_replicated()
        grads = self.compute_params
        if accumulation_steps > 1:
            grads = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, self.precision.accumulator(x.dtype)),
                self.abstract_params,
            )
        parts = [("params", self.compute_params, self.params), ("grads", grads, grad_acc)]
        if self.precision.mixed:
            parts.append(("master_params", self.abstract_params, self.master))
        parts.append(("opt_state", self.abstract_opt_state, self.opt_state))
        return parts

    def _bytes_where(self, host: bool, accumulation_steps: int) -> dict[str, int]:
        out = {}
        for name, tree, shardings in self._state_trees(accumulation_steps):
            pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
            kept = [(x, s) for x, s in pairs if is_host(s) == host]
            out[name] = self.per_device_bytes([x for x, _ in kept], [s for _, s in kept])
        return out

    def model_state_bytes(self, accumulation_steps: int = 1) -> dict[str, int]:
        """Per-device bytes in *device* memory of params, gradients, master weights (mixed
        precision only) and optimizer state.

        Params are counted in the compute dtype. The gradient is full-size at stages 0-1 and one
        shard at stages 2-3, in the compute dtype, or in the accumulator dtype when
        ``accumulation_steps > 1``. Offloaded state is counted by :meth:`host_state_bytes`.
        """
        return self._bytes_where(False, accumulation_steps)

    def host_state_bytes(self, accumulation_steps: int = 1) -> dict[str, int]:
        """Per-device bytes in *host* memory (offloaded), with the keys of
        :meth:`model_state_bytes`."""
        return self._bytes_where(True, accumulation_steps)

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
        flat_c = jax.tree.leaves(self.compute_params)
        for leaf, sp, sg, c in zip(self.leaves, flat_p, flat_g, flat_c, strict=True):
            nbytes = math.prod(sp.shard_shape(leaf.shape)) * np.dtype(c.dtype).itemsize
            rows.append(
                (
                    leaf.path,
                    "x".join(map(str, leaf.shape)) or "()",
                    np.dtype(c.dtype).name,
                    str(tuple(sp.spec)) + (" host" if is_host(sp) else ""),
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
        lines.append("")
        lines.append(
            "each leaf is sharded on its leading dimension that the data axis divides "
            "(contiguous shards)"
            + (
                "; a stacked-layer dimension a scan consumes stays whole, so each layer is "
                "gathered on its own"
                if self.stage.shard_params and any(d is not None for d in self.layer_dims)
                else ""
            )
        )
        for where, totals in (
            ("device", self.model_state_bytes()),
            ("host", self.host_state_bytes()),
        ):
            if where == "host" and not any(totals.values()):
                continue
            lines.append(
                f"per-device model state in {where} memory: "
                + ", ".join(f"{k} {v:,} B" for k, v in totals.items())
                + f", total {sum(totals.values()):,} B"
            )
        if self.precision.mixed:
            lines.append(
                f"mixed precision: compute {np.dtype(self.precision.compute_dtype).name}, "
                "float32 master weights laid out with the optimizer state"
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


def make_plan(
    abstract_params: PyTree,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    stage: int | StageSpec,
    *,
    axis: str = DATA_AXIS,
    persistence_threshold: int = 100_000,
    param_specs: PyTree | None = None,
    precision: Precision | None = None,
    offload_optimizer: str | None = None,
    offload_params: str | None = None,
    layer_dims: Sequence[int | None] | None = None,
    reshard_after_forward: bool = True,
    prefetch_bucket_size: int = 0,
    max_reuse_distance: int | None = None,
    max_live_parameters: int | None = None,
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
      precision: the run's dtypes; under mixed precision the float32 master weights get the
        optimizer state's layout.
      offload_optimizer: a host memory kind (``"pinned_host"``) for the optimizer state and the
        master weights, at stages 1-3 (DeepSpeed's ``offload_optimizer``).
      offload_params: a host memory kind for the parameters at rest, at stage 3 only
        (DeepSpeed's ``offload_param``).
      layer_dims: per leaf (``jax.tree.leaves`` order), the stacked-layer dimension a ``scan``
        consumes, or ``None``; from :func:`jzero.gather.layer_dims`. Stage 3 never shards it.
      reshard_after_forward: see :class:`Plan` (FSDP2's switch of that name).
      prefetch_bucket_size, max_reuse_distance, max_live_parameters: see :class:`Plan`.

    Returns:
      The :class:`Plan`.
    """
    spec = stage if isinstance(stage, StageSpec) else stage_spec(stage)
    precision = precision if precision is not None else Precision()
    if offload_optimizer is not None:
        check_offload(spec, "optimizer")
    if offload_params is not None:
        check_offload(spec, "optimizer+params")
    if axis not in mesh.shape:
        raise ValueError(
            f"The mesh has no axis {axis!r}; its axes are {list(mesh.shape)}. "
            f"Build the mesh with jzero.make_mesh or name its data-parallel axis {axis!r}."
        )
    abstract_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), abstract_params
    )
    if precision.mixed:  # the master weights are float32 whatever the user's params were
        abstract_params = cast_floating(abstract_params, jnp.float32)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    if param_specs is None:
        bases = tuple(P() for _ in flat)
    else:
        bases = tuple(treedef.flatten_up_to(param_specs))
        for (path, _), b in zip(flat, bases, strict=True):
            missing = [a for a in jax.tree.leaves(tuple(b)) if a not in mesh.shape]
            if missing:
                raise ValueError(
                    f"The partition spec {b} of {_path_str(path)} names mesh axes {missing}, but "
                    f"the mesh has {list(mesh.shape)}. Add them to the config's mesh section "
                    f"(e.g. mesh: {{data: -1, {missing[0]}: 2}}) or remove them from the "
                    "annotation."
                )
            if axis in jax.tree.leaves(tuple(b)):
                raise ValueError(
                    f"The partition spec {b} of {_path_str(path)} already uses the data axis "
                    f"{axis!r}; jzero places the data axis itself. Remove {axis!r} from it."
                )
    n = int(mesh.shape[axis])
    traced = layer_dims is not None
    layer_dims = tuple(layer_dims) if traced else (None,) * len(flat)
    if len(layer_dims) != len(flat):
        raise ValueError(
            f"layer_dims has {len(layer_dims)} entries but the params have {len(flat)} leaves; "
            "pass one stacked-layer dimension (or None) per leaf."
        )
    leaves = tuple(
        _leaf_plan(_path_str(path), x, b, n, spec, persistence_threshold, ld)
        for (path, x), b, ld in zip(flat, bases, layer_dims, strict=True)
    )

    def shardings(dims: list[int | None]) -> PyTree:
        return treedef.unflatten(
            [
                NamedSharding(mesh, _spec_with(b, len(leaf.shape), d, axis))
                for leaf, b, d in zip(leaves, bases, dims, strict=True)
            ]
        )

    state_dims = [leaf.state_dim for leaf in leaves]
    params_sh = _with_kind(shardings([leaf.param_dim for leaf in leaves]), offload_params)
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
    opt_sh = _with_kind(opt_sh, offload_optimizer)
    return Plan(
        stage=spec,
        mesh=mesh,
        axis=axis,
        abstract_params=abstract_params,
        leaves=leaves,
        params=params_sh,
        grads=grads_sh,
        update_layout=update_sh,
        abstract_opt_state=abstract_opt_state,
        opt_state=opt_sh,
        batch=NamedSharding(mesh, P(axis)),
        replicated=replicated,
        precision=precision,
        master=_with_kind(update_sh, offload_optimizer) if precision.mixed else None,
        base_specs=bases,
        layers_traced=traced,
        reshard_after_forward=bool(reshard_after_forward),
        prefetch_bucket_size=int(prefetch_bucket_size),
        max_reuse_distance=max_reuse_distance,
        max_live_parameters=max_live_parameters,
    )


def _with_kind(shardings: PyTree, memory_kind: str | None) -> PyTree:
    if memory_kind is None:
        return shardings
    return jax.tree.map(
        lambda s: s.with_memory_kind(memory_kind),
        shardings,
        is_leaf=lambda s: isinstance(s, NamedSharding),
    )
