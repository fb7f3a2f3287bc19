"""The :class:`Plan`: the shardings of every tree a step touches, and what follows from them.

Decisions:

* A plan is data: shardings per category (params at rest, gradients, the update layout, optimizer
  state, masters, batch), the :class:`~jzero.parallel.zero.leaf_rule.LeafPlan` of every leaf and the
  options it was made with (:class:`~jzero.plan.options.PlanOptions`, read through their groups:
  ``plan.options.comm.overlap_comm``, never copied into fields of their own);
  :func:`jzero.plan.make_plan` builds it, and nothing here runs a step.
* What follows from those fields and is read by every step (shard counts, the mesh axes each
  category uses, each leaf's spec on them) is derived here on demand. What is counted or
  printed from a plan (bytes per device, the largest gather, the table ``engine.describe()``
  shows) is :mod:`jzero.plan.report`'s.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.choices.stages import StageSpec
from jzero.costs import ParallelDims
from jzero.distributed import REPLICA_AXIS
from jzero.parallel.zero.leaf_rule import LeafPlan, spec_axis_names, spec_with
from jzero.plan.options import PlanOptions
from jzero.plan.precision import cast_floating

__all__ = ["Plan"]

PyTree = Any


def _keep(entry: Any, axes: set[str], inside: bool) -> Any:
    """A spec entry with only its axes in ``axes`` (``inside``) or only those not in it."""
    if entry is None:
        return None
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    kept = tuple(a for a in names if (a in axes) == inside)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def _only(entry: Any, axes: set[str]) -> Any:
    return _keep(entry, axes, True)


def _drop(entry: Any, axes: set[str]) -> Any:
    return _keep(entry, axes, False)


@dataclass(frozen=True)
class Plan:
    """Shardings for every tree a training step touches, derived from one stage.

    Attributes:
      stage: the stage table row.
      mesh: the device mesh.
      abstract_params: the params as ``jax.ShapeDtypeStruct``.
      leaves: one :class:`LeafPlan` per parameter leaf, in ``jax.tree.leaves`` order.
      params: shardings of the params at rest.
      grads: shardings of the reduced gradients, as the optimizer update sees them.
      update_layout: shardings the optimizer update runs in (params are cut to these for the
        update).
      abstract_opt_state: the optimizer state as ``jax.ShapeDtypeStruct``.
      opt_state: shardings of the optimizer state.
      batch: sharding of every batch leaf (leading dim over the data axis).
      replicated: a replicated sharding (scalars, metrics).
      options: the options the plan was made with, as :func:`~jzero.plan.make_plan` applied
        them: ZeRO's (``options.zero``), the collectives' (``options.comm``; bucket sizes
        ``None`` where the step's own reductions do not use them), the other parallelisms'
        layout (``options.parallel``: ZeRO's ``axis``, ``seq_axis``, ``context_axis``,
        ``pipe_axis``, ``expert_axis``, ``tp_rules``, ...) and the run's dtypes
        (``options.precision``).
      master: under mixed precision, shardings of the float32 master weights (the update
        layout, like the optimizer state, and in the same memory); ``None`` otherwise.
      base_specs: per leaf, the user's own ``PartitionSpec`` on other mesh axes.
      layers_traced: whether ``layer_dims`` came from tracing the loss (so a leaf without one
        is known not to be a scanned stack).
      stored_opt_state: the optimizer state as it rests (a parameter's mirrors padded like
        it); ``None``: as :attr:`abstract_opt_state`.

    Shardings of state that is offloaded carry a host memory kind (``pinned_host``); the step
    computes on :func:`~jzero.plan.memory_kinds.on_device` copies of them.
    """

    stage: StageSpec
    mesh: Mesh
    abstract_params: PyTree
    leaves: tuple[LeafPlan, ...]
    params: PyTree
    grads: PyTree
    update_layout: PyTree
    abstract_opt_state: PyTree
    opt_state: PyTree
    batch: NamedSharding
    replicated: NamedSharding
    options: PlanOptions = field(default_factory=PlanOptions)
    master: PyTree = None
    base_specs: tuple[P, ...] = field(default=())
    layers_traced: bool = False
    stored_opt_state: PyTree = None

    # -- the shapes arrays rest at (padded, :mod:`jzero.plan.padding`) ---------------------------
    def _stored(self, tree: PyTree, sharded: Any) -> PyTree:
        treedef = jax.tree.structure(self.abstract_params)
        return treedef.unflatten(
            [
                jax.ShapeDtypeStruct(leaf.stored_shape(sharded(leaf)), x.dtype)
                for leaf, x in zip(self.leaves, jax.tree.leaves(tree), strict=True)
            ]
        )

    @property
    def stored_params(self) -> PyTree:
        """The params as they rest (compute dtype): padded where sharded at rest (stage 3)."""
        return self._stored(self.compute_params, lambda leaf: leaf.param_dim is not None)

    @property
    def stored_update(self) -> PyTree:
        """The master weights and reduced gradients as they rest: padded where sharded."""
        return self._stored(self.abstract_params, lambda leaf: True)

    @property
    def padded(self) -> bool:
        """Whether any leaf rests in another shape than its logical one: padded, or with its
        leading dimensions merged."""
        return any(leaf.stored_shape() != leaf.shape for leaf in self.leaves)

    def stored_opt(self) -> PyTree:
        """The optimizer state as it rests (a parameter's mirrors padded like it)."""
        return self.abstract_opt_state if self.stored_opt_state is None else self.stored_opt_state

    @property
    def zero_axes(self) -> tuple[str, ...]:
        """The mesh axes ZeRO shards over, major first: ``data``, and ``context`` and ``seq``
        beside it under context and sequence parallelism (the options' ``parallel.axis``)."""
        axis = self.options.parallel.axis
        return (axis,) if isinstance(axis, str) else tuple(axis)

    @property
    def num_shards(self) -> int:
        """The size of ZeRO's axes: how many shards a parameter is split into at rest."""
        return math.prod(int(self.mesh.shape[a]) for a in self.zero_axes)

    @property
    def replica_axis(self) -> str | None:
        """The mesh's replica axis (hybrid sharding), or ``None``: the batch is split over it
        and ZeRO's shards are replicated across it (or, under hpZ, the state is sharded over
        it too)."""
        return REPLICA_AXIS if REPLICA_AXIS in self.mesh.shape else None

    @functools.cached_property
    def dims(self) -> ParallelDims:
        """The mesh's layout as the cost model, the estimate and the auto layout take it
        (:class:`jzero.costs.ParallelDims`): the devices and each parallelism's size, read from
        the axes the options name. ``model`` is every axis the step leaves to the partitioner
        but the pipeline's (AutoTP's ``model``, or the user's own specs' axes); the
        micro-batches are the engine's, not the plan's (``None``)."""
        shape = {a: int(n) for a, n in self.mesh.shape.items()}
        par = self.options.parallel

        def size(axis: str | None) -> int:
            return shape[axis] if axis in shape else 1

        return ParallelDims(
            devices=math.prod(shape.values()),
            replica=size(self.replica_axis),
            model=math.prod(
                n for a, n in shape.items() if a in self.auto_axes and a != par.pipe_axis
            ),
            seq=size(par.seq_axis),
            context=size(par.context_axis),
            pipe=size(par.pipe_axis),
            expert=size(par.expert_axis),
            schedule=par.pipe_schedule,
            virtual=par.pipe_virtual if par.pipe_schedule == "interleaved_1f1b" else None,
        )

    @property
    def num_replicas(self) -> int:
        """The size of the replica axis (1 without one)."""
        return self.dims.replica

    @property
    def seq_size(self) -> int:
        """The size of the sequence-parallel axis (1 without one)."""
        return self.dims.seq

    @property
    def context_size(self) -> int:
        """The size of the context-parallel (ring) axis (1 without one)."""
        return self.dims.context

    @property
    def pipe_size(self) -> int:
        """The pipeline stages (1 without pipeline parallelism)."""
        return self.dims.pipe

    @property
    def pipelined(self) -> tuple[bool, ...]:
        """Per leaf, whether its stacked-layer dimension is split into pipeline stages."""
        pipe = self.options.parallel.pipe_axis
        return tuple(bool(pipe) and len(b) > 0 and b[0] == pipe for b in self._bases())

    @property
    def expert_size(self) -> int:
        """The devices the experts are split over (1 without expert parallelism)."""
        return self.dims.expert

    @property
    def experts(self) -> tuple[bool, ...]:
        """Per leaf, whether it holds experts: its spec splits it over the options'
        ``parallel.expert_axis``."""
        axis = self.options.parallel.expert_axis
        if not axis:
            return (False,) * len(self.leaves)
        return tuple(axis in spec_axis_names(b) for b in self._bases())

    def leaf_axes(self, index: int, axes: Any = None) -> tuple[str, ...]:
        """The axes of ``axes`` (default :attr:`zero_axes`) ZeRO shards leaf ``index`` over:
        all of them but those its own spec uses (``expert`` on an expert leaf)."""
        axes = self.zero_axes if axes is None else ((axes,) if isinstance(axes, str) else axes)
        own = spec_axis_names(self._bases()[index])
        return tuple(a for a in axes if a not in own)

    def manual_spec(self, index: int, dim: int | None = None, axes: Any = None) -> P:
        """Leaf ``index``'s spec on the step's manual axes (:attr:`batch_axes`), as the
        step's ``shard_map`` takes it: its own entries on them (``expert``), and ZeRO's
        ``axes`` (less those) on ``dim`` when given; the compiler's axes left out."""
        manual = set(self.batch_axes)
        base = P(*(_only(e, manual) for e in self._bases()[index]))
        return spec_with(base, len(self.leaves[index].shape), dim, axes or self.zero_axes)

    def other_spec(self, index: int, *manual: str) -> P:
        """Leaf ``index``'s own entries on the axes the step leaves to the compiler (a user's
        or AutoTP's ``model``): what :func:`jzero.comm.manual.over_axes` makes manual.
        ``manual``: axes a region makes manual too, dropped (:meth:`entries_beside`)."""
        entries = list((self.entries_beside(*manual) if manual else self.other_entries)[index])
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def local_stored_shape(self, index: int) -> tuple[int, ...]:
        """Leaf ``index``'s resting shape (padded, merged) as one device holds it inside the
        step's ``shard_map`` before ZeRO shards it: its dimensions split over the manual axes
        its own spec names (an expert leaf's experts) divided by their sizes."""
        leaf = self.leaves[index]
        shape = leaf.stored_shape()
        if len(shape) != len(leaf.shape):  # merged leading dimensions: a leaf no axis splits
            return tuple(shape)
        return self._local_shape(index, shape)

    def _local_shape(self, index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` of leaf ``index`` with each dimension its spec splits over a manual axis
        (:attr:`batch_axes`) divided by that axis's size: one device's piece in the step."""
        manual = set(self.batch_axes)
        out = list(shape)
        for d, e in enumerate(tuple(self._bases()[index])):
            for a in spec_axis_names(P(_only(e, manual))):
                out[d] //= int(self.mesh.shape[a])
        return tuple(out)

    @property
    def local_compute_params(self) -> PyTree:
        """:attr:`compute_params` as one device sees them inside the step's ``shard_map``
        before ZeRO's gathers: split over the manual axes their own spec names (an expert
        leaf holds ``E / E_p`` experts), whole otherwise."""
        out = [
            jax.ShapeDtypeStruct(self._local_shape(i, tuple(x.shape)), x.dtype)
            for i, x in enumerate(jax.tree.leaves(self.compute_params))
        ]
        return jax.tree.structure(self.compute_params).unflatten(out)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes each device computes its own part of the loss over, the ones the
        step's ``shard_map`` makes manual: ``replica`` (if any), then ZeRO's axes. The
        batch's rows are split over all of them but ``seq`` and ``context``, whose devices
        share rows and split their tokens."""
        return (self.replica_axis, *self.zero_axes) if self.replica_axis else self.zero_axes

    @property
    def auto_axes(self) -> tuple[str, ...]:
        """The mesh axes of more than one device the step's ``shard_map`` leaves to the
        partitioner (not in :attr:`batch_axes`): AutoTP's ``model``, a pipeline's ``pipe``."""
        return tuple(a for a, n in self.mesh.shape.items() if a not in self.batch_axes and n > 1)

    @property
    def state_axes(self) -> tuple[str, ...]:
        """The mesh axes gradients and optimizer state are sharded over, major first:
        ZeRO's axes, and ``replica`` too under hpZ (the options' ``zero.hpz``)."""
        return (
            (*self.zero_axes, self.replica_axis)
            if self.options.zero.hpz and self.replica_axis
            else (self.zero_axes)
        )

    @property
    def data_parallel_size(self) -> int:
        """Devices the batch's rows are split over (``replica`` x ``data``); a ``seq`` or
        ``context`` group shares its rows."""
        return self.num_shards * self.num_replicas // (self.seq_size * self.context_size)

    @property
    def loss_shards(self) -> int:
        """Devices whose local losses average into the step's loss: every device of
        :attr:`batch_axes` (each holds its own rows, or its own tokens of them)."""
        return self.num_shards * self.num_replicas

    @property
    def state_shards(self) -> int:
        """How many shards gradients and optimizer state are split into."""
        return self.num_shards * (self.num_replicas if self.options.zero.hpz else 1)

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

    def grad_dims(self) -> list[int | None]:
        """Per leaf, the dimension the reduced gradient is sharded on (``None``: all-reduced)."""
        return self.state_dims if self.stage.reduce_scatter else [None] * len(self.leaves)

    @property
    def compute_params(self) -> PyTree:
        """The params as the step computes with them (``ShapeDtypeStruct``, compute dtype)."""
        if not self.options.precision.mixed:
            return self.abstract_params
        return cast_floating(self.abstract_params, self.options.precision.compute_dtype)

    def params_replicated(self) -> PyTree:
        """Shardings that keep every parameter whole (other mesh axes still honoured)."""
        treedef = jax.tree.structure(self.abstract_params)
        return treedef.unflatten(
            [NamedSharding(self.mesh, self.leaf_spec(i)) for i in range(len(self.leaves))]
        )

    def leaf_spec(self, index: int, dim: int | None = None, axes: Any = None) -> P:
        """Leaf ``index``'s spec: its own entries on the mesh's other axes (a user's or AutoTP's
        ``model``), and ``axes`` on ``dim`` when given; trailing ``None`` left out, so it fits
        a leaf resting with merged leading dimensions too."""
        leaf = self.leaves[index]
        return spec_with(self._bases()[index], len(leaf.shape), dim, axes)

    @property
    def other_entries(self) -> tuple[tuple[Any, ...], ...]:
        """Per leaf, its spec's entries on the mesh axes the step leaves to the compiler (a
        user's or AutoTP's ``model``; not ``expert``, which the step makes manual), one per
        dimension; all ``None`` for a leaf no other axis splits."""
        manual = set(self.batch_axes)
        return tuple(
            tuple(_drop(e, manual) for e in b) + (None,) * (len(leaf.shape) - len(b))
            for leaf, b in zip(self.leaves, self._bases(), strict=True)
        )

    def entries_beside(self, *manual: str) -> tuple[tuple[Any, ...], ...]:
        """:attr:`other_entries` with ``manual`` axes dropped too: what the compiler still
        splits inside a region that makes them manual (a pipeline stage's ``pipe``)."""
        drop = set(manual)
        return tuple(tuple(_drop(e, drop) for e in entries) for entries in self.other_entries)

    def _bases(self) -> tuple[P, ...]:
        return self.base_specs or tuple(P() for _ in self.leaves)
