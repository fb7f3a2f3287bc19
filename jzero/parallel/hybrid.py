"""Hybrid sharding's part of the step: the gradient shards summed over the ``replica`` axis.

With a ``replica`` axis the step's ``shard_map`` spans ``replica`` and ``data``: each device
differentiates its own rows, gradients are reduce-scattered within ``data`` as the stage says
(:func:`jzero.parallel.zero.reduce_grads`), and only the shards cross the replica axis, once per
step at the accumulation boundary (:func:`reduce_replicas`): an all-reduce of ``1/data`` of the
gradient bytes (hybrid), or a reduce-scatter of them (ZeRO++ hpZ, whose optimizer state is
sharded over both axes). Stage 3's gathers stay within ``data``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax

from jzero.comm import over_axes

if TYPE_CHECKING:
    from jzero.plan import Plan

__all__ = ["reduce_replicas"]

PyTree = Any


def reduce_replicas(plan: Plan, grads: PyTree) -> PyTree:
    """Sums the ``data``-reduced gradient shards over the replica axis, once per step (after
    accumulation), in the communication dtype: an all-reduce (hybrid sharding) or, under hpZ,
    a reduce-scatter into the optimizer's ``replica`` x ``data`` shards. Leaves that stayed
    whole were summed over every axis by :func:`jzero.parallel.zero.reduce_grads`."""
    if plan.replica_axis is None:
        return grads
    out = []
    for i, (g, grad_dim) in enumerate(zip(jax.tree.leaves(grads), plan.grad_dims(), strict=True)):
        if grad_dim is None:
            out.append(g)
            continue

        def reduce(c: jax.Array, grad_dim: int = grad_dim) -> jax.Array:
            if plan.options.zero.hpz:
                return jax.lax.psum_scatter(
                    c, plan.replica_axis, scatter_dimension=grad_dim, tiled=True
                )
            return jax.lax.psum(c, plan.replica_axis)

        spec = plan.other_spec(i)
        comm_dtype = plan.options.precision.communication(g.dtype)
        c = over_axes(reduce, (spec,), spec)(g.astype(comm_dtype))
        out.append(c.astype(g.dtype))
    return jax.tree.structure(grads).unflatten(out)
