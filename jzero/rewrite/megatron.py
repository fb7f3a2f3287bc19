"""Megatron's tensor-parallel pairs read from a traced loss: which dimension of which weight to
split over the model axis, for a model whose weights carry its author's own names.

:func:`program_splits` traces the loss on abstract params and batch and follows every array
dimension through the program. A weight whose matmul output dimension flows (through
elementwise ops, reshapes and transposes into heads, attention's matmuls and softmax) into a
second matmul that contracts it against another weight is split column-wise there, the second
weight row-wise on that contracted dimension: Megatron's pair, whose only communication is the
all-reduce after the row-parallel matmul.

Decisions:

* **Dimensions are joined, not typed.** Every dimension of every value gets a class (a
  union-find over dimensions): an elementwise op joins its operands' dimensions, a matmul its
  batch and contracted dimensions, a reshape carries a dimension into the major part it splits
  into (``[.., H*Dh] -> [.., H, Dh]``: heads), a scan its stacked weights' per-layer slices
  into its body. A class is one splittable "channel": splitting it on every value at once is
  what tensor parallelism does.
* **A channel is a Megatron pair** when some weight produces it (a matmul's free dimension),
  some weight contracts it against an activation (a row-parallel matmul), and nothing else
  mixes along it: a reduction (a norm's mean, the softmax over the vocabulary) or a
  contraction of two activations (attention's scores over ``Dh``) would need a collective
  within the layer, so such a channel stays whole. The model's hidden dimension is such a
  channel (every norm reduces it): it is never split.
* **Largest channel first.** A weight takes part in at most one split: the channels are taken
  by how many weights they split (attention's heads, q, k, v and the output together, before
  ``Dh`` of v alone), a channel whose weight another took is skipped whole. Other leaves in a
  taken channel (a column bias, a per-head scale) follow it.
* **Embeddings and output heads** as the name rules split them: a weight read by a gather
  (``jnp.take``) is split on the gathered (vocabulary) dimension; a weight whose one output
  dimension only the loss reduces (the softmax over the vocabulary), with no weight contracting
  it, on that output dimension.
* **Conservative by default**: an operation this reading does not know gives fresh
  dimensions, so a pair through it is not found (its weights stay replicated) rather than
  guessed. Splitting is a layout only: the compiler keeps any split numerically exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

__all__ = ["ProgramSplit", "program_splits", "splits_of_jaxpr"]

_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
           "argmax", "argmin", "reduce_xor"}  # fmt: skip
_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
_LAYOUT = {"convert_element_type", "copy", "transpose", "reshape", "squeeze",
           "broadcast_in_dim", "slice", "dynamic_slice", "reduce_precision",
           "stop_gradient", "sharding_constraint"}  # fmt: skip
_INNER = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@dataclass(frozen=True)
class ProgramSplit:
    """How the traced program says one leaf is split over the model axis.

    Attributes:
      kind: ``"column"``, ``"row"``, ``"column bias"`` (a leaf that follows a column split),
        ``"vocab"`` (a gathered table's rows) or ``"vocab head"``.
      dim: the leaf's dimension split.
      group: the channel's id: the leaves of one pair share it (and are split or kept whole
        together).
    """

    kind: str
    dim: int
    group: int


class _Classes:
    """The union-find over dimensions, with what each class has met."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.bad: dict[int, set[str]] = {}
        self.owner: dict[int, tuple[int, int]] = {}  # a parameter's own dimension

    def new(self, owner: tuple[int, int] | None = None) -> int:
        self.parent.append(len(self.parent))
        if owner is not None:
            self.owner[len(self.parent) - 1] = owner
        return len(self.parent) - 1

    def find(self, a: int) -> int:
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: int | None, b: int | None) -> int | None:
        if a is None or b is None:
            return a if b is None else b
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            self.bad.setdefault(ra, set()).update(self.bad.pop(rb, set()))
        return ra

    def flag(self, a: int | None, why: str) -> None:
        if a is not None:
            self.bad.setdefault(self.find(a), set()).add(why)

    def flags(self, a: int) -> set[str]:
        return self.bad.get(self.find(a), set())


@dataclass
class _Reading:
    """What the walk records: the classes, each matmul's column and row uses of a weight
    (``(leaf, node)``), the gathered tables (``leaf -> node``)."""

    classes: _Classes
    cols: list[tuple[int, int]]
    rows: list[tuple[int, int]]
    gathered: dict[int, int]


