"""Stage 3 parameter gathering: one layer at a time, for any model.

At ZeRO stage 3 a device holds only its shard of each parameter. The loss function a user wrote
expects full parameters, so they must be all-gathered; the whole point of stage 3 is that they
are never all gathered *at once*. DeepSpeed does this with module hooks. In JAX there are no
modules at run time, only a traced program, so jzero rewrites the program:

* The user's loss is traced once (``jax.make_jaxpr``) with full-size abstract parameters.
* The trace is replayed with each sharded parameter standing as a *pending gather* (its local
  shard plus the dimension it is split on). A pending gather passes through dtype casts
  that do not widen it (so a bf16 copy is gathered in bf16, at half the bytes, and a bf16
  parameter the model upcasts is still gathered in bf16) and into nested ``jit`` calls.
* When a ``scan`` consumes a pending gather as a scanned operand (stacked layers, layer dim
  leading), the shard itself is scanned and the all-gather is placed *inside* the scan body,
  which is re-traced under ``jax.checkpoint`` with a policy that saves only matmul outputs
  (``dots_no_batch``; the ``activation_checkpointing`` policy when one is set, see
  :mod:`jzero.remat`), so no gathered weight is kept for the backward pass. The backward pass
  therefore gathers each layer again and reduce-scatters its gradient (the transpose of an
  all-gather): ZeRO-3's 3x volume, with one layer's full weights live at a time.
* Any other use (a model written as a Python loop over layers, embeddings, a final norm, a tied
  embedding used twice) gathers the whole leaf right at that use, inside a custom VJP whose
  backward pass gathers it again instead of keeping the gathered weight alive from the
  forward pass (FSDP's reshard-after-forward). Two things make that hold on every backend,
  both measured on CPU, where a Python loop of 16 layers of 512x512 kept 16.1 MiB of
  temporaries without them and 4.0 MiB with them (the same layers as a scan: 4.1 MiB):
  each gather is tied (``_tied``: the shard plus zero times one element) to an operand of its
  use, or in the backward pass to the use's cotangent, so XLA's scheduler cannot hoist every
  layer's gather to the start of the step; and the backward gather is thereby a different
  value, which XLA's CSE cannot merge with the forward one (``jax.checkpoint`` cannot do this
  on CPU: its optimization barriers are expanded away before CSE runs).
* The transpose of each gather (the gradient's reduce-scatter) runs in the communication dtype
  when one is given (``communication_data_type``), else in the parameter's dtype.
* Policy ``none`` would keep the gathered weights, so with gathered weights it keeps only what
  depends on the layer's input: the body is re-emitted eqn by eqn and each such value tagged
  with ``checkpoint_name`` (``save_anything_except_these_names`` saves everything in JAX
  0.10.2). Measured, 16 layers of 512x512 (16 MiB) at stage 3: 4.5 MiB of temporaries and
  two all-gathers per layer, as the default; saving everything: 20.8 MiB and one all-gather.
* The same replay serves activation checkpointing at every stage (:func:`replay`, and
  :func:`gathered` with a ``policy``): every scan reached outside other scans (through nested
  ``jit`` calls too) is re-emitted with its body under ``jax.checkpoint``, and a model
  written as a Python loop has each of its layers (:func:`_segments`, named by the
  parameters' paths) re-emitted as one checkpointed function (:func:`_checkpointed`). Inside
  such a layer stage 3 gathers plainly: the recomputation gathers again and also serves the
  backward pass, two gathers per weight as in a scan. Scans inside other higher-order
  primitives (``cond``, ``while``, custom derivatives, the model's own ``jax.checkpoint``)
  are left as written.
* DeepSpeed's stage-3 knobs act on the uses outside scans and checkpointed layers, from the
  gather order one recording pass of the replay finds (:class:`_Event`):
  ``stage3_prefetch_bucket_size`` ties a forward gather to an earlier use's operand
  (:func:`prefetch_anchors`), ``stage3_max_reuse_distance`` gathers a leaf reused soon enough
  once and keeps it (:func:`kept_leaves`), within ``stage3_max_live_parameters``.

The rewrite happens at trace time only; the compiled step contains no interpreter. The result
is a function of the shards with exactly the numerics of the original function of the full
parameters.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.ad_checkpoint
from jax.extend import core as jex_core

from jzero.remat import ACTIVATION, LAYER_INPUT, RematPolicy, parse_policy

__all__ = [
    "all_gather",
    "checkpoint_policy",
    "checkpoint_scans",
    "gathered",
    "layer_dims",
    "replay",
]


@dataclass(frozen=True)
class _Pending:
    """A parameter still in its shard: gathering ``shard`` on ``dim`` gives the full value."""

    shard: Any
    dim: int
    dtype: Any = None  # a widening cast applied after the gather (the gather stays narrow)
    index: int = -1  # the parameter leaf it comes from (``jax.tree.leaves`` order)

    @property
    def key(self) -> tuple[int, str, str]:
        """Which gathered value this is: the leaf, the dtype gathered, the dtype after it."""
        return (self.index, str(self.shard.dtype), str(self.dtype))

    def numel(self, shards: int) -> int:
        """Elements of the gathered value."""
        return int(self.shard.size) * shards

    def gather(self, axis_name: str, grad_dtype: Any, shard: Any = None, dim: int | None = None):
        x = all_gather(
            self.shard if shard is None else shard,
            axis_name,
            self.dim if dim is None else dim,
            grad_dtype,
        )
        return x if self.dtype is None else x.astype(self.dtype)


def all_gather(x: jax.Array, axis_name: str, dim: int, grad_dtype: Any = None) -> jax.Array:
    """A tiled all-gather whose transpose reduce-scatters in ``grad_dtype`` (default: x's)."""
    if grad_dtype is None or jax.numpy.dtype(grad_dtype) == x.dtype:
        return jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)

    @jax.custom_vjp
    def gather(x: jax.Array) -> jax.Array:
        return jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)

    def fwd(x: jax.Array) -> tuple[jax.Array, None]:
        return gather(x), None

    def bwd(_: None, ct: jax.Array) -> tuple[jax.Array]:
        reduced = jax.lax.psum_scatter(
            ct.astype(grad_dtype), axis_name, scatter_dimension=dim, tiled=True
        )
        return (reduced.astype(x.dtype),)

    gather.defvjp(fwd, bwd)
    return gather(x)


