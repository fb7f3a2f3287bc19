"""The train state: what a step reads and writes, its shardings, and the state before step 1.

Decisions:

* The state is created inside one ``jit`` whose ``out_shardings`` are the plan's
  (:func:`init_train_state`): every leaf is born in its shard, and parameters given as a
  function of no arguments are created there, so they never exist whole. The caller's arrays
  are copied, never donated.
* Under mixed precision the parameters given become the float32 master weights, and the
  16-bit copy the step computes with is rounded from them.
* Leaves whose sharded dimension the shard count does not divide rest padded with zeros
  (:mod:`jzero.plan.padding`): the state holds the plan's ``stored_*`` shapes.
* Offloaded leaves (a host memory kind in the plan) are brought into device memory inside the
  step (:func:`to_device`), so XLA schedules the copies; the step's ``out_shardings`` send the
  results back.
* The step's ``shard_map`` specs come from the plan (:meth:`jzero.plan.Plan.manual_spec`:
  ZeRO's axes on the sharded dimension, and a leaf's own manual axes, ``expert``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jzero._util import is_creator
from jzero.plan import (
    LossScaleState,
    Plan,
    cast_floating,
    even_sharding,
    is_host,
    logical_copies,
    to_logical,
    to_stored,
)

__all__ = [
    "TrainState",
    "find_learning_rate",
    "from_logical",
    "init_train_state",
    "logical_shardings",
    "logical_state",
    "logical_view",
    "relayout",
    "restore_target",
    "state_shardings",
    "stored_state",
]

PyTree = Any


class TrainState(NamedTuple):
    """Everything a step reads and writes; donated to the step.

    Attributes:
      step: the number of optimizer updates applied so far (int32 scalar); a skipped step
        (non-finite gradients under :attr:`jzero.plan.precision.Precision.skips`: an fp16 overflow,
        or any precision with ``skip_nonfinite``) does not count, so the schedule does not
        advance either.
      params: the parameters the model computes with, sharded per ``plan.params`` (16-bit
        under mixed precision).
      opt_state: the optax state, sharded per ``plan.opt_state``.
      extra: non-trainable model state (e.g. BatchNorm statistics, RNG counters), replicated
        and never sharded as parameters; empty for a plain loss function.
      master: under mixed precision the float32 master weights, sharded per ``plan.master``;
        empty otherwise.
      loss_scale: the :class:`jzero.plan.precision.LossScaleState`.
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
        master=plan.master if plan.options.precision.mixed else (),
        loss_scale=LossScaleState(r, r, r, r, r),
    )


def init_train_state(
    plan: Plan,
    params: PyTree,
    optimizer: optax.GradientTransformation,
    extra: PyTree = (),
    *,
    returns_extra: bool = False,
    abstract: bool = False,
) -> TrainState:
    """The :class:`TrainState` before the first step, every leaf in its plan's sharding.

    The whole state is made by one jitted program (one compilation), whatever it holds.

    Args:
      plan: the sharding plan.
      params: the initial parameters (full precision; under mixed precision they become the
        float32 master weights and the 16-bit copy is made from them), or a function of no
        arguments that creates them (a function, ``functools.partial`` or method: a callable
        pytree such as an Equinox module is a value, never called): it then runs inside the
        same ``jit``, so the parameters are created directly in their shards and never exist
        whole.
      optimizer: the optax transformation the plan was made for.
      extra: non-trainable model state, if any.
      returns_extra: ``params`` is a function returning ``(params, extra)`` (a Flax model's
        init), so the model is built once, in the same program; ``extra`` is then ignored.
      abstract: return the state's shapes only (``jax.ShapeDtypeStruct`` with their
        shardings): nothing is compiled or allocated.

    Returns:
      A fresh state; the caller's arrays are copied, never donated.
    """
    prec = plan.options.precision
    sh = state_shardings(plan)

    # A creator is a function (or partial, method, class); a callable pytree is a value.
    make = params if is_creator(params) else None
    if returns_extra and make is None:
        raise ValueError(
            "init_train_state(returns_extra=True) needs params to be a function returning "
            f"(params, extra); got {type(params).__name__}. Pass the function, or drop "
            "returns_extra and pass extra=..."
        )

    def init(params: PyTree, extra: PyTree) -> TrainState:
        if returns_extra:
            params, extra = make()
        elif make is not None:
            params = make()
        master = jax.tree.map(lambda x, a: jnp.asarray(x, a.dtype), params, plan.abstract_params)
        opt_state = optimizer.init(master)
        compute = cast_floating(master, prec.compute_dtype) if prec.mixed else master
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=to_stored(jax.tree.map(jnp.copy, compute), plan.stored_params),
            opt_state=to_stored(opt_state, plan.stored_opt()),
            extra=jax.tree.map(jnp.copy, extra),
            master=to_stored(master, plan.stored_update) if prec.mixed else (),
            loss_scale=jax.tree.map(jnp.asarray, LossScaleState.initial(prec)),
        )

    made = jax.jit(init, out_shardings=sh)
    args = (None if make is not None else params, None if returns_extra else extra)
    return made.eval_shape(*args) if abstract else made(*args)


