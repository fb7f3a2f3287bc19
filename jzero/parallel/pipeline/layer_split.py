"""The loss cut at its layer scan, for pipeline parallelism: one stage unit for every stage.

A model whose layers are stacked under one ``lax.scan`` (``nnx.scan``, ``jax.lax.scan`` over
stacked parameters, the built-in GPT) is traced once with one stage's share of the layers
(``L / P`` of the stacked dimension). The trace falls into three parts: what precedes the
layer scan (the embedding, positions, masks), the scan, and what follows it (the final norm,
the head, the loss). :func:`stage_unit` turns that into the function every pipeline stage runs
on one micro-batch (:func:`jzero.parallel.pipeline.schedule.run`):

* the part before the scan is cut three ways: what the layers read beside their carry
  (positions, masks) runs on every stage; what only makes the carry's start (the embedding)
  runs on the first stage only, under ``lax.cond``, the other stages taking the activations
  the previous stage sent; what only the part after the scan reads (the labels) runs with it;
* the scan runs this stage's layers;
* the part after it runs on the last stage only, under ``lax.cond`` (zeros elsewhere).

Decisions:

* **The layer scan** is the top-level scan (after inlining nested ``jit``) that consumes the
  most parameter leaves as scanned operands. A loss with none (a Python loop over layers, no
  stacked parameters) is refused: a loop's layers are separate parameters, and the pipeline
  splits one stacked dimension.
* **Per-layer outputs travel with the activations.** A scan output used after the scan (an
  MoE layer's load-balancing loss and dropped fraction, one per layer) is gathered into a
  buffer of all ``L`` layers' rows that rides in the carry from stage to stage: each stage
  rolls the buffer up by its ``L / P`` rows and writes its own rows last, so after the last
  stage the buffer holds every layer's in order, and the part after the scan reads it as the
  whole model's. Its gradient goes back through the stages as the activations' does. The
  buffer costs ``L`` rows of each such output per message (scalars per layer for an auxiliary
  loss).
* **Refused rather than wrong:** per-layer inputs that are not parameters (a layer index, one
  dropout key per layer: each stage would see the first ``L / P`` of them). The message says
  what to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jex_core

from jzero.rewrite.trace import (
    PASS_THROUGH,
    STAGE_MARK,
    bind,
    free_vars,
    inline_calls,
    needed_eqns,
    read,
    run_eqns,
)

__all__ = [
    "LayerSplit",
    "NoLayerScan",
    "layer_scan_index",
    "split_at_layers",
    "stage_unit",
]


class NoLayerScan(ValueError):
    """The loss has no ``lax.scan`` over stacked parameters to pipeline."""


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """A loss's trace and where its layer scan is.

    Attributes:
      closed: the trace (nested calls inlined).
      index: the layer scan's position in ``closed.jaxpr.eqns``.
      scanned: per parameter leaf, whether the layer scan consumes it (its stacked dimension 0).
      carry: what passes between stages: the scan's carry, then one buffer of all ``L``
        layers' rows per per-layer output used after the scan (:attr:`layer_outputs`).
      out_tree: the tree of what the loss returns.
      layer_outputs: the positions (among the scan's per-layer outputs) of those used after it.
    """

    closed: Any
    index: int
    scanned: tuple[bool, ...]
    carry: tuple[jax.ShapeDtypeStruct, ...]
    out_tree: Any
    layer_outputs: tuple[int, ...] = ()

    @property
    def eqn(self) -> Any:
        return self.closed.jaxpr.eqns[self.index]


def split_at_layers(fn: Callable[..., Any], params: Any, *args: Any, stages: int = 1) -> LayerSplit:
    """Traces ``fn(params, *args)`` (abstract values) and finds its layer scan.

    ``params`` hold one stage's share of the stacked layers; ``stages`` is how many stages
    share them (the per-layer outputs' buffers hold ``stages`` times a stage's rows).

    Raises:
      NoLayerScan: no top-level scan consumes a parameter.
      ValueError: the layer scan reads per-layer inputs that are not parameters.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params, *args)
    closed = inline_calls(closed)
    jaxpr = closed.jaxpr
    num = len(jax.tree.leaves(params))
    origin = _origins(jaxpr, num)
    best = layer_scan_index(jaxpr, num)
    if best is None:
        raise NoLayerScan(
            "pipeline.stages > 1 needs the model's layers stacked under one lax.scan (nnx.scan, "
            "jax.lax.scan over parameters with a leading layer dimension, as the built-in GPT "
            "does), but the loss runs no scan over its parameters (a Python loop over layers is "
            "not split into stages). Stack the layers and scan over them, or set "
            "pipeline.stages: 1."
        )
    eqn = jaxpr.eqns[best]
    nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
    scanned = [False] * num
    for v in eqn.invars[nc + ncarry :]:
        i = None if isinstance(v, jex_core.Literal) else origin.get(v)
        if i is None:
            raise ValueError(
                "pipeline: the layer scan reads a per-layer input that is not a parameter "
                f"({v.aval.str_short()}: a layer index or one random key per layer?); each stage "
                "would see the first layers' values. Compute it inside the layer from the "
                "carry, or pass it as a parameter with a leading layer dimension."
            )
        scanned[i] = True
    later = {
        v
        for v in [u for e in jaxpr.eqns[best + 1 :] for u in e.invars] + list(jaxpr.outvars)
        if not isinstance(v, jex_core.Literal)
    }
    used = tuple(j for j, v in enumerate(eqn.outvars[ncarry:]) if v in later)
    carry = tuple(
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars[nc : nc + ncarry]
    )
    buffers = tuple(
        jax.ShapeDtypeStruct((v.aval.shape[0] * stages, *v.aval.shape[1:]), v.aval.dtype)
        for v in (eqn.outvars[ncarry + j] for j in used)
    )
    return LayerSplit(
        closed, best, tuple(scanned), carry + buffers, jax.tree.structure(out_shape), used
    )