Dims = tuple  # one class id (or None: unknown) per dimension of a value


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _reshape(dims: Dims, old: Sequence[int], new: Sequence[int]) -> Dims:
    """A reshape's dimensions: each group of old dims that becomes a group of new dims of the
    same size hands its major (first non-1) dimension's class to the new group's major one."""
    out: list[int | None] = [None] * len(new)
    i = j = 0
    while i < len(old) or j < len(new):
        gi, gj, a, b = [i], [j], old[i] if i < len(old) else 1, new[j] if j < len(new) else 1
        i, j = i + 1, j + 1
        while a != b:
            if a < b and i < len(old):
                gi.append(i)
                a *= old[i]
                i += 1
            elif j < len(new):
                gj.append(j)
                b *= new[j]
                j += 1
            else:
                return tuple(out)
        src = next((k for k in gi if k < len(old) and old[k] > 1), None)
        dst = next((k for k in gj if k < len(new) and new[k] > 1), None)
        if src is not None and dst is not None:
            out[dst] = dims[src]
    return tuple(out)


def _inner(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """The jaxpr (and its consts) a call-like eqn runs on its own invars, or None."""
    for key in _INNER:
        inner = eqn.params.get(key)
        if inner is None or callable(inner) and not hasattr(inner, "jaxpr"):
            continue
        jaxpr, consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, ())
        if hasattr(jaxpr, "eqns") and len(jaxpr.invars) == len(eqn.invars):
            return jaxpr, consts
    return None


