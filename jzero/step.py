"""The jitted ZeRO train step: accumulate, reduce, clip, update, gather.

Decisions:

* Gradients are computed and reduced inside ``shard_map`` over the data axis, where each
  device sees its slice of the global batch. That is the only way to get a true
  ``reduce-scatter`` on every backend (plain GSPMD lowers a sharded-gradient constraint to an
  all-reduce plus a slice on CPU). ``check_vma=False``: each device differentiates its own
  local loss, and jzero chooses every reduction explicitly.
* Stage 0 and 1 accumulate the full local gradient over micro-batches (``lax.scan``) and reduce
  once at the boundary (stage 0 all-reduce, stage 1 reduce-scatter). Stages 2 and 3
  reduce-scatter every micro-batch and accumulate only the shard.
* At stage 3 the parameters enter ``shard_map`` as shards and :mod:`jzero.gather` moves each
  gather to its use (inside the layer scan for stacked layers). Their gradients come out of the
  transpose of the all-gather already reduce-scattered.
* Activation checkpointing (``remat_policy``, the config's ``activation_checkpointing``) is a
  rewrite of the loss too: at every stage the body of each ``lax.scan`` in the loss (each
  stacked layer) runs under ``jax.checkpoint`` with the policy (:mod:`jzero.remat`), by the
  same replay that places stage 3's gathers. Without a policy stages 0-2 call the loss as
  written. The eval step never rematerialises (it has no backward pass).
* Clipping, the optax update and the final parameter all-gather run as ordinary sharded JAX
  under ``jit``: the update sees global arrays laid out in shards, so every optax transform
  (including norm-based ones like LAMB) computes what it would on one device, while each
  device only does the arithmetic for its own shard.
* The gradient is the mean over the global batch: local sums are divided by
  ``accumulation_steps x data-parallel size`` once, on the reduced shards.
* With a ``replica`` axis (hybrid sharding) the ``shard_map`` spans ``replica`` and ``data``:
  each device differentiates its own rows, gradients are reduce-scattered within ``data`` as
  the stage says, and only the shards cross the replica axis, once per step at the
  accumulation boundary: an all-reduce of ``1/data`` of the gradient bytes (hybrid), or a
  reduce-scatter of them (ZeRO++ hpZ, whose optimizer state is sharded over both axes; its
  updated shards are all-gathered over ``replica`` back into the ``data``-sharded parameters).
  Stage 3's gathers stay within ``data``.
* ZeRO++ qgZ (``plan.quantized_gradients``) replaces every gradient reduce-scatter over
  ``data`` by the quantized all-to-all of :func:`jzero.quantize.quantized_psum_scatter`: here for
  the leaves the step reduces itself, in the gather's transpose for stage 3's sharded ones. It
  quantizes the gradient in its own dtype (the integers replace ``communication_data_type``)
  and sums in float32; all-reduces and the replica-axis reduction stay exact.
* ``overlap_comm`` (:mod:`jzero.overlap`): at stages 0-2 the step's own reductions and the
  gather of the updated parameters run per bucket (``plan.reduce_bucket_size``,
  ``plan.allgather_bucket_size``); on a GPU the step is jitted with XLA's options for
  asynchronous collectives (:func:`jzero.overlap.compiler_options`, empty on other backends).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jzero.gather import gathered
from jzero.overlap import compiler_options, gather_buckets, reduce_buckets
from jzero.plan import Plan, axis_entry, is_host, on_device
from jzero.precision import LossScaleState, cast_floating, next_loss_scale
from jzero.quantize import quantized_psum_scatter
from jzero.remat import RematPolicy, parse_policy
from jzero.streaming import streamed_groups, streamed_update
from jzero.trace import Partition

__all__ = [
    "TrainState",
    "find_learning_rate",
    "init_train_state",
    "make_eval_step",
    "make_train_step",
    "state_shardings",
]

PyTree = Any
LossFn = Callable[[PyTree, PyTree], Any]


class TrainState(NamedTuple):
    """Everything a step reads and writes; donated to the step.

    Attributes:
      step: the number of optimizer updates applied so far (int32 scalar); a skipped step
        (non-finite gradients under :attr:`jzero.precision.Precision.skips`: an fp16 overflow,
        or any precision with ``skip_nonfinite``) does not count, so the schedule does not
        advance either.
      params: the parameters the model computes with, sharded per ``plan.params`` (16-bit
        under mixed precision).
      opt_state: the optax state, sharded per ``plan.opt_state``.
      extra: non-trainable model state (e.g. BatchNorm statistics, RNG counters), replicated
        and never sharded as parameters; empty for a plain loss function.
      master: under mixed precision the float32 master weights, sharded per ``plan.master``;
        empty otherwise.
      loss_scale: the :class:`jzero.precision.LossScaleState`.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    extra: PyTree = ()
    master: PyTree = ()
    loss_scale: LossScaleState | tuple = ()


