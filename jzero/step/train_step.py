"""The jitted ZeRO train step: accumulate, reduce, clip, update, gather.

The step is two halves under one ``jit``: the gradient half (:mod:`jzero.step.gradients`: the loss
on each device's rows inside ``shard_map``, accumulated, reduced as the stage says, unscaled and
clipped) and the update half (:mod:`jzero.step.update`: the optax update on the shards, then the
params at rest gathered from them). The state both read and write is :mod:`jzero.step.state`'s
:class:`TrainState`, whose one public home is :mod:`jzero.step`.

Decisions:

* Clipping, the optax update and the final parameter all-gather run as ordinary sharded JAX
  under ``jit``, after the ``shard_map`` of the gradient half: the update sees global arrays
  laid out in shards, so every optax transform computes what it would on one device, while
  each device only does the arithmetic for its own shard.
* The state is donated to the step (``donate``), and its ``in_shardings`` and
  ``out_shardings`` are the plan's (:func:`state_shardings`), so offloaded state returns to
  host memory by the step's own output shardings.
* A skipped step (non-finite gradients when the precision ``skips``) leaves every bit of the
  params, masters, optimizer state and ``TrainState.step`` as they were; the loss-scale state
  counts it either way.
* With the optimizer state offloaded and ``sub_group_size`` set, the update streams over groups
  of leaves (:mod:`jzero.step.streaming`); the NVMe tier runs the gradient half alone
  (:func:`make_gradient_step`) and the update itself.
* ``overlap_comm`` (:mod:`jzero.comm.overlap`): at stages 0-2 the step's own reductions and the
  gather of the updated parameters run per bucket (``plan.options.comm.reduce_bucket_size``,
  ``plan.options.comm.allgather_bucket_size``); on a GPU the step is jitted with XLA's options
  for asynchronous collectives (:func:`jzero.comm.overlap.compiler_options`, empty on other
  backends).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jzero.comm import compiler_options
from jzero.optim.update_context import update_layout
from jzero.parallel.pipeline import pipelined_loss
from jzero.parallel.zero import local_loss
from jzero.plan import LossScaleState, Plan, next_loss_scale, on_device, to_logical, to_stored
from jzero.step.gradients import LossFn, gradient_part, with_extra
from jzero.step.options import StepOptions
from jzero.step.state import (
    TrainState,
    find_learning_rate,
    state_shardings,
    to_device,
)
from jzero.step.streaming import streamed_groups, streamed_update
from jzero.step.update import (
    apply_updates,
    keep_old_when_nonfinite,
    params_at_rest,
    update_inputs,
)

__all__ = ["make_eval_step", "make_train_step"]

PyTree = Any


def make_eval_step(
    plan: Plan,
    loss_fn: LossFn,
    *,
    has_aux: bool | None = None,
    takes_extra: bool = False,
    micro_batches: int = 1,
) -> Callable[[PyTree, PyTree, PyTree], jax.Array]:
    """Builds the jitted ``(params, extra, batch) -> mean loss`` over a global batch.

    At stage 3 the parameters are gathered layer by layer, as in the train step. ``has_aux``
    and ``takes_extra`` as in :func:`make_train_step`. Under pipeline parallelism each stage
    runs its own layers on the rows in up to ``micro_batches`` micro-batches (the most that
    divides a device's rows), forward only.
    """
    full_loss = with_extra(loss_fn, has_aux, takes_extra)
    treedef = jax.tree.structure(plan.abstract_params)
    in_specs = treedef.unflatten(
        [plan.manual_spec(i, leaf.param_dim) for i, leaf in enumerate(plan.leaves)]
    )
    local = local_loss(plan, full_loss)

    def loss(params: PyTree, extra: PyTree, batch: PyTree) -> jax.Array:
        if plan.options.parallel.pipe_axis:
            rows = jax.tree.leaves(batch)[0].shape[0]
            micro = max(d for d in range(1, max(1, micro_batches) + 1) if rows % d == 0)
            value = pipelined_loss(plan, full_loss, micro)(params, extra, batch)
        else:
            value = local(params, extra, batch)[0]
        if plan.options.precision.sixteen_bit:
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
        lambda params, extra, batch: fn(to_device(params, plan.params), extra, batch),
        in_shardings=(plan.params, plan.replicated, plan.batch),
        out_shardings=plan.replicated,
        compiler_options=compiler_options(plan) or None,
    )


def make_train_step(
    plan: Plan,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    options: StepOptions | None = None,
    *,
    has_aux: bool | None = None,
    takes_extra: bool = False,
    learning_rate: Callable[[jax.Array], jax.Array] | None = None,
    donate: bool = True,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds the jitted step ``(state, batch) -> (state, metrics)`` for a plan.

    Args:
      plan: the sharding plan (see :func:`jzero.plan.make_plan`); its ``precision`` decides
        the compute, communication and accumulation dtypes and the loss scaling.
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), the mean loss of the
        batch it is given, written for full parameters.
      optimizer: the optax transformation the plan was made for. Gradient clipping is done by
        the step itself (``gradient_clipping``), not inside it.
      options: the :class:`~jzero.step.StepOptions` (accumulation, clipping, remat, the
        offloaded update's grouping and where it runs); ``None``: the defaults. The engine
        passes the config's (:func:`jzero.engine.settings.step_options`).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``None`` (the default): read from
        what it returns when the step is traced. Aux leaves are averaged over the global batch
        and returned in the metrics.
      takes_extra: ``loss_fn(params, extra, batch) -> (loss, (aux, new_extra))`` carries the
        non-trainable model state (``TrainState.extra``: BatchNorm statistics, RNG counters)
        through the micro-batches; floating leaves of the new state are averaged over the data
        axis.
      learning_rate: the schedule, for the ``lr`` metric; else read from an
        ``inject_hyperparams`` state when present. With neither the learning rate is unknown
        and ``lr`` is left out of the metrics.
      donate: donate the incoming state's buffers to the new state: arrays taken from the
        state before the step (``state.params``) are deleted by it; copy what you keep.

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
      :class:`~jzero.plan.precision.LossScaleState` counts skipped and non-finite steps always.
    """
    opts = options if options is not None else StepOptions()
    prec = plan.options.precision
    gradients = gradient_part(plan, loss_fn, opts, has_aux, takes_extra)
    on_host = opts.offload_compute == "host"
    if opts.offload_compute not in ("device", "host"):
        raise ValueError(
            f"offload_compute is {opts.offload_compute!r}; it must be 'device' (stream the "
            "offloaded state through device memory) or 'host' (update it where it rests)."
        )
    groups = streamed_groups(plan, opts.sub_group_size, optimizer, on_host)
    if groups is not None and prec.stochastic_rounding:
        raise ValueError(
            "bf16.stochastic_rounding rounds the update of the whole state at once; the "
            "offloaded update streams it in groups (sub_group_size, offload_optimizer.compute: "
            "host), which round to nearest. Remove stochastic_rounding, or sub_group_size and "
            "compute: host."
        )

    def step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, jax.Array]]:
        params, grads, grad_norm, finite, loss, aux, extra = gradients(state, batch)
        if groups is not None:  # the offloaded update, one group of leaves at a time
            new_master, new_opt_state, copies = streamed_update(
                plan,
                optimizer,
                groups,
                state,
                params,
                grads,
                finite if prec.skips else None,
                on_host,
            )
            if prec.skips:
                extra = keep_old_when_nonfinite(finite, ((), (), extra), ((), (), state.extra))[2]
            new_params = params_at_rest(plan, copies)
        else:
            master, opt_state = update_inputs(plan, state, params)
            grads = to_logical(grads, plan.abstract_params, on_device(plan.grads))
            # Muon orthogonalises each matrix whole where the update layout deals it out.
            with update_layout(on_device(plan.update_layout)):
                updates, new_opt_state = optimizer.update(grads, opt_state, master)
            new_master = apply_updates(plan, master, updates, state.step)
            if prec.skips:  # a skipped step leaves every bit of the state as it was
                new_master, new_opt_state, extra = keep_old_when_nonfinite(
                    finite, (new_master, new_opt_state, extra), (master, opt_state, state.extra)
                )
            new_params = params_at_rest(plan, new_master)
        applied = (finite if prec.skips else jnp.bool_(True)).astype(jnp.int32)
        ls = state.loss_scale
        new_state = TrainState(
            step=state.step + applied,
            params=new_params,
            opt_state=to_stored(new_opt_state, plan.stored_opt()),
            extra=extra,
            master=to_stored(new_master, plan.stored_update) if prec.mixed else (),
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


def make_gradient_step(
    plan: Plan,
    loss_fn: LossFn,
    options: StepOptions | None = None,
    *,
    has_aux: bool | None = None,
    takes_extra: bool = False,
    learning_rate: Callable[[jax.Array], jax.Array] | None = None,
) -> Callable[[TrainState, PyTree], tuple[Any, ...]]:
    """The train step without its update, for callers that run the update themselves (the
    NVMe tier, :mod:`jzero.nvme.step`): the jitted ``(state, batch) -> (grads, applied,
    extra, loss_scale, metrics)``, the gradients reduced, unscaled and clipped in the plan's
    gradient layout, ``applied`` 0 when the step is to be skipped (non-finite gradients under
    skipping), ``extra`` and ``loss_scale`` the state's next ones. Arguments as for
    :func:`make_train_step` (the options' ``sub_group_size`` and ``offload_compute`` are the
    caller's update's); the state is not donated."""
    prec = plan.options.precision
    opts = options if options is not None else StepOptions()
    gradients = gradient_part(plan, loss_fn, opts, has_aux, takes_extra)

    def step(state: TrainState, batch: PyTree) -> tuple[Any, ...]:
        _, grads, grad_norm, finite, loss, aux, extra = gradients(state, batch)
        if prec.skips:
            extra = keep_old_when_nonfinite(finite, ((), (), extra), ((), (), state.extra))[2]
        applied = (finite if prec.skips else jnp.bool_(True)).astype(jnp.int32)
        ls = state.loss_scale
        lr = learning_rate(state.step) if learning_rate else find_learning_rate(state.opt_state)
        metrics = _metrics(prec, loss, grad_norm, lr, aux, applied, finite, ls)
        return grads, applied, extra, next_loss_scale(prec, ls, finite), metrics

    return jax.jit(
        step,
        out_shardings=(on_device(plan.grads), *(plan.replicated,) * 4),
        compiler_options=compiler_options(plan) or None,
    )


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