class _Walk:
    """Follows every dimension through a jaxpr (and the jaxprs it calls)."""

    def __init__(self, reading: _Reading) -> None:
        self.r = reading
        self.c = reading.classes

    def run(self, jaxpr: Any, ins: Sequence[Dims], views: Sequence[int | None]) -> list:
        """The output dims (and weight views) of ``jaxpr`` given its invars' ``ins``."""
        env: dict[Any, Dims] = {}
        view: dict[Any, int] = {}
        for v in jaxpr.constvars:
            env[v] = (None,) * len(_shape(v))
        for v, d, w in zip(jaxpr.invars, ins, views, strict=True):
            env[v] = d
            if w is not None:
                view[v] = w
        for eqn in jaxpr.eqns:
            dims = [self._dims(env, v) for v in eqn.invars]
            ws = [None if isinstance(v, jex_core.Literal) else view.get(v) for v in eqn.invars]
            outs, out_views = self.eqn(eqn, dims, ws)
            for v, d, w in zip(eqn.outvars, outs, out_views, strict=True):
                env[v] = d
                if w is not None:
                    view[v] = w
        return [
            (self._dims(env, v), None if isinstance(v, jex_core.Literal) else view.get(v))
            for v in jaxpr.outvars
        ]

    @staticmethod
    def _dims(env: dict[Any, Dims], v: Any) -> Dims:
        if isinstance(v, jex_core.Literal):
            return (None,) * len(np.shape(v.val))
        return env[v]

    def eqn(self, eqn: Any, ins: list[Dims], views: list[int | None]) -> tuple[list, list]:
        name = eqn.primitive.name
        outs = [_shape(v) for v in eqn.outvars]
        none = [(None,) * len(s) for s in outs]
        first_view = views[0] if views else None
        if name == "scan":
            return self._scan(eqn, ins, views)
        if name == "cond":
            return self._cond(eqn, ins, views)
        inner = _inner(eqn)
        if inner is not None:
            got = self.run(inner[0], ins, views)
            return [d for d, _ in got], [w for _, w in got]
        if name == "dot_general":
            return [self._dot(eqn, ins, views)], [None]
        if name == "gather":
            return [self._gather(eqn, ins, views)], [None]
        if len(outs) != 1:
            return none, [None] * len(outs)
        d = self._one(eqn, name, ins, _shape(eqn.invars[0]) if eqn.invars else (), outs[0])
        return [d], [first_view if name in _LAYOUT else None]

    def _one(self, eqn: Any, name: str, ins: list[Dims], old: tuple, new: tuple) -> Dims:
        c, p = self.c, eqn.params
        if name == "transpose":
            return tuple(ins[0][k] for k in p["permutation"])
        if name == "reshape":
            return _reshape(ins[0], old, new)
        if name == "squeeze":
            gone = {k % len(old) for k in p["dimensions"]}
            return tuple(d for k, d in enumerate(ins[0]) if k not in gone)
        if name == "broadcast_in_dim":
            out: list[int | None] = [None] * len(new)
            for k, to in enumerate(p["broadcast_dimensions"]):
                if old[k] == new[to]:
                    out[to] = ins[0][k]
            return tuple(out)
        if name in ("slice", "dynamic_slice"):
            return tuple(d if a == b else None for d, a, b in zip(ins[0], old, new, strict=True))
        if name in _REDUCE:
            axes = set(p["axes"])
            for k in axes:
                c.flag(ins[0][k], "reduced")
            return tuple(d for k, d in enumerate(ins[0]) if k not in axes)
        if name in _CUMULATIVE:
            c.flag(ins[0][p["axis"]], "reduced")
            return ins[0]
        if name == "concatenate":
            return tuple(
                None if k == p["dimension"] else _join(c, [d[k] for d in ins])
                for k in range(len(new))
            )
        if name == "pad":
            cfg = p["padding_config"]
            return tuple(d if tuple(cfg[k]) == (0, 0, 0) else None for k, d in enumerate(ins[0]))
        if name == "dynamic_update_slice":
            upd = _shape(eqn.invars[1])
            for k, (a, b) in enumerate(zip(old, upd, strict=True)):
                if a == b:
                    c.union(ins[0][k], ins[1][k])
            return tuple(c.find(d) if d is not None else None for d in ins[0])
        shapes = [_shape(v) for v in eqn.invars]
        if shapes and all(_broadcasts(s, new) for s in shapes):  # elementwise
            return tuple(
                _join(c, [d[k] for d, s in zip(ins, shapes, strict=True) if s and s[k] == n])
                for k, n in enumerate(new)
            )
        return (None,) * len(new)

    def _dot(self, eqn: Any, ins: list[Dims], views: list[int | None]) -> Dims:
        c, r = self.c, self.r
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        lw, rw = views
        for a, b in zip(lc, rc, strict=True):
            if (lw is None) == (rw is None):
                c.flag(_join(c, [lhs[a], rhs[b]]), "contracted")
                continue
            w, node = (lw, lhs[a]) if lw is not None else (rw, rhs[b])
            c.union(lhs[a], rhs[b])
            if node is not None:
                r.rows.append((w, node))
        batch = tuple(_join(c, [lhs[a], rhs[b]]) for a, b in zip(lb, rb, strict=True))
        free_l = tuple(d for k, d in enumerate(lhs) if k not in lc and k not in lb)
        free_r = tuple(d for k, d in enumerate(rhs) if k not in rc and k not in rb)
        for w, free in ((lw, free_l), (rw, free_r)):
            if w is not None and (lw is None) != (rw is None):
                r.cols.extend((w, node) for node in free if node is not None)
        return batch + free_l + free_r

    def _gather(self, eqn: Any, ins: list[Dims], views: list[int | None]) -> Dims:
        p = eqn.params
        dn, sizes = p["dimension_numbers"], p["slice_sizes"]
        operand = ins[0]
        old = _shape(eqn.invars[0])
        picked = [k for k in dn.start_index_map if sizes[k] < old[k]]  # the rows it picks
        if views[0] is not None:
            for k in picked:
                if operand[k] is not None:
                    self.r.gathered.setdefault(views[0], operand[k])
        else:
            for k in picked:
                self.c.flag(operand[k], "reduced")  # picks along it: a per-shard select
        out: list[int | None] = [None] * len(_shape(eqn.outvars[0]))
        kept = [
            k
            for k in range(len(old))
            if k not in dn.collapsed_slice_dims and k not in dn.operand_batching_dims
        ]
        for k, to in zip(kept, dn.offset_dims, strict=True):
            if sizes[k] == old[k]:
                out[to] = operand[k]
        return tuple(out)

    def _scan(self, eqn: Any, ins: list[Dims], views: list[int | None]) -> tuple[list, list]:
        p = eqn.params
        body = p["jaxpr"]
        n_c, n_carry = p["num_consts"], p["num_carry"]
        inner = [d if k < n_c + n_carry else d[1:] for k, d in enumerate(ins)]
        got = self.run(body.jaxpr, inner, views)
        outs = []
        for k, (d, _) in enumerate(got):
            if k < n_carry:
                carried = zip(d, ins[n_c + k], strict=True)
                outs.append(tuple(_join(self.c, [a, b]) for a, b in carried))
            else:
                outs.append((None, *d))
        return outs, [None] * len(outs)

    def _cond(self, eqn: Any, ins: list[Dims], views: list[int | None]) -> tuple[list, list]:
        branches = [self.run(b.jaxpr, ins[1:], views[1:]) for b in eqn.params["branches"]]
        outs = []
        for k, v in enumerate(eqn.outvars):
            outs.append(
                tuple(_join(self.c, [b[k][0][i] for b in branches]) for i in range(len(_shape(v))))
            )
        return outs, [None] * len(outs)


