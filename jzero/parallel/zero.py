"""ZeRO's part of the step: the loss with stage 3's gathers at their use, and the reductions.

Where each leaf is sharded is the plan's leaf rule (:mod:`jzero.plan.leaf_rule`, with the stage
table :mod:`jzero.choices.stages`); this module is what the step does with it, inside the step's
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
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jzero.comm import over_axes, quantized_psum_scatter, reduce_buckets
from jzero.plan import Plan, largest_gathered, pad_to
from jzero.rewrite import GatherOptions, Partition, RematPolicy, gather_at_use

__all__ = ["local_loss", "reduce_grads", "sharded_grads"]

PyTree = Any


def local_loss(
    plan: Plan,
    loss_fn: Callable[..., Any],
    policy: RematPolicy | None = None,
    stage_shapes: PyTree = None,
) -> Callable[..., Any]:
    """The loss of the local parameters inside ``shard_map``: gathers stage-3 shards lazily,
    and checkpoints each scan body by ``policy`` (:mod:`jzero.rewrite.remat`).

    ``stage_shapes``: one pipeline stage's compute params (its ``L / P`` layers, its experts),
    for the stage unit run with ``pipe`` manual: the compiler's axes (``model``) split a leaf as
    :meth:`Plan.entries_beside` says, and activations are not partitioned over them."""
    if any(d is not None for d in plan.param_dims) or (policy is not None and policy.active):
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


def reduce_grads(
    plan: Plan,
    grads: PyTree,
    *,
    now_sharded: bool,
    in_stage: bool = False,
    scattered: bool | None = None,
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
    reduction), False only the others (summed once after the micro-batches); None all."""
    bits = plan.options.comm.quantized_gradients
    pipe = plan.options.parallel.pipe_axis
    region_axes = (pipe,) if in_stage else ()  # manual in a stage's region
    leaves = jax.tree.leaves(grads)
    todo, sent, dims, groups = [], [], [], []
    for i, (g, leaf, grad_dim) in enumerate(
        zip(leaves, plan.leaves, plan.grad_dims(), strict=True)
    ):
        if leaf.param_dim is not None:
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
