"""Pipeline parallelism's part of the step: the micro-batches through the stages, inside
the step's ``shard_map``, for training (:func:`pipelined_grads`) and evaluation
(:func:`pipelined_loss`).

Decisions:

* The loss is cut at its layer scan (:func:`jzero.parallel.pipeline.split_at_layers`) into
  the unit each stage runs; at ZeRO stage 3 (or with an activation checkpointing policy) that
  unit is rewritten by :func:`jzero.parallel.zero.local_loss` as the whole loss is without a
  pipeline, so each layer's gather stays in the scan body and its transpose reduce-scatters
  over ``data`` within the stage.
* The schedule runs with ``pipe`` manual (:func:`jzero.parallel.pipeline.run`); the gradients
  of the leaves every stage holds whole (embedding, head) are summed over ``pipe``, the split
  leaves' stay with their stage.
* At ZeRO stage 2 each micro-batch's gradients are reduce-scattered as its backward pass
  ends (:func:`scatters_each_micro_batch`); the step reduces the rest once.
* A loss that changes the model's non-trainable state is refused: the stages do not carry it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jzero.parallel.pipeline.backward_split import split_backward
from jzero.parallel.pipeline.layer_split import split_at_layers, stage_unit
from jzero.parallel.pipeline.schedule import RunOptions, make_schedule, run, run_forward
from jzero.parallel.zero import local_loss, reduce_grads
from jzero.rewrite import RematPolicy

if TYPE_CHECKING:
    from jzero.plan import Plan

__all__ = ["pipelined_grads", "pipelined_loss", "scatters_each_micro_batch"]

PyTree = Any
LossFn = Callable[..., Any]


def scatters_each_micro_batch(plan: Plan) -> bool:
    """Under a pipeline, whether each micro-batch's gradients are reduce-scattered as its
    backward pass ends: where the stage shards gradients but not parameters (sharded
    parameters' gradients arrive scattered already, by their gathers' transpose)."""
    return plan.stage.shard_grads and not plan.stage.shard_params


def _stage_shapes(plan: Plan, chunks: int = 1) -> PyTree:
    """The compute params one pipeline stage holds inside the step: ``L / P`` layers of each
    split leaf (a chunk's ``L / (P V)`` with ``chunks = V``), and of an expert leaf its
    ``E / E_p`` experts."""
    p = plan.pipe_size * chunks
    return jax.tree.map(
        lambda x, piped: (
            jax.ShapeDtypeStruct((x.shape[0] // p, *x.shape[1:]), x.dtype) if piped else x
        ),
        plan.local_compute_params,
        jax.tree.structure(plan.abstract_params).unflatten(list(plan.pipelined)),
    )


def pipelined_grads(
    plan: Plan, full_loss: LossFn, accum: int, policy: RematPolicy | None
) -> Callable[..., Any]:
    """The pipeline's hook in the gradient step: ``(params, extra, scale, batch) -> (loss,
    aux, grads)``, the gradients summed over the ``accum`` micro-batches of this device's rows
    and not yet reduced over ``data``, inside the step's ``shard_map``.

    The loss is cut at its layer scan (:func:`split_at_layers`) into the unit
    each stage runs; at stage 3 (or with an activation checkpointing policy) that unit is
    rewritten by :func:`local_loss` as the whole loss is without a pipeline, so each layer's
    gather stays in the scan body and its transpose reduce-scatters over ``data`` within the
    stage. The schedule runs with ``pipe`` manual; the gradients of the leaves every stage
    holds whole (embedding, head) are summed over ``pipe``, the split leaves' stay with
    their stage.
    """
    prec, par = plan.options.precision, plan.options.parallel
    pipe, chunks = par.pipe_axis, par.pipe_virtual
    schedule = make_schedule(par.pipe_schedule, plan.pipe_size, accum, chunks)
    treedef = jax.tree.structure(plan.abstract_params)
    split_leaves = plan.pipelined
    grad_dtypes = [prec.accumulator(x.dtype) for x in jax.tree.leaves(plan.abstract_params)]
    stage_shapes = _stage_shapes(plan, chunks)  # what the stage unit runs: one chunk

    loss_only = _loss_only(full_loss, prec)

    def pipelined(params: PyTree, extra: PyTree, scale: jax.Array, batch: PyTree) -> Any:
        mbs = _micro_batches(batch, accum)
        mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), mbs)
        _check_state_unchanged(full_loss, stage_shapes, extra, mb)
        trees: dict[str, Any] = {}  # the aux's tree, read from the split traced in the region

        def region(params: PyTree, extra: PyTree, scale: jax.Array, mbs: PyTree) -> Any:
            # Traced here, with `pipe` manual, so the replayed equations see this mesh.
            split, run_unit = _stage_unit(
                plan, loss_only, policy, stage_shapes, extra, mb, plan.pipe_size * chunks
            )
            trees["aux"] = jax.tree_util.treedef_children(split.out_tree)[1]
            seed = scale if prec.scaled else jnp.ones((), jnp.float32)

            def reduce(gs: list[Any]) -> list[Any]:  # stage 2: each micro-batch's scattered
                g = reduce_grads(plan, treedef.unflatten(gs), now_sharded=True, in_stage=True,
                            scattered=True)  # fmt: skip
                return jax.tree.leaves(g)

            options = RunOptions(
                axis=pipe,
                reduce=reduce if scatters_each_micro_batch(plan) else None,
                split_backward=split_backward,
                chunked=split_leaves,
            )
            grads, outs = run(
                run_unit,
                jax.tree.leaves(params),
                mbs,
                split.carry,
                schedule,
                seed,
                grad_dtypes=grad_dtypes,
                options=options,
            )
            grads = [g if s else jax.lax.psum(g, pipe) for g, s in zip(grads, split_leaves,
                     strict=True)]  # fmt: skip
            outs = [jax.lax.psum(o, pipe) for o in outs]
            return treedef.unflatten(grads), outs

        specs = _pipe_specs(plan)
        if chunks > 1:  # each stage's rows: its chunks of the model, V non-adjacent ones
            params = _interleaved(plan, params, to_chunks=True)
        grads, outs = jax.shard_map(
            region,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(specs, P(), P(), P()),
            out_specs=(specs, P()),
            axis_names={pipe},
            check_vma=False,
        )(params, extra, scale, mbs)
        if chunks > 1:
            grads = _interleaved(plan, grads, to_chunks=False)
        loss = outs[0] / accum
        aux = trees["aux"].unflatten([a / accum for a in outs[1:]])
        return loss, aux, grads

    return pipelined


def _interleaved(plan: Plan, tree: PyTree, *, to_chunks: bool) -> PyTree:
    """The split leaves' layers reordered for interleaving (``to_chunks``) or back: with ``V``
    chunks of ``L / (P V)`` layers per stage, stage ``s`` holds the model's chunks ``s, P + s,
    ...``, so its contiguous ``1 / P`` of the reordered rows are those chunks in turn. Each
    leaf rests in the model's order; the step moves each stage's chunks into place (an
    all-to-all over ``pipe``, 1 - 1/P of the split leaves' bytes) and their gradients back."""
    p, v = plan.pipe_size, plan.options.parallel.pipe_virtual

    def move(x: jax.Array, split: bool) -> jax.Array:
        if not split:
            return x
        rows = x.shape[0] // (p * v)
        grid = (v, p) if to_chunks else (p, v)  # the model's chunk v P + s <-> stage s's v-th
        y = x.reshape(*grid, rows, *x.shape[1:]).swapaxes(0, 1)
        return y.reshape(x.shape)

    leaves = [move(x, s) for x, s in zip(jax.tree.leaves(tree), plan.pipelined, strict=True)]
    return jax.tree.structure(tree).unflatten(leaves)


def pipelined_loss(plan: Plan, full_loss: LossFn, micro: int) -> Callable[..., Any]:
    """An evaluation under pipeline parallelism: ``(params, extra, batch) -> loss``, this
    device's rows' mean loss, inside the step's ``shard_map``. The rows go through the stages
    in ``micro`` micro-batches, forward only (:func:`run_forward`):
    each stage runs its own layers, as in training, instead of the compiler gathering every
    stage's layers onto each device."""
    stage_shapes = _stage_shapes(plan)
    loss_only = _loss_only(full_loss, plan.options.precision)

    def evaluate(params: PyTree, extra: PyTree, batch: PyTree) -> jax.Array:
        mbs = _micro_batches(batch, micro)
        mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), mbs)

        def region(params: PyTree, extra: PyTree, mbs: PyTree) -> Any:
            split, run_unit = _stage_unit(plan, loss_only, None, stage_shapes, extra, mb)
            outs = run_forward(
                run_unit, jax.tree.leaves(params), mbs, split.carry, plan.pipe_size,
                axis=plan.options.parallel.pipe_axis,
            )  # fmt: skip
            return jax.lax.psum(outs[0], plan.options.parallel.pipe_axis)

        total = jax.shard_map(
            region,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(_pipe_specs(plan), P(), P()),
            out_specs=P(),
            axis_names={plan.options.parallel.pipe_axis},
            check_vma=False,
        )(params, extra, mbs)
        return total / micro

    return evaluate