def _broadcasts(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    """Whether an elementwise op's operand of ``shape`` reaches ``out`` (a scalar, or each dim
    equal or 1)."""
    return not shape or (
        len(shape) == len(out) and all(a in (b, 1) for a, b in zip(shape, out, strict=True))
    )


def _join(c: _Classes, nodes: Sequence[int | None]) -> int | None:
    out = None
    for n in nodes:
        out = c.union(out, n)
    return out


def splits_of_jaxpr(jaxpr: Any, num_params: int) -> dict[int, ProgramSplit]:
    """The splits of the first ``num_params`` invars of ``jaxpr`` (a closed jaxpr), by leaf
    index; a leaf absent is not split by the program."""
    classes = _Classes()
    reading = _Reading(classes, [], [], {})
    ins: list[Dims] = []
    for k, v in enumerate(jaxpr.jaxpr.invars):
        own = k < num_params
        ins.append(tuple(classes.new((k, i) if own else None) for i in range(len(_shape(v)))))
    views = [k if k < num_params else None for k in range(len(ins))]
    _Walk(reading).run(jaxpr.jaxpr, ins, views)
    return _choose(reading, [len(_shape(v)) for v in jaxpr.jaxpr.invars[:num_params]])


def _choose(reading: _Reading, ranks: Sequence[int]) -> dict[int, ProgramSplit]:
    """The channels taken, largest first; then the gathered tables and the output heads."""
    c = reading.classes
    members: dict[int, list[tuple[int, int]]] = {}
    for node, owner in c.owner.items():
        members.setdefault(c.find(node), []).append(owner)
    uses: dict[int, dict[str, set[int]]] = {}
    for kind, found in (("column", reading.cols), ("row", reading.rows)):
        for leaf, node in found:
            if c.owner.get(node, (None,))[0] == leaf:
                uses.setdefault(c.find(node), {"column": set(), "row": set()})[kind].add(leaf)
    taken: dict[int, ProgramSplit] = {}
    gathered = {leaf: c.owner[n][1] for leaf, n in reading.gathered.items() if n in c.owner}
    for leaf, dim in gathered.items():
        taken[leaf] = ProgramSplit("vocab", dim, -1 - leaf)
    candidates = []
    for root, use in uses.items():
        leaves = [leaf for leaf, _ in members.get(root, [])]
        if len(leaves) != len(set(leaves)) or use["column"] & use["row"]:
            continue  # a leaf with two dims in one channel, or both sides of it
        flags = c.flags(root)
        if not flags and use["column"] and use["row"]:
            candidates.append((-len(use["column"] | use["row"]), root))
        elif flags == {"reduced"} and len(use["column"]) == 1 and not use["row"]:
            (leaf,) = use["column"]
            if ranks[leaf] >= 2 and leaf not in taken:  # an output head
                candidates.append((1, root))
    for _, root in sorted(candidates):
        use, leaves = uses[root], members[root]
        if any(leaf in taken for leaf, _ in leaves):
            continue
        head = not use["row"]
        for leaf, dim in leaves:
            kind = "row" if leaf in use["row"] else "column" if leaf in use["column"] else None
            if head:
                kind = "vocab head" if leaf in use["column"] else "vocab head bias"
            taken[leaf] = ProgramSplit(kind or "column bias", dim, root)
    return taken


def program_splits(loss_fn: Callable[..., Any], params: Any, *args: Any) -> dict[int, ProgramSplit]:
    """Megatron's splits of ``params``' leaves, read from ``loss_fn(params, *args)`` traced on
    shapes (nothing runs).

    Args:
      loss_fn: the loss, ``loss_fn(params, *args)``.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      *args: the loss's other arguments (a batch), arrays or ``jax.ShapeDtypeStruct``.

    Returns:
      ``{leaf index: ProgramSplit}`` in ``jax.tree.leaves(params)`` order; a leaf absent stays
      whole over the model axis.
    """
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (params, args))
    num = len(jax.tree.leaves(params))
    closed = jax.make_jaxpr(lambda p, a: loss_fn(p, *a))(*shapes)
    return splits_of_jaxpr(closed, num)
