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
* Hybrid sharding (a ``replica`` axis beside ``data``, FSDP's HSDP and DeepSpeed's MiCS): the
  batch is split over both axes, and every sharded category is sharded over ``data`` only and
  replicated over ``replica``. ZeRO++'s hierarchical partition (``hpz``) instead shards the
  gradients and optimizer state over ``replica`` x ``data`` (all devices) and keeps the
  parameters at rest sharded over ``data`` only, the secondary copy that stage 3's gathers
  read within a host. A state leaf is then sharded over ``("data", "replica")`` on one
  dimension: each ``data`` shard is split again into ``replica`` pieces, which is the layout a
  reduce-scatter over ``data`` followed by one over ``replica`` leaves.
* A mesh axis of more than one device that is neither ``data``, ``replica`` nor named by any
  parameter's partition spec would make its devices compute the same rows: an error.
* The communication options (``overlap_comm`` and its buckets, ZeRO++'s qwZ and qgZ) ride in
  the plan, so the step and the replay read them from one place; ``make_plan`` refuses the
  quantization a stage has no collective for, and keeps bucket sizes only where the step's own
  reductions use them (stages 0-2 with ``overlap_comm``).
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

from jzero.mesh import DATA_AXIS, REPLICA_AXIS
from jzero.precision import Precision, cast_floating
from jzero.stages import StageSpec, check_offload, stage_spec

__all__ = [
    "DATA_AXIS",
    "HOST_MEMORY_KINDS",
    "LeafPlan",
    "Plan",
    "axis_entry",
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
      replica_axis: the mesh's replica axis (hybrid sharding), or ``None``: the batch is split
        over it and ZeRO's shards are replicated across it.
      hpz: ZeRO++'s hierarchical partition: gradients and optimizer state are sharded over
        ``replica`` x ``data``, parameters at rest over ``data`` only (the secondary copy).
      overlap_comm: DeepSpeed's ``overlap_comm``: stage 3 gathers each scanned layer one
        iteration ahead (:func:`jzero.gather.gathered`'s ``overlap``), stages 0-2 reduce the
        gradients in buckets (below), and on a GPU the step is compiled with XLA's options for
        asynchronous collectives (:func:`jzero.overlap.compiler_options`).
      reduce_bucket_size: at stages 0-2 with ``overlap_comm``, the most gradient elements one
        reduction carries: consecutive leaves are reduced together up to it (one collective
        per bucket); ``None``: one collective per leaf.
      allgather_bucket_size: likewise for the all-gather of the updated parameters (stages 1-2).
      quantized_weights: ZeRO++ qwZ at stage 3: stage 3's parameter gathers send this many
        bits a value (8 or 4); 0: exact.
      quantized_gradients: ZeRO++ qgZ at stages 1-3: every gradient reduce-scatter over the
        data axis is a quantized all-to-all of this many bits a value (8 or 4) summed in float32
        on the receiving device; 0: exact.

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
    replica_axis: str | None = None
    hpz: bool = False
    overlap_comm: bool = False
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    quantized_weights: int = 0
    quantized_gradients: int = 0

    @property
    def update(self) -> PyTree:
        """The old name of :attr:`update_layout`."""
        return self.update_layout

    @property
    def num_shards(self) -> int:
        """The size of the data axis: how many shards a parameter is split into at rest."""
        return int(self.mesh.shape[self.axis])

    @property
    def num_replicas(self) -> int:
        """The size of the replica axis (1 without one)."""
        return int(self.mesh.shape[self.replica_axis]) if self.replica_axis else 1

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over: ``replica`` (if any), then ``data``."""
        return (self.replica_axis, self.axis) if self.replica_axis else (self.axis,)

    @property
    def state_axes(self) -> tuple[str, ...]:
        """The mesh axes gradients and optimizer state are sharded over, major first:
        ``data``, and ``replica`` too under :attr:`hpz`."""
        return (self.axis, self.replica_axis) if self.hpz and self.replica_axis else (self.axis,)

    @property
    def data_parallel_size(self) -> int:
        """Devices the batch is split over (``replica`` x ``data``)."""
        return self.num_shards * self.num_replicas

    @property
    def state_shards(self) -> int:
        """How many shards gradients and optimizer state are split into."""
        return self.num_shards * (self.num_replicas if self.hpz else 1)

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
        if self.replica_axis:
            lines.append(
                f"hybrid: {self.num_replicas} replicas; "
                + (
                    f"hpZ: gradients and optimizer state over replica x data "
                    f"({self.state_shards} shards), params at rest over data ({n} shards)"
                    if self.hpz
                    else "every shard replicated across the replica axis, gradient shards "
                    "all-reduced over it"
                )
            )
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
        comm = []
        if self.overlap_comm:
            comm.append("overlap_comm")
        for name, size in (
            ("reduce", self.reduce_bucket_size),
            ("all-gather", self.allgather_bucket_size),
        ):
            if size is not None:
                comm.append(f"{name} buckets of {size:,} elements")
        if self.quantized_weights:
            comm.append(f"ZeRO++ qwZ: int{self.quantized_weights} parameter gathers")
        if self.quantized_gradients:
            comm.append(f"ZeRO++ qgZ: int{self.quantized_gradients} gradient reduce-scatters")
        if comm:
            lines.append("communication: " + ", ".join(comm))
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
    offload_ratio: float = 1.0,
    layer_dims: Sequence[int | None] | None = None,
    reshard_after_forward: bool = True,
    prefetch_bucket_size: int = 0,
    max_reuse_distance: int | None = None,
    max_live_parameters: int | None = None,
    hpz: bool = False,
    overlap_comm: bool = False,
    reduce_bucket_size: int | None = None,
    allgather_bucket_size: int | None = None,
    quantized_weights: int = 0,
    quantized_gradients: int = 0,
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
      offload_ratio: the fraction of the optimizer-state bytes offloaded (DeepSpeed's
        ``offload_optimizer.ratio``): the state and masters of whole parameter leaves go to
        host memory, the largest first, each taken when it brings the offloaded bytes closer
        to the fraction (:func:`_offloaded_leaves`); the rest stays in device memory.
      offload_params: a host memory kind for the parameters at rest, at stage 3 only
        (DeepSpeed's ``offload_param``).
      layer_dims: per leaf (``jax.tree.leaves`` order), the stacked-layer dimension a ``scan``
        consumes, or ``None``; from :func:`jzero.gather.layer_dims`. Stage 3 never shards it.
      reshard_after_forward: see :class:`Plan` (FSDP2's switch of that name).
      prefetch_bucket_size, max_reuse_distance, max_live_parameters: see :class:`Plan`.
      hpz: ZeRO++'s hierarchical partition (see :class:`Plan`); needs a ``replica`` axis and
        a stage that shards parameters. A mesh with a ``replica`` axis without it is hybrid
        sharding.
      overlap_comm, reduce_bucket_size, allgather_bucket_size: see :class:`Plan`; the bucket
        sizes (elements, >= 1) apply with ``overlap_comm`` at the stages that keep parameters
        whole (0-2), and are ``None`` in the plan otherwise.
      quantized_weights: see :class:`Plan`; needs a stage that shards parameters (3).
      quantized_gradients: see :class:`Plan`; needs a stage that reduce-scatters (1-3).

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
    _check_axes_used(mesh, axis, bases)
    replica = REPLICA_AXIS if REPLICA_AXIS in mesh.shape else None
    if hpz and (replica is None or not spec.shard_params):
        raise ValueError(
            "zero_hpz_partition_size (ZeRO++ hpZ) needs stage 3 and a mesh with a "
            f"{REPLICA_AXIS!r} axis (the hosts) beside {axis!r} (one host's devices); got stage "
            f"{spec.stage} and mesh {dict(mesh.shape)}. Set zero_optimization.stage to 3, or "
            "zero_hpz_partition_size to 1."
        )
    hpz = bool(hpz)
    _check_comm(spec, reduce_bucket_size, allgather_bucket_size, quantized_weights,
                quantized_gradients)  # fmt: skip
    buckets = bool(overlap_comm) and not spec.shard_params
    state_axes = (axis, replica) if hpz else (axis,)
    n = int(mesh.shape[axis]) * (int(mesh.shape[replica]) if hpz else 1)
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

    def shardings(dims: list[int | None], axes: tuple[str, ...] = (axis,)) -> PyTree:
        return treedef.unflatten(
            [
                NamedSharding(mesh, _spec_with(b, len(leaf.shape), d, axes))
                for leaf, b, d in zip(leaves, bases, dims, strict=True)
            ]
        )

    state_dims = [leaf.state_dim for leaf in leaves]
    params_sh = _with_kind(shardings([leaf.param_dim for leaf in leaves]), offload_params)
    update_sh = shardings(state_dims, state_axes)
    grads_sh = update_sh if spec.reduce_scatter else shardings([None] * len(leaves))
    replicated = NamedSharding(mesh, P())

    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)

    def fit(state_leaf: Any, sharding: NamedSharding, index: int) -> Any:
        if isinstance(state_leaf, optax.MaskedNode):  # a leaf the mask leaves out: no state
            return state_leaf
        if tuple(state_leaf.shape) == leaves[index].shape:
            return sharding
        if not spec.shard_opt_state:
            return replicated
        d = shard_dim(tuple(state_leaf.shape), n)
        return NamedSharding(mesh, _spec_with(P(), len(state_leaf.shape), d, state_axes))

    opt_sh = optax.tree_map_params(
        optimizer,
        fit,
        abstract_opt_state,
        update_sh,
        treedef.unflatten(list(range(len(leaves)))),
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )
    # Any leaf that is not an array (e.g. optax's MaskedNode) needs no sharding; keep structure.
    opt_sh = jax.tree.map(
        lambda s, x: s if hasattr(x, "shape") else replicated,
        opt_sh,
        abstract_opt_state,
    )
    host_leaves = _offloaded_leaves(leaves, offload_ratio)
    master_sh = update_sh
    if offload_optimizer is not None and len(host_leaves) < len(leaves):
        from jzero.groups import param_leaf_owner

        owner = param_leaf_owner(optimizer, abstract_params, abstract_opt_state)
        flat_sh, sh_def = jax.tree.flatten(opt_sh)
        opt_sh = sh_def.unflatten(
            [
                x.with_memory_kind(offload_optimizer) if o in host_leaves else x
                for x, o in zip(flat_sh, owner, strict=True)
            ]
        )
        master_sh = treedef.unflatten(
            [
                x.with_memory_kind(offload_optimizer) if i in host_leaves else x
                for i, x in enumerate(jax.tree.leaves(update_sh))
            ]
        )
    else:
        opt_sh = _with_kind(opt_sh, offload_optimizer)
        master_sh = _with_kind(update_sh, offload_optimizer)
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
        batch=NamedSharding(mesh, P(axis_entry((replica, axis) if replica else (axis,)))),
        replicated=replicated,
        precision=precision,
        master=master_sh if precision.mixed else None,
        base_specs=bases,
        layers_traced=traced,
        reshard_after_forward=bool(reshard_after_forward),
        prefetch_bucket_size=int(prefetch_bucket_size),
        max_reuse_distance=max_reuse_distance,
        max_live_parameters=max_live_parameters,
        replica_axis=replica,
        hpz=hpz,
        overlap_comm=bool(overlap_comm),
        # Buckets group the step's own reductions and gathers: stages 0-2, with overlap_comm.
        reduce_bucket_size=reduce_bucket_size if buckets else None,
        allgather_bucket_size=allgather_bucket_size if buckets else None,
        quantized_weights=int(quantized_weights),
        quantized_gradients=int(quantized_gradients),
    )


def _check_comm(
    spec: StageSpec,
    reduce_bucket_size: int | None,
    allgather_bucket_size: int | None,
    quantized_weights: int,
    quantized_gradients: int,
) -> None:
    """The bucket sizes and ZeRO++ quantization this stage can use (clear errors otherwise)."""
    for name, size in (
        ("reduce_bucket_size", reduce_bucket_size),
        ("allgather_bucket_size", allgather_bucket_size),
    ):
        if size is not None and (isinstance(size, bool) or int(size) != size or size < 1):
            raise ValueError(
                f"{name}={size!r} is not a bucket size; pass a number of elements >= 1, or None "
                "for one collective per leaf."
            )
    for name, bits in (
        ("quantized_weights", quantized_weights),
        ("quantized_gradients", quantized_gradients),
    ):
        if bits not in (0, 4, 8):
            raise ValueError(f"{name}={bits!r}: pass 8 or 4 bits a value, or 0 for exact.")
    if quantized_weights and not spec.shard_params:
        raise ValueError(
            f"quantized_weights (ZeRO++ qwZ) quantizes stage 3's parameter all-gathers, but "
            f"stage {spec.stage} keeps parameters whole and gathers none. Use stage 3, or "
            "quantized_weights=0."
        )
    if quantized_gradients and not spec.reduce_scatter:
        raise ValueError(
            f"quantized_gradients (ZeRO++ qgZ) replaces the gradient reduce-scatter, but stage "
            f"{spec.stage} all-reduces its gradients. Use stage 1, 2 or 3, or "
            "quantized_gradients=0."
        )


def _check_axes_used(mesh: Mesh, axis: str, bases: Sequence[P]) -> None:
    """Refuses a mesh axis of several devices that neither splits the batch (``data``,
    ``replica``) nor any parameter (a partition spec): its devices would compute the same
    rows, a silent multiple of the compute."""
    used = {a for b in bases for a in jax.tree.leaves(tuple(b))}
    for name, size in mesh.shape.items():
        if size > 1 and name not in (axis, REPLICA_AXIS) and name not in used:
            raise ValueError(
                f"mesh axis {name!r} ({size} devices) is neither {axis!r}, {REPLICA_AXIS!r} nor "
                "named by any parameter's partition spec, so its devices would all compute the "
                f"same rows ({size}x redundant work). Rename it to {REPLICA_AXIS!r} to replicate "
                f"ZeRO's shards across it (e.g. across hosts), fold it into {axis!r} (mesh: "
                f"{{{axis}: -1}}), or give parameters partition specs over it (param_specs=, "
                "nnx.with_partitioning)."
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
