"""Which parameter leaves form a group, and which optimizer-state leaves each group owns.

The grouping half of :mod:`jzero.subgroups` (DeepSpeed's ``sub_group_size``); the update of one
group is :mod:`jzero.subgroups.update`.

Decisions:

* Groups are consecutive runs of parameter leaves (``jax.tree.leaves`` order) of at most
  ``sub_group_size`` elements (:func:`leaf_groups`); a leaf is never split, and a leaf larger
  than the limit is a group of its own, as in DeepSpeed.
* Which state leaf belongs to which parameter comes from ``optax.tree_map_params`` over a tree
  of leaf indices (:func:`param_leaf_owner`), as in :mod:`jzero.plan`; state of another shape
  (factored moments) still belongs to its parameter. State that is no parameter's (step counts,
  injected hyperparameters, RNG keys) is *shared* (:func:`shared_state`): every group's call
  gets its old value, and its new value is taken from the first group's call.
* A caller that needs the bits of the one-call update keeps every group at two leaves or more
  (:func:`merge_single_leaf_groups`; see "Bits" in :mod:`jzero.subgroups.update`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import optax

__all__ = [
    "leaf_groups",
    "merge_single_leaf_groups",
    "owned_state",
    "param_leaf_owner",
    "shared_state",
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
    """``groups`` with no one-leaf group, when there are two leaves: one-leaf groups in a row
    pair up, and one left alone joins a neighbour (the previous group, or the next for the
    first). Groups of leaves at ``sub_group_size`` each thus become pairs, not one group.

    Compiled, a one-leaf group of an Adam-like optimizer may round its update's last bit
    differently from the one-call update (see "Bits" in :mod:`jzero.subgroups.update`); groups
    of two leaves or more gave the one-call bits. The price: such a group holds one more leaf
    than ``sub_group_size`` allows.
    """
    out: list[list[int]] = []
    for group in groups:  # one-leaf groups in a row pair up
        if not len(group):
            continue
        if len(group) == 1 and out and len(out[-1]) == 1:
            out[-1] = out[-1] + list(group)
        else:
            out.append(list(group))
    i = 0  # a one-leaf group left between larger ones joins its neighbour
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