# Matmul outputs (the activations) are kept for the backward pass; everything else in a
# gathered layer, the gathered weights first of all, is recomputed there. Measured on the
# built-in GPT (8 layers of d=256, stage 3, 8 devices): saving all but the all-gather outputs
# left 48 MiB of temporaries (weight-derived values were saved), this policy 18 MiB, saving
# nothing 11 MiB at the cost of a second forward pass.
checkpoint_policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def _first(anchor: Any) -> Any:
    """One element of the first floating array in ``anchor`` (a pytree), or None."""
    for x in jax.tree.leaves(anchor):
        if _floating(x) and getattr(x, "size", 0):
            return x.reshape(-1)[0]
    return None


def _tied(shard: Any, anchor: Any) -> Any:
    """``shard`` made to depend on one element of ``anchor`` (its value unchanged): a gather of
    it cannot start before ``anchor`` exists, and two such gathers are never merged."""
    first = _first(anchor)
    if first is None or not _floating(shard):
        return shard
    return shard + (first != first).astype(shard.dtype) * 0  # 0 even for inf or NaN


def _tie_all(tree: Any, anchor: Any) -> Any:
    """Every floating leaf of ``tree`` tied to ``anchor`` (see :func:`_tied`)."""
    first = _first(anchor)
    if first is None:
        return tree
    return jax.tree.map(
        lambda x: x + (first != first).astype(x.dtype) * 0 if _floating(x) else x, tree
    )


def _bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older JAX returns (subfuns, params)
        subfuns, params = params
        invals = [*subfuns, *invals]
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


_CALLS = ("pjit", "jit", "closed_call")


def _inner(eqn: Any) -> Any:
    """The closed jaxpr a call eqn (``jit``, ``closed_call``) runs, or None."""
    if eqn.primitive.name not in _CALLS:
        return None
    inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    return inner if hasattr(inner, "jaxpr") else None