def state_shardings(plan: Plan) -> TrainState:
    """The sharding of every leaf of the :class:`TrainState` for ``plan``."""
    r = plan.replicated
    return TrainState(
        step=r,
        params=plan.params,
        opt_state=plan.opt_state,
        extra=r,
        master=plan.master if plan.precision.mixed else (),
        loss_scale=LossScaleState(r, r, r, r, r),
    )


def init_train_state(
    plan: Plan,
    params: PyTree,
    optimizer: optax.GradientTransformation,
    extra: PyTree = (),
) -> TrainState:
    """The :class:`TrainState` before the first step, every leaf in its plan's sharding.

    Args:
      plan: the sharding plan.
      params: the initial parameters (full precision; under mixed precision they become the
        float32 master weights and the 16-bit copy is made from them), or a function of no
        arguments that creates them: it then runs inside the same ``jit``, so the parameters
        are created directly in their shards and never exist whole.
      optimizer: the optax transformation the plan was made for.
      extra: non-trainable model state, if any.

    Returns:
      A fresh state; the caller's arrays are copied, never donated.
    """
    prec = plan.precision
    sh = state_shardings(plan)

    make = params if callable(params) else None

    def init(params: PyTree, extra: PyTree) -> TrainState:
        if make is not None:
            params = make()
        master = jax.tree.map(lambda x, a: jnp.asarray(x, a.dtype), params, plan.abstract_params)
        opt_state = optimizer.init(master)
        compute = cast_floating(master, prec.compute_dtype) if prec.mixed else master
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=jax.tree.map(jnp.copy, compute),
            opt_state=opt_state,
            extra=jax.tree.map(jnp.copy, extra),
            master=master if prec.mixed else (),
            loss_scale=jax.tree.map(jnp.asarray, LossScaleState.initial(prec)),
        )

    return jax.jit(init, out_shardings=sh)(None if make is not None else params, extra)


def find_learning_rate(opt_state: PyTree) -> jax.Array | None:
    """The learning rate held in an ``optax.inject_hyperparams`` state, if there is one."""
    found: list[jax.Array] = []

    def visit(x: Any) -> bool:
        hp = getattr(x, "hyperparams", None)
        if isinstance(hp, dict) and "learning_rate" in hp and not found:
            found.append(hp["learning_rate"])
        return hp is not None

    jax.tree.leaves(opt_state, is_leaf=visit)
    return found[0] if found else None


def _spec(mesh_axes: str | tuple[str, ...], ndim: int, dim: int | None) -> P:
    if dim is None:
        return P()
    entries: list[Any] = [None] * ndim
    entries[dim] = axis_entry(mesh_axes)
    return P(*entries)


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


def _with_extra(loss_fn: LossFn, has_aux: bool | None, takes_extra: bool) -> LossFn:
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