def _loss_only(full_loss: LossFn, prec: Any) -> Callable[..., Any]:
    """The loss (in float32 under 16-bit compute) and its float aux: what a stage unit ends in."""

    def loss_only(params: PyTree, extra: PyTree, mb: PyTree) -> Any:
        loss, (aux, _) = full_loss(params, extra, mb)
        loss = jnp.asarray(loss, jnp.float32) if prec.sixteen_bit else loss
        return loss, jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), aux)

    return loss_only


def _micro_batches(batch: PyTree, micro: int) -> PyTree:
    """``batch`` with its rows split into ``micro`` micro-batches (a new leading dim)."""
    return jax.tree.map(lambda x: x.reshape(micro, x.shape[0] // micro, *x.shape[1:]), batch)


def _pipe_specs(plan: Plan) -> PyTree:
    """The stage region's ``in_specs`` of the parameters: a split leaf's layers over ``pipe``."""
    treedef = jax.tree.structure(plan.abstract_params)
    pipe = plan.options.parallel.pipe_axis
    return treedef.unflatten([P(pipe) if s else P() for s in plan.pipelined])


def _stage_unit(
    plan: Plan,
    loss_only: Callable[..., Any],
    policy: RematPolicy | None,
    stage_shapes: PyTree,
    extra: PyTree,
    mb: PyTree,
    units: int | None = None,
) -> tuple[Any, Callable[..., Any]]:
    """Inside the stage region: the loss cut at its layer scan, and the unit of a flat list of
    the stage's parameters (gathered at stage 3, checkpointed by ``policy``); ``units``: how
    many units the model's layers make (``P``, or ``P V`` chunks under interleaving)."""
    treedef = jax.tree.structure(plan.abstract_params)
    split = split_at_layers(loss_only, stage_shapes, extra, mb, stages=units or plan.pipe_size)
    unit = local_loss(plan, stage_unit(split), policy, stage_shapes)

    def run_unit(ps: list[Any], c: Any, first: Any, last: Any, mb: PyTree) -> Any:
        return unit(treedef.unflatten(ps), c, first, last, extra, mb)

    return split, run_unit


def _check_state_unchanged(full_loss: LossFn, params: PyTree, extra: PyTree, mb: PyTree) -> None:
    """Pipeline parallelism does not carry model state through the stages: a loss that
    changes it (BatchNorm statistics, an RNG counter) is refused rather than trained wrong."""
    if not jax.tree.leaves(extra):
        return
    closed = jax.make_jaxpr(full_loss)(params, extra, mb)
    n_params, n_extra = len(jax.tree.leaves(params)), len(jax.tree.leaves(extra))
    ins = closed.jaxpr.invars[n_params : n_params + n_extra]
    outs = closed.jaxpr.outvars[len(closed.jaxpr.outvars) - n_extra :]
    if any(a is not b for a, b in zip(ins, outs, strict=True)):
        raise ValueError(
            "pipeline.stages > 1 does not carry a model's non-trainable state through the "
            "stages yet, and this loss changes it (BatchNorm statistics, an nnx.Rngs counter?). "
            "Use a model without mutable state (LayerNorm, no stateful dropout), or set "
            "pipeline.stages: 1."
        )
