"""The :class:`Plan`: the shardings of every tree a step touches, and what follows from them.

Decisions:

* A plan is data: shardings per category (params at rest, gradients, the update layout,
  optimizer state, masters, batch), the :class:`~jzero.plan.leaf_rule.LeafPlan` of every leaf and
  the communication options; :func:`jzero.plan.make_plan` builds it, and nothing here runs a
  step.
* Everything else is derived on demand from those fields: shard counts and mesh axes, the
  largest gathered unit, per-device bytes in device and host memory (:meth:`Plan.model_state_bytes`,
  :meth:`Plan.host_state_bytes`), and the table :meth:`Plan.describe` prints.
* Bytes are counted from the shardings' shard shapes (``NamedSharding.shard_shape``), so an
  uneven or replicated leaf is counted as it is laid out; params in the compute dtype,
  gradients in the accumulator dtype when micro-batches are accumulated.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.choices.stages import StageSpec
from jzero.plan.leaf_rule import LeafPlan, spec_axis_names, spec_with
from jzero.plan.memory_kinds import is_host
from jzero.plan.precision import Precision, cast_floating

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
      mesh: the device mesh (``axis`` is its data-parallel axis).
      axis: the data-parallel axis name, or the axes ZeRO shards over (``("data", "seq")``
        under sequence parallelism).
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
      precision: the run's dtypes (see :mod:`jzero.plan.precision`).
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
        iteration ahead (:func:`jzero.replay.gather.gathered`'s ``overlap``), stages 0-2 reduce the
        gradients in buckets (below), and on a GPU the step is compiled with XLA's options for
        asynchronous collectives (:func:`jzero.comm.overlap.compiler_options`).
      reduce_bucket_size: at stages 0-2 with ``overlap_comm``, the most gradient elements one
        reduction carries: consecutive leaves are reduced together up to it (one collective
        per bucket); ``None``: one collective per leaf.
      allgather_bucket_size: likewise for the all-gather of the updated parameters (stages 1-2).
      quantized_weights: ZeRO++ qwZ at stage 3: stage 3's parameter gathers send this many
        bits a value (8 or 4); 0: exact.
      seq_axis: the sequence-parallel mesh axis (Ulysses), one of :attr:`zero_axes`, or
        ``None``: its devices share the batch's rows and each computes the loss of its own
        tokens (:mod:`jzero.distributed.sequence`).
      tp_rules: per leaf, the tensor-parallel rule that laid it out over the model axis
        (:func:`jzero.distributed.tensor.autotp_specs`), empty without AutoTP.
      pipe_axis: the pipeline mesh axis (:mod:`jzero.distributed.pipeline`), or ``None``: the
        leaves the layer scan consumes are split over it on their stacked dimension (their
        base spec names it), every other leaf is whole on each stage.
      pipe_schedule: the pipeline schedule, ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"`` or
        ``"zero_bubble"``.
      pipe_virtual: the chunks of layers each stage holds (``interleaved_1f1b``; else 1).
      expert_axis: the expert-parallel mesh axis (:mod:`jzero.distributed.expert`), one of
        :attr:`zero_axes`, or ``None``: each expert leaf rests split over it on its experts
        dimension (its base spec names it) and is sharded by ZeRO over the other axes only;
        every other leaf is sharded over all of them.
      quantized_gradients: ZeRO++ qgZ at stages 1-3: every gradient reduce-scatter over the
        data axis is a quantized all-to-all of this many bits a value (8 or 4) summed in float32
        on the receiving device; 0: exact.

    Shardings of state that is offloaded carry a host memory kind (``pinned_host``); the step
    computes on :func:`~jzero.plan.memory_kinds.on_device` copies of them.
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
    stored_opt_state: PyTree = None
    tp_rules: tuple[str, ...] = ()
    seq_axis: str | None = None
    pipe_axis: str | None = None
    pipe_schedule: str = "1f1b"
    pipe_virtual: int = 1
    expert_axis: str | None = None

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
        """The mesh axes ZeRO shards over, major first: ``data``, and ``seq`` beside it under
        sequence parallelism (:attr:`seq_axis`)."""
        return (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)

    @property
    def num_shards(self) -> int:
        """The size of ZeRO's axes: how many shards a parameter is split into at rest."""
        return math.prod(int(self.mesh.shape[a]) for a in self.zero_axes)

    @property
    def num_replicas(self) -> int:
        """The size of the replica axis (1 without one)."""
        return int(self.mesh.shape[self.replica_axis]) if self.replica_axis else 1

    @property
    def seq_size(self) -> int:
        """The size of the sequence-parallel axis (1 without one)."""
        return int(self.mesh.shape[self.seq_axis]) if self.seq_axis else 1

    @property
    def pipe_size(self) -> int:
        """The pipeline stages (1 without pipeline parallelism)."""
        return int(self.mesh.shape[self.pipe_axis]) if self.pipe_axis else 1

    @property
    def pipelined(self) -> tuple[bool, ...]:
        """Per leaf, whether its stacked-layer dimension is split into pipeline stages."""
        return tuple(
            bool(self.pipe_axis) and len(b) > 0 and b[0] == self.pipe_axis for b in self._bases()
        )

    @property
    def expert_size(self) -> int:
        """The devices the experts are split over (1 without expert parallelism)."""
        return int(self.mesh.shape[self.expert_axis]) if self.expert_axis else 1

    @property
    def experts(self) -> tuple[bool, ...]:
        """Per leaf, whether it holds experts: its spec splits it over :attr:`expert_axis`."""
        if not self.expert_axis:
            return (False,) * len(self.leaves)
        return tuple(self.expert_axis in spec_axis_names(b) for b in self._bases())

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
        batch's rows are split over all of them but ``seq``, whose devices share rows and
        split their tokens."""
        return (self.replica_axis, *self.zero_axes) if self.replica_axis else self.zero_axes

    @property
    def auto_axes(self) -> tuple[str, ...]:
        """The mesh axes of more than one device the step's ``shard_map`` leaves to the
        partitioner (not in :attr:`batch_axes`): AutoTP's ``model``, a pipeline's ``pipe``."""
        return tuple(a for a, n in self.mesh.shape.items() if a not in self.batch_axes and n > 1)

    @property
    def state_axes(self) -> tuple[str, ...]:
        """The mesh axes gradients and optimizer state are sharded over, major first:
        ZeRO's axes, and ``replica`` too under :attr:`hpz`."""
        return (
            (*self.zero_axes, self.replica_axis)
            if self.hpz and self.replica_axis
            else (self.zero_axes)
        )

    @property
    def data_parallel_size(self) -> int:
        """Devices the batch's rows are split over (``replica`` x ``data``); a ``seq`` group
        shares its rows."""
        return self.num_shards * self.num_replicas // self.seq_size

    @property
    def loss_shards(self) -> int:
        """Devices whose local losses average into the step's loss: every device of
        :attr:`batch_axes` (each holds its own rows, or its own tokens of them)."""
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
                    if leaf.shape[0] > 1:  # the trace moves it off the layer dimension
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
        dtypes = jax.tree.leaves(self.compute_params)
        if accumulation_steps > 1:
            dtypes = [
                jax.ShapeDtypeStruct((), self.precision.accumulator(x.dtype))
                for x in jax.tree.leaves(self.abstract_params)
            ]
        treedef = jax.tree.structure(self.abstract_params)
        grads = treedef.unflatten(
            [
                jax.ShapeDtypeStruct(leaf.stored_shape(self.stage.shard_grads), d.dtype)
                for leaf, d in zip(self.leaves, dtypes, strict=True)
            ]
        )
        parts = [("params", self.stored_params, self.params), ("grads", grads, grad_acc)]
        if self.precision.mixed:
            parts.append(("master_params", self.stored_update, self.master))
        parts.append(("opt_state", self.stored_opt(), self.opt_state))
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

    def describe(self) -> str:
        """A table of every leaf: shape, spec per category, per-device bytes, what stayed whole."""
        n = self.num_shards
        rules = self.tp_rules or ("",) * len(self.leaves)
        rows = [("leaf", "shape", "dtype", "params", "grads", "opt state", "bytes/device")]
        if self.tp_rules:
            rows[0] += ("tensor parallel",)
        flat_p = jax.tree.leaves(self.params)
        flat_g = jax.tree.leaves(self.grads)
        flat_c = jax.tree.leaves(self.compute_params)
        for leaf, sp, sg, c, rule in zip(self.leaves, flat_p, flat_g, flat_c, rules, strict=True):
            nbytes = math.prod(sp.shard_shape(leaf.param_shape)) * np.dtype(c.dtype).itemsize
            shape = "x".join(map(str, leaf.shape)) or "()"
            if leaf.padding:
                shape += f" (+{leaf.padding} on dim {leaf.state_dim})"
            rows.append(
                (
                    leaf.path,
                    shape,
                    np.dtype(c.dtype).name,
                    str(tuple(sp.spec)) + (" host" if is_host(sp) else ""),
                    str(tuple(sg.spec)),
                    str(tuple(sg.spec)) if self.stage.shard_opt_state else "()",
                    f"{nbytes:,}",
                )
                + ((rule,) if self.tp_rules else ())
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            f"ZeRO stage {self.stage.stage} ({self.stage.description}) over "
            f"{' x '.join(self.zero_axes)}={n} of mesh {dict(self.mesh.shape)}",
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
        if self.pipe_axis:
            split = sum(self.pipelined)
            lines.append(
                f"pipeline: {self.pipe_size} stages over {self.pipe_axis!r}, schedule "
                f"{self.pipe_schedule}"
                + (
                    f" ({self.pipe_virtual} chunks of layers per stage)"
                    if self.pipe_virtual > 1
                    else ""
                )  # fmt: skip
                + "; "
                + (
                    f"{split} stacked-layer leaves split into consecutive layers per stage, "
                    + (
                        "each stage's rows its chunks in turn (the model's s, P + s, ...), "
                        if self.pipe_virtual > 1
                        else ""
                    )  # fmt: skip
                    + "the rest whole on every stage"
                    if self.layers_traced
                    else "the layer scan's leaves are split when the loss is first traced"
                )
            )
        if self.expert_axis:
            experts = [leaf.path for leaf, e in zip(self.leaves, self.experts, strict=True) if e]
            others = "x".join(a for a in self.zero_axes if a != self.expert_axis)
            lines.append(
                f"experts: {len(experts)} expert leaves split over {self.expert_axis!r} "
                f"({self.expert_size} devices, each holding its share of the experts), ZeRO over "
                f"{others or 'no other axis'} for them, over all of "
                f"{'x'.join(self.zero_axes)} for the rest: " + ", ".join(experts)
            )
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
        lines.append(
            "each leaf is sharded on its leading dimension (contiguous shards), padded with "
            "zeros to a multiple of the shard count where that does not divide it (+N)"
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
        padded = [leaf for leaf in self.leaves if leaf.padding]
        if padded:
            extra = sum(
                leaf.padding * math.prod(leaf.shape) // leaf.shape[leaf.state_dim]
                for leaf in padded
            )
            lines.append(
                f"padding: {len(padded)} leaves rest padded, {extra:,} zero elements in all "
                f"({extra / max(1, sum(math.prod(x.shape) for x in self.leaves)):.2%} of the "
                "parameters), never read by the loss, the norms or the update"
            )
        if self.tp_rules:
            model = {a: n for a, n in self.mesh.shape.items() if a == "model"}
            lines.append(
                f"tensor parallel (AutoTP) over {model}: Megatron's column, row and vocabulary "
                "splits; ZeRO shards a dimension the model axis leaves free"
            )
            loose = [leaf.path for leaf, r in zip(self.leaves, rules, strict=True)
                     if r.startswith("no rule")]  # fmt: skip
            if loose:
                lines.append(
                    f"leaves no tensor-parallel rule matched, replicated over model "
                    f"({len(loose)}; give them a tensor_parallel.tp_plan entry to split them): "
                    + ", ".join(loose)
                )
        whole = [leaf for leaf in self.leaves if leaf.note]
        if whole:
            lines.append("leaves ZeRO left whole on every device:")
            lines.extend(f"  {leaf.path}: {leaf.note}" for leaf in whole)
        return "\n".join(lines)