def _local_loss(plan: Plan, loss_fn: LossFn, policy: RematPolicy | None = None) -> LossFn:
    """The loss of the local parameters inside ``shard_map``: gathers stage-3 shards lazily,
    and checkpoints each scan body by ``policy`` (:mod:`jzero.remat`)."""
    if any(d is not None for d in plan.param_dims) or (policy is not None and policy.active):
        return gathered(
            loss_fn,
            plan.param_dims,
            plan.compute_params,
            plan.axis,
            grad_dtype=plan.precision.comm_dtype,
            policy=policy,
            reshard=plan.reshard_after_forward,
            prefetch=_prefetch(plan),
            reuse_distance=plan.max_reuse_distance,
            max_live=plan.max_live_parameters,
            partition=_partition(plan, policy),
            bits=plan.quantized_weights,
            grad_bits=plan.quantized_gradients,
            overlap=plan.overlap_comm,
        )
    return loss_fn


def _prefetch(plan: Plan) -> int:
    """The elements a stage-3 gather outside a scan may run ahead of its use: DeepSpeed's
    ``stage3_prefetch_bucket_size`` when set, else under ``overlap_comm`` one layer (the
    largest gathered unit), so a Python loop's layer ``i + 1`` is gathered while layer ``i``
    computes, as the scans' overlap does; else 0."""
    if plan.prefetch_bucket_size or not plan.overlap_comm:
        return plan.prefetch_bucket_size
    return plan.largest_gathered()[0]


def _partition(plan: Plan, policy: RematPolicy | None) -> Partition | None:
    """``partition_activations``: the mesh's other axes with more than one device, if any."""
    if policy is None or not policy.partition or not policy.active:
        return None
    axes = tuple(a for a, n in plan.mesh.shape.items() if a not in plan.batch_axes and n > 1)
    return Partition(plan.mesh, axes) if axes else None


def _to_device(tree: PyTree, shardings: PyTree) -> PyTree:
    """Brings offloaded (host-memory) leaves into device memory inside the step."""
    return jax.tree.map(
        lambda x, s: jax.device_put(x, jax.memory.Space.Device) if is_host(s) else x,
        tree,
        shardings,
    )


def make_eval_step(
    plan: Plan,
    loss_fn: LossFn,
    *,
    has_aux: bool | None = None,
    takes_extra: bool = False,
    stateful: bool | None = None,
) -> Callable[[PyTree, PyTree, PyTree], jax.Array]:
    """Builds the jitted ``(params, extra, batch) -> mean loss`` over a global batch.

    At stage 3 the parameters are gathered layer by layer, as in the train step. ``has_aux``
    and ``takes_extra`` as in :func:`make_train_step` (``stateful`` is ``takes_extra``'s old
    name).
    """
    full_loss = _with_extra(loss_fn, has_aux, takes_extra or bool(stateful))
    treedef = jax.tree.structure(plan.abstract_params)
    in_specs = treedef.unflatten(
        [_spec(plan.axis, len(leaf.shape), leaf.param_dim) for leaf in plan.leaves]
    )
    local = _local_loss(plan, full_loss)

    def loss(params: PyTree, extra: PyTree, batch: PyTree) -> jax.Array:
        value = local(params, extra, batch)[0]
        if plan.precision.mixed:
            value = value.astype(jnp.float32)
        return jax.lax.pmean(value, plan.batch_axes)

    fn = jax.shard_map(
        loss,
        mesh=plan.mesh,
        in_specs=(in_specs, P(), plan.batch.spec),
        out_specs=P(),
        axis_names=set(plan.batch_axes),
        check_vma=False,
    )
    return jax.jit(
        lambda params, extra, batch: fn(_to_device(params, plan.params), extra, batch),
        in_shardings=(plan.params, plan.replicated, plan.batch),
        out_shardings=plan.replicated,
    )


