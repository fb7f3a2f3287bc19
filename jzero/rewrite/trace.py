"""Reading and re-emitting a traced loss: the tools :mod:`jzero.rewrite.gather` replays it with.

* :func:`bind` re-emits one eqn; :func:`inner_jaxpr` opens a nested ``jit``/``closed_call``;
  :func:`inline_calls` flattens a program so its layers can be found whatever calls it makes.
* :func:`tied` and :func:`tie_all` make a value depend on one element of another (its value
  unchanged): that orders work (a gather cannot start before its anchor exists) and makes a
  recomputation a different value, which XLA's CSE cannot merge back into the forward pass.
* The layers of a model written as a Python loop (:func:`layer_keys`, :func:`find_layers`) and
  their rematerialisation (:func:`remat_layer`): see :mod:`jzero.rewrite.remat` for the rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.ad_checkpoint
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.rewrite.remat import ACTIVATION, LAYER_INPUT, RematPolicy

__all__ = [
    "STAGE_MARK",
    "Partition",
    "Segment",
    "bind",
    "remat_layer",
    "eval_tagged",
    "find_layers",
    "first_element",
    "free_vars",
    "has_scan",
    "inline_calls",
    "inner_jaxpr",
    "is_floating",
    "layer_keys",
    "named",
    "needed_eqns",
    "read",
    "run_eqns",
    "tie_all",
    "tie_to",
    "tied",
]

STAGE_MARK = "jzero_pipeline_stage"
"""The ``checkpoint_name`` a stage unit gives its first/last-stage predicates: a ``cond`` on
them takes the same branch on every device of a stage, so the replay gathers a parameter only
in the branch that reads it (:mod:`jzero.rewrite.interpreter`); the pipeline's
:func:`jzero.parallel.pipeline.stage_unit` sets it."""


def first_element(anchor: Any) -> Any:
    """One element of the first floating array in ``anchor`` (a pytree), or None."""
    for x in jax.tree.leaves(anchor):
        if is_floating(x) and getattr(x, "size", 0):
            return x.reshape(-1)[0]
    return None


def tie_to(shard: Any, first: Any) -> Any:
    """``shard`` made to depend on ``first``, one element (from :func:`first_element`, or
    None), its value unchanged."""
    if first is None or not is_floating(shard):
        return shard
    return shard + (first != first).astype(shard.dtype) * 0  # 0 even for inf or NaN


def tied(shard: Any, anchor: Any) -> Any:
    """``shard`` made to depend on one element of ``anchor`` (its value unchanged): a gather of
    it cannot start before ``anchor`` exists, and two such gathers are never merged."""
    return tie_to(shard, first_element(anchor))


def tie_all(tree: Any, anchor: Any) -> Any:
    """Every floating leaf of ``tree`` tied to ``anchor`` (see :func:`tied`)."""
    first = first_element(anchor)
    if first is None:
        return tree
    return jax.tree.map(
        lambda x: x + (first != first).astype(x.dtype) * 0 if is_floating(x) else x, tree
    )


def bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older JAX returns (subfuns, params)
        subfuns, params = params
        invals = [*subfuns, *invals]
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def read(env: dict[Any, Any], v: Any) -> Any:
    """A variable's value in ``env``, or a literal's own."""
    return v.val if isinstance(v, jex_core.Literal) else env[v]


def run_eqns(eqns: Sequence[Any], env: dict[Any, Any]) -> dict[Any, Any]:
    """Evaluates ``eqns`` in order into ``env`` (returned)."""
    for e in eqns:
        env.update(zip(e.outvars, bind(e, [read(env, v) for v in e.invars]), strict=True))
    return env


def free_vars(reads: Sequence[Any], defined: set[Any]) -> list[Any]:
    """The variables among ``reads`` not in ``defined`` (no literals), once each, in order."""
    kept = (v for v in reads if not isinstance(v, jex_core.Literal) and v not in defined)
    return list(dict.fromkeys(kept))


def needed_eqns(eqns: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
    """The equations among ``eqns`` that ``outs`` depend on, in order."""
    want = {v for v in outs if not isinstance(v, jex_core.Literal)}
    keep = []
    for e in reversed(eqns):
        if any(v in want for v in e.outvars):
            keep.append(e)
            want.update(v for v in e.invars if not isinstance(v, jex_core.Literal))
    return keep[::-1]


_CALLS = ("pjit", "jit", "closed_call")

PASS_THROUGH = ("convert_element_type", "copy", "copy_p")
"""Primitives a parameter passes through unchanged in identity (a dtype cast, a copy): what
it feeds after one is still that parameter, for finding which leaves a scan consumes."""


def inner_jaxpr(eqn: Any) -> Any:
    """The closed jaxpr a call eqn (``jit``, ``closed_call``) runs, or None."""
    if eqn.primitive.name not in _CALLS:
        return None
    inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    return inner if hasattr(inner, "jaxpr") else None


def has_scan(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` runs a scan at its top level or inside calls (not inside other
    higher-order primitives, which the replay leaves as written)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            return True
        inner = inner_jaxpr(eqn)
        if inner is not None and has_scan(inner.jaxpr):
            return True
    return False


def is_floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)


def named(x: Any, name: str) -> Any:
    return jax.ad_checkpoint.checkpoint_name(x, name) if is_floating(x) else x


def eval_tagged(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], live: Sequence[bool]):
    """Evaluates ``jaxpr``, naming :data:`~jzero.rewrite.remat.ACTIVATION` every floating value that
    depends on an argument flagged in ``live`` (calls are inlined, so their insides too)."""
    env: dict[Any, Any] = {}
    tainted: set[Any] = set()

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    def is_live(v: Any) -> bool:
        return not isinstance(v, jex_core.Literal) and v in tainted

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x, flag in zip(jaxpr.invars, args, live, strict=True):
        env[v] = x
        if flag:
            tainted.add(v)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        flags = [is_live(v) for v in eqn.invars]
        inner = inner_jaxpr(eqn)
        if not any(flags):
            outs = bind(eqn, invals)
        elif inner is not None:
            outs = eval_tagged(inner.jaxpr, inner.consts, invals, flags)
        else:
            outs = [named(x, ACTIVATION) for x in bind(eqn, invals)]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
            if any(flags):
                tainted.add(v)
    return [read(v) for v in jaxpr.outvars]


# Layers of a model written as a Python loop: found in the trace, checkpointed one by one.


def inline_calls(closed: Any, *, remat: bool = False) -> Any:
    """``closed`` with every nested ``jit``/``closed_call`` inlined: one flat list of eqns, so
    layer boundaries can be found whatever calls the model makes; with ``remat`` the
    checkpointed (``remat``) regions too (a pullback's, whose equations are then cut apart)."""

    def opened(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
        if remat and eqn.primitive.name == "remat2":
            return eqn.params["jaxpr"], ()
        inner = inner_jaxpr(eqn)
        return (inner.jaxpr, inner.consts) if inner is not None else None

    def run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for eqn in jaxpr.eqns:
            invals = [read(env, v) for v in eqn.invars]
            inner = opened(eqn)
            outs = run(*inner, invals) if inner else bind(eqn, invals)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(env, v) for v in jaxpr.outvars]

    if not any(opened(eqn) is not None for eqn in closed.jaxpr.eqns):
        return closed
    avals = [v.aval for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *a: run(closed.jaxpr, closed.consts, a))(
        *[jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    )


_NUMBERED = re.compile(r"(.*_)?\d+")


def layer_keys(params: Any) -> list[str | None]:
    """Per leaf of ``params``, the layer it belongs to, read from its path: the path up to its
    first numbered part (a list index, ``layers_3``, an ``nnx.List`` index), e.g.
    ``params/layers_3`` for ``params/layers_3/attn/kernel``; ``None`` for a leaf with no
    numbered part (an embedding, a final norm)."""
    keys: list[str | None] = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        parts, key = [], None
        for entry in path:
            name = next(
                (getattr(entry, a) for a in ("key", "idx", "name") if hasattr(entry, a)), entry
            )
            parts.append(str(name))
            if isinstance(name, int) or _NUMBERED.fullmatch(str(name)):
                key = "/".join(parts)
                break
        keys.append(key)
    return keys


@dataclass(frozen=True)
class Segment:
    """Eqns ``[start, stop)`` of a flat jaxpr (one layer), with the values they read from
    before (``live_in``) and the values read after them (``live_out``)."""

    start: int
    stop: int
    live_in: tuple[Any, ...]
    live_out: tuple[Any, ...]
    activations_in: tuple[bool, ...] = ()  # per live_in: depends on the non-parameter inputs


def find_layers(jaxpr: Any, keys: Sequence[str | None]) -> dict[int, Segment]:
    """The layers of a model written as a Python loop, by start eqn (empty for a model whose
    parameters reach a ``scan``: there the scan body is the layer).

    ``jaxpr`` is flat (:func:`inline_calls`); its first ``len(keys)`` inputs are the parameter
    leaves, with their :func:`layer_keys`. A layer's *uses* are the eqns that combine one of its
    parameters (or a value computed from parameters alone, such as a cast) with a value that
    depends on the other inputs (the activations). Layer ``i`` runs from its first use to the
    first use of layer ``i + 1``, so what sits between (a residual add, a norm without
    parameters) belongs to the layer before; the last layer ends at its last use.
    """
    num = len(keys)
    # Values computed from parameters alone, with the layers they belong to (None: none).
    origin: dict[Any, frozenset[str | None]] = {}
    live: set[Any] = set()
    for i, v in enumerate(jaxpr.invars):
        if i < num:
            origin[v] = frozenset((keys[i],))
        else:
            live.add(v)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
        layers = frozenset().union(*(origin.get(v, frozenset()) for v in ins))
        active = any(v in live for v in ins)
        if layers and eqn.primitive.name == "scan":
            return {}
        if layers and active:
            for key in layers - {None}:
                first.setdefault(key, k)
                last[key] = k
        elif layers and eqn.primitive.name == "slice" and len(ins) == 1:
            # One slice of a stacked parameter (``p["w"][i]`` in a loop) is a layer of its own.
            start, stop = eqn.params["start_indices"][0], eqn.params["limit_indices"][0]
            if stop - start == 1 and eqn.invars[0].aval.shape[0] > 1:
                layers = frozenset(f"{key or ''}[{start}]" for key in layers)
        for v in eqn.outvars:
            if active:
                live.add(v)
            elif layers:
                origin[v] = layers
    if len(first) < 2:
        return {}
    order = sorted(first, key=first.__getitem__)
    starts = [first[key] for key in order]
    stops = [*starts[1:], last[order[-1]] + 1]
    defined: dict[Any, int] = {}
    last_read: dict[Any, int] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal):
                last_read[v] = k
        for v in eqn.outvars:
            defined[v] = k
    for v in jaxpr.outvars:
        if not isinstance(v, jex_core.Literal):
            last_read[v] = len(jaxpr.eqns)
    found: dict[int, Segment] = {}
    for a, b in zip(starts, stops, strict=True):
        if b <= a:
            continue
        live_in: dict[Any, None] = {}
        live_out: dict[Any, None] = {}
        for eqn in jaxpr.eqns[a:b]:
            for v in eqn.invars:
                if not isinstance(v, jex_core.Literal) and defined.get(v, -1) < a:
                    live_in[v] = None
            for v in eqn.outvars:
                if last_read.get(v, -1) >= b:
                    live_out[v] = None
        activations = tuple(v in live for v in live_in)
        found[a] = Segment(a, b, tuple(live_in), tuple(live_out), activations)
    return found


@dataclass(frozen=True)
class Partition:
    """DeepSpeed's ``partition_activations`` on a mesh with model-parallel axes: a layer's
    saved input is sharded over ``axes`` (each device of a model-parallel group keeps a slice)
    and gathered back before the layer is recomputed.

    Attributes:
      mesh: the training mesh (its data axis is manual inside the step's ``shard_map``).
      axes: the mesh axes besides the data axis that have more than one device.
    """

    mesh: Any
    axes: tuple[str, ...]

    @property
    def size(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.axes]))

    def dim(self, x: Any) -> int | None:
        """The dimension of ``x`` split over the axes: the last one they divide."""
        for d in reversed(range(getattr(x, "ndim", 0))):
            if x.shape[d] % self.size == 0 and x.shape[d] >= self.size:
                return d
        return None

    def split(self, x: Any) -> Any:
        d = self.dim(x) if is_floating(x) else None
        if d is None:
            return x
        spec = [None] * x.ndim
        spec[d] = self.axes if len(self.axes) > 1 else self.axes[0]
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))

    def join(self, x: Any) -> Any:
        if not is_floating(x) or self.dim(x) is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P()))


