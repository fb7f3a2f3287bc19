"""Collectives over ZeRO's axes on arrays that are split over other mesh axes too.

Inside the step's ``shard_map`` ZeRO's axes (``data``, ``seq``, ``replica``) are manual and the
others (``model``, a user's own) are left to the compiler, so a model that is written for whole
arrays keeps working (the compiler places tensor parallelism's activation all-reduces). A ZeRO
collective on an array split over such an axis, though, is partitioned by XLA as an all-gather
over that axis first (measured: every gradient's reduce-scatter and every parameter's
all-gather of a ``{data: 4, model: 2}`` GPT step also all-gathered the whole weight over
``model``): the model-axis split would be undone each step.

Decision: :func:`over_axes` runs such a collective in a nested ``shard_map`` that makes the
array's other axes manual too (the context mesh's, as JAX requires), with the array's own spec
on them in and out, so each device reduces or gathers only its own model-axis piece. No data
moves over those axes (measured: the all-gather over ``model`` disappears).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["over_axes", "spec_axes", "trailing_spec"]


def spec_axes(specs: Sequence[Any]) -> frozenset[str]:
    """The mesh axis names the specs (``PartitionSpec`` or entry tuples) use."""
    names: set[str] = set()
    for spec in specs:
        for entry in tuple(spec):
            if entry is None:
                continue
            names.update((entry,) if isinstance(entry, str) else entry)
    return frozenset(names)


def trailing_spec(entries: Sequence[Any], ndim: int) -> P:
    """The spec of an array whose dimensions are the last ``ndim`` of a leaf with per-dimension
    ``entries`` (a scanned layer's slice of a stacked leaf drops the leading ones)."""
    entries = tuple(entries)
    return P(*entries[len(entries) - ndim :]) if ndim else P()


def over_axes(fn: Callable[..., Any], in_specs: Any, out_specs: Any) -> Callable[..., Any]:
    """``fn`` with the mesh axes its specs name made manual too, where there are any.

    Must be called inside ``shard_map`` (ZeRO's axes manual already): the axes named here are
    the others, and ``fn`` sees each device's piece over them.

    Args:
      fn: the collective (any function of arrays).
      in_specs: as ``jax.shard_map`` takes them, naming only axes not yet manual.
      out_specs: as ``in_specs``.

    Returns:
      ``fn`` itself when the specs name no axis, else ``fn`` under a nested ``shard_map``.
    """
    flat = [s for s in jax.tree.leaves((in_specs, out_specs), is_leaf=lambda x: isinstance(x, P))]
    axes = spec_axes(flat)
    if not axes:
        return fn
    return jax.shard_map(
        fn,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=set(axes),
        check_vma=False,
    )