def make_train_step(
    plan: Plan,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    accumulation_steps: int = 1,
    gradient_clipping: float = 0.0,
    has_aux: bool | None = None,
    takes_extra: bool = False,
    stateful: bool | None = None,
    learning_rate: Callable[[jax.Array], jax.Array] | None = None,
    donate: bool = True,
    remat_policy: RematPolicy | str | None = None,
    sub_group_size: int | None = None,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds the jitted step ``(state, batch) -> (state, metrics)`` for a plan.

    Args:
      plan: the sharding plan (see :func:`jzero.plan.make_plan`); its ``precision`` decides
        the compute, communication and accumulation dtypes and the loss scaling.
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), the mean loss of the
        batch it is given, written for full parameters.
      optimizer: the optax transformation the plan was made for. Gradient clipping is done by
        the step itself (``gradient_clipping``), not inside it.
      accumulation_steps: micro-batches per step; the batch's leading dim must be
        ``accumulation_steps x micro-batch x data-parallel size`` (checked when the step is
        traced).
      gradient_clipping: clip the global gradient norm to this value (0 disables), as
        DeepSpeed's ``gradient_clipping``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``None`` (the default): read from
        what it returns when the step is traced. Aux leaves are averaged over the global batch
        and returned in the metrics.
      takes_extra: ``loss_fn(params, extra, batch) -> (loss, (aux, new_extra))`` carries the
        non-trainable model state (``TrainState.extra``: BatchNorm statistics, RNG counters)
        through the micro-batches; floating leaves of the new state are averaged over the data
        axis. ``stateful`` is its old name, still accepted.
      learning_rate: the schedule, for the ``lr`` metric; else read from an
        ``inject_hyperparams`` state when present. With neither the learning rate is unknown
        and ``lr`` is left out of the metrics.
      donate: donate the incoming state's buffers to the new state: arrays taken from the
        state before the step (``state.params``) are deleted by it; copy what you keep.
      remat_policy: activation checkpointing of each layer (every ``lax.scan`` body in the
        loss, each layer of a Python loop), a :class:`jzero.remat.RematPolicy` or its text
        (``"full"``, ``"dots"``, ``"dots_no_batch"``, ``"names:a,b"``, ``"none"``); see
        :mod:`jzero.remat`. ``None`` (the default): no checkpointing at stages 0-2; stage 3
        checkpoints the scans it gathers with :data:`jzero.gather.checkpoint_policy`. The
        engine passes the config's ``activation_checkpointing``.
      sub_group_size: with the optimizer state offloaded, stream the update over groups of
        parameter leaves of at most this many elements, one group's state in device memory at
        a time (:mod:`jzero.streaming`; DeepSpeed's ``sub_group_size``); ``None``: one piece.

    Returns:
      The jitted step, taking a state from :func:`init_train_state`. Its metrics, float32
      scalars: ``loss``, ``grad_norm``, ``lr`` (only when the learning rate is known, see
      ``learning_rate``), the aux leaves, at every precision ``nonfinite`` (1.0 when this
      step's gradients were not finite, else 0.0) and ``skipped`` (1.0 when its update was
      skipped, which happens only when the plan's precision ``skips``), and under mixed
      precision ``loss_scale`` (the scale this step ran with).

      A skipped step leaves every bit of the params, the master weights (under mixed
      precision), the optimizer state and ``TrainState.step`` as they were, at any precision
      and stage; without mixed precision the params are the master weights. The
      :class:`~jzero.precision.LossScaleState` counts skipped and non-finite steps always.
    """
    prec = plan.precision
    takes_extra = takes_extra or bool(stateful)
    gradients = _gradient_part(
        plan, loss_fn, accumulation_steps, gradient_clipping, has_aux, takes_extra, remat_policy
    )
    groups = streamed_groups(plan, sub_group_size)

    def step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, jax.Array]]:
        params, grads, grad_norm, finite, loss, aux, extra = gradients(state, batch)
        if groups is not None:  # the offloaded update, one group of leaves at a time
            new_master, new_opt_state, copies = streamed_update(
                plan, optimizer, groups, state, params, grads, finite if prec.skips else None
            )
            if prec.skips:
                extra = _keep_old_when_nonfinite(finite, ((), (), extra), ((), (), state.extra))[2]
            new_params = _params_at_rest(plan, copies)
        else:
            master, opt_state = _update_inputs(plan, state, params)
            updates, new_opt_state = optimizer.update(grads, opt_state, master)
            new_master = optax.apply_updates(master, updates)
            if prec.skips:  # a skipped step leaves every bit of the state as it was
                new_master, new_opt_state, extra = _keep_old_when_nonfinite(
                    finite, (new_master, new_opt_state, extra), (master, opt_state, state.extra)
                )
            new_params = _params_at_rest(plan, new_master)
        applied = (finite if prec.skips else jnp.bool_(True)).astype(jnp.int32)
        ls = state.loss_scale
        new_state = TrainState(
            step=state.step + applied,
            params=new_params,
            opt_state=new_opt_state,
            extra=extra,
            master=new_master if prec.mixed else (),
            loss_scale=next_loss_scale(prec, ls, finite),
        )
        lr = learning_rate(state.step) if learning_rate else find_learning_rate(state.opt_state)
        return new_state, _metrics(prec, loss, grad_norm, lr, aux, applied, finite, ls)

    shardings = state_shardings(plan)
    return jax.jit(
        step,
        in_shardings=(shardings, plan.batch),
        out_shardings=(shardings, plan.replicated),
        donate_argnums=(0,) if donate else (),
        compiler_options=compiler_options(plan) or None,
    )


def _gradient_part(
    plan: Plan,
    loss_fn: LossFn,
    accumulation_steps: int,
    gradient_clipping: float,
    has_aux: bool | None,
    takes_extra: bool,
    remat_policy: RematPolicy | str | None,
) -> Callable[[TrainState, PyTree], tuple[Any, ...]]:
    """The step up to the update: ``(state, batch) -> (params on the device, gradients
    reduced, unscaled and clipped in the update layout, their global norm, whether it is
    finite, loss, aux, new extra)``."""
    accum = int(accumulation_steps)
    if isinstance(remat_policy, str):
        remat_policy = parse_policy(remat_policy)
    full_loss = _with_extra(loss_fn, has_aux, takes_extra)
    grads_fn = _sharded_grads(plan, _local_grads(plan, full_loss, accum, remat_policy))
    prec = plan.precision

    def gradients(state: TrainState, batch: PyTree) -> tuple[Any, ...]:
        if not isinstance(state.loss_scale, LossScaleState):
            raise ValueError(
                "The TrainState has no loss-scale state; build it with "
                "jzero.step.init_train_state(plan, params, optimizer)."
            )
        _check_batch_rows(batch, accum * plan.data_parallel_size, accum)
        params = _to_device(state.params, plan.params)
        ls = state.loss_scale
        loss, aux, grads, extra = grads_fn(params, state.extra, ls.scale, batch)
        grads = jax.lax.with_sharding_constraint(grads, on_device(plan.grads))
        if prec.scaled:  # the loss was multiplied by the scale; the gradients come back down
            grads = jax.tree.map(lambda g: g / ls.scale, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        grads = _clip(grads, grad_norm, gradient_clipping)
        return params, grads, grad_norm, finite, loss, aux, extra

    return gradients


def make_gradient_step(
    plan: Plan,
    loss_fn: LossFn,
    *,
    accumulation_steps: int = 1,
    gradient_clipping: float = 0.0,
    has_aux: bool | None = None,
    takes_extra: bool = False,
    learning_rate: Callable[[jax.Array], jax.Array] | None = None,
    remat_policy: RematPolicy | str | None = None,
) -> Callable[[TrainState, PyTree], tuple[Any, ...]]:
    """The train step without its update, for callers that run the update themselves (the
    NVMe tier, :mod:`jzero.nvme_step`): the jitted ``(state, batch) -> (grads, applied,
    extra, loss_scale, metrics)``, the gradients reduced, unscaled and clipped in the plan's
    gradient layout, ``applied`` 0 when the step is to be skipped (non-finite gradients under
    skipping), ``extra`` and ``loss_scale`` the state's next ones. Arguments as for
    :func:`make_train_step`; the state is not donated."""
    prec = plan.precision
    gradients = _gradient_part(
        plan, loss_fn, accumulation_steps, gradient_clipping, has_aux, takes_extra, remat_policy
    )

    def step(state: TrainState, batch: PyTree) -> tuple[Any, ...]:
        _, grads, grad_norm, finite, loss, aux, extra = gradients(state, batch)
        if prec.skips:
            extra = _keep_old_when_nonfinite(finite, ((), (), extra), ((), (), state.extra))[2]
        applied = (finite if prec.skips else jnp.bool_(True)).astype(jnp.int32)
        ls = state.loss_scale
        lr = learning_rate(state.step) if learning_rate else find_learning_rate(state.opt_state)
        metrics = _metrics(prec, loss, grad_norm, lr, aux, applied, finite, ls)
        return grads, applied, extra, next_loss_scale(prec, ls, finite), metrics

    return jax.jit(step, out_shardings=(on_device(plan.grads), *(plan.replicated,) * 4))


def params_at_rest(plan: Plan, master: PyTree) -> PyTree:
    """The params the next step computes with, from updated master shards in the update
    layout (the 16-bit copies of them work too: the rounding is the same)."""
    return _params_at_rest(plan, master)


def _check_batch_rows(batch: PyTree, multiple: int, accum: int) -> None:
    """Trace-time check: every batch leaf splits into ``accum`` micro-batches per device."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        lead = x.shape[0] if x.ndim else None
        if lead is None or lead % multiple:
            name = jax.tree_util.keystr(path, simple=True, separator=".") or "<batch>"
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
    prec, axis, n = plan.precision, plan.batch_axes, plan.data_parallel_size
    treedef = jax.tree.structure(plan.abstract_params)
    master_dtypes = [x.dtype for x in jax.tree.leaves(plan.abstract_params)]
    # Stages 2-3 reduce every micro-batch (only the shard is accumulated); 0-1 reduce once,
    # at the accumulation boundary.
    reduce_each = plan.stage.shard_grads
    local = _local_loss(plan, full_loss, policy)

    def scaled(params: PyTree, extra: PyTree, scale: jax.Array, batch: PyTree) -> Any:
        """The loss to differentiate (times the loss scale under fp16), and what to report."""
        loss, (aux, extra) = local(params, extra, batch)
        if not prec.mixed:
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

    def local_grads(params: PyTree, extra: PyTree, scale: jax.Array, batch: PyTree) -> Any:
        if accum == 1:
            extra, (loss, aux, g) = micro(params, extra, scale, batch)
        else:
            extra, (loss, aux, g) = _accumulate(
                functools.partial(micro, params), extra, scale, batch, accum
            )
        if not reduce_each:
            g = _reduce(plan, g, now_sharded=plan.stage.reduce_scatter)
        g = _reduce_replicas(plan, g)
        # The mean over the global batch: local sums over accum micro-batches and n devices.
        leaves = zip(jax.tree.leaves(g), master_dtypes, strict=True)
        g = treedef.unflatten([x.astype(m) / (accum * n) for x, m in leaves])
        loss = jax.lax.pmean(loss, axis)
        aux = jax.tree.map(lambda a: jax.lax.pmean(a, axis), aux)
        return loss, aux, g, _mean_extra(extra, axis)

    return local_grads


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


def _reduce(plan: Plan, grads: PyTree, *, now_sharded: bool) -> PyTree:
    """Sums local gradients over the data axis in the communication dtype: a reduce-scatter
    where the plan shards the gradient (and ``now_sharded``), else an all-reduce (over every
    batch axis: a leaf that stays whole is summed over the replicas here too). Leaves come
    back in the dtype they went in; stage 3's arrive reduce-scattered already (the transpose
    of their all-gather) and pass through.

    With ``plan.quantized_gradients`` (ZeRO++ qgZ) each reduce-scatter is the quantized
    all-to-all of :func:`jzero.quantize.quantized_psum_scatter` (summed in float32, from the
    gradient's own dtype: the integers replace the communication dtype); all-reduces stay
    exact. With ``plan.reduce_bucket_size`` (``overlap_comm`` at stages 0-2) the leaves are
    reduced in buckets, one collective each (:func:`jzero.overlap.reduce_buckets`)."""
    bits = plan.quantized_gradients
    leaves = jax.tree.leaves(grads)
    todo, sent, dims = [], [], []
    for i, (g, param_dim, grad_dim) in enumerate(
        zip(leaves, plan.param_dims, plan.grad_dims(), strict=True)
    ):
        if param_dim is not None:
            continue
        scatter = grad_dim is not None and now_sharded
        todo.append(i)
        dims.append(grad_dim if scatter else None)
        sent.append(g if scatter and bits else g.astype(plan.precision.communication(g.dtype)))

    def scatter(x: jax.Array, dim: int) -> jax.Array:
        if bits:
            return quantized_psum_scatter(x, plan.axis, dim, bits)
        return jax.lax.psum_scatter(x, plan.axis, scatter_dimension=dim, tiled=True)

    def total(x: jax.Array) -> jax.Array:
        return jax.lax.psum(x, plan.batch_axes)

    reduced = reduce_buckets(sent, dims, plan.num_shards, plan.reduce_bucket_size, scatter, total)
    out = list(leaves)
    for i, r in zip(todo, reduced, strict=True):
        out[i] = r.astype(leaves[i].dtype)
    return jax.tree.structure(grads).unflatten(out)


def _reduce_replicas(plan: Plan, grads: PyTree) -> PyTree:
    """Sums the ``data``-reduced gradient shards over the replica axis, once per step (after
    accumulation), in the communication dtype: an all-reduce (hybrid sharding) or, under hpZ,
    a reduce-scatter into the optimizer's ``replica`` x ``data`` shards. Leaves that stayed
    whole were summed over every axis by :func:`_reduce`."""
    if plan.replica_axis is None:
        return grads
    out = []
    for g, grad_dim in zip(jax.tree.leaves(grads), plan.grad_dims(), strict=True):
        if grad_dim is None:
            out.append(g)
            continue
        c = g.astype(plan.precision.communication(g.dtype))
        if plan.hpz:
            c = jax.lax.psum_scatter(c, plan.replica_axis, scatter_dimension=grad_dim, tiled=True)
        else:
            c = jax.lax.psum(c, plan.replica_axis)
        out.append(c.astype(g.dtype))
    return jax.tree.structure(grads).unflatten(out)


def _sharded_grads(plan: Plan, local_grads: Callable[..., Any]) -> Callable[..., Any]:
    """``local_grads`` under ``shard_map``: params come in as the plan rests them (shards at
    stage 3), the batch split over the data axis; gradients leave in the plan's grad layout."""
    treedef = jax.tree.structure(plan.abstract_params)

    def specs(dims: list[int | None], axes: tuple[str, ...]) -> PyTree:
        shapes = zip(plan.leaves, dims, strict=True)
        return treedef.unflatten([_spec(axes, len(leaf.shape), d) for leaf, d in shapes])

    return jax.shard_map(
        local_grads,
        mesh=plan.mesh,
        in_specs=(specs(plan.param_dims, (plan.axis,)), P(), P(), plan.batch.spec),
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


def _update_inputs(plan: Plan, state: TrainState, params: PyTree) -> tuple[PyTree, PyTree]:
    """What the optax update runs on, on the device: the local shard of the master weights
    (the float32 masters under mixed precision, else the params themselves cut to the update
    layout, with no communication) and the optimizer state."""
    if plan.precision.mixed:
        master = _to_device(state.master, plan.master)
    else:
        master = jax.lax.with_sharding_constraint(params, on_device(plan.update_layout))
    return master, _to_device(state.opt_state, plan.opt_state)


def _keep_old_when_nonfinite(finite: jax.Array, new: tuple, old: tuple) -> tuple:
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


def _metrics(
    prec: Any,
    loss: jax.Array,
    grad_norm: jax.Array,
    lr: Any,
    aux: PyTree,
    applied: jax.Array,
    finite: jax.Array,
    ls: LossScaleState,
) -> dict[str, jax.Array]:
    """The step's metrics. The learning rate only when it is known: an unknown one is left
    out rather than NaN, so a NaN in the metrics always comes from the run itself."""
    metrics = {"loss": loss, "grad_norm": grad_norm}
    if lr is not None:
        metrics["lr"] = jnp.asarray(lr, jnp.float32)
    metrics.update(aux)
    metrics.update(
        skipped=(1 - applied).astype(jnp.float32),
        nonfinite=(~finite).astype(jnp.float32),
    )
    if prec.mixed:
        metrics["loss_scale"] = ls.scale
    return metrics


def _params_at_rest(plan: Plan, master: PyTree) -> PyTree:
    """The params the next step computes with, from the updated master shards.

    Leaves that rest whole but are updated in shards are all-gathered explicitly (inside
    ``shard_map``, so the collective's dtype is exactly the one chosen here). Under mixed
    precision the 16-bit copy is the rounding of the masters: a 16-bit communication dtype
    rounds each shard before the all-gather (half the bytes), a float32 one gathers the masters
    and rounds after. Both give the same bits.
    """
    prec = plan.precision
    axis = plan.axis
    compute = prec.compute_dtype
    comm = prec.comm_dtype if prec.comm_dtype is not None else compute
    round_first = prec.mixed and jnp.dtype(comm).itemsize <= jnp.dtype(compute).itemsize
    if round_first:
        master = cast_floating(master, compute)
    treedef = jax.tree.structure(plan.abstract_params)
    leaves = plan.leaves
    state_axes = plan.state_axes
    # Per leaf, the axes its updated shard is gathered over: every state axis where the
    # parameter rests whole, the replica axis where hpZ keeps it sharded over data only.
    gather_axes = [
        ()
        if leaf.state_dim is None
        else state_axes
        if leaf.param_dim is None
        else tuple(a for a in state_axes if a != axis)
        for leaf in leaves
    ]
    if any(gather_axes):
        in_specs = treedef.unflatten(
            [_spec(state_axes, len(leaf.shape), leaf.state_dim) for leaf in leaves]
        )
        out_specs = treedef.unflatten(
            [_spec(axis, len(leaf.shape), leaf.param_dim) for leaf in leaves]
        )

        def gather(tree: PyTree) -> PyTree:
            xs = jax.tree.leaves(tree)
            if plan.allgather_bucket_size is not None:  # stages 1-2: all over state_axes
                dims = [
                    leaf.state_dim if axes else None
                    for axes, leaf in zip(gather_axes, leaves, strict=True)
                ]
                return treedef.unflatten(
                    gather_buckets(
                        xs,
                        dims,
                        plan.state_shards,
                        plan.allgather_bucket_size,
                        lambda x, d: jax.lax.all_gather(
                            x, axis_entry(state_axes), axis=d, tiled=True
                        ),
                    )
                )
            return treedef.unflatten(
                [
                    x
                    if not axes
                    else jax.lax.all_gather(x, axis_entry(axes), axis=leaf.state_dim, tiled=True)
                    for x, axes, leaf in zip(xs, gather_axes, leaves, strict=True)
                ]
            )

        master = jax.shard_map(
            gather,
            mesh=plan.mesh,
            in_specs=(in_specs,),
            out_specs=out_specs,
            axis_names=set(state_axes),
            check_vma=False,
        )(master)
    master = jax.lax.with_sharding_constraint(master, on_device(plan.params))
    if prec.mixed and not round_first:
        master = cast_floating(master, compute)
    return master