def remat_layer(
    fn: Callable[[list[Any]], list[Any]],
    policy: RematPolicy,
    partition: Partition | None = None,
    split: Sequence[bool] = (),
) -> Callable:
    """``fn`` (one layer: a list of arrays to a list of arrays) rematerialised by ``policy``:
    the forward pass keeps what the policy saves and the backward pass recomputes the rest.

    ``jax.checkpoint`` alone does not do this for a layer that is not a scan body: on CPU,
    XLA removes its optimization barriers before CSE, which then merges the recomputation
    with the forward pass and keeps every activation (``benchmarks/stage3_layers.py``: 16
    residual MLP layers at stage 0, 5.56 MiB of temporaries with and without it). So the
    checkpointed layer's VJP is taken in the forward pass and its saved values are tied to the
    cotangent (:func:`tie_all`) before the backward pass recomputes from them: the
    recomputation is then a different value (4.13 MiB). Values
    offloaded to host memory are left untied: they come back through a transfer, which is
    already a different value.

    With ``partition``, the inputs flagged in ``split`` (the activations, not the weights) are
    saved split over the model-parallel axes: the VJP is taken at the split inputs and the
    layer gathers them back first, so what the forward pass keeps is the slice.
    """
    offload = policy.offload
    flags = list(split) if partition is not None else []

    def body(arrays: list[Any]) -> list[Any]:
        if flags:  # the saved inputs are slices; the layer runs on the whole
            arrays = [partition.join(a) if f else a for a, f in zip(arrays, flags, strict=True)]
        if offload:  # the layer's inputs, kept in host memory
            arrays = [named(a, LAYER_INPUT) for a in arrays]
        return fn(arrays)

    inner = jax.checkpoint(body, policy=policy.jax_policy())

    @jax.custom_vjp
    def layer(arrays: list[Any]) -> list[Any]:
        return fn(arrays)

    def fwd(arrays: list[Any]) -> tuple[list[Any], Any]:
        if flags:
            arrays = [partition.split(a) if f else a for a, f in zip(arrays, flags, strict=True)]
        return jax.vjp(inner, arrays)

    def bwd(pull: Any, cts: list[Any]) -> Any:
        return (pull if offload else tie_all(pull, cts))(cts)

    layer.defvjp(fwd, bwd)
    return layer
