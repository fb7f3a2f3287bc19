"""One group's optimizer update, and the whole update run one group at a time.

The update half of :mod:`jzero.subgroups` (DeepSpeed's ``sub_group_size``); which leaves form a
group is :mod:`jzero.subgroups.ownership`, and which optimizers this is exact for is
:func:`jzero.subgroups.check_leafwise`.

Decisions:

* One group's update is one ordinary ``optimizer.update`` call on the *full* tree structure in
  which every leaf outside the group (its parameter, gradient and per-parameter state) is a
  zero-size placeholder: an array of the leaf's dtype and rank whose dimensions are all 0 (a
  0-d leaf is a scalar zero). Any optax chain therefore runs unchanged and touches only the
  group's arrays. Placeholders keep the rank (not shape ``(0,)``) so that masks computed from
  the params by rank (``x.ndim > 1``, the usual weight-decay mask) see the same tree as in the
  one-call update, and so that a leaf's placeholders always broadcast with each other.
* Bits. A group's call runs the same primitives on the same arrays as the one-call update,
  so op by op the results are equal. Compiled, XLA may round a few operations differently
  because the surrounding program differs: on XLA:CPU ``x / s`` with a scalar ``s`` that has
  a single consumer is rewritten to ``x * (1 / s)``, so Adam's bias correction, which every
  leaf of the one-call update consumes, is rounded differently in a group that holds one
  leaf (or one leaf under a mask): the update's last bit differs in 0.2-0.4% of elements
  (measured; Adam, AdamW, LAMB). Groups of two or more leaves, and transforms without such
  scalar divisions (SGD with momentum, Lion, Adagrad, Adafactor), gave the same bits in
  every grouping measured, under ``jit`` and on sharded inputs; the tests pin both. A caller
  that needs the bits of the one-call update can keep every group at two leaves or more
  (merge a leaf larger than ``sub_group_size`` with a neighbour).
* Everything here is traceable: :func:`grouped_update` runs under ``jax.jit`` with sharded
  inputs, and ``sequential=True`` orders the groups with ``jax.lax.optimization_barrier`` so
  that XLA cannot start a group's input copies (e.g. from host memory) before the previous
  group's results exist. A caller that moves state itself (NVMe: one ``jit`` call per group
  inside a Python loop) calls :func:`update_group` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jzero.subgroups.ownership import owned_state, param_leaf_owner, shared_state

__all__ = [
    "GroupLeaves",
    "GroupTransfers",
    "GroupUpdate",
    "grouped_update",
    "placeholder",
    "update_group",
    "update_group_leaves",
]

PyTree = Any


def placeholder(x: Any) -> jax.Array:
    """The zero-size stand-in for a leaf outside the group: its dtype and rank, every dimension
    0 (a 0-d leaf becomes a scalar zero). Only ``x.dtype`` and ``x.shape`` are read."""
    return jnp.zeros((0,) * len(x.shape), x.dtype)


class GroupLeaves(NamedTuple):
    """One group's own leaves, as a caller that moves one group at a time holds them
    (:func:`update_group_leaves`).

    Attributes:
      grads: the group's gradient leaves, in the group's order.
      params: its parameter leaves, in the group's order.
      state: the optimizer-state leaves it owns, in the order of :func:`owned_state`.
      shared_old: the *old* shared state leaves, in the order of :func:`shared_state`.
    """

    grads: Sequence[Any]
    params: Sequence[Any]
    state: Sequence[Any]
    shared_old: Sequence[Any]


class GroupTransfers(NamedTuple):
    """How :func:`grouped_update` moves each group's arrays around its update (e.g. from host
    memory into device memory and back); ``None`` fields move nothing.

    Attributes:
      bring: ``bring(leaves, indices, kind) -> leaves``, applied to each group's parameter
        (``kind`` ``"params"``, parameter leaf indices) and owned state leaves (``"state"``,
        state leaf indices) just before its update: e.g. ``jax.device_put`` from host memory.
      send: the same for each group's results right after its update (back to host memory).
      keep: ``keep(new_params, indices) -> values``, applied to the group's new parameters
        before ``send``; what it returns is collected per parameter leaf and returned as a
        third result (e.g. the 16-bit copies the next step computes with, kept in device
        memory while the fp32 masters go back to the host).
    """

    bring: Any = None
    send: Any = None
    keep: Any = None


class GroupUpdate(NamedTuple):
    """What one group's update returns.

    Attributes:
      params: the new parameter leaves of the group, in the group's order.
      opt_state: the new optimizer-state leaves the group owns, in the order of
        :func:`owned_state`.
      shared: the new shared state leaves, in the order of :func:`shared_state`; every group
        computes the same values from the same old ones, and the first group's are kept.
    """

    params: list[Any]
    opt_state: list[Any]
    shared: list[Any]


def update_group(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    opt_state: PyTree,
    params: PyTree,
    group: Sequence[int],
    owner: Sequence[int | None],
    shared_old: Sequence[Any] | None = None,
) -> GroupUpdate:
    """One group's optimizer update: ``optimizer.update`` then ``optax.apply_updates`` on the
    full tree structure with every leaf outside ``group`` replaced by a :func:`placeholder`.

    Only the group's leaves of ``grads``, ``params`` and ``opt_state`` (and the shared state)
    are read; the others need only ``dtype`` and ``shape``, so a caller that streams groups may
    pass ``jax.ShapeDtypeStruct`` (or anything with those attributes) for them, e.g. by
    closing over abstract trees inside the ``jit`` it calls once per group.

    Args:
      optimizer: a leafwise optax transformation (see :mod:`jzero.subgroups`).
      grads: the gradient tree (the params' structure).
      opt_state: the optimizer state tree.
      params: the parameter tree the update applies to (the fp32 masters under mixed
        precision).
      group: the parameter leaf indices to update.
      owner: :func:`param_leaf_owner` of the optimizer and this state.
      shared_old: the *old* shared state leaves (order of :func:`shared_state`); default: read
        from ``opt_state``. Pass them when ``opt_state`` already holds a previous group's
        results.

    Returns:
      The group's new leaves (:class:`GroupUpdate`).

    Raises:
      ValueError: if the group names a leaf index out of range or twice, or ``owner`` or
        ``shared_old`` does not fit the trees.
    """
    p_leaves, p_def = jax.tree.flatten(params)
    g_leaves, g_def = jax.tree.flatten(grads)
    s_leaves, s_def = jax.tree.flatten(opt_state)
    group = [int(i) for i in group]
    _check_group(group, len(p_leaves))
    if g_def != p_def:
        raise ValueError(
            f"The gradients' tree structure {g_def} differs from the params' {p_def}; pass "
            "gradients with exactly the params' structure."
        )
    if len(owner) != len(s_leaves):
        raise ValueError(
            f"owner has {len(owner)} entries but the optimizer state has {len(s_leaves)} "
            "leaves; compute it with param_leaf_owner(optimizer, params, opt_state) for this "
            "optimizer and state."
        )
    shared = shared_state(owner)
    if shared_old is None:
        shared_old = [s_leaves[k] for k in shared]
    elif len(shared_old) != len(shared):
        raise ValueError(
            f"shared_old has {len(shared_old)} leaves but the optimizer state has "
            f"{len(shared)} shared leaves (owner None); pass the old value of each, in "
            "state-leaf order."
        )
    members = set(group)
    owned = owned_state(owner, group)

    def keep(i: int, leaves: list[Any]) -> Any:
        return leaves[i] if i in members else placeholder(leaves[i])

    sub_params = p_def.unflatten([keep(i, p_leaves) for i in range(len(p_leaves))])
    sub_grads = p_def.unflatten([keep(i, g_leaves) for i in range(len(g_leaves))])
    sub_state = list(s_leaves)
    for k, o in enumerate(owner):
        if o is not None and o not in members:
            sub_state[k] = placeholder(s_leaves[k])
    for k, old in zip(shared, shared_old, strict=True):
        sub_state[k] = old
    updates, new_state = optimizer.update(sub_grads, s_def.unflatten(sub_state), sub_params)
    new_params = jax.tree.leaves(optax.apply_updates(sub_params, updates))
    new_s = jax.tree.leaves(new_state)
    if len(new_s) != len(s_leaves):
        raise ValueError(
            f"The optimizer's update returned {len(new_s)} state leaves for {len(s_leaves)}; "
            "its state changes structure between steps, which grouped updates cannot follow."
        )
    return GroupUpdate(
        params=[new_params[i] for i in group],
        opt_state=[new_s[k] for k in owned],
        shared=[new_s[k] for k in shared],
    )


def update_group_leaves(
    optimizer: optax.GradientTransformation,
    abstract_params: PyTree,
    abstract_opt_state: PyTree,
    group: Sequence[int],
    owner: Sequence[int | None],
    leaves: GroupLeaves,
) -> GroupUpdate:
    """:func:`update_group` given only the group's own leaves and the old shared state
    (:class:`GroupLeaves`); the other leaves come from the abstract trees (only their shapes
    and dtypes are read). How a caller that moves one group at a time (host memory, files)
    runs the update."""
    p_leaves, p_def = jax.tree.flatten(abstract_params)
    s_leaves, s_def = jax.tree.flatten(abstract_opt_state)
    p_tree, g_tree, s_tree = list(p_leaves), list(p_leaves), list(s_leaves)
    for i, p, g in zip(group, leaves.params, leaves.grads, strict=True):
        p_tree[i], g_tree[i] = p, g
    for k, x in zip(owned_state(owner, group), leaves.state, strict=True):
        s_tree[k] = x
    return update_group(
        optimizer,
        p_def.unflatten(g_tree),
        s_def.unflatten(s_tree),
        p_def.unflatten(p_tree),
        group,
        owner,
        leaves.shared_old,
    )


def grouped_update(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    opt_state: PyTree,
    params: PyTree,
    groups: Sequence[Sequence[int]],
    owner: Sequence[int | None] | None = None,
    *,
    sequential: bool = False,
    transfers: GroupTransfers | None = None,
) -> Any:
    """The optimizer step one group at a time; for a leafwise optimizer the same bits as
    ``updates, s = optimizer.update(grads, opt_state, params)`` and
    ``optax.apply_updates(params, updates)`` (compiled, one-leaf groups of Adam-like
    optimizers may differ in the update's last bit: see "Bits" in the module docstring).

    Args:
      optimizer: a leafwise optax transformation (see :func:`jzero.subgroups.check_leafwise`).
      grads: the gradient tree.
      opt_state: the optimizer state.
      params: the parameters (fp32 masters under mixed precision).
      groups: a partition of the parameter leaf indices, e.g. from :func:`leaf_groups`.
      owner: :func:`param_leaf_owner` (default: computed here from the trees' shapes).
      sequential: order the groups with ``jax.lax.optimization_barrier``: group ``g + 1``'s
        inputs and group ``g``'s results pass one barrier together, so under ``jit`` group
        ``g + 1`` cannot start (nor its inputs be brought in) before group ``g`` is done.
        The values are the same either way.
      transfers: what moves each group's arrays in before its update and out after it, and
        what is kept of its new parameters (:class:`GroupTransfers`); ``None``: nothing.

    Returns:
      ``(new_params, new_opt_state)`` with the structures of ``params`` and ``opt_state``, and
      with a ``keep`` transfer a third element: the tree of what ``keep`` returned.

    Raises:
      ValueError: if ``groups`` is not a partition of the parameter leaf indices.
    """
    bring, send, keep = transfers if transfers is not None else GroupTransfers()
    p_leaves, p_def = jax.tree.flatten(params)
    g_leaves = jax.tree.leaves(grads)
    s_leaves, s_def = jax.tree.flatten(opt_state)
    groups = [[int(i) for i in g] for g in groups]
    flat = sorted(i for g in groups for i in g)
    if flat != list(range(len(p_leaves))):
        raise ValueError(
            f"groups must partition the {len(p_leaves)} parameter leaf indices 0..."
            f"{len(p_leaves) - 1}, each exactly once, but they hold {_describe(flat)}. "
            "Build them with leaf_groups(sizes, sub_group_size)."
        )
    if not groups:  # no parameter leaves: the update changes shared state only
        updates, new_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state
    if owner is None:
        owner = param_leaf_owner(optimizer, params, opt_state)
    shared = shared_state(owner)
    shared_old = [s_leaves[k] for k in shared]
    new_p, new_s = list(p_leaves), list(s_leaves)
    kept: list[Any] = list(p_leaves)
    g_now, p_now, s_now = list(g_leaves), list(p_leaves), list(s_leaves)
    previous: GroupUpdate | None = None
    previous_at: tuple[list[int], list[int]] = ([], [])
    for index, group in enumerate(groups):
        owned = owned_state(owner, group)
        if sequential and previous is not None:
            inputs = (
                [g_now[i] for i in group],
                [p_now[i] for i in group],
                [s_now[k] for k in owned],
            )
            previous, inputs = jax.lax.optimization_barrier((previous, inputs))
            _put(g_now, group, inputs[0])
            _put(p_now, group, inputs[1])
            _put(s_now, owned, inputs[2])
            _put(new_p, previous_at[0], previous.params)
            _put(new_s, previous_at[1], previous.opt_state)
        if bring is not None:
            _put(p_now, group, bring([p_now[i] for i in group], group, "params"))
            _put(s_now, owned, bring([s_now[k] for k in owned], owned, "state"))
        result = update_group(
            optimizer,
            p_def.unflatten(g_now),
            s_def.unflatten(s_now),
            p_def.unflatten(p_now),
            group,
            owner,
            shared_old,
        )
        if keep is not None:
            _put(kept, group, keep(result.params, group))
        if send is not None:
            result = result._replace(
                params=send(result.params, group, "params"),
                opt_state=send(result.opt_state, owned, "state"),
            )
        _put(new_p, group, result.params)
        _put(new_s, owned, result.opt_state)
        if index == 0:
            _put(new_s, shared, result.shared)
        previous, previous_at = result, (group, owned)
    if keep is not None:
        return p_def.unflatten(new_p), s_def.unflatten(new_s), p_def.unflatten(kept)
    return p_def.unflatten(new_p), s_def.unflatten(new_s)


# --- helpers -------------------------------------------------------------------------------


def _put(target: list[Any], indices: Sequence[int], values: Sequence[Any]) -> None:
    for i, v in zip(indices, values, strict=True):
        target[i] = v


def _check_group(group: list[int], n: int) -> None:
    bad = [i for i in group if not 0 <= i < n]
    if bad or len(set(group)) != len(group):
        raise ValueError(
            f"The group {_describe(group)} must name distinct parameter leaf indices in "
            f"0...{n - 1}; {'out of range: ' + str(bad) if bad else 'some appear twice'}. "
            "Build groups with leaf_groups(sizes, sub_group_size)."
        )


def _describe(indices: Sequence[int]) -> str:
    shown = list(indices[:8])
    return f"{shown}{' ...' if len(indices) > 8 else ''} ({len(indices)} in all)"