def _has_scan(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` runs a scan at its top level or inside calls (not inside other
    higher-order primitives, which the replay leaves as written)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            return True
        inner = _inner(eqn)
        if inner is not None and _has_scan(inner.jaxpr):
            return True
    return False


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)


GATHERED = "jzero_gathered_weight"


def _name(x: Any, name: str) -> Any:
    return jax.ad_checkpoint.checkpoint_name(x, name) if _floating(x) else x


def _eval_tagged(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], live: Sequence[bool]):
    """Evaluates ``jaxpr``, naming :data:`~jzero.remat.ACTIVATION` every floating value that
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
        inner = _inner(eqn)
        if not any(flags):
            outs = _bind(eqn, invals)
        elif inner is not None:
            outs = _eval_tagged(inner.jaxpr, inner.consts, invals, flags)
        else:
            outs = [_name(x, ACTIVATION) for x in _bind(eqn, invals)]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
            if any(flags):
                tainted.add(v)
    return [read(v) for v in jaxpr.outvars]


# ---------------------------------------------------------------------------------------------
# Layers of a model written as a Python loop: found in the trace, checkpointed one by one.


def _inline(closed: Any) -> Any:
    """``closed`` with every nested ``jit``/``closed_call`` inlined: one flat list of eqns, so
    layer boundaries can be found whatever calls the model makes."""

    def run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jex_core.Literal) else env[v]

        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            inner = _inner(eqn)
            outs = run(inner.jaxpr, inner.consts, invals) if inner else _bind(eqn, invals)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    if not any(_inner(eqn) is not None for eqn in closed.jaxpr.eqns):
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
class _Segment:
    """Eqns ``[start, stop)`` of a flat jaxpr (one layer), with the values they read from
    before (``live_in``) and the values read after them (``live_out``)."""

    start: int
    stop: int
    live_in: tuple[Any, ...]
    live_out: tuple[Any, ...]


def _segments(jaxpr: Any, keys: Sequence[str | None]) -> dict[int, _Segment]:
    """The layers of a model written as a Python loop, by start eqn (empty for a model whose
    parameters reach a ``scan``: there the scan body is the layer).

    ``jaxpr`` is flat (:func:`_inline`); its first ``len(keys)`` inputs are the parameter
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
    found: dict[int, _Segment] = {}
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
        found[a] = _Segment(a, b, tuple(live_in), tuple(live_out))
    return found


def _checkpointed(fn: Callable[[list[Any]], list[Any]], policy: RematPolicy) -> Callable:
    """``fn`` (one layer: a list of arrays to a list of arrays) rematerialised by ``policy``:
    the forward pass keeps what the policy saves and the backward pass recomputes the rest.

    ``jax.checkpoint`` alone does not do this for a layer that is not a scan body: on CPU,
    XLA removes its optimization barriers before CSE, which then merges the recomputation
    with the forward pass and keeps every activation (measured: 8 layers of an MLP, 52 MiB of
    temporaries with and without it). So the checkpointed layer's VJP is taken in the forward
    pass and its saved values are tied to the cotangent (:func:`_tie_all`) before the backward
    pass recomputes from them: the recomputation is then a different value (24 MiB). Values
    offloaded to host memory are left untied: they come back through a transfer, which is
    already a different value.
    """
    offload = policy.offload

    def named(arrays: list[Any]) -> list[Any]:
        if offload:  # the layer's inputs, kept in host memory
            arrays = [_name(a, LAYER_INPUT) for a in arrays]
        return fn(arrays)

    inner = jax.checkpoint(named, policy=policy.jax_policy())

    @jax.custom_vjp
    def layer(arrays: list[Any]) -> list[Any]:
        return fn(arrays)

    def fwd(arrays: list[Any]) -> tuple[list[Any], Any]:
        return jax.vjp(inner, arrays)

    def bwd(pull: Any, cts: list[Any]) -> Any:
        return (pull if offload else _tie_all(pull, cts))(cts)

    layer.defvjp(fwd, bwd)
    return layer


# ---------------------------------------------------------------------------------------------
# Stage 3's gather order, recorded in one pass, for prefetch and reuse (DeepSpeed's knobs).


@dataclass(frozen=True)
class _Event:
    """One place the program gathers parameters: ``leaves`` maps leaf index to the elements
    gathered; ``kind`` is ``use`` (a use outside scans and checkpointed layers), ``layer`` (a
    checkpointed layer of a Python loop) or ``scan`` (a stacked leaf, one slice at a time);
    ``unit``: the most elements gathered at once here."""

    leaves: dict[int, int]
    kind: str
    unit: int


def _between(events: Sequence[_Event], leaf: int) -> int:
    """Elements of the other leaves ``events`` gather (each leaf counted once)."""
    sizes: dict[int, int] = {}
    for e in events:
        for i, n in e.leaves.items():
            if i != leaf:
                sizes[i] = max(sizes.get(i, 0), n)
    return sum(sizes.values())


def kept_leaves(events: Sequence[_Event], distance: int, max_live: int) -> frozenset[int]:
    """DeepSpeed's ``stage3_max_reuse_distance`` on a recorded gather order: the leaves whose
    every next use is within ``distance`` elements of other gathered parameters are gathered
    once and kept until their last backward use.

    A leaf's reuses are its later forward uses (a tied embedding) and, after its last forward
    use, its backward use: the backward pass mirrors the forward, so that distance is twice
    what is gathered after it. Leaves with the shortest distance are kept first, while the
    kept elements plus the largest unit gathered stay within ``max_live``
    (``stage3_max_live_parameters``). Only uses outside scans and checkpointed layers count.
    """
    fixed = {i for e in events if e.kind != "use" for i in e.leaves}
    largest = max((e.unit for e in events), default=0)
    candidates = []
    for leaf in sorted({i for e in events if e.kind == "use" for i in e.leaves} - fixed):
        pos = [k for k, e in enumerate(events) if leaf in e.leaves]
        gaps = [_between(events[a + 1 : b], leaf) for a, b in zip(pos, pos[1:], strict=False)]
        gaps.append(2 * _between(events[pos[-1] + 1 :], leaf))
        if max(gaps) <= distance:
            size = max(events[k].leaves[leaf] for k in pos)
            candidates.append((max(gaps), leaf, size))
    kept, total = set(), 0
    for _, leaf, size in sorted(candidates):
        if total + size + largest <= max_live:
            kept.add(leaf)
            total += size
    return frozenset(kept)


def prefetch_anchors(events: Sequence[_Event], bucket: int) -> list[int]:
    """DeepSpeed's ``stage3_prefetch_bucket_size`` on a recorded gather order: per use (the
    ``use`` events, in order), the earliest use whose operands its gather may wait for, such
    that what is gathered from there to it is at most ``bucket`` elements."""
    uses = [k for k, e in enumerate(events) if e.kind == "use"]
    anchors = []
    for j, at in enumerate(uses):
        i = j
        while i > 0 and sum(sum(e.leaves.values()) for e in events[uses[i - 1] + 1 : at + 1]) <= (
            bucket
        ):
            i -= 1
        anchors.append(i)
    return anchors


class _Replay:
    """Replays a jaxpr, moving the gathers of pending parameters as late as their uses allow,
    and re-emitting each scan's body under ``jax.checkpoint`` where ``policy`` asks for it.

    ``policy`` None: only the scans that gather weights are checkpointed, with
    :data:`checkpoint_policy` (stage 3's default); a :class:`~jzero.remat.RematPolicy`: every
    scan reached outside other scans (see :mod:`jzero.remat` for what each policy keeps).
    """

    def __init__(
        self,
        axis_name: str | None,
        grad_dtype: Any = None,
        policy: Any = None,
        reshard: bool = True,
        *,
        shards: int = 1,
        kept: frozenset[int] = frozenset(),
        anchors: Sequence[int] = (),
        record: bool = False,
    ):
        self.axis_name = axis_name
        self.grad_dtype = grad_dtype
        self.policy: RematPolicy | None = policy
        self.reshard = reshard  # gather again in the backward pass (see ``gathered``)
        self.shards = shards  # the size of the axis
        self.kept = kept  # leaves gathered once and kept (``stage3_max_reuse_distance``)
        self.anchors = list(anchors)  # per use, the use its gather waits for (prefetch)
        self.record = record  # only record the gather order (:class:`_Event`), gather nothing
        self.events: list[_Event] = []
        self._firsts: list[Any] = []  # per use so far, one element of its first operand
        self._kept_values: dict[Any, Any] = {}

    def run(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        segments: dict[int, _Segment] | None = None,
    ) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jex_core.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        k, eqns = 0, jaxpr.eqns
        while k < len(eqns):
            seg = segments.get(k) if segments else None
            if seg is not None:
                outs = self._layer(eqns[seg.start : seg.stop], seg, [read(v) for v in seg.live_in])
                env.update(zip(seg.live_out, outs, strict=True))
                k = seg.stop
                continue
            eqn = eqns[k]
            invals = [read(v) for v in eqn.invars]
            if any(isinstance(x, _Pending) for x in invals) or self._rewrites(eqn):
                outs = self._eqn(eqn, invals)
            else:
                outs = _bind(eqn, invals)
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
            k += 1
        return [read(v) for v in jaxpr.outvars]

    def _layer(self, eqns: Sequence[Any], seg: _Segment, vals: list[Any]) -> list[Any]:
        """One layer of a Python loop, checkpointed by the policy (:func:`_checkpointed`).

        Its parameters come in as shards and are gathered at their uses inside, plainly: the
        backward pass recomputes the layer, gathers included, so no gathered weight is saved.
        """
        pend = [x if isinstance(x, _Pending) else None for x in vals]
        if self.record:
            leaves = {p.index: p.numel(self.shards) for p in pend if p is not None}
            self.events.append(_Event(leaves, "layer", sum(leaves.values())))
        arrays = [x.shard if p is not None else x for x, p in zip(vals, pend, strict=True)]
        out_pend: list[Any] = [None] * len(seg.live_out)

        def body(arrays: list[Any]) -> list[Any]:
            env: dict[Any, Any] = {}
            for v, x, p in zip(seg.live_in, arrays, pend, strict=True):
                env[v] = x if p is None else dataclasses.replace(p, shard=x)

            def read(v: Any) -> Any:
                return v.val if isinstance(v, jex_core.Literal) else env[v]

            gathered: dict[Any, Any] = {}
            for eqn in eqns:
                invals = [read(v) for v in eqn.invars]
                if not any(isinstance(x, _Pending) for x in invals):
                    outs = _bind(eqn, invals)
                elif eqn.primitive.name == "convert_element_type":
                    outs = self._eqn(eqn, invals)
                else:
                    anchor = [x for x in invals if not isinstance(x, _Pending)]
                    for i, x in enumerate(invals):
                        if isinstance(x, _Pending):
                            if x.key not in gathered:
                                gathered[x.key] = self.materialize(x, anchor)
                            invals[i] = gathered[x.key]
                    outs = _bind(eqn, invals)
                env.update(zip(eqn.outvars, outs, strict=True))
            outs = []
            for i, v in enumerate(seg.live_out):
                x = read(v)
                if isinstance(x, _Pending):  # a cast parameter another layer uses
                    out_pend[i], x = x, x.shard
                outs.append(x)
            return outs

        if self.record or self.policy is None or not self.policy.active:
            outs = body(arrays)
        else:
            outs = _checkpointed(body, self.policy)(arrays)
        return [
            x if p is None else dataclasses.replace(p, shard=x)
            for x, p in zip(outs, out_pend, strict=True)
        ]

    def _rewrites(self, eqn: Any) -> bool:
        """Whether an eqn without pending operands holds a scan the policy checkpoints."""
        if self.policy is None or not self.policy.active:
            return False
        if eqn.primitive.name == "scan":
            return True
        inner = _inner(eqn)
        return inner is not None and _has_scan(inner.jaxpr)

    def materialize(self, x: Any, anchor: Any = None) -> Any:
        """``x`` gathered if pending (tied to ``anchor``, see :func:`_tied`); else ``x``."""
        if not isinstance(x, _Pending):
            return x
        if self.record:  # the right shape, nothing gathered
            shape = list(x.shard.shape)
            shape[x.dim] *= self.shards
            return jax.numpy.zeros(shape, x.dtype or x.shard.dtype)
        shard = x.shard if anchor is None else _tied(x.shard, anchor)
        return x.gather(self.axis_name, self.grad_dtype, shard=shard)

    def _eqn(self, eqn: Any, invals: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        if name == "convert_element_type" and isinstance(invals[0], _Pending):
            p = invals[0]
            # Narrowing (or same-width) casts run on the shard, so the gather moves fewer
            # bytes; a widening cast (a bf16 parameter upcast by the model) runs after it.
            new = jax.numpy.dtype(eqn.params["new_dtype"])
            if new.itemsize <= p.shard.dtype.itemsize:
                return [_Pending(p.shard.astype(new), p.dim, index=p.index)]
            return [_Pending(p.shard, p.dim, new, p.index)]
        inner = _inner(eqn)
        if inner is not None:
            return self.run(inner.jaxpr, inner.consts, invals)
        if name == "scan":
            return self._scan(eqn, invals)
        return self._use(eqn, invals)

    def _use(self, eqn: Any, invals: list[Any]) -> list[Any]:
        """A use of pending parameters outside a scan: gathered there, and again in the
        backward pass (see the module's decisions), unless the leaf is kept (reuse distance).

        The forward gather waits for one element of this use's operands, or of an earlier
        use's when prefetch lets it start there (``anchors``)."""
        j = len(self._firsts)
        operands = [x for x in invals if not isinstance(x, _Pending)]
        self._firsts.append(_first(operands))
        if self.record:
            leaves = {x.index: x.numel(self.shards) for x in invals if isinstance(x, _Pending)}
            self.events.append(_Event(leaves, "use", max(leaves.values())))
            return _bind(eqn, [self.materialize(x) for x in invals])
        invals = list(invals)
        for i, x in enumerate(invals):
            if isinstance(x, _Pending) and x.index in self.kept:  # gathered once, kept
                if x.key not in self._kept_values:
                    self._kept_values[x.key] = self.materialize(x, operands)
                invals[i] = self._kept_values[x.key]
        if not self.reshard:  # the gathered value is kept for the backward pass
            return _bind(eqn, [self.materialize(x) for x in invals])
        pending = [i for i, x in enumerate(invals) if isinstance(x, _Pending)]
        if not pending:
            return _bind(eqn, invals)
        others = [None if isinstance(x, _Pending) else x for x in invals]
        early = self.anchors[j] if j < len(self.anchors) else j
        ahead = [self._firsts[early]] if early < j and self._firsts[early] is not None else []
        axis_name, grad_dtype = self.axis_name, self.grad_dtype

        def run(shards: list[Any], others: list[Any], anchor: Any) -> list[Any]:
            vals = list(others)
            for i, shard in zip(pending, shards, strict=True):
                vals[i] = invals[i].gather(axis_name, grad_dtype, shard=_tied(shard, anchor))
            return _bind(eqn, vals)

        @jax.custom_vjp
        def use(shards: list[Any], others: list[Any], ahead: list[Any]) -> list[Any]:
            return run(shards, others, ahead or others)

        def fwd(shards: list[Any], others: list[Any], ahead: list[Any]) -> tuple[list[Any], Any]:
            # The residuals are the shards, not the gathered values.
            return use(shards, others, ahead), (shards, others, ahead)

        def bwd(res: Any, cts: list[Any]) -> tuple[Any, Any, Any]:
            shards, others, ahead = res
            d_shards, d_others = jax.vjp(lambda sh, ot: run(sh, ot, cts), shards, others)[1](cts)
            return d_shards, d_others, [jax.numpy.zeros_like(a) for a in ahead]

        use.defvjp(fwd, bwd)
        return use([invals[i].shard for i in pending], others, ahead)

    def _body_policy(self, gathers: bool) -> Any:
        """The ``jax.checkpoint`` policy of a scan body (None: not checkpointed)."""
        if self.policy is None:
            return checkpoint_policy if gathers else None
        if self.policy.active or gathers:
            # ``none`` with gathered weights is checkpointed too: its policy keeps every tagged
            # activation (see ``tag`` in :meth:`_scan`) and re-gathers the weights.
            return self.policy.jax_policy()
        return None

    def _scan(self, eqn: Any, invals: list[Any]) -> list[Any]:
        """A scan with pending operands (gathered in its body) or one the policy checkpoints."""
        p = eqn.params
        if self.record:
            leaves = {x.index: x.numel(self.shards) for x in invals if isinstance(x, _Pending)}
            if leaves:
                self.events.append(_Event(leaves, "scan", max(leaves.values()) // p["length"]))
            return _bind(eqn, [self.materialize(x) for x in invals])
        num_consts, num_carry = p["num_consts"], p["num_carry"]
        consts = [self.materialize(x) for x in invals[:num_consts]]
        init = [self.materialize(x) for x in invals[num_consts : num_consts + num_carry]]
        xs = invals[num_consts + num_carry :]
        # A pending operand scanned over its sharded dim can't be gathered per slice.
        xs = [x if not isinstance(x, _Pending) or x.dim != 0 else self.materialize(x) for x in xs]
        gathers = any(isinstance(x, _Pending) for x in xs)
        policy = self._body_policy(gathers)
        if policy is None:
            return _bind(eqn, [*consts, *init, *xs])
        body_closed = p["jaxpr"]
        pending = [x if isinstance(x, _Pending) else None for x in xs]
        xs_vals = [x.shard if isinstance(x, _Pending) else x for x in xs]
        axis_name, grad_dtype = self.axis_name, self.grad_dtype
        offload = self.policy is not None and self.policy.offload
        tag = gathers and self.policy is not None and not self.policy.active
        keep = gathers and not self.reshard
        if keep:  # the gathered weights are saved for the backward pass as well
            policy = jax.checkpoint_policies.save_from_both_policies(
                policy, jax.checkpoint_policies.save_only_these_names(GATHERED)
            )
        num_xs = len(xs)

        def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            if offload:  # the layer's input, kept in host memory
                carry = [_name(c, LAYER_INPUT) for c in carry]
            x = [
                xi if p is None else p.gather(axis_name, grad_dtype, shard=xi, dim=p.dim - 1)
                for xi, p in zip(x, pending, strict=True)
            ]
            if keep:
                x = [
                    xi if p is None else _name(xi, GATHERED)
                    for xi, p in zip(x, pending, strict=True)
                ]
            args = [*consts, *carry, *x]
            if tag:
                live = [False] * num_consts + [True] * num_carry + [False] * num_xs
                outs = _eval_tagged(body_closed.jaxpr, body_closed.consts, args, live)
            else:
                outs = jax.core.eval_jaxpr(body_closed.jaxpr, body_closed.consts, *args)
            return list(outs[:num_carry]), list(outs[num_carry:])

        body = jax.checkpoint(body, policy=policy)
        carry, ys = jax.lax.scan(
            body,
            init,
            xs_vals,
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        return [*carry, *ys]


def _abstract(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False)),
        tree,
    )


def _layers(closed: Any, params: Any, policy: RematPolicy | None) -> tuple[Any, Any]:
    """The flat program and its layers (:func:`_segments`) when ``policy`` checkpoints."""
    if policy is None or not policy.active:
        return closed, None
    closed = _inline(closed)
    return closed, _segments(closed.jaxpr, layer_keys(params))


def replay(fn: Callable[..., Any], policy: RematPolicy | None) -> Callable[..., Any]:
    """``fn(params, *args)`` re-emitted with every layer checkpointed by ``policy`` (see
    :mod:`jzero.remat`): the body of every scan outside other scans, and each layer of a
    Python loop over layers that ``params``' paths name (:func:`layer_keys`). The same
    outputs. ``None`` or ``none``: ``fn``."""
    if policy is None or not policy.active:
        return fn

    def g(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*_abstract(args))
        closed, segments = _layers(closed, args[0] if args else (), policy)
        outs = _Replay(None, None, policy).run(
            closed.jaxpr, closed.consts, jax.tree.leaves(args), segments
        )
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return g


def gathered(
    fn: Callable[..., Any],
    dims: Sequence[int | None],
    full_shapes: Any,
    axis_name: str,
    grad_dtype: Any = None,
    policy: RematPolicy | None = None,
    reshard: bool = True,
    *,
    prefetch: int = 0,
    reuse_distance: int | None = None,
    max_live: int | None = None,
) -> Callable[..., Any]:
    """Turns ``fn(params, *args)`` into ``g(shards, *args)`` that gathers parameters lazily.

    Must be called inside ``shard_map`` over ``axis_name``.

    Args:
      fn: the function of full parameters (a loss function).
      dims: per leaf of ``params`` (in ``jax.tree.leaves`` order), the dimension the leaf is
        sharded on, or ``None`` for a leaf that is already whole on every device.
      full_shapes: a pytree like ``params`` of ``jax.ShapeDtypeStruct`` with the full shapes.
      axis_name: the mesh axis the shards are split over.
      grad_dtype: the dtype the gradients' reduce-scatter runs in; ``None``: the shard's.
      policy: the activation-checkpointing policy of every layer (:mod:`jzero.remat`): each
        scan body, and each layer of a Python loop; ``None``: only the scans that gather
        weights are checkpointed, by :data:`checkpoint_policy`. Whatever the policy, no
        gathered weight is saved for the backward pass.
      reshard: gather each weight again in the backward pass (FSDP's
        ``reshard_after_forward``); ``False`` keeps the forward's gathered weights for the
        backward pass instead: one all-gather per weight, not two, and every gathered weight
        alive until its backward use.
      prefetch: DeepSpeed's ``stage3_prefetch_bucket_size``: a use's gather may start this
        many gathered elements ahead of it (:func:`prefetch_anchors`); 0: at its use.
      reuse_distance: DeepSpeed's ``stage3_max_reuse_distance``: leaves reused within this
        many elements are gathered once and kept (:func:`kept_leaves`); ``None``: none.
      max_live: DeepSpeed's ``stage3_max_live_parameters``, the cap on what reuse keeps.

    Returns:
      A function with the same outputs as ``fn``, taking the local shards instead.
    """
    shards = next(
        (
            full.shape[d]
            for full, d in zip(jax.tree.leaves(full_shapes), dims, strict=True)
            if d is not None
        ),
        None,
    )

    def g(local: Any, *args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(full_shapes, *_abstract(args))
        closed, segments = _layers(closed, full_shapes, policy)
        leaves = jax.tree.leaves(local)
        n = (
            1
            if shards is None
            else shards
            // next(x.shape[d] for x, d in zip(leaves, dims, strict=True) if d is not None)
        )

        def pending(leaves: list[Any]) -> list[Any]:
            return [
                x if d is None else _Pending(x, d, index=i)
                for i, (x, d) in enumerate(zip(leaves, dims, strict=True))
            ]

        flat_args = jax.tree.leaves(args)
        kept: frozenset[int] = frozenset()
        anchors: list[int] = []
        if shards is not None and (prefetch or reuse_distance is not None):
            rec = _Replay(axis_name, grad_dtype, policy, reshard, shards=n, record=True)
            jax.eval_shape(
                lambda sh, a: rec.run(closed.jaxpr, closed.consts, [*pending(sh), *a], segments),
                _abstract(leaves),
                _abstract(flat_args),
            )
            if reuse_distance is not None:
                limit = max_live if max_live is not None else 2**63
                kept = kept_leaves(rec.events, reuse_distance, limit)
            if prefetch:
                anchors = prefetch_anchors(rec.events, prefetch)
        rep = _Replay(axis_name, grad_dtype, policy, reshard, shards=n, kept=kept, anchors=anchors)
        outs = rep.run(closed.jaxpr, closed.consts, [*pending(leaves), *flat_args], segments)
        outs = [rep.materialize(o) for o in outs]
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return g


_PASS_THROUGH = ("convert_element_type", "copy", "copy_p")


def layer_dims(fn: Callable[..., Any], params: Any, *args: Any) -> list[int | None]:
    """Per leaf of ``params``, the stacked-layer dimension a ``scan`` in ``fn`` consumes.

    ``fn(params, *args)`` is traced once (abstract values, nothing runs). A parameter that
    reaches a ``scan`` as a scanned operand (possibly through dtype casts and nested ``jit``)
    has its leading dimension consumed one slice per iteration: that dimension is 0. Stage 3
    must keep it whole (:mod:`jzero.plan`), so that this module can gather one layer at a time.

    Args:
      fn: the loss function of full parameters.
      params: a pytree of arrays or ``jax.ShapeDtypeStruct``.
      args: example arguments (arrays or ``ShapeDtypeStruct``), e.g. a micro-batch.

    Returns:
      One entry per leaf of ``params`` in ``jax.tree.leaves`` order: 0 or ``None``.
    """
    closed = jax.make_jaxpr(fn)(params, *args)
    num = len(jax.tree.leaves(params))
    found: list[int | None] = [None] * num

    def visit(jaxpr: Any, origin: dict[Any, int]) -> None:
        for eqn in jaxpr.eqns:
            ins = [
                origin.get(v) if not isinstance(v, jex_core.Literal) else None for v in eqn.invars
            ]
            if not any(i is not None for i in ins):
                continue
            name = eqn.primitive.name
            if name in _PASS_THROUGH:
                origin[eqn.outvars[0]] = ins[0]
            elif name in ("pjit", "jit", "closed_call"):
                inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
                if hasattr(inner, "jaxpr"):
                    visit(
                        inner.jaxpr,
                        {
                            v: i
                            for v, i in zip(inner.jaxpr.invars, ins, strict=True)
                            if i is not None
                        },
                    )
            elif name == "scan":
                first_xs = eqn.params["num_consts"] + eqn.params["num_carry"]
                for i in ins[first_xs:]:
                    if i is not None:
                        found[i] = 0

    visit(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars[:num])})
    return found


def checkpoint_scans(fn: Callable[..., Any], policy: RematPolicy | str) -> Callable[..., Any]:
    """``fn`` with the body of every top-level ``lax.scan`` it runs checkpointed by ``policy``.

    The same numbers as ``fn``; only what its gradient keeps for the backward pass changes.
    The engine does this itself (``activation_checkpointing``); use it with your own step.

    Args:
      fn: any function of arrays (pytrees in, pytrees out), e.g. a loss.
      policy: a :class:`RematPolicy` or a policy text (``"full"``, ``"names:a,b"``, ...).
    """
    if isinstance(policy, str):
        policy = parse_policy(policy)
    return replay(fn, policy)
