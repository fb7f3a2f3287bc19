"""The gradient half of the train step: the loss on each device's rows, reduced as the stage says.

This is the one data-parallel step; each parallelism's part of it is its room's hook
(:mod:`jzero.parallel`): ZeRO's rewritten loss and reductions (:mod:`jzero.parallel.zero`),
the replica axis's (:mod:`jzero.parallel.hybrid`), and the pipeline's micro-batches through
the stages (:mod:`jzero.parallel.pipeline.step`).

Decisions:

* Gradients are computed and reduced inside ``shard_map`` over the data axis, where each
  device sees its slice of the global batch. That is the only way to get a true
  ``reduce-scatter`` on every backend (plain GSPMD lowers a sharded-gradient constraint to an
  all-reduce plus a slice on CPU). ``check_vma=False``: each device differentiates its own
  local loss, and jzero chooses every reduction explicitly.
* Stage 0 and 1 accumulate the full local gradient over micro-batches (``lax.scan``) and reduce
  once at the boundary (stage 0 all-reduce, stage 1 reduce-scatter). Stages 2 and 3
  reduce-scatter every micro-batch and accumulate only the shard; stage 2 reduce-scatters the
  leaves of the loss's layer scan inside its backward, one layer at a time (it differentiates
  their stand-ins, :func:`jzero.parallel.zero.stand_ins`), found by tracing the loss on the
  micro-batch's shapes.
* The eval step never rematerialises (it has no backward pass).
* The gradient is the mean over the global batch: local sums are divided by
  ``accumulation_steps x data-parallel size`` once, on the reduced shards.
* With a ``replica`` axis (hybrid sharding) the ``shard_map`` spans ``replica`` and ``data``,
  and the shards cross the replica axis once per step, after accumulation.
* Under fp16 loss scaling the gradients are unscaled after the reduction, then their global
  norm decides finiteness and DeepSpeed's clipping (:func:`_clip`), before any update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jzero._util import abstract_tree, dotted
from jzero.parallel import hybrid, pipeline, zero
from jzero.plan import LossScaleState, Plan, on_device
from jzero.rewrite import RematPolicy, layer_dims, parse_policy
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
    grads_fn = zero.sharded_grads(plan, _local_grads(plan, full_loss, accum, remat_policy))
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
    gradients leave reduced over the data axis as the stage says
    (:func:`jzero.parallel.zero.reduce_grads`), already divided into the mean over the global
    batch, in the master weights' dtype.
    """
    prec, axis, n = plan.options.precision, plan.batch_axes, plan.loss_shards
    treedef = jax.tree.structure(plan.abstract_params)
    master_dtypes = [x.dtype for x in jax.tree.leaves(plan.abstract_params)]
    # Stages 2-3 reduce every micro-batch (only the shard is accumulated); 0-1 reduce once,
    # at the accumulation boundary.
    reduce_each = plan.stage.shard_grads
    local = zero.local_loss(plan, full_loss, policy)
    # Stage 2: the layer scan's leaves reduce-scattered in its backward, layer by layer.
    may_scatter = any(zero.scattered_leaves(plan, [0] * len(plan.leaves)))
    scattering = zero.local_loss(plan, full_loss, policy, scatter=True) if may_scatter else None

    def scaled(
        params: PyTree, extra: PyTree, scale: jax.Array, batch: PyTree, wholes: Any = None
    ) -> Any:
        """The loss to differentiate (times the loss scale under fp16), and what to report;
        with ``wholes`` (stage 2) ``params`` holds the stand-ins of the scattered leaves."""
        if wholes is None:
            loss, (aux, extra) = local(params, extra, batch)
        else:
            loss, (aux, extra) = scattering(params, extra, batch, wholes=wholes)
        if not prec.sixteen_bit:
            return loss, (loss, aux, extra)
        loss = jnp.asarray(loss, jnp.float32)  # a 16-bit loss is reported in float32
        return (loss * scale if prec.scaled else loss), (loss, aux, extra)

    grad_fn = jax.grad(scaled, has_aux=True)

    def micro(params: PyTree, extra: PyTree, scale: jax.Array, mb: PyTree) -> tuple[Any, Any]:
        """One micro-batch: its gradient, reduce-scattered now at stages 2-3, and widened to
        the accumulator's dtype when there is more than one micro-batch to add up."""
        scattered = _scattered(plan, full_loss, params, extra, mb) if may_scatter else None
        if scattered is None:
            g, (loss, aux, extra) = grad_fn(params, extra, scale, mb)
        else:
            leaves = zip(jax.tree.leaves(params), scattered, strict=True)
            wholes = [x if s else None for x, s in leaves]
            stand = zero.stand_ins(plan, params, scattered)
            g, (loss, aux, extra) = grad_fn(stand, extra, scale, mb, wholes)
            g = zero.to_state_layout(plan, g, scattered)
        if reduce_each:
            g = zero.reduce_grads(plan, g, now_sharded=True, reduced=scattered or ())
        if accum > 1:
            leaves = zip(jax.tree.leaves(g), master_dtypes, strict=True)
            g = treedef.unflatten([x.astype(prec.accumulator(m)) for x, m in leaves])
        return extra, (loss, _float_aux(aux), g)

    piped = (
        pipeline.pipelined_grads(plan, full_loss, accum, policy)
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
            done = False if pipeline.scatters_each_micro_batch(plan) else None
            g = zero.reduce_grads(plan, g, now_sharded=plan.stage.reduce_scatter, scattered=done)
        elif not reduce_each:
            g = zero.reduce_grads(plan, g, now_sharded=plan.stage.reduce_scatter)
        g = hybrid.reduce_replicas(plan, g)
        # The mean over the global batch: local sums over accum micro-batches and n devices.
        leaves = zip(jax.tree.leaves(g), master_dtypes, strict=True)
        g = treedef.unflatten([x.astype(m) / (accum * n) for x, m in leaves])
        loss = jax.lax.pmean(loss, axis)
        aux = jax.tree.map(lambda a: jax.lax.pmean(a, axis), aux)
        return loss, aux, g, _mean_extra(extra, axis)

    return local_grads


def _scattered(
    plan: Plan, full_loss: LossFn, params: PyTree, extra: PyTree, mb: PyTree
) -> list[bool] | None:
    """The leaves stage 2 reduce-scatters in the layer scan's backward
    (:func:`jzero.parallel.zero.scattered_leaves`), from the loss traced on this micro-batch's
    shapes; ``None`` where there is none."""
    args = abstract_tree((params, extra, mb))
    found = zero.scattered_leaves(plan, layer_dims(full_loss, *args))
    return found if any(found) else None


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


def _clip(grads: PyTree, grad_norm: jax.Array, max_norm: float) -> PyTree:
    """DeepSpeed's clipping: scale by ``max_norm / (norm + 1e-6)`` when that is below one."""
    if not max_norm or max_norm <= 0:
        return grads
    coef = jnp.minimum(1.0, max_norm / (grad_norm + 1e-6))
    return jax.tree.map(lambda g: (g * coef).astype(g.dtype), grads)
