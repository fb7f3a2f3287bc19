"""Padded shards: where a leaf's sharded dimension rests longer than it is, and back.

Every leaf ZeRO shards is split on one dimension (:mod:`jzero.parallel.zero.leaf_rule`). JAX
requires an array's sharded dimensions to divide evenly wherever it crosses a ``jit`` boundary or
enters ``shard_map``, so a leaf whose dimension the shard count does not divide *rests* padded with
zeros to the next multiple (the plan's ``stored_*`` trees) and is *used* at its logical shape.

Decisions:

* The padding lives only where arrays rest: the :class:`~jzero.step.TrainState`, the gradients
  leaving the reduction, and the local shards inside ``shard_map``. The loss sees the logical
  parameters (stage 3's gather drops the padding after the all-gather,
  :mod:`jzero.rewrite.pending`), and the optax update runs on the logical shapes
  (:func:`to_logical` inside the step), laid out with the plan's own shardings, which ``jit``
  allows to be uneven inside a program. So every optax transform computes what it computes on
  one device (Adafactor's factored means, LAMB's norms, a per-leaf RMS), and no gradient, norm,
  clip or update ever reads a padded element. A padded element is a zero: the transpose of
  the gather's slice, and :func:`to_stored`, put zeros there.
* A leaf whose gradient and state rest with merged leading dimensions
  (:mod:`jzero.parallel.zero.leaf_rule`) is reshaped to its logical shape inside the step and left
  in the layout the reshape gives (tiles of its leading dimensions), never constrained to one that
  would move data.
* Slicing a padded array to its logical shape under the same sharding, and padding it back,
  is a local operation on each device: on 8 CPU devices an AdamW update on a 50,257-row leaf
  through both compiles to no collective and no copy (measured).
* Outside the step (``engine.params``, ``engine.opt_state``, checkpoints, exports) a padded
  leaf is handed out at its logical shape by :func:`logical_copies`: one jitted slice into a
  layout ``jit`` accepts for the logical shape (the data axis moved to a dimension it divides,
  else that leaf whole). Leaves without padding are handed out as they are, no copy.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.parallel.zero.leaf_rule import divisible_dim, pad_to, unpad_to

__all__ = [
    "cut_leaf",
    "even_sharding",
    "logical_copies",
    "to_logical",
    "to_stored",
    "update_view",
]

PyTree = Any


def to_stored(tree: PyTree, stored: PyTree) -> PyTree:
    """Inside ``jit``: every leaf of ``tree`` padded with zeros to its shape in ``stored``
    (a tree of ``ShapeDtypeStruct`` of the same structure)."""
    return jax.tree.map(lambda x, s: pad_to(x, tuple(s.shape)), tree, stored)


def cut_leaf(x: jax.Array, shape: tuple[int, ...], sharding: Any = None) -> jax.Array:
    """Inside ``jit``: one leaf cut to its logical ``shape``, laid out by ``sharding`` (uneven
    where the shard count does not divide; ``jit`` allows that inside a program); a merged view
    keeps the layout its reshape has. A leaf already logical passes unchanged."""
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    y = unpad_to(x, shape)
    if sharding is None or y.ndim != x.ndim:
        return y
    return jax.lax.with_sharding_constraint(y, sharding)


def update_view(x: jax.Array, shape: tuple[int, ...], stored: tuple[int, ...], sharding: Any):
    """Inside ``jit``: a parameter (whole, or resting as its shards) cut to the update layout
    ``sharding`` as its master weights rest (``stored``: padded, merged), with no
    communication, then viewed at its logical ``shape``: what the optax update runs on where
    the params are the masters (no mixed precision)."""
    resting = jax.lax.with_sharding_constraint(pad_to(unpad_to(x, shape), stored), sharding)
    return cut_leaf(resting, shape, sharding)


def to_logical(tree: PyTree, logical: PyTree, shardings: PyTree | None = None) -> PyTree:
    """Inside ``jit``: :func:`cut_leaf` on every leaf of ``tree``, to its shape in ``logical``,
    laid out by ``shardings`` when given."""
    if shardings is None:
        return jax.tree.map(lambda x, s: cut_leaf(x, s.shape), tree, logical)
    return jax.tree.map(lambda x, s, sh: cut_leaf(x, s.shape, sh), tree, logical, shardings)


def even_sharding(shape: tuple[int, ...], sharding: NamedSharding) -> NamedSharding:
    """A sharding ``jit`` accepts at the boundary for ``shape``: ``sharding`` itself where every
    sharded dimension divides; else each uneven dimension's axes moved to a free dimension they
    divide, or dropped (that leaf then whole over them)."""
    mesh = sharding.mesh
    entries = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))

    def count(e: Any) -> int:
        names = (e,) if isinstance(e, str) else tuple(e)
        total = 1
        for a in names:
            total *= int(mesh.shape[a])
        return total

    for d, e in enumerate(entries):
        if e is None or shape[d] % count(e) == 0:
            continue
        entries[d] = None
        free = [x is None for x in entries]
        to = divisible_dim(shape, count(e), free)
        if to is not None:
            entries[to] = e
    while entries and entries[-1] is None:
        entries.pop()
    return NamedSharding(mesh, P(*entries), memory_kind=sharding.memory_kind)


def logical_copies(tree: PyTree, logical: PyTree, shardings: PyTree) -> PyTree:
    """``tree`` (resting arrays, some padded) at its logical shapes, outside ``jit``: padded
    leaves are cut by one jitted program into :func:`even_sharding` layouts (compiled once per
    set of shapes and layouts, so reading ``engine.params`` again compiles nothing); the others
    are returned as they are (no copy)."""
    leaves, treedef = jax.tree.flatten(tree)
    shapes = [tuple(s.shape) for s in jax.tree.leaves(logical)]
    shs = jax.tree.leaves(shardings)
    todo = [i for i, (x, s) in enumerate(zip(leaves, shapes, strict=True)) if x.shape != s]
    if not todo:
        return tree
    outs = tuple(even_sharding(shapes[i], shs[i]) for i in todo)
    cut = _cutter(tuple(shapes[i] for i in todo), outs)([leaves[i] for i in todo])
    out = list(leaves)
    for i, x in zip(todo, cut, strict=True):
        out[i] = x
    return treedef.unflatten(out)


@functools.lru_cache(maxsize=64)
def _cutter(shapes: tuple[tuple[int, ...], ...], outs: tuple[NamedSharding, ...]) -> Any:
    """The jitted cut of resting leaves to ``shapes``, laid out by ``outs``."""
    return jax.jit(
        lambda xs: [unpad_to(x, shape) for x, shape in zip(xs, shapes, strict=True)],
        out_shardings=list(outs),
    )
