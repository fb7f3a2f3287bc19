"""The loss cut at its layer scan, for pipeline parallelism: one stage unit for every stage.

A model whose layers are stacked under one ``lax.scan`` (``nnx.scan``, ``jax.lax.scan`` over
stacked parameters, the built-in GPT) is traced once with one stage's share of the layers
(``L / P`` of the stacked dimension). The trace falls into three parts: what precedes the
layer scan (the embedding, positions, masks), the scan, and what follows it (the final norm,
the head, the loss). :func:`stage_unit` turns that into the function every pipeline stage runs
on one micro-batch (:func:`jzero.distributed.pipeline.run`):

* the part before the scan runs on every stage (it also makes what the layers read beside
  their carry), but the scan's carry comes from it only on the first stage; the others take
  the activations the previous stage sent;
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
from jax.extend import core as jex_core

from jzero.replay.trace import PASS_THROUGH, bind, inline_calls

__all__ = ["LayerSplit", "NoLayerScan", "split_at_layers", "stage_unit"]


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


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, jex_core.Literal) else env[v]


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
    origin: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars[:num])}
    best, best_count = None, 0
    for n, eqn in enumerate(jaxpr.eqns):
        ins = [None if isinstance(v, jex_core.Literal) else origin.get(v) for v in eqn.invars]
        if eqn.primitive.name in PASS_THROUGH and ins[0] is not None:
            origin[eqn.outvars[0]] = ins[0]
        elif eqn.primitive.name == "scan":
            first = eqn.params["num_consts"] + eqn.params["num_carry"]
            count = sum(i is not None for i in ins[first:])
            if count > best_count:
                best, best_count = n, count
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


def stage_unit(split: LayerSplit) -> Callable[..., tuple[list[Any], list[Any]]]:
    """``unit(params, carry_in, first, last, *args) -> (carry_out, outs)`` for one stage.

    ``params`` are the stage's (``L / P`` layers of each scanned leaf), ``outs`` the loss's
    outputs flattened (the loss first), zeros on every stage but the last.
    """
    jaxpr, consts = split.closed.jaxpr, split.closed.consts
    k = split.index
    eqn = split.eqn
    nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
    post = jaxpr.eqns[k + 1 :]
    defined_after = {v for e in post for v in e.outvars}
    needed: list[Any] = []
    seen: set[Any] = set()
    for v in [u for e in post for u in e.invars] + list(jaxpr.outvars):
        if isinstance(v, jex_core.Literal) or v in defined_after or v in seen:
            continue
        seen.add(v)
        needed.append(v)

    def unit(
        params: Any, carry_in: Sequence[Any], first: Any, last: Any, *args: Any
    ) -> tuple[list[Any], list[Any]]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, [*jax.tree.leaves(params), *jax.tree.leaves(args)],
                       strict=True))  # fmt: skip
        for e in jaxpr.eqns[:k]:
            env.update(zip(e.outvars, bind(e, [_read(env, v) for v in e.invars]), strict=True))
        invals = [_read(env, v) for v in eqn.invars]
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
            local = dict(zip(needed, vals, strict=True))
            for e in post:
                local.update(
                    zip(e.outvars, bind(e, [_read(local, v) for v in e.invars]), strict=True)
                )
            return [jnp.asarray(_read(local, v)) for v in jaxpr.outvars]

        def zeros(vals: list[Any]) -> list[Any]:
            return [jnp.zeros(v.aval.shape, v.aval.dtype) for v in jaxpr.outvars]

        results = jax.lax.cond(last, run_post, zeros, [env[v] for v in needed])
        return [*outs[:ncarry], *buffers], results

    return unit
