"""The update half of the train step: the optax update on the shards, then params at rest.

Decisions:

* The optax update runs as ordinary sharded JAX under ``jit``: it sees global arrays laid out
  in shards (the plan's update layout), so every optax transform (including norm-based ones
  like LAMB) computes what it would on one device, while each device only does the arithmetic
  for its own shard.
* It updates the float32 master weights under mixed precision; otherwise the params
  themselves, cut to the update layout with no communication (:func:`update_inputs`). With
  16-bit masters (``bf16.bf16_master_weights_and_grads``) those params are bfloat16: the
  optimizer runs in float32 (:func:`jzero.optim.float32_update`) and the new shard is rounded
  to bfloat16 there, to nearest or stochastically (:func:`apply_updates`).
* A skipped step (non-finite gradients under skipping) keeps every bit of the masters and the
  optimizer state, and the floating model state (BatchNorm statistics may hold the same NaN);
  integer model state (RNG counters) advances as usual (:func:`keep_old_when_nonfinite`).
* The params the next step computes with are gathered from the updated shards explicitly,
  inside ``shard_map``, so the collective's dtype is exactly the one chosen: a 16-bit
  communication dtype rounds each shard before the all-gather (half the bytes), a float32 one
  gathers the masters and rounds after; both give the same bits. Under ZeRO++ hpZ the updated
  ``replica`` x ``data`` shards are all-gathered over ``replica`` back into the
  ``data``-sharded parameters; with ``overlap_comm`` at stages 1-2 the gather runs per bucket
  (``plan.options.comm.allgather_bucket_size``, :func:`jzero.comm.overlap.gather_buckets`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jzero.comm import gather_buckets, spec_axes
from jzero.optim.master16 import apply_rounded
from jzero.parallel.zero import axis_entry, unpad_to
from jzero.plan import (
    Plan,
    cast_floating,
    on_device,
    to_logical,
    to_stored,
    update_view,
)
from jzero.step.state import TrainState, to_device

__all__ = ["params_at_rest"]

PyTree = Any


def update_inputs(plan: Plan, state: TrainState, params: PyTree) -> tuple[PyTree, PyTree]:
    """What the optax update runs on, on the device, at the logical shapes (padded leaves cut,
    :mod:`jzero.plan.padding`): the local shard of the master weights (the float32 masters
    under mixed precision, else the params themselves cut to the update layout, with no
    communication) and the optimizer state."""
    if plan.options.precision.mixed:
        master = to_logical(
            to_device(state.master, plan.master), plan.abstract_params, on_device(plan.master)
        )
    else:
        master = jax.tree.map(
            lambda x, a, s, sh: update_view(x, a.shape, s.shape, sh),
            params,
            plan.compute_params,
            plan.stored_update,
            on_device(plan.update_layout),
        )
    opt_state = to_logical(
        to_device(state.opt_state, plan.opt_state),
        plan.abstract_opt_state,
        on_device(plan.opt_state),
    )
    return master, opt_state


def apply_updates(plan: Plan, master: PyTree, updates: PyTree, step: jax.Array) -> PyTree:
    """The new masters: ``optax.apply_updates`` (16-bit masters: the sum in float32 rounded to
    nearest), or with 16-bit masters and ``stochastic_rounding`` rounded stochastically with
    keys from the update count ``step`` and each leaf's index
    (:func:`jzero.optim.master16.apply_rounded`)."""
    prec = plan.options.precision
    sr = prec.low_precision_masters and prec.stochastic_rounding
    return apply_rounded(master, updates, step if sr else None)


def keep_old_when_nonfinite(finite: jax.Array, new: tuple, old: tuple) -> tuple:
    """A skipped step's ``(master, opt_state, extra)``: the old values where ``finite`` is
    false. Floating model state (BatchNorm statistics may hold the same NaN) is kept too;
    integer model state (RNG counters) advances as usual."""
    (new_master, new_opt, new_extra), (master, opt, extra) = new, old

    def keep(a: PyTree, b: PyTree) -> PyTree:
        return jax.tree.map(lambda x, y: jnp.where(finite, x, y), a, b)

    extra = jax.tree.map(
        lambda x, y: jnp.where(finite, x, y) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
        new_extra,
        extra,
    )
    return keep(new_master, master), keep(new_opt, opt), extra


def params_at_rest(plan: Plan, master: PyTree) -> PyTree:
    """The params the next step computes with, from updated master shards in the update
    layout (the 16-bit copies of them work too: the rounding is the same).

    Leaves that rest whole but are updated in shards are all-gathered explicitly (inside
    ``shard_map``, so the collective's dtype is exactly the one chosen here). Under mixed
    precision the 16-bit copy is the rounding of the masters: a 16-bit communication dtype
    rounds each shard before the all-gather (half the bytes), a float32 one gathers the masters
    and rounds after. Both give the same bits.
    """
    prec = plan.options.precision
    axis = plan.options.parallel.axis
    compute = prec.compute_dtype
    comm = prec.comm_dtype if prec.comm_dtype is not None else compute
    round_first = prec.mixed and jnp.dtype(comm).itemsize <= jnp.dtype(compute).itemsize
    if round_first:
        master = cast_floating(master, compute)
    # The updated shards rest padded (jzero.plan.padding); a gathered leaf is cut back after
    # its all-gather, one sharded at rest keeps its padding.
    master = to_stored(master, plan.stored_update)
    treedef = jax.tree.structure(plan.abstract_params)
    leaves = plan.leaves
    state_axes = plan.state_axes
    # Per leaf, the axes its updated shard is gathered over: every state axis where the
    # parameter rests whole, the replica axis where hpZ keeps it sharded over data only.
    # An expert leaf's shard spans the axes besides `expert` (plan.leaf_axes).
    gather_axes = [
        ()
        if leaf.state_dim is None
        else plan.leaf_axes(i, state_axes)
        if leaf.param_dim is None
        else tuple(a for a in state_axes if a not in plan.zero_axes)
        for i, leaf in enumerate(leaves)
    ]
    if any(gather_axes):
        # A leaf split over another axis too (tensor parallelism) is gathered piece by piece
        # over it, that axis manual here as well: never the whole weight over `model`.
        in_specs = treedef.unflatten(
            [plan.leaf_spec(i, leaf.state_dim, state_axes) for i, leaf in enumerate(leaves)]
        )
        out_specs = treedef.unflatten(
            [plan.leaf_spec(i, leaf.param_dim, axis) for i, leaf in enumerate(leaves)]
        )
        # Each device's logical piece over those other axes, which the gather cuts back to.
        local = [
            NamedSharding(plan.mesh, plan.leaf_spec(i)).shard_shape(leaf.shape)
            for i, leaf in enumerate(leaves)
        ]

        def gather(tree: PyTree) -> PyTree:
            xs = jax.tree.leaves(tree)
            # Stages 1-2 with buckets: the leaves gathered over every state axis go in buckets,
            # the others (expert leaves) one by one.
            bucketed = [
                plan.options.comm.allgather_bucket_size is not None and axes == state_axes
                for axes in gather_axes
            ]
            if any(bucketed):
                dims = [
                    leaf.state_dim if b else None
                    for b, leaf in zip(bucketed, leaves, strict=True)
                ]  # fmt: skip
                xs = gather_buckets(  # a leaf with dim None passes through
                    xs,
                    dims,
                    plan.state_shards,
                    plan.options.comm.allgather_bucket_size,
                    lambda x, d: jax.lax.all_gather(x, axis_entry(state_axes), axis=d, tiled=True),
                )
            xs = [
                x
                if not axes or b
                else jax.lax.all_gather(x, axis_entry(axes), axis=leaf.state_dim, tiled=True)
                for x, axes, leaf, b in zip(xs, gather_axes, leaves, bucketed, strict=True)
            ]
            return treedef.unflatten(
                [
                    unpad_to(x, shape) if axes and leaf.param_dim is None else x
                    for x, axes, leaf, shape in zip(xs, gather_axes, leaves, local, strict=True)
                ]
            )

        master = jax.shard_map(
            gather,
            mesh=plan.mesh,
            in_specs=(in_specs,),
            out_specs=out_specs,
            axis_names=set(state_axes) | spec_axes(plan.base_specs),
            check_vma=False,
        )(master)
    master = jax.lax.with_sharding_constraint(master, on_device(plan.params))
    if prec.mixed and not round_first:
        master = cast_floating(master, compute)
    return master
