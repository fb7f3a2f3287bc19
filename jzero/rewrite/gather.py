"""Stage 3 parameter gathering: one layer at a time, for any model.

At ZeRO stage 3 a device holds only its shard of each parameter. The loss function a user wrote
expects full parameters, so they must be all-gathered; the whole point of stage 3 is that they
are never all gathered *at once*. DeepSpeed does this with module hooks. In JAX there are no
modules at run time, only a traced program, so jzero rewrites the program. Three parts, every
name importable from :mod:`jzero.rewrite`:

* the gather of one parameter (:mod:`jzero.rewrite.pending`: :func:`all_gather`, whose transpose
  reduce-scatters in the communication dtype or quantized, and the pending gather a sharded
  parameter stands as until its use);
* the replay (:mod:`jzero.rewrite.interpreter`): the trace re-run with gathers moved into scan
  bodies and to each other use, scans and layers re-emitted under ``jax.checkpoint``;
* here, the entry points: :func:`gather_at_use` (stage 3), :func:`remat_layers` and
  :func:`remat_scans` (activation checkpointing at any stage), :func:`layer_dims` (the
  stacked-layer dimensions the plan keeps whole).

Decisions:

* The user's loss is traced once (``jax.make_jaxpr``) with full-size abstract parameters, and
  the trace is replayed with each sharded parameter standing as a *pending gather* (its local
  shard plus the dimension it is split on), which passes through dtype casts that do not
  widen it and into nested ``jit`` calls.
* The same replay serves activation checkpointing at every stage (:func:`remat_layers`, and
  :func:`gather_at_use` with a ``policy``).
* DeepSpeed's stage-3 knobs (``stage3_prefetch_bucket_size``, ``stage3_max_reuse_distance``,
  ``stage3_max_live_parameters``) come from one recording pass of the replay before the real
  one (:mod:`jzero.rewrite.prefetch`).
* :func:`layer_dims` reads which parameters a ``scan`` consumes from the trace alone (through
  dtype casts and nested ``jit``), so the plan can keep their stacked-layer dimension whole.

The rewrite happens at trace time only; the compiled step contains no interpreter. The result
is a function of the shards with exactly the numerics of the original function of the full
parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex_core

from jzero._util import abstract_tree
from jzero.rewrite.interpreter import GatherOptions, Interpreter
from jzero.rewrite.pending import Pending, Scattered
from jzero.rewrite.prefetch import kept_leaves, prefetch_anchors
from jzero.rewrite.remat import RematPolicy, parse_policy
from jzero.rewrite.trace import PASS_THROUGH, find_layers, inline_calls, layer_keys

__all__ = ["GatherOptions", "gather_at_use", "layer_dims", "remat_layers", "remat_scans"]


def _layers(closed: Any, params: Any, policy: RematPolicy | None) -> tuple[Any, Any]:
    """The flat program and its layers (:func:`find_layers`) when ``policy`` checkpoints."""
    if policy is None or not policy.active:
        return closed, None
    closed = inline_calls(closed)
    return closed, find_layers(closed.jaxpr, layer_keys(params))


def remat_layers(fn: Callable[..., Any], policy: RematPolicy | None) -> Callable[..., Any]:
    """``fn(params, *args)`` re-emitted with every layer checkpointed by ``policy`` (see
    :mod:`jzero.rewrite.remat`): the body of every scan outside other scans, and each layer of a
    Python loop over layers that ``params``' paths name (:func:`layer_keys`). The same
    outputs. ``None`` or ``none``: ``fn``."""
    if policy is None or not policy.active:
        return fn

    def g(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
            *abstract_tree(args, weak_type=True)
        )
        closed, segments = _layers(closed, args[0] if args else (), policy)
        outs = Interpreter(None, policy=policy).run(
            closed.jaxpr, closed.consts, jax.tree.leaves(args), segments
        )
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return g


def gather_at_use(
    fn: Callable[..., Any],
    dims: Sequence[int | None],
    full_shapes: Any,
    axis_name: str,
    options: GatherOptions | None = None,
    policy: RematPolicy | None = None,
    *,
    specs: Sequence[tuple] | None = None,
    axes: Sequence[Any] | None = None,
) -> Callable[..., Any]:
    """Turns ``fn(params, *args)`` into ``g(shards, *args)`` that gathers parameters lazily.

    Must be called inside ``shard_map`` over ``axis_name``.

    Args:
      fn: the function of full parameters (a loss function).
      dims: per leaf of ``params`` (in ``jax.tree.leaves`` order), the dimension the leaf is
        sharded on, or ``None`` for a leaf that is already whole on every device.
      full_shapes: a pytree like ``params`` of ``jax.ShapeDtypeStruct`` with the full shapes.
      axis_name: the mesh axis the shards are split over.
      options: how the parameters are gathered (:class:`GatherOptions`: the gradients' dtype,
        resharding, DeepSpeed's stage-3 prefetch and reuse, ZeRO++'s quantized gathers,
        ``overlap_comm``, partitioned activations); ``None``: its defaults.
      policy: the activation-checkpointing policy of every layer (:mod:`jzero.rewrite.remat`): each
        scan body, and each layer of a Python loop; ``None``: only the scans that gather
        weights are checkpointed, by :data:`remat_save_policy`. Whatever the policy, no
        gathered weight is saved for the backward pass.
      specs: per leaf, its entries (one per dimension) on the mesh's other axes (tensor
        parallelism's ``model``): its gathers run with those axes manual too
        (:func:`jzero.comm.manual.over_axes`); ``None``: no other axis.
      axes: per leaf, the mesh axes its shards span where that is not ``axis_name`` (an
        expert leaf's: ZeRO's axes besides ``expert``); ``None``: ``axis_name`` for all.

    Returns:
      A function with the same outputs as ``fn``, taking the local shards instead. Its
      keyword ``wholes`` (per leaf, ``None`` or a whole parameter; stage 2) makes that leaf's
      argument the stand-in of its gradient's shard (:class:`~jzero.rewrite.pending.Scattered`):
      ``fn`` reads the whole value, and each use's cotangent is reduce-scattered into the
      stand-in, per layer in a scan's backward.
    """
    opts = options if options is not None else GatherOptions()
    sizes = [
        None if d is None else full.shape[d]
        for full, d in zip(jax.tree.leaves(full_shapes), dims, strict=True)
    ]
    sharded = any(d is not None for d in dims)

    def g(local: Any, *args: Any, wholes: Sequence[Any] | None = None) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
            full_shapes, *abstract_tree(args, weak_type=True)
        )
        closed, segments = _layers(closed, full_shapes, policy)
        leaves = jax.tree.leaves(local)
        n = jax.lax.axis_size(axis_name) if sharded else 1

        def own_axes(i: int) -> dict[str, Any]:
            if axes is None:
                return {}
            mine = tuple(axes[i]) if not isinstance(axes[i], str) else (axes[i],)
            default = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
            if mine == default:
                return {}
            entry = mine[0] if len(mine) == 1 else mine
            return {"axis": entry, "shards": math.prod(jax.lax.axis_size(a) for a in mine)}

        def pending(leaves: list[Any]) -> list[Any]:
            return [
                Scattered(wholes[i], x, axis_name, grad_bits=opts.grad_bits)
                if wholes is not None and wholes[i] is not None
                else x
                if d is None
                else Pending(
                    x,
                    d,
                    index=i,
                    bits=opts.bits,
                    grad_bits=opts.grad_bits,
                    size=sizes[i],
                    spec=specs[i] if specs is not None else (),
                    **own_axes(i),
                )  # fmt: skip
                for i, (x, d) in enumerate(zip(leaves, dims, strict=True))
            ]

        flat_args = jax.tree.leaves(args)
        kept: frozenset[int] = frozenset()
        anchors: list[int] = []
        if sharded and (opts.prefetch or opts.reuse_distance is not None):
            # the recording pass neither partitions activations nor overlaps the scans
            plain = dataclasses.replace(opts, partition=None, overlap=False)
            rec = Interpreter(axis_name, plain, policy, shards=n, record=True)
            jax.eval_shape(
                lambda sh, a: rec.run(closed.jaxpr, closed.consts, [*pending(sh), *a], segments),
                abstract_tree(leaves, weak_type=True),
                abstract_tree(flat_args, weak_type=True),
            )
            if opts.reuse_distance is not None:
                limit = opts.max_live if opts.max_live is not None else 2**63
                kept = kept_leaves(rec.events, opts.reuse_distance, limit)
            if opts.prefetch:
                anchors = prefetch_anchors(rec.events, opts.prefetch)
        rep = Interpreter(axis_name, opts, policy, shards=n, kept=kept, anchors=anchors)
        outs = rep.run(closed.jaxpr, closed.consts, [*pending(leaves), *flat_args], segments)
        outs = [rep.materialize(o) for o in outs]
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return g


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
            if name in PASS_THROUGH:
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


def remat_scans(fn: Callable[..., Any], policy: RematPolicy | str) -> Callable[..., Any]:
    """``fn`` with the body of every top-level ``lax.scan`` it runs checkpointed by ``policy``.

    The same numbers as ``fn``; only what its gradient keeps for the backward pass changes.
    The engine does this itself (``activation_checkpointing``); use it with your own step.

    Args:
      fn: any function of arrays (pytrees in, pytrees out), e.g. a loss.
      policy: a :class:`RematPolicy` or a policy text (``"full"``, ``"names:a,b"``, ...).
    """
    if isinstance(policy, str):
        policy = parse_policy(policy)
    return remat_layers(fn, policy)
