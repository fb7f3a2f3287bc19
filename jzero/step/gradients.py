"""The gradient half of the train step: the loss on each device's rows, reduced as the stage says.

Decisions:

* Gradients are computed and reduced inside ``shard_map`` over the data axis, where each
  device sees its slice of the global batch. That is the only way to get a true
  ``reduce-scatter`` on every backend (plain GSPMD lowers a sharded-gradient constraint to an
  all-reduce plus a slice on CPU). ``check_vma=False``: each device differentiates its own
  local loss, and jzero chooses every reduction explicitly.
* Stage 0 and 1 accumulate the full local gradient over micro-batches (``lax.scan``) and reduce
  once at the boundary (stage 0 all-reduce, stage 1 reduce-scatter). Stages 2 and 3
  reduce-scatter every micro-batch and accumulate only the shard.
* At stage 3 the parameters enter ``shard_map`` as shards and :mod:`jzero.replay.gather` moves each
  gather to its use (inside the layer scan for stacked layers). Their gradients come out of the
  transpose of the all-gather already reduce-scattered.
* Activation checkpointing (``remat_policy``, the config's ``activation_checkpointing``) is a
  rewrite of the loss too: at every stage the body of each ``lax.scan`` in the loss (each
  stacked layer) runs under ``jax.checkpoint`` with the policy (:mod:`jzero.replay.remat`), by the
  same replay that places stage 3's gathers. Without a policy stages 0-2 call the loss as
  written. The eval step never rematerialises (it has no backward pass).
* The gradient is the mean over the global batch: local sums are divided by
  ``accumulation_steps x data-parallel size`` once, on the reduced shards.
* With a ``replica`` axis (hybrid sharding) the ``shard_map`` spans ``replica`` and ``data``:
  each device differentiates its own rows, gradients are reduce-scattered within ``data`` as
  the stage says, and only the shards cross the replica axis, once per step at the
  accumulation boundary: an all-reduce of ``1/data`` of the gradient bytes (hybrid), or a
  reduce-scatter of them (ZeRO++ hpZ, whose optimizer state is sharded over both axes).
  Stage 3's gathers stay within ``data``.
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
* Under fp16 loss scaling the gradients are unscaled after the reduction, then their global
  norm decides finiteness and DeepSpeed's clipping (:func:`_clip`), before any update.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jzero._util import dotted
from jzero.comm import over_axes, quantized_psum_scatter, reduce_buckets
from jzero.plan import LossScaleState, Plan, largest_gathered, on_device, pad_to
from jzero.replay import (
    GatherOptions,
    Partition,
    RematPolicy,
    gathered,
    parse_policy,
    split_at_layers,
    split_backward,
    stage_unit,
)
from jzero.step.options import StepOptions
from jzero.step.state import TrainState, to_device

PyTree = Any

LossFn = Callable[[PyTree, PyTree], Any]


def _loss_and_aux(out: Any) -> tuple[Any, Any]:
    """Splits what a loss returned: a scalar, or a ``(loss, aux)`` pair; else a clear error."""
    if isinstance(out, tuple) and len(out) == 2:
        return out
    if getattr(out, "shape", None) == ():
        return out, {}
    shown = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), out)
    raise ValueError(
        f"loss_fn must return a scalar loss or a (loss, aux) pair, but it returned {shown}. "
        "Return the mean loss of the batch it is given."
    )


def with_extra(loss_fn: LossFn, has_aux: bool | None, takes_extra: bool) -> LossFn:
    """Every loss as ``f(params, extra, batch) -> (loss, (aux, new_extra))``.

    ``has_aux`` None: whether the loss returns ``(loss, aux)`` is read from what it returns
    when the step is traced (once per batch shape, at no cost per step).
    """
    if takes_extra:
        return loss_fn
    if has_aux is None:

        def detect(params: PyTree, extra: PyTree, batch: PyTree) -> Any:
            loss, aux = _loss_and_aux(loss_fn(params, batch))
            return loss, (aux, extra)

        return detect
    if has_aux:
        return lambda params, extra, batch: (lambda o: (o[0], (o[1], extra)))(
            loss_fn(params, batch)
        )
    return lambda params, extra, batch: (loss_fn(params, batch), ({}, extra))


def _mean_extra(extra: PyTree, axis: str | tuple[str, ...]) -> PyTree:
    """Averages floating non-trainable state over devices (running statistics); the rest
    (counters, RNG keys) advances identically on every device and is kept."""

    def mean(x: Any) -> Any:
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return jax.lax.pmean(x, axis)
        return x

    return jax.tree.map(mean, extra)


def _float_aux(aux: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), aux)


def local_loss(
    plan: Plan, loss_fn: LossFn, policy: RematPolicy | None = None, stage_shapes: PyTree = None
) -> LossFn:
    """The loss of the local parameters inside ``shard_map``: gathers stage-3 shards lazily,
    and checkpoints each scan body by ``policy`` (:mod:`jzero.replay.remat`).

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
        return gathered(
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


def gradient_part(
    plan: Plan,
    loss_fn: LossFn,
    options: StepOptions,
    has_aux: bool | None,
    takes_extra: bool,
) -> Callable[[TrainState, PyTree], tuple[Any, ...]]:
    """The step up to the update: ``(state, batch) -> (params on the device, gradients
    reduced, unscaled and clipped in the update layout, their global norm, whether it is
    finite, loss, aux, new extra)``; ``options``' accumulation, clipping and remat policy."""
    accum = int(options.accumulation_steps)
    remat_policy = options.remat_policy
    if isinstance(remat_policy, str):
        remat_policy = parse_policy(remat_policy)
    full_loss = with_extra(loss_fn, has_aux, takes_extra)
    grads_fn = _sharded_grads(plan, _local_grads(plan, full_loss, accum, remat_policy))
    prec = plan.options.precision

    def gradients(state: TrainState, batch: PyTree) -> tuple[Any, ...]:
        if not isinstance(state.loss_scale, LossScaleState):
            raise ValueError(
                "The TrainState has no loss-scale state; build it with "
                "jzero.step.init_train_state(plan, params, optimizer)."
            )
        _check_batch_rows(batch, accum * plan.data_parallel_size, accum)
        params = to_device(state.params, plan.params)
        ls = state.loss_scale
        loss, aux, grads, extra = grads_fn(params, state.extra, ls.scale, batch)
        grads = jax.lax.with_sharding_constraint(grads, on_device(plan.grads))
        if prec.scaled:  # the loss was multiplied by the scale; the gradients come back down
            grads = jax.tree.map(lambda g: g / ls.scale, grads)
        if prec.low_precision_masters:  # bf16 gradients: their norm is summed in float32
            grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        else:
            grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        grads = _clip(grads, grad_norm, options.gradient_clipping)
        return params, grads, grad_norm, finite, loss, aux, extra

    return gradients


def _check_batch_rows(batch: PyTree, multiple: int, accum: int) -> None:
    """Trace-time check: every batch leaf splits into ``accum`` micro-batches per device."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        lead = x.shape[0] if x.ndim else None
        if lead is None or lead % multiple:
            name = dotted(path) or "<batch>"
            raise ValueError(
                f"Batch leaf {name!r} has leading dim {lead}, which does not split into "
                f"{accum} micro-batch(es) on each of the {multiple // accum} devices of the "
                f"data axis. Pass a global batch whose leading dim is a multiple of {multiple} "
                "(accumulation_steps x data-parallel size)."
            )


def _local_grads(
    plan: Plan, full_loss: LossFn, accum: int, policy: RematPolicy | None
) -> Callable[..., Any]:
    """The per-device gradient computation, run inside ``shard_map`` over the data axis.

    ``(params, extra, scale, batch) -> (loss, aux, grads, extra)``: each device differentiates
    the loss of its own rows (``accum`` micro-batches of them, accumulated by a scan) and the
    gradients leave reduced over the data axis as the stage says (:func:`_reduce`), already
    divided into the mean over the global batch, in the master weights' dtype.
    """
    prec, axis, n = plan.options.precision, plan.batch_axes, plan.loss_shards
    treedef = jax.tree.structure(plan.abstract_params)
    master_dtypes = [x.dtype for x in jax.tree.leaves(plan.abstract_params)]
    # Stages 2-3 reduce every micro-batch (only the shard is accumulated); 0-1 reduce once,
    # at the accumulation boundary.
    reduce_each = plan.stage.shard_grads
    local = local_loss(plan, full_loss, policy)

    def scaled(params: PyTree, extra: PyTree, scale: jax.Array, batch: PyTree) -> Any:
        """The loss to differentiate (times the loss scale under fp16), and what to report."""
        loss, (aux, extra) = local(params, extra, batch)
        if not prec.sixteen_bit:
            return loss, (loss, aux, extra)
        loss = jnp.asarray(loss, jnp.float32)  # a 16-bit loss is reported in float32
        return (loss * scale if prec.scaled else loss), (loss, aux, extra)

    grad_fn = jax.grad(scaled, has_aux=True)

    def micro(params: PyTree, extra: PyTree, scale: jax.Array, mb: PyTree) -> tuple[Any, Any]:
        """One micro-batch: its gradient, reduce-scattered now at stages 2-3, and widened to
        the accumulator's dtype when there is more than one micro-batch to add up."""
        g, (loss, aux, extra) = grad_fn(params, extra, scale, mb)
        if reduce_each:
            g = _reduce(plan, g, now_sharded=True)
        if accum > 1:
            leaves = zip(jax.tree.leaves(g), master_dtypes, strict=True)
            g = treedef.unflatten([x.astype(prec.accumulator(m)) for x, m in leaves])
        return extra, (loss, _float_aux(aux), g)

    piped = (
        _pipelined_grads(plan, full_loss, accum, policy)
        if plan.options.parallel.pipe_axis
        else None
    )

    def local_grads(params: PyTree, extra: PyTree, scale: jax.Array, batch: PyTree) -> Any:
        if piped is not None:  # the micro-batches go through the stages; reduced once below
            loss, aux, g = piped(params, extra, scale, batch)
        elif accum == 1:
            extra, (loss, aux, g) = micro(params, extra, scale, batch)
        else:
            extra, (loss, aux, g) = _accumulate(
                functools.partial(micro, params), extra, scale, batch, accum
            )
        if piped is not None:  # at stage 2 the pipeline scattered each micro-batch's already
            done = False if _scatters_each_micro_batch(plan) else None
            g = _reduce(plan, g, now_sharded=plan.stage.reduce_scatter, scattered=done)
        elif not reduce_each:
            g = _reduce(plan, g, now_sharded=plan.stage.reduce_scatter)
        g = _reduce_replicas(plan, g)
        # The mean over the global batch: local sums over accum micro-batches and n devices.
        leaves = zip(jax.tree.leaves(g), master_dtypes, strict=True)
        g = treedef.unflatten([x.astype(m) / (accum * n) for x, m in leaves])
        loss = jax.lax.pmean(loss, axis)
        aux = jax.tree.map(lambda a: jax.lax.pmean(a, axis), aux)
        return loss, aux, g, _mean_extra(extra, axis)

    return local_grads


def _scatters_each_micro_batch(plan: Plan) -> bool:
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


def _pipelined_grads(
    plan: Plan, full_loss: LossFn, accum: int, policy: RematPolicy | None
) -> Callable[..., Any]:
    """Pipeline parallelism (:mod:`jzero.parallel.pipeline`): ``(params, extra, scale,
    batch) -> (loss, aux, grads)``, the gradients summed over the ``accum`` micro-batches of
    this device's rows and not yet reduced over ``data``, inside the step's ``shard_map``.

    The loss is cut at its layer scan (:func:`jzero.replay.split_at_layers`) into the unit
    each stage runs; at stage 3 (or with an activation checkpointing policy) that unit is
    replayed by :func:`gathered` as the whole loss is without a pipeline, so each layer's
    gather stays in the scan body and its transpose reduce-scatters over ``data`` within the
    stage. The schedule runs with ``pipe`` manual; the gradients of the leaves every stage
    holds whole (embedding, head) are summed over ``pipe``, the split leaves' stay with
    their stage.
    """
    from jzero.parallel import pipeline

    prec, par = plan.options.precision, plan.options.parallel
    pipe, chunks = par.pipe_axis, par.pipe_virtual
    schedule = pipeline.make_schedule(par.pipe_schedule, plan.pipe_size, accum, chunks)
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
                g = _reduce(plan, treedef.unflatten(gs), now_sharded=True, in_stage=True,
                            scattered=True)  # fmt: skip
                return jax.tree.leaves(g)

            options = pipeline.RunOptions(
                axis=pipe,
                reduce=reduce if _scatters_each_micro_batch(plan) else None,
                split_backward=split_backward,
                chunked=split_leaves,
            )
            grads, outs = pipeline.run(
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
    in ``micro`` micro-batches, forward only (:func:`jzero.parallel.pipeline.schedule.run_forward`):
    each stage runs its own layers, as in training, instead of the compiler gathering every
    stage's layers onto each device."""
    from jzero.parallel import pipeline

    stage_shapes = _stage_shapes(plan)
    loss_only = _loss_only(full_loss, plan.options.precision)

    def evaluate(params: PyTree, extra: PyTree, batch: PyTree) -> jax.Array:
        mbs = _micro_batches(batch, micro)
        mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), mbs)

        def region(params: PyTree, extra: PyTree, mbs: PyTree) -> Any:
            split, run_unit = _stage_unit(plan, loss_only, None, stage_shapes, extra, mb)
            outs = pipeline.run_forward(
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
        return loss, _float_aux(aux)

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


def _accumulate(
    micro: Callable[..., Any], extra: PyTree, scale: jax.Array, batch: PyTree, accum: int
) -> tuple[PyTree, tuple[Any, Any, Any]]:
    """Runs ``micro`` over ``accum`` micro-batches of ``batch`` (a scan) and sums what it
    returns: the loss and aux come back as means, the gradients as sums. Model state
    (``extra``) threads through the micro-batches in order."""
    mbs = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)
    first = jax.tree.map(lambda x: x[0], mbs)
    shapes = jax.eval_shape(micro, extra, scale, first)[1]
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def body(carry: Any, mb: PyTree) -> tuple[Any, None]:
        extra, sums = carry
        extra, out = micro(extra, scale, mb)
        return (extra, jax.tree.map(jnp.add, sums, out)), None

    (extra, (loss, aux, g)), _ = jax.lax.scan(body, (extra, zeros), mbs)
    return extra, (loss / accum, jax.tree.map(lambda a: a / accum, aux), g)


def _reduce(
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


def _reduce_replicas(plan: Plan, grads: PyTree) -> PyTree:
    """Sums the ``data``-reduced gradient shards over the replica axis, once per step (after
    accumulation), in the communication dtype: an all-reduce (hybrid sharding) or, under hpZ,
    a reduce-scatter into the optimizer's ``replica`` x ``data`` shards. Leaves that stayed
    whole were summed over every axis by :func:`_reduce`."""
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


def _sharded_grads(plan: Plan, local_grads: Callable[..., Any]) -> Callable[..., Any]:
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


def _clip(grads: PyTree, grad_norm: jax.Array, max_norm: float) -> PyTree:
    """DeepSpeed's clipping: scale by ``max_norm / (norm + 1e-6)`` when that is below one."""
    if not max_norm or max_norm <= 0:
        return grads
    coef = jnp.minimum(1.0, max_norm / (grad_norm + 1e-6))
    return jax.tree.map(lambda g: (g * coef).astype(g.dtype), grads)
