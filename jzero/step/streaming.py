"""The offloaded optimizer step streamed over sub-groups (DeepSpeed's ``sub_group_size``).

With ``offload_optimizer`` the optimizer state (and the float32 masters under mixed precision)
rest in host memory. Brought into device memory in one piece for the update, they would make
the step's device peak that of a run without offload. Here the update runs over groups of
parameter leaves of at most ``sub_group_size`` elements (:func:`jzero.subgroups.leaf_groups`,
every group two leaves or more): bring the group's state in, update it, send it back, then the
next group.

Decisions:

* Inside the one jitted step: group ``g + 1``'s host-memory inputs and group ``g``'s results
  (already sent back to host memory) pass one ``optimization_barrier`` together, so XLA cannot
  bring ``g + 1`` in before ``g`` has gone out; the device then holds one group of the state
  (plus the 16-bit params and the gradients). The lowered program shows the order: one barrier
  between consecutive groups, each group's ``annotate_device_placement`` to host before it.
* Each group's update is :func:`jzero.subgroups.update_group` (the optax chain unchanged, the
  other leaves zero-size placeholders), so a leafwise optimizer gives the bits of the one-call
  update; a skipped step (non-finite gradients) keeps each group's old values, on the device,
  before they go back.
* Each group also leaves its new parameters in the compute dtype on the device (the 16-bit copy
  the next step computes with), from which the step gathers the parameters at rest.
* ``offload_optimizer.compute: host`` (jzero's key) runs each group's update on the host
  instead, where DeepSpeed runs its CPU Adam: under ``jax.experimental.compute_on
  ("device_host")``, on the group's state where it rests in host memory, with the gradients
  sent to the host and the group's 16-bit copy sent back. The device then holds none of the
  offloaded state at any time; the price is the host's arithmetic. Which is faster depends on
  the backend and the model: ``device`` (streaming through the device) is the default, and the
  GPU check (``benchmarks/gpu_check.py``) times both. A group with leaves in device memory
  (``ratio < 1``) is updated on the device. On CPU host and device are the same memory, so
  both give the same numbers; the lowered program shows where each group runs.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jzero import subgroups
from jzero.parallel.zero import pad_to, unpad_to
from jzero.plan import Plan, cut_leaf, is_host, on_device, update_view

__all__ = ["streamed_groups", "streamed_update"]

PyTree = Any


def streamed_groups(
    plan: Plan,
    sub_group_size: int | None,
    optimizer: optax.GradientTransformation | None = None,
    on_host: bool = False,
) -> list[list[int]] | None:
    """The groups the offloaded update streams over, or ``None`` when it runs in one piece:
    nothing of the optimizer state in host memory, or no ``sub_group_size`` or one group
    (``on_host``: one group of every leaf instead, updated on the host).

    Raises:
      ValueError: when ``optimizer`` is given, there are groups, and its update reads across
        leaves (:func:`jzero.subgroups.check_leafwise`, its data-flow part): grouped updates
        would change the training.
    """
    if not any(is_host(s) for s in jax.tree.leaves(plan.opt_state)):
        return None
    sizes = [math.prod(leaf.shape) for leaf in plan.leaves]
    groups = [list(range(len(sizes)))]
    if sub_group_size:
        groups = subgroups.merge_single_leaf_groups(subgroups.leaf_groups(sizes, sub_group_size))
    if len(groups) < 2:
        return groups if on_host else None
    if optimizer is not None:
        subgroups.check_leafwise(optimizer, plan.abstract_params, max_elements=0)
    return groups


def _to(x: Any, host: bool) -> Any:
    space = jax.memory.Space.Host if host else jax.memory.Space.Device
    return jax.device_put(x, space)


def streamed_update(
    plan: Plan,
    optimizer: optax.GradientTransformation,
    groups: list[list[int]],
    state: Any,
    params: PyTree,
    grads: PyTree,
    finite: jax.Array | None,
    on_host: bool = False,
) -> tuple[PyTree, PyTree, PyTree]:
    """The optimizer update one group at a time, inside the step.

    Args:
      plan: the plan (its optimizer state, and masters, in host memory).
      optimizer: a leafwise optax transformation.
      groups: from :func:`streamed_groups`.
      state: the step's :class:`~jzero.step.TrainState` (masters and optimizer state as they
        rest).
      params: the params in device memory (the masters themselves without mixed precision).
      grads: the reduced, clipped gradients in the update layout.
      finite: under skipping, whether the step's gradients are finite (else the old values
        are kept); ``None``: always apply.
      on_host: update the groups whose state all rests in host memory on the host
        (``compute_on("device_host")``) rather than streaming them through the device.

    Returns:
      ``(new masters, new optimizer state, new compute-dtype params)``: the first two laid out
      as they rest (host memory where offloaded), the last in the update layout on the device.
      Without mixed precision the new masters are the new params.
    """
    mixed = plan.options.precision.mixed
    compute = plan.options.precision.compute_dtype
    owner = subgroups.param_leaf_owner(optimizer, plan.abstract_params, plan.abstract_opt_state)
    shared = subgroups.shared_state(owner)
    p_abstract = jax.tree.leaves(plan.abstract_params)
    s_abstract, s_def = jax.tree.flatten(plan.abstract_opt_state)
    p_def = jax.tree.structure(plan.abstract_params)
    m_sh = jax.tree.leaves(plan.master if mixed else plan.update_layout)
    s_sh = jax.tree.leaves(plan.opt_state)
    update_sh = jax.tree.leaves(on_device(plan.update_layout))
    m_rest = jax.tree.leaves(state.master) if mixed else jax.tree.leaves(params)
    s_rest = jax.tree.leaves(state.opt_state)
    g_leaves = jax.tree.leaves(grads)
    # Padded leaves (jzero.plan.padding) are updated at their logical shapes and rest padded.
    m_stored = [tuple(x.shape) for x in jax.tree.leaves(plan.stored_update)]
    s_stored = [tuple(x.shape) for x in jax.tree.leaves(plan.stored_opt())]
    s_dev = jax.tree.leaves(on_device(plan.opt_state))

    g_leaves = [cut_leaf(g, a.shape, update_sh[i]) for i, (g, a) in enumerate(
        zip(g_leaves, p_abstract, strict=True))]  # fmt: skip

    def keep(new: list[Any], old: list[Any]) -> list[Any]:
        if finite is None:
            return new
        return [jnp.where(finite, a, b) for a, b in zip(new, old, strict=True)]

    shared_old = [_to(s_rest[k], False) if is_host(s_sh[k]) else s_rest[k] for k in shared]
    new_m: list[Any] = [None] * len(p_abstract)
    new_s: list[Any] = list(s_rest)
    copies: list[Any] = [None] * len(p_abstract)
    previous: list[Any] = []
    for index, group in enumerate(groups):
        owned = subgroups.owned_state(owner, group)
        m_in = [m_rest[i] for i in group]
        s_in = [s_rest[k] for k in owned]
        if (  # the group's state rests in host memory: updated there (masters sent along)
            on_host
            and all(is_host(s_sh[k]) for k in owned)
            and (not mixed or all(is_host(m_sh[i]) for i in group))
        ):
            group_m, group_s, group_shared = _host_update(
                plan,
                optimizer,
                owner,
                group,
                [g_leaves[i] for i in group],
                m_in,
                s_in,
                [s_rest[k] for k in shared],
                finite,
                ([tuple(p_abstract[i].shape) for i in group],
                 [tuple(s_abstract[k].shape) for k in owned]),
            )  # fmt: skip
            for i, x in zip(group, group_m, strict=True):
                new_m[i] = x if is_host(m_sh[i]) else _to(x, False)
                x = unpad_to(_to(x, False), tuple(p_abstract[i].shape))  # the next step's copy
                floating = jnp.issubdtype(x.dtype, jnp.floating)
                copies[i] = x.astype(compute) if mixed and floating else x
            for k, x in zip(owned, group_s, strict=True):
                new_s[k] = x
            if index == 0:
                for k, x in zip(shared, group_shared, strict=True):
                    new_s[k] = x if is_host(s_sh[k]) else _to(x, False)
            continue
        if previous:  # group g + 1 comes in after group g went out (host arrays only: one op
            # cannot mix host and device operands)
            m_at = [j for j, i in enumerate(group) if is_host(m_sh[i])]
            s_at = [j for j, k in enumerate(owned) if is_host(s_sh[k])]
            previous, m_b, s_b = jax.lax.optimization_barrier(
                (previous, [m_in[j] for j in m_at], [s_in[j] for j in s_at])
            )
            for j, x in zip(m_at, m_b, strict=True):
                m_in[j] = x
            for j, x in zip(s_at, s_b, strict=True):
                s_in[j] = x
        masters = [
            _to(x, False) if is_host(m_sh[i]) else x for x, i in zip(m_in, group, strict=True)
        ]
        if mixed:
            masters = [
                cut_leaf(x, p_abstract[i].shape, update_sh[i])
                for x, i in zip(masters, group, strict=True)
            ]
        else:  # the params themselves, cut to the update layout
            masters = [
                update_view(x, p_abstract[i].shape, m_stored[i], update_sh[i])
                for x, i in zip(masters, group, strict=True)
            ]
        states = [
            cut_leaf(_to(x, False) if is_host(s_sh[k]) else x, s_abstract[k].shape, s_dev[k])
            for x, k in zip(s_in, owned, strict=True)
        ]
        result = _group_update(plan, optimizer, owner, group)(
            [g_leaves[i] for i in group], masters, states, shared_old
        )
        group_m = keep(result.params, masters)
        group_s = keep(result.opt_state, states)
        for i, x in zip(group, group_m, strict=True):
            floating = jnp.issubdtype(x.dtype, jnp.floating)
            copies[i] = x.astype(compute) if mixed and floating else x
        group_m = [pad_to(x, m_stored[i]) for x, i in zip(group_m, group, strict=True)]
        group_s = [pad_to(x, s_stored[k]) for x, k in zip(group_s, owned, strict=True)]
        sent_m = [
            _to(x, True) if is_host(m_sh[i]) else x for x, i in zip(group_m, group, strict=True)
        ]
        sent_s = [
            _to(x, True) if is_host(s_sh[k]) else x for x, k in zip(group_s, owned, strict=True)
        ]
        for i, x in zip(group, sent_m, strict=True):
            new_m[i] = x
        for k, x in zip(owned, sent_s, strict=True):
            new_s[k] = x
        if index == 0:
            for k, x in zip(shared, keep(result.shared, shared_old), strict=True):
                new_s[k] = _to(x, True) if is_host(s_sh[k]) else x
        previous = [x for x, i in zip(sent_m, group, strict=True) if is_host(m_sh[i])]
        previous += [x for x, k in zip(sent_s, owned, strict=True) if is_host(s_sh[k])]
    return p_def.unflatten(new_m), s_def.unflatten(new_s), p_def.unflatten(copies)


def _group_update(
    plan: Plan, optimizer: optax.GradientTransformation, owner: list[int | None], group: list[int]
) -> Any:
    """``(grads, masters, owned state, shared state) -> GroupUpdate`` of ``group``."""

    def update(grads: Any, masters: Any, states: Any, shared: Any) -> Any:
        leaves = subgroups.GroupLeaves(grads, masters, states, shared)
        abstract = (plan.abstract_params, plan.abstract_opt_state)
        return subgroups.update_group_leaves(optimizer, *abstract, group, owner, leaves)

    return update


def _host_update(
    plan: Plan,
    optimizer: optax.GradientTransformation,
    owner: list[int | None],
    group: list[int],
    grads: list[Any],
    masters: list[Any],
    states: list[Any],
    shared: list[Any],
    finite: jax.Array | None,
    logical: tuple[list[tuple[int, ...]], list[tuple[int, ...]]],
) -> tuple[list[Any], list[Any], list[Any]]:
    """One group's update run on the host (``compute_on("device_host")``): its masters and
    state as they rest in host memory, the gradients, shared state and flag sent there. Returns
    the new masters, owned state and shared state, in host memory, as they rest (padded leaves
    are updated at their ``logical`` shapes, masters' and owned state's, and padded back)."""
    from jax.experimental.compute_on import compute_on

    m_shapes, s_shapes = logical

    def update(grads, masters, states, shared, finite):
        rest = ([tuple(x.shape) for x in masters], [tuple(x.shape) for x in states])
        masters = [unpad_to(x, n) for x, n in zip(masters, m_shapes, strict=True)]
        states = [unpad_to(x, n) for x, n in zip(states, s_shapes, strict=True)]
        result = _group_update(plan, optimizer, owner, group)(grads, masters, states, shared)
        out = (result.params, result.opt_state, result.shared)
        if finite is not None:
            out = jax.tree.map(lambda a, b: jnp.where(finite, a, b), out, (masters, states, shared))
        new_m, new_s, new_shared = out
        new_m = [pad_to(x, n) for x, n in zip(new_m, rest[0], strict=True)]
        new_s = [pad_to(x, n) for x, n in zip(new_s, rest[1], strict=True)]
        return new_m, new_s, new_shared

    host = functools.partial(_to, host=True)  # no-op where the array rests there already
    args = jax.tree.map(host, (grads, masters, states, shared))
    flag = None if finite is None else host(finite)
    return compute_on("device_host")(jax.jit(update))(*args, flag)