def _origins(jaxpr: Any, num: int) -> dict[Any, int]:
    """Which parameter (of the first ``num`` inputs) each variable is, through casts and
    copies."""
    origin: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars[:num])}
    for eqn in jaxpr.eqns:
        v = eqn.invars[0] if eqn.invars else None
        if eqn.primitive.name in PASS_THROUGH and not isinstance(v, jex_core.Literal):
            if v in origin:
                origin[eqn.outvars[0]] = origin[v]
    return origin


def layer_scan_index(jaxpr: Any, num: int) -> int | None:
    """The position in ``jaxpr.eqns`` of its layer scan: the top-level scan that consumes the
    most of the first ``num`` inputs (the parameters) as scanned operands, or None."""
    origin = _origins(jaxpr, num)
    best, best_count = None, 0
    for n, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "scan":
            continue
        first = eqn.params["num_consts"] + eqn.params["num_carry"]
        count = sum(not isinstance(v, jex_core.Literal) and v in origin
                    for v in eqn.invars[first:])  # fmt: skip
        if count > best_count:
            best, best_count = n, count
    return best


def stage_unit(split: LayerSplit) -> Callable[..., tuple[list[Any], list[Any]]]:
    """``unit(params, carry_in, first, last, *args) -> (carry_out, outs)`` for one stage.

    ``params`` are the stage's (``L / P`` layers of each scanned leaf), ``outs`` the loss's
    outputs flattened (the loss first), zeros on every stage but the last.
    """
    jaxpr, consts = split.closed.jaxpr, split.closed.consts
    k = split.index
    eqn = split.eqn
    nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
    pre, post = jaxpr.eqns[:k], jaxpr.eqns[k + 1 :]
    defined_after = {v for e in post for v in e.outvars}
    post_reads = free_vars([u for e in post for u in e.invars] + list(jaxpr.outvars), defined_after)
    # Which equations before the scan each stage needs: what the layers read besides their
    # carry (positions, masks) on every stage; the carry's start (the embedding) on the first
    # stage only; what only the loss after the scan reads (the labels) on the last only.
    scan_reads = [*eqn.invars[:nc], *eqn.invars[nc + ncarry :]]
    always = {id(e) for e in needed_eqns(pre, scan_reads)}
    every = [e for e in pre if id(e) in always]
    first_only = [e for e in needed_eqns(pre, eqn.invars[nc : nc + ncarry]) if id(e) not in always]
    last_only = [e for e in needed_eqns(pre, post_reads) if id(e) not in always]
    starts = list(eqn.invars[nc : nc + ncarry])
    start_reads = free_vars([u for e in first_only for u in e.invars] + starts,
                        {v for e in first_only for v in e.outvars})  # fmt: skip
    tail = [*last_only, *post]
    needed = free_vars([u for e in tail for u in e.invars] + list(jaxpr.outvars),
                   {v for e in tail for v in e.outvars})  # fmt: skip

    def unit(
        params: Any, carry_in: Sequence[Any], first: Any, last: Any, *args: Any
    ) -> tuple[list[Any], list[Any]]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, [*jax.tree.leaves(params), *jax.tree.leaves(args)],
                       strict=True))  # fmt: skip
        run_eqns(every, env)
        first, last = (checkpoint_name(jnp.asarray(x), STAGE_MARK) for x in (first, last))

        def start(vals: list[Any]) -> list[Any]:
            return [read(run_eqns(first_only, dict(zip(start_reads, vals, strict=True))), v)
                    for v in starts]  # fmt: skip

        def no_start(vals: list[Any]) -> list[Any]:
            return [jnp.zeros(v.aval.shape, v.aval.dtype) for v in starts]

        begun = jax.lax.cond(first, start, no_start, [read(env, v) for v in start_reads])
        invals = [*(read(env, v) for v in eqn.invars[:nc]), *begun,
                  *(read(env, v) for v in eqn.invars[nc + ncarry :])]  # fmt: skip
        for j, c in enumerate(carry_in[:ncarry]):
            init = invals[nc + j]
            invals[nc + j] = jnp.where(first, init, c.astype(init.dtype))
        outs = bind(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
        buffers = []  # each per-layer output used later: the earlier stages' rows, then ours
        for j, b in zip(split.layer_outputs, carry_in[ncarry:], strict=True):
            mine = outs[ncarry + j]
            b = jnp.where(first, jnp.zeros_like(b), b.astype(mine.dtype))
            rows = mine.shape[0]
            b = jnp.concatenate([b[rows:], mine], axis=0)
            env[eqn.outvars[ncarry + j]] = b
            buffers.append(b)

        def run_post(vals: list[Any]) -> list[Any]:
            local = run_eqns(tail, dict(zip(needed, vals, strict=True)))
            return [jnp.asarray(read(local, v)) for v in jaxpr.outvars]

        def zeros(vals: list[Any]) -> list[Any]:
            return [jnp.zeros(v.aval.shape, v.aval.dtype) for v in jaxpr.outvars]

        results = jax.lax.cond(last, run_post, zeros, [env[v] for v in needed])
        return [*outs[:ncarry], *buffers], results

    return unit
