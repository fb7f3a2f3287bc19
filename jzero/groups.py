"""The optimizer update one group of parameter leaves at a time (DeepSpeed's ``sub_group_size``).

DeepSpeed's ZeRO-3 runs the optimizer step over sub-groups of its flat partition so that only
one sub-group's fp32 master weights, gradients and optimizer state need be in fast memory at a
time (with ``offload_optimizer``/NVMe, the rest waits in host memory or in files). This module
is that step for any optax transformation that acts leaf by leaf.

Decisions:

* Groups are consecutive runs of parameter leaves (``jax.tree.leaves`` order) of at most
  ``sub_group_size`` elements (:func:`leaf_groups`); a leaf is never split, and a leaf larger
  than the limit is a group of its own, as in DeepSpeed.
* One group's update is one ordinary ``optimizer.update`` call on the *full* tree structure in
  which every leaf outside the group (its parameter, gradient and per-parameter state) is a
  zero-size placeholder: an array of the leaf's dtype and rank whose dimensions are all 0 (a
  0-d leaf is a scalar zero). Any optax chain therefore runs unchanged and touches only the
  group's arrays. Placeholders keep the rank (not shape ``(0,)``) so that masks computed from
  the params by rank (``x.ndim > 1``, the usual weight-decay mask) see the same tree as in the
  one-call update, and so that a leaf's placeholders always broadcast with each other.
* Which state leaf belongs to which parameter comes from ``optax.tree_map_params`` over a tree
  of leaf indices (:func:`param_leaf_owner`), as in :mod:`jzero.plan`; state of another shape
  (factored moments) still belongs to its parameter. State that is no parameter's (step counts,
  injected hyperparameters, RNG keys) is *shared*: every group's call gets its old value, and
  its new value is taken from the first group's call.
* This is the one-call update (to the bit, op by op; see "Bits" below) exactly when the
  transformation is leafwise: a leaf's new parameter and state depend only on that leaf's
  inputs and the shared state, and the new shared state depends on no leaf's inputs. Adam,
  AdamW, SGD with momentum, Lion, Adagrad, RMSProp, Adafactor, LAMB and LARS (whose trust
  ratios use per-leaf norms), per-leaf clipping, ``MultiSteps``, and chains of them with
  ``inject_hyperparams``, schedules and masks are leafwise (:func:`check_leafwise` passes
  them). Not leafwise: ``clip_by_global_norm`` (or any transform that computes a global norm)
  inside the chain, ``apply_if_finite`` (one finiteness check over all leaves),
  ``MultiSteps`` with a ``should_skip_update_fn``, transforms that mix leaves, and anything
  whose Python code reads the shapes of other leaves. DeepSpeed's own gradient clipping is
  applied by the step before the update (:func:`jzero.step.make_train_step`), so it is
  unaffected.
* :func:`check_leafwise` decides this honestly in two ways: a data-flow analysis of the
  update's jaxpr at the real shapes (it costs no memory and finds every cross-leaf data
  dependence, even one that only acts for some values, e.g. clipping that did not trigger),
  then, when the tree is small enough, a bit comparison of the grouped and one-call updates
  on random values of the real shapes (it also catches Python-level dependence on other
  leaves' shapes, which no data flow shows). Above the size limit only the first runs.
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
import numpy as np
import optax
from jax.extend import core as jcore

__all__ = [
    "GroupUpdate",
    "check_leafwise",
    "grouped_update",
    "leaf_groups",
    "merge_single_leaf_groups",
    "owned_state",
    "param_leaf_owner",
    "placeholder",
    "shared_state",
    "update_group",
    "update_group_leaves",
]

PyTree = Any
_MASKED = -2  # owner marker of an optax.MaskedNode (no array, no leaf in jax.tree.leaves)


def leaf_groups(sizes: Sequence[int], sub_group_size: int) -> list[list[int]]:
    """Partitions leaf indices, in order, into consecutive groups of at most ``sub_group_size``
    elements.

    A leaf with more elements than ``sub_group_size`` forms a group of its own (DeepSpeed does
    the same with a parameter larger than a sub-group). Zero-size leaves join the group at hand.

    Args:
      sizes: the number of elements of each leaf, in ``jax.tree.leaves`` order.
      sub_group_size: the most elements a group may hold (DeepSpeed's
        ``zero_optimization.sub_group_size``).

    Returns:
      The groups as lists of leaf indices; their concatenation is ``range(len(sizes))``.

    Raises:
      ValueError: if ``sub_group_size`` is below 1 or a size is negative.
    """
    if int(sub_group_size) < 1:
        raise ValueError(
            f"sub_group_size is {sub_group_size}, but a group must hold at least 1 element. "
            "Set zero_optimization.sub_group_size to a positive number of elements "
            "(DeepSpeed's default is 1e9)."
        )
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        n = int(n)
        if n < 0:
            raise ValueError(f"Leaf {i} has size {n}; sizes must be element counts (>= 0).")
        if current and total + n > sub_group_size:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        groups.append(current)
    return groups


def merge_single_leaf_groups(groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """``groups`` with every one-leaf group joined to a neighbour (the previous group, or the
    next for the first), so that each group holds two leaves or more when there are two.

    Compiled, a one-leaf group of an Adam-like optimizer may round its update's last bit
    differently from the one-call update (see "Bits" in the module docstring); groups of two
    leaves or more gave the one-call bits. The price: such a group holds one more leaf than
    ``sub_group_size`` allows.
    """
    out = [list(g) for g in groups if len(g)]
    i = 0
    while len(out) > 1 and i < len(out):
        if len(out[i]) == 1:
            if i == 0:
                out[1] = out[0] + out[1]
            else:
                out[i - 1] = out[i - 1] + out[i]
            del out[i]
            continue
        i += 1
    return out


def param_leaf_owner(
    optimizer: optax.GradientTransformation, abstract_params: PyTree, abstract_opt_state: PyTree
) -> list[int | None]:
    """For every leaf of ``jax.tree.leaves(opt_state)``, the index of the parameter leaf it
    belongs to, or ``None`` for shared state.

    Per-parameter state (Adam's ``mu``/``nu``, momentum traces, factored moments of another
    shape) maps to its parameter; state outside the copies of the parameter tree (step counts,
    injected hyperparameters and their schedules' state, RNG keys) maps to ``None``. Masked-out
    entries (``optax.MaskedNode``) hold no array and are no leaf, so they get no entry.

    Args:
      optimizer: the optax transformation.
      abstract_params: the params (arrays or ``jax.ShapeDtypeStruct``).
      abstract_opt_state: its state for those params (e.g. ``jax.eval_shape(optimizer.init,
        abstract_params)``).

    Returns:
      One entry per optimizer-state leaf.

    Raises:
      ValueError: if the mapping does not cover the state's leaves one to one (a state whose
        structure ``optax.tree_map_params`` cannot follow).
    """
    treedef = jax.tree.structure(abstract_params)
    index_tree = treedef.unflatten(list(range(treedef.num_leaves)))

    def param_state(leaf: Any, index: int) -> int:
        return _MASKED if isinstance(leaf, optax.MaskedNode) else index

    owner_tree = optax.tree_map_params(
        optimizer,
        param_state,
        abstract_opt_state,
        index_tree,
        transform_non_params=lambda value: jax.tree.map(lambda _: -1, value),
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )
    marks = [m for m in jax.tree.leaves(owner_tree) if m != _MASKED]
    n_state = len(jax.tree.leaves(abstract_opt_state))
    if len(marks) != n_state:
        raise ValueError(
            f"Mapping the optimizer state to parameters gave {len(marks)} entries for "
            f"{n_state} state leaves, so this optax transformation's state cannot be split "
            "by parameter. Use the one-call update (no sub_group_size) for this optimizer."
        )
    return [None if m == -1 else int(m) for m in marks]


def owned_state(owner: Sequence[int | None], group: Sequence[int]) -> list[int]:
    """Indices of the optimizer-state leaves that belong to the parameter leaves of ``group``,
    in state-leaf order (the order of :attr:`GroupUpdate.opt_state`)."""
    members = set(group)
    return [k for k, o in enumerate(owner) if o is not None and o in members]


def shared_state(owner: Sequence[int | None]) -> list[int]:
    """Indices of the shared optimizer-state leaves (owner ``None``), in state-leaf order (the
    order of :attr:`GroupUpdate.shared` and of ``shared_old``)."""
    return [k for k, o in enumerate(owner) if o is None]


def placeholder(x: Any) -> jax.Array:
    """The zero-size stand-in for a leaf outside the group: its dtype and rank, every dimension
    0 (a 0-d leaf becomes a scalar zero). Only ``x.dtype`` and ``x.shape`` are read."""
    return jnp.zeros((0,) * len(x.shape), x.dtype)


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
      optimizer: a leafwise optax transformation (see the module docstring).
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
    grads: Sequence[Any],
    params: Sequence[Any],
    state: Sequence[Any],
    shared_old: Sequence[Any],
) -> GroupUpdate:
    """:func:`update_group` given only the group's own leaves (``grads`` and ``params`` in the
    group's order, ``state`` in :func:`owned_state` order) and the old shared state; the other
    leaves come from the abstract trees (only their shapes and dtypes are read). How a caller
    that moves one group at a time (host memory, files) runs the update."""
    p_leaves, p_def = jax.tree.flatten(abstract_params)
    s_leaves, s_def = jax.tree.flatten(abstract_opt_state)
    p_tree, g_tree, s_tree = list(p_leaves), list(p_leaves), list(s_leaves)
    for i, p, g in zip(group, params, grads, strict=True):
        p_tree[i], g_tree[i] = p, g
    for k, x in zip(owned_state(owner, group), state, strict=True):
        s_tree[k] = x
    return update_group(
        optimizer,
        p_def.unflatten(g_tree),
        s_def.unflatten(s_tree),
        p_def.unflatten(p_tree),
        group,
        owner,
        shared_old,
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
    bring: Any = None,
    send: Any = None,
    keep: Any = None,
) -> Any:
    """The optimizer step one group at a time; for a leafwise optimizer the same bits as
    ``updates, s = optimizer.update(grads, opt_state, params)`` and
    ``optax.apply_updates(params, updates)`` (compiled, one-leaf groups of Adam-like
    optimizers may differ in the update's last bit: see "Bits" in the module docstring).

    Args:
      optimizer: a leafwise optax transformation (see :func:`check_leafwise`).
      grads: the gradient tree.
      opt_state: the optimizer state.
      params: the parameters (fp32 masters under mixed precision).
      groups: a partition of the parameter leaf indices, e.g. from :func:`leaf_groups`.
      owner: :func:`param_leaf_owner` (default: computed here from the trees' shapes).
      sequential: order the groups with ``jax.lax.optimization_barrier``: group ``g + 1``'s
        inputs and group ``g``'s results pass one barrier together, so under ``jit`` group
        ``g + 1`` cannot start (nor its inputs be brought in) before group ``g`` is done.
        The values are the same either way.
      bring: ``bring(leaves, indices, kind) -> leaves``, applied to each group's parameter
        (``kind`` ``"params"``, parameter leaf indices) and owned state leaves (``"state"``,
        state leaf indices) just before its update: e.g. ``jax.device_put`` from host memory.
      send: the same for each group's results right after its update (back to host memory).
      keep: ``keep(new_params, indices) -> values``, applied to the group's new parameters
        before ``send``; what it returns is collected per parameter leaf and returned as a
        third result (e.g. the 16-bit copies the next step computes with, kept in device
        memory while the fp32 masters go back to the host).

    Returns:
      ``(new_params, new_opt_state)`` with the structures of ``params`` and ``opt_state``, and
      with ``keep`` a third element: the tree of what ``keep`` returned.

    Raises:
      ValueError: if ``groups`` is not a partition of the parameter leaf indices.
    """
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


def check_leafwise(
    optimizer: optax.GradientTransformation,
    abstract_params: PyTree,
    *,
    max_elements: int = 1 << 22,
    seed: int = 0,
) -> bool:
    """Raises if grouped updates of ``optimizer`` could differ from its one-call update.

    Two checks, the second only for small trees:

    1. Data flow (any size, no memory): the update's jaxpr at the real shapes is traced and
       every output's dependence on the inputs followed through all equations (into ``jit``,
       ``cond``, ``while`` and ``scan`` bodies; other primitives conservatively make each
       output depend on each input). A parameter's new value or state that depends on another
       parameter's gradient, value or state, or new shared state that depends on any
       parameter's, is a violation. This finds a cross-leaf dependence even where it acts only
       for some values (clipping that would not trigger on the data at hand). It can report a
       dependence that never changes a value (a false alarm), never miss a data dependence.
    2. Values (when params and state together have at most ``max_elements`` elements): one
       step with random gradients on random params (after a first step, so the moments are
       not zero) computed in one call and with each leaf its own group, both under ``jit``,
       compared up to compiler rounding (8 units in the last place of each leaf's largest
       value: XLA may round a one-leaf program differently, see the module docstring; a
       cross-leaf effect moves values far more). This also catches what no data flow shows:
       Python code that reads other leaves' shapes (placeholders change them) or masks that
       change with them.
       Larger trees get only the first check, and a trace of the grouped update at the real
       shapes (``jax.eval_shape``), which catches structural failures but not such values.

    Args:
      optimizer: the optax transformation.
      abstract_params: the params (arrays or ``jax.ShapeDtypeStruct``) at their real shapes;
        shapes are not shrunk, since state shapes (factored moments) depend on them.
      max_elements: the most elements for which the value comparison runs.
      seed: the random values' seed.

    Returns:
      Whether the value comparison ran (``False``: the tree was over ``max_elements`` and only
      the data flow and a trace were checked).

    Raises:
      ValueError: naming the leaves whose update depends on other leaves, or the leaves
        whose grouped result differs, and the fix.
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), abstract_params
    )
    abstract_state = jax.eval_shape(optimizer.init, abstract)
    owner = param_leaf_owner(optimizer, abstract, abstract_state)
    p_paths = _paths(abstract, "params")
    s_paths = _paths(abstract_state, "opt_state")
    _check_data_flow(optimizer, abstract, abstract_state, owner, p_paths, s_paths)

    singletons = [[i] for i in range(len(p_paths))]

    def grouped(g: PyTree, s: PyTree, p: PyTree) -> tuple[PyTree, PyTree]:
        return grouped_update(optimizer, g, s, p, singletons, owner)

    def one_call(g: PyTree, s: PyTree, p: PyTree) -> tuple[PyTree, PyTree]:
        updates, new_state = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), new_state

    want = jax.eval_shape(one_call, abstract, abstract_state, abstract)
    got = jax.eval_shape(grouped, abstract, abstract_state, abstract)
    if jax.tree.structure(want) != jax.tree.structure(got) or not all(
        a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True)
    ):
        raise ValueError(_not_leafwise("the grouped update returns other shapes or dtypes"))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves((abstract, abstract_state)))
    if count > max_elements:
        return False

    keys = iter(jax.random.split(jax.random.key(seed), 3 * len(p_paths) + 1))
    params = jax.tree.map(lambda x: _random(next(keys), x), abstract)
    grads0 = jax.tree.map(lambda x: _random(next(keys), x), abstract)
    grads1 = jax.tree.map(lambda x: _random(next(keys), x), abstract)
    state = optimizer.init(params)
    params, state = jax.jit(one_call)(grads0, state, params)
    want = jax.jit(one_call)(grads1, state, params)
    got = jax.jit(grouped)(grads1, state, params)
    names = p_paths + s_paths
    differ = [
        name
        for name, a, b in zip(names, jax.tree.leaves(want), jax.tree.leaves(got), strict=True)
        if not _rounding_close(_host(a), _host(b))
    ]
    if differ:
        raise ValueError(
            _not_leafwise(
                "one step on random values gives other results when each leaf is updated on "
                f"its own, at {_first(differ)}"
            )
        )
    return True


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


