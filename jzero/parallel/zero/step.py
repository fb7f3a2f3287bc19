"""ZeRO's part of the step: the loss with stage 3's gathers at their use, and the reductions.

Where each leaf is sharded is ZeRO's leaf rule beside this module
(:mod:`jzero.parallel.zero.leaf_rule`, with the stage table :mod:`jzero.choices.stages`), which
the plan is made from; this module is what the step does with it, inside the step's
``shard_map`` over the data axis (:func:`sharded_grads`).

Decisions:

* At stage 3 the parameters enter ``shard_map`` as shards and :func:`local_loss` rewrites the
  traced loss (:mod:`jzero.rewrite.gather`) so each gather runs at its use (inside the layer
  scan for stacked layers). Their gradients come out of the transpose of the all-gather
  already reduce-scattered.
* Activation checkpointing (``remat_policy``, the config's ``activation_checkpointing``) is a
  rewrite of the loss too: at every stage the body of each ``lax.scan`` in the loss (each
  stacked layer) runs under ``jax.checkpoint`` with the policy (:mod:`jzero.rewrite.remat`), by
  the same rewrite that places stage 3's gathers. Without a policy stages 0-2 call the loss as
  written.
* Stage 0 and 1 reduce once at the accumulation boundary (stage 0 all-reduce, stage 1
  reduce-scatter); stages 2 and 3 reduce-scatter every micro-batch (:func:`reduce_grads`).
* At stage 2 the gradient of a leaf the loss's layer scan consumes is reduce-scattered one
  layer at a time inside the scan's backward (:func:`scattered_leaves`), as stage 3's
  gathers' transposes do, so no device holds the whole stacked gradient: the step
  differentiates a stand-in of each layer's shard (:func:`stand_ins`, its trailing dimensions
  flattened and split evenly, :class:`jzero.rewrite.pending.Scattered`) while the loss reads
  the whole parameter. The layers' pieces then move to the plan's resting layout, contiguous
  blocks of the leading dimension, by one all-to-all of the shard's size
  (:func:`to_state_layout`). Only leaves resting so unpadded qualify (a stack whose layer
  count the shard count divides, or divides it); any other leaf is reduced after the
  backward as before.
* ZeRO++ qgZ (``plan.options.comm.quantized_gradients``) replaces every gradient reduce-scatter
  over ``data`` by the quantized all-to-all of
  :func:`jzero.comm.quantization.quantized_psum_scatter`: here for the leaves the step reduces
  itself, in the gather's transpose for stage 3's sharded ones.
  It quantizes the gradient in its own dtype (the integers replace ``communication_data_type``)
  and sums in float32; all-reduces and the replica-axis reduction stay exact.
* ``overlap_comm`` at stages 0-2: the step's own reductions run per bucket
  (``plan.options.comm.reduce_bucket_size``, :func:`jzero.comm.overlap.reduce_buckets`).
* A leaf whose sharded dimension the shard count does not divide is reduce-scattered padded
  with zeros (:mod:`jzero.plan.padding`): the gradients leave the reduction in the shapes the
  masters rest at, the padding zero, so the global norm, the finiteness test and the clipping
  read the logical gradient only.
* A leaf split over another mesh axis too (tensor parallelism's ``model``, which the loss
  leaves to the compiler) is reduced with that axis manual as well
  (:func:`jzero.comm.manual.over_axes`): each device reduces its own model-axis piece, where
  the compiler would all-gather the whole gradient over ``model`` first.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jzero.comm import over_axes, quantized_psum_scatter, reduce_buckets
from jzero.parallel.zero.leaf_rule import pad_to
from jzero.rewrite import GatherOptions, Partition, RematPolicy, gather_at_use

if TYPE_CHECKING:
    from jzero.plan import Plan

__all__ = [
    "largest_gathered",
    "local_loss",
    "reduce_grads",
    "scattered_leaves",
    "sharded_grads",
    "stand_ins",
    "to_state_layout",
]

PyTree = Any


def local_loss(
    plan: Plan,
    loss_fn: Callable[..., Any],
    policy: RematPolicy | None = None,
    stage_shapes: PyTree = None,
    *,
    scatter: bool = False,
) -> Callable[..., Any]:
    """The loss of the local parameters inside ``shard_map``: gathers stage-3 shards lazily,
    and checkpoints each scan body by ``policy`` (:mod:`jzero.rewrite.remat`).

    ``scatter``: the loss takes ``wholes=`` (per leaf, the whole parameter of a leaf whose
    argument is its gradient's stand-in, :func:`stand_ins`; else ``None``) and reduce-scatters
    those leaves' gradients at their uses (stage 2, :func:`scattered_leaves`).

    ``stage_shapes``: one pipeline stage's compute params (its ``L / P`` layers, its experts),
    for the stage unit run with ``pipe`` manual: the compiler's axes (``model``) split a leaf as
    :meth:`Plan.entries_beside` says, and activations are not partitioned over them."""
    active = policy is not None and policy.active
    if scatter or any(d is not None for d in plan.param_dims) or active:
        staged = stage_shapes is not None
        zero, comm = plan.options.zero, plan.options.comm
        options = GatherOptions(
            grad_dtype=plan.options.precision.comm_dtype,
            reshard=zero.reshard_after_forward,
            prefetch=_prefetch(plan),
            reuse_distance=zero.max_reuse_distance,
            max_live=zero.max_live_parameters,
            bits=comm.quantized_weights,
            grad_bits=comm.quantized_gradients,
            overlap=comm.overlap_comm,
            partition=None if staged else _partition(plan, policy),
        )
        return gather_at_use(
            loss_fn,
            plan.param_dims,
            stage_shapes if staged else plan.local_compute_params,
            plan.options.parallel.axis,
            options,
            policy,
            specs=(
                plan.entries_beside(plan.options.parallel.pipe_axis)
                if staged
                else plan.other_entries
            ),
            axes=[plan.leaf_axes(i) for i in range(len(plan.leaves))],
        )
    return loss_fn


def largest_gathered(plan: Plan, in_bytes: bool = False) -> tuple[int, str]:
    """The most stage 3 gathers at once, and the leaf: a scanned leaf one layer slice at a
    time (its ``layer_dim``), any other sharded leaf whole; ``(0, "")`` when nothing is
    sharded at rest.

    Before the loss is traced (``layers_traced`` false) a stacked leaf is recognised by
    its siblings: two or more leaves of one parent with the same leading dimension (> 1)
    are taken for a layer stack, gathered one slice at a time.

    Args:
      plan: the plan.
      in_bytes: count bytes of the compute dtype instead of elements.
    """
    dtypes = [np.dtype(x.dtype) for x in jax.tree.leaves(plan.compute_params)]
    parents: dict[str, set[int | None]] = {}
    for leaf in plan.leaves:
        lead = leaf.shape[0] if len(leaf.shape) >= 2 else None
        parents.setdefault(leaf.path.rpartition(".")[0], set()).add(lead)
    siblings = Counter(leaf.path.rpartition(".")[0] for leaf in plan.leaves)
    best, path = 0, ""
    for leaf, dtype in zip(plan.leaves, dtypes, strict=True):
        if leaf.param_dim is None:
            continue
        size = math.prod(leaf.shape)
        if plan.layers_traced:  # from the traced loss: a scan gathers one slice at a time
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


def _prefetch(plan: Plan) -> int:
    """The elements a stage-3 gather outside a scan may run ahead of its use: DeepSpeed's
    ``stage3_prefetch_bucket_size`` when set, else under ``overlap_comm`` one layer (the
    largest gathered unit), so a Python loop's layer ``i + 1`` is gathered while layer ``i``
    computes, as the scans' overlap does; else 0."""
    prefetch = plan.options.zero.prefetch_bucket_size
    if prefetch or not plan.options.comm.overlap_comm:
        return prefetch
    return largest_gathered(plan)[0]


def _partition(plan: Plan, policy: RematPolicy | None) -> Partition | None:
    """``partition_activations``: the mesh's other axes with more than one device, if any."""
    if policy is None or not policy.partition or not policy.active:
        return None
    return Partition(plan.mesh, plan.auto_axes) if plan.auto_axes else None


def scattered_leaves(plan: Plan, layer_dims: Sequence[int | None]) -> list[bool]:
    """Per leaf, whether the step reduce-scatters its gradient at its uses in the loss (in a
    layer scan's backward, one layer at a time) instead of after the backward: at a stage
    that shards gradients but not parameters (stage 2), without a pipeline, for a leaf a scan
    consumes over its leading dimension (``layer_dims``, :func:`jzero.rewrite.layer_dims`)
    whose gradient rests on that dimension unpadded, over ZeRO's one axis and no other mesh
    axis, and whose layers split evenly (their element count a multiple of the shard count,
    and the layer count a multiple or a divisor of it). Else every entry is False."""
    par = plan.options.parallel
    if not plan.stage.shard_grads or plan.stage.shard_params or par.pipe_axis:
        return [False] * len(plan.leaves)
    if len(plan.zero_axes) != 1:
        return [False] * len(plan.leaves)
    n = plan.num_shards
    out = []
    for i, (leaf, layer_dim) in enumerate(zip(plan.leaves, layer_dims, strict=True)):
        layers = leaf.shape[0] if leaf.shape else 0
        out.append(
            layer_dim == 0
            and leaf.param_dim is None
            and leaf.state_dim == 0
            and not leaf.padding
            and plan.leaf_axes(i) == plan.zero_axes
            and not tuple(plan.other_spec(i))
            and math.prod(leaf.shape[1:]) % n == 0
            and (layers % n == 0 or n % layers == 0)
        )
    return out


def stand_ins(plan: Plan, params: PyTree, scattered: Sequence[bool]) -> PyTree:
    """``params`` with each leaf ``scattered`` marks (:func:`scattered_leaves`) replaced by
    zeros of its gradient's local piece per layer: ``(layers, layer elements / shards)`` in
    the parameter's dtype. The step differentiates this tree; the loss reads the whole
    parameters beside it (:func:`local_loss`'s ``scatter``)."""
    n = plan.num_shards
    leaves = [
        jnp.zeros((x.shape[0], math.prod(x.shape[1:]) // n), x.dtype) if s else x
        for x, s in zip(jax.tree.leaves(params), scattered, strict=True)
    ]
    return jax.tree.structure(params).unflatten(leaves)


def to_state_layout(plan: Plan, grads: PyTree, scattered: Sequence[bool]) -> PyTree:
    """The gradients of :func:`stand_ins`' leaves (each device: its piece of every layer,
    reduced) moved to the plan's resting layout (each device: one contiguous block of the
    leaf), by one all-to-all over ZeRO's axis each; other leaves pass through.

    With at least as many layers as shards a device takes whole layers; with fewer, the
    shards of one layer's block (``shards / layers`` blocks a layer), each sent only to the
    device whose block holds it (the other entries of the all-to-all zeros)."""
    (axis,) = plan.zero_axes
    n = plan.num_shards
    out = []
    for i, (g, s) in enumerate(zip(jax.tree.leaves(grads), scattered, strict=True)):
        if not s:
            out.append(g)
            continue
        layers, piece = g.shape
        if layers % n == 0:  # device k takes layers [k L/n, (k+1) L/n), every piece of each
            block = jax.lax.all_to_all(g, axis, 0, 1, tiled=True)
        else:  # layer l's block c (of n / L) is pieces [c L, (c+1) L): device l n/L + c's
            per_layer = n // layers
            me = jax.lax.axis_index(axis)
            hot = jax.nn.one_hot(me // layers, per_layer, dtype=g.dtype)
            send = (g[:, None, :] * hot[None, :, None]).reshape(n, piece)
            got = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)
            block = jax.lax.dynamic_slice_in_dim(got, (me % per_layer) * layers, layers)
        shape = list(plan.local_stored_shape(i))
        shape[0] //= n
        out.append(block.reshape(shape))
    return jax.tree.structure(grads).unflatten(out)


def reduce_grads(
    plan: Plan,
    grads: PyTree,
    *,
    now_sharded: bool,
    in_stage: bool = False,
    scattered: bool | None = None,
    reduced: Sequence[bool] = (),
) -> PyTree:
    """Sums local gradients over the data axis in the communication dtype: a reduce-scatter
    where the plan shards the gradient (and ``now_sharded``), else an all-reduce (over every
    batch axis: a leaf that stays whole is summed over the replicas here too). Leaves come
    back in the dtype they went in; stage 3's arrive reduce-scattered already (the transpose
    of their all-gather) and pass through.

    With ``plan.options.comm.quantized_gradients`` (ZeRO++ qgZ) each reduce-scatter is the
    quantized all-to-all of :func:`jzero.comm.quantization.quantized_psum_scatter` (summed in
    float32, from the gradient's own dtype: the integers replace the communication dtype);
    all-reduces stay exact. With ``plan.options.comm.reduce_bucket_size`` (``overlap_comm`` at
    stages 0-2) the leaves are reduced in buckets, one collective each
    (:func:`jzero.comm.overlap.reduce_buckets`).

    ``in_stage``: called in a pipeline stage's region (``pipe`` manual too), where a split
    leaf holds the stage's ``L / P`` layers and ``pipe`` is no longer the compiler's.
    ``scattered``: True reduces only the leaves scattered now (a pipeline's per-micro-batch
    reduction), False only the others (summed once after the micro-batches); None all.
    ``reduced``: per leaf, True for one reduced in the backward already
    (:func:`scattered_leaves`), which passes through."""
    bits = plan.options.comm.quantized_gradients
    pipe = plan.options.parallel.pipe_axis
    region_axes = (pipe,) if in_stage else ()  # manual in a stage's region
    leaves = jax.tree.leaves(grads)
    todo, sent, dims, groups = [], [], [], []
    for i, (g, leaf, grad_dim) in enumerate(
        zip(leaves, plan.leaves, plan.grad_dims(), strict=True)
    ):
        if leaf.param_dim is not None or (reduced and reduced[i]):
            continue
        scatter = grad_dim is not None and now_sharded
        if scattered is not None and scatter != scattered:
            continue
        todo.append(i)
        groups.append(plan.leaf_axes(i))  # expert leaves: over the axes besides `expert`
        dims.append(grad_dim if scatter else None)
        if scatter:  # a leaf the shard count does not divide is scattered padded with zeros
            shape = list(plan.local_stored_shape(i))
            if in_stage and plan.pipelined[i]:  # a stage's rows, or under interleaving a chunk's
                shape[0] //= plan.pipe_size * plan.options.parallel.pipe_virtual
            g = pad_to(g, tuple(shape))
        comm_dtype = plan.options.precision.communication(g.dtype)
        sent.append(g if scatter and bits else g.astype(comm_dtype))

    def reduce_over(axes: tuple[str, ...]) -> Callable[[list[jax.Array]], list[jax.Array]]:
        """The reduction of leaves ZeRO shards over ``axes``: scattered over them, summed
        over them and the replicas (an expert leaf's experts differ over ``expert``)."""
        entry = axes[0] if len(axes) == 1 else axes
        totals = tuple(a for a in plan.batch_axes if a not in plan.zero_axes or a in axes)

        def scatter(x: jax.Array, dim: int) -> jax.Array:
            if bits:
                return quantized_psum_scatter(x, entry, dim, bits)
            return jax.lax.psum_scatter(x, entry, scatter_dimension=dim, tiled=True)

        def total(x: jax.Array) -> jax.Array:
            return jax.lax.psum(x, totals)

        shards = math.prod(int(plan.mesh.shape[a]) for a in axes)
        return lambda xs, ds: reduce_buckets(
            xs, ds, shards, plan.options.comm.reduce_bucket_size, scatter, total
        )

    out = list(leaves)
    for axes in dict.fromkeys(groups):  # one reduction per set of axes, in leaf order
        mine = [j for j, g in enumerate(groups) if g == axes]
        # Leaves split over another axis too (tensor parallelism) are reduced piece by piece
        # over it, with that axis manual (jzero.comm.manual): no weight-sized gather.
        specs = [plan.other_spec(todo[j], *region_axes) for j in mine]
        run = reduce_over(axes)
        ds = [dims[j] for j in mine]
        reduced = over_axes(lambda xs, run=run, ds=ds: run(xs, ds), (specs,), specs)(
            [sent[j] for j in mine]
        )
        for j, r in zip(mine, reduced, strict=True):
            out[todo[j]] = r.astype(leaves[todo[j]].dtype)
    return jax.tree.structure(grads).unflatten(out)


def sharded_grads(plan: Plan, local_grads: Callable[..., Any]) -> Callable[..., Any]:
    """``local_grads`` under ``shard_map``: params come in as the plan rests them (shards at
    stage 3), the batch split over the data axis; gradients leave in the plan's grad layout."""
    treedef = jax.tree.structure(plan.abstract_params)

    def specs(dims: list[int | None], axes: tuple[str, ...]) -> PyTree:
        return treedef.unflatten([plan.manual_spec(i, d, axes) for i, d in enumerate(dims)])

    return jax.shard_map(
        local_grads,
        mesh=plan.mesh,
        in_specs=(specs(plan.param_dims, plan.zero_axes), P(), P(), plan.batch.spec),
        out_specs=(P(), P(), specs(plan.grad_dims(), plan.state_axes), P()),
        axis_names=set(plan.batch_axes),
        check_vma=False,
    )