def logical_state(plan: Plan, state: TrainState) -> TrainState:
    """The :class:`TrainState`'s shapes at their logical sizes (``ShapeDtypeStruct``): what
    the padded leaves (:mod:`jzero.plan.padding`) hold without their padding."""
    sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    return TrainState(
        step=sds(state.step),
        params=plan.compute_params,
        opt_state=plan.abstract_opt_state,
        extra=jax.tree.map(sds, state.extra),
        master=plan.abstract_params if plan.options.precision.mixed else (),
        loss_scale=jax.tree.map(sds, state.loss_scale),
    )


def stored_state(plan: Plan, logical: TrainState) -> TrainState:
    """The shapes a :class:`TrainState` rests at under ``plan``, from its logical ones."""
    return logical._replace(
        params=plan.stored_params,
        opt_state=plan.stored_opt(),
        master=plan.stored_update if plan.options.precision.mixed else (),
    )


def relayout(state: TrainState, old: Plan, new: Plan) -> TrainState:
    """``state`` (resting under plan ``old``) moved to plan ``new``'s shardings and padding,
    by one jitted program; a plain ``device_put`` where neither plan pads."""
    shardings = state_shardings(new)
    abstract = is_abstract(state)  # an abstract engine's: the new shapes and shardings only
    if not abstract and not old.padded and not new.padded:
        return jax.device_put(state, shardings)
    logical = logical_state(old, state)
    target = stored_state(new, logical)
    move = jax.jit(lambda s: to_stored(to_logical(s, logical), target), out_shardings=shardings)
    return move.eval_shape(state) if abstract else move(state)


def is_abstract(state: TrainState) -> bool:
    """Whether ``state`` holds shapes only (an engine built with ``abstract=True``)."""
    return isinstance(state.step, jax.ShapeDtypeStruct)


def logical_view(plan: Plan, state: TrainState) -> TrainState:
    """``state`` outside ``jit`` at its logical shapes: padded leaves cut into copies whose
    layout ``jit`` accepts (:func:`jzero.plan.padding.logical_copies`), the rest as they are."""
    if not plan.padded:
        return state
    logical = logical_state(plan, state)
    # Fields left out of ``state`` (``()``) are left out of the view too.
    empty = {f: () for f, v in zip(state._fields, state, strict=True) if type(v) is tuple and not v}
    logical = logical._replace(**empty)
    return logical_copies(state, logical, _per_leaf(plan, state))


def _per_leaf(plan: Plan, tree: TrainState) -> TrainState:
    """:func:`state_shardings` (a prefix of the state) spelled out leaf by leaf; a field left
    out of ``tree`` (``()``) stays out."""

    def spell(shardings: Any, sub: Any) -> Any:
        if type(sub) is tuple and not sub:
            return ()
        return jax.tree.map(lambda sh, t: jax.tree.map(lambda _: sh, t), shardings, sub)

    return TrainState(*(spell(s, t) for s, t in zip(state_shardings(plan), tree, strict=True)))


def logical_shardings(plan: Plan, logical: TrainState) -> TrainState:
    """Per leaf of a logical :class:`TrainState`, a sharding ``jit`` accepts for its logical
    shape: the plan's, with each uneven dimension's axes moved to one they divide
    (:func:`jzero.plan.padding.even_sharding`)."""
    return jax.tree.map(
        lambda x, sh: even_sharding(tuple(x.shape), sh), logical, _per_leaf(plan, logical)
    )


def restore_target(plan: Plan, state: TrainState) -> TrainState:
    """What a checkpoint of a :class:`TrainState` is read into under ``plan``: per leaf a
    ``jax.ShapeDtypeStruct`` of its logical shape (checkpoints hold no padding) with a sharding
    ``jit`` accepts for it. ``state`` gives the structure (arrays or abstract, e.g. from
    ``jax.eval_shape`` of :func:`init_train_state`). Pad what is read with
    :func:`from_logical`; write with ``Checkpointer.save(step, logical_view(plan, state))``."""
    logical = logical_state(plan, state)
    return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=sh),
        logical,
        logical_shardings(plan, logical),
    )


def from_logical(plan: Plan, state: TrainState) -> TrainState:
    """A logical :class:`TrainState` (as :func:`logical_view` gives, or a checkpoint holds)
    padded into ``plan``'s resting shapes and shardings."""
    if not plan.padded:
        return jax.device_put(state, state_shardings(plan))
    target = stored_state(plan, logical_state(plan, state))
    return jax.jit(lambda s: to_stored(s, target), out_shardings=state_shardings(plan))(state)


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


def to_device(tree: PyTree, shardings: PyTree) -> PyTree:
    """Brings offloaded (host-memory) leaves into device memory inside the step."""
    return jax.tree.map(
        lambda x, s: jax.device_put(x, jax.memory.Space.Device) if is_host(s) else x,
        tree,
        shardings,
    )