def _first(names: Sequence[str], n: int = 4) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _paths(tree: PyTree, root: str) -> list[str]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    keys = [jax.tree_util.keystr(path, simple=True, separator=".") for path, _ in flat]
    return [f"{root}.{k}" if k else root for k in keys]


def _host(x: Any) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _rounding_close(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal, or (floating point) apart by no more than compiler rounding: 8 units in the last
    place of the leaf's largest magnitude. A cross-leaf effect (clipping, a global scale)
    moves values far more."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.tobytes() == b.tobytes():
        return True
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return False
    x, y = a.astype(np.float64), b.astype(np.float64)
    if not np.array_equal(np.isnan(x), np.isnan(y)):
        return False
    x, y = np.nan_to_num(x), np.nan_to_num(y)
    scale = max(float(np.max(np.abs(x), initial=0.0)), float(np.finfo(np.float64).tiny))
    return bool(np.max(np.abs(x - y)) <= 8 * float(jnp.finfo(a.dtype).eps) * scale)


def _not_leafwise(why: str) -> str:
    return (
        f"The optimizer is not leafwise: {why}. Grouped updates (sub_group_size, NVMe offload) "
        "would change the training. Move cross-leaf transforms such as "
        "optax.clip_by_global_norm out of the chain (use the config's gradient_clipping, "
        "which the step applies before the update), or run without sub_group_size."
    )


def _random(key: jax.Array, x: Any) -> jax.Array:
    dtype = jnp.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jax.random.normal(key, x.shape, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.random.randint(key, x.shape, -8, 8, dtype)
    return jnp.zeros(x.shape, dtype)


def _check_data_flow(
    optimizer: optax.GradientTransformation,
    params: PyTree,
    state: PyTree,
    owner: Sequence[int | None],
    p_paths: list[str],
    s_paths: list[str],
) -> None:
    """Raises if an output of ``optimizer.update`` depends on inputs of another leaf."""
    closed = jax.make_jaxpr(optimizer.update)(params, state, params)
    n = len(p_paths)
    own = [frozenset() if o is None else frozenset([o]) for o in owner]
    leaf = [frozenset([i]) for i in range(n)]
    in_deps = leaf + own + leaf  # grads, state, params (shared state carries no leaf)
    if len(in_deps) != len(closed.jaxpr.invars):
        raise ValueError(
            f"The update's jaxpr has {len(closed.jaxpr.invars)} inputs for {len(in_deps)} "
            "leaves of grads, state and params; its inputs cannot be told apart."
        )
    out_deps = _flow(closed.jaxpr, in_deps)
    out_owner: list[int | None] = list(range(n)) + list(owner)
    if len(out_deps) != len(out_owner):
        raise ValueError(
            _not_leafwise(f"its update returns {len(out_deps) - n} state leaves for {len(owner)}")
        )
    names = [f"the update of {p}" for p in p_paths] + [f"the new {s}" for s in s_paths]
    bad = []
    for name, deps, o in zip(names, out_deps, out_owner, strict=True):
        foreign = sorted(deps - ({o} if o is not None else set()))
        if foreign:
            bad.append(
                f"{name} reads the gradient, value or state of "
                f"{_first([p_paths[i] for i in foreign], 2)}"
            )
    if bad:
        raise ValueError(_not_leafwise("; ".join(bad[:3]) + (" ..." if len(bad) > 3 else "")))


def _flow(jaxpr: Any, in_deps: Sequence[frozenset]) -> list[frozenset]:
    """Per output of ``jaxpr``, the union of the dependence sets of the inputs it reads."""
    env: dict[Any, frozenset] = {}

    def read(v: Any) -> frozenset:
        return frozenset() if isinstance(v, jcore.Literal) else env.get(v, frozenset())

    for v, d in zip(jaxpr.invars, in_deps, strict=True):
        env[v] = d
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _eqn_flow(eqn, ins)
        for v, d in zip(eqn.outvars, outs, strict=True):
            env[v] = d
    return [read(v) for v in jaxpr.outvars]


def _union(sets: Sequence[frozenset]) -> frozenset:
    return frozenset().union(*sets)


def _inner(j: Any) -> Any:
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


def _eqn_flow(eqn: Any, ins: list[frozenset]) -> list[frozenset]:
    """Dependence of one equation's outputs: exact through calls, ``cond``, ``while`` and
    ``scan``; every input to every output for any other primitive."""
    name, params, n_out = eqn.primitive.name, eqn.params, len(eqn.outvars)
    call = next((params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in params), None)
    if name == "cond":
        index, ops = ins[0], ins[1:]
        outs = [_flow(_inner(b), ops) for b in params["branches"]]
        return [index | _union(per_out) for per_out in zip(*outs, strict=True)]
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cconsts, bconsts, carry = ins[:nc], ins[nc : nc + nb], list(ins[nc + nb :])
        while True:
            pred = _flow(_inner(params["cond_jaxpr"]), cconsts + carry)[0]
            body = _flow(_inner(params["body_jaxpr"]), bconsts + carry)
            new = [c | b | pred for c, b in zip(carry, body, strict=True)]
            if new == carry:
                return carry
            carry = new
    if name == "scan":
        nc, nk = params["num_consts"], params["num_carry"]
        consts, carry, xs = ins[:nc], list(ins[nc : nc + nk]), ins[nc + nk :]
        while True:
            out = _flow(_inner(params["jaxpr"]), consts + carry + xs)
            new = [c | o for c, o in zip(carry, out[:nk], strict=True)]
            if new == carry:
                return carry + out[nk:]
            carry = new
    if call is not None and len(_inner(call).invars) == len(ins):
        return _flow(_inner(call), ins)
    every = _union(ins)
    return [every] * n_out
