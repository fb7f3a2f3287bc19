"""The model's FLOPs per module, from the loss's jaxpr: every ``dot_general`` (and convolution)
of the forward pass, attributed to the parameter leaf it multiplies.

Decisions:

* **Forward FLOPs, counted exactly; the backward pass estimated.** A ``dot_general`` of output
  shape ``O`` contracting ``K`` elements costs ``2 x |O| x K`` FLOPs. The backward pass of a
  matmul is two more of the same size (the gradients of both operands), so a module's training
  FLOPs are 3x its forward ones, DeepSpeed's rule (``recompute_fwd_factor`` adds the forward
  passes activation checkpointing repeats). Elementwise work is left out: it is small beside
  the matmuls, and MFU conventionally counts only the model's matmul FLOPs (6 x params x tokens
  for a dense model).
* **Modules are parameter paths.** The loss's inputs are the params' leaves; a value derived
  from a leaf by layout-only operations (reshape, transpose, slicing, casts, a scan's slice of a
  stacked leaf) still names that leaf, and a matmul with such an operand belongs to the leaf's
  path. A matmul of two activations (attention's ``q k^T`` and ``p v``) names no leaf: it goes to
  the innermost named scope (``jax.named_scope``, Flax modules' names) when there is one, else
  to ``(activations)``. ``module_depth`` groups paths by their first components.
* **Loops count their trips.** A ``scan`` body's FLOPs are multiplied by its length (a stack of
  layers is one scan); a ``while`` body is counted once (its trip count is not in the jaxpr);
  of a ``cond``'s branches the most expensive is counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core

__all__ = ["ACTIVATIONS", "module_flops"]

PyTree = Any
ACTIVATIONS = "(activations)"

# Primitives that only move or relabel elements: their output is still "the parameter".
_LAYOUT = {
    "reshape",
    "transpose",
    "convert_element_type",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "slice",
    "dynamic_slice",
    "copy",
    "copy_p",
    "sharding_constraint",
    "reduce_precision",
    "rev",
    "optimization_barrier",
}


def _dot_flops(eqn: Any) -> int:
    """``2 x |out| x contracted`` of a ``dot_general`` (or a convolution's equivalent)."""
    out = math.prod(eqn.outvars[0].aval.shape)
    if eqn.primitive.name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2 * out * math.prod(lhs[d] for d in lhs_contract)
    # conv_general_dilated: each output element sums kernel spatial x input features.
    rhs = eqn.invars[1].aval.shape
    dn = eqn.params["dimension_numbers"]
    out_feature = dn.rhs_spec[0]
    groups = eqn.params.get("feature_group_count", 1)
    return 2 * out * math.prod(rhs) // max(rhs[out_feature], 1) // max(groups, 1) * groups


def _sub_jaxprs(eqn: Any) -> list[tuple[Any, int]]:
    """The jaxprs an equation runs, each with how often (``scan``: its length)."""
    p = eqn.params
    name = eqn.primitive.name
    if name == "scan":
        return [(p["jaxpr"], p["length"])]
    if name == "cond":
        return [(b, 1) for b in p["branches"]]
    if name == "while":
        return [(p["body_jaxpr"], 1)]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in p:
            return [(p[key], 1)]
    return []


def _walk(
    jaxpr: Any, origins: list[str | None], times: int, out: dict[str, int], scope: str
) -> None:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's inner jaxpr
    named: dict[Any, str] = {}
    for var, origin in zip(jaxpr.invars, origins, strict=False):
        if origin is not None:
            named[var] = origin

    def origin_of(v: Any) -> str | None:
        return None if isinstance(v, jex_core.Literal) else named.get(v)

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [origin_of(v) for v in eqn.invars]
        if name in ("dot_general", "conv_general_dilated"):
            owner = next((o for o in ins if o is not None), None)
            if owner is None:
                stack = str(eqn.source_info.name_stack) or scope
                owner = f"{ACTIVATIONS[:-1]}: {stack})" if stack else ACTIVATIONS
            out[owner] = out.get(owner, 0) + times * _dot_flops(eqn)
        elif name in _LAYOUT and ins and ins[0] is not None:
            named[eqn.outvars[0]] = ins[0]
        subs = _sub_jaxprs(eqn)
        if name == "cond":  # the most expensive branch; its operands follow the predicate
            best: dict[str, int] = {}
            for branch, n in subs:
                trial: dict[str, int] = {}
                _walk(branch, ins[1:], times * n, trial, scope)
                if sum(trial.values()) > sum(best.values()):
                    best = trial
            for k, v in best.items():
                out[k] = out.get(k, 0) + v
        else:
            for sub, n in subs:
                _walk(sub, ins, times * n, out, str(eqn.source_info.name_stack) or scope)


def module_flops(
    loss_fn: Callable[..., Any], params: PyTree, *args: Any, depth: int = -1
) -> dict[str, int]:
    """Forward FLOPs of ``loss_fn(params, *args)`` per parameter path (see the module's
    decisions), largest first.

    Args:
      loss_fn: the loss (any function of the params and the rest).
      params: the params (arrays or ``jax.ShapeDtypeStruct``).
      *args: the other arguments, e.g. one batch (arrays or shapes).
      depth: keep this many leading path components (``-1``: the whole path), summing the
        rest, as DeepSpeed's ``module_depth``.

    Returns:
      ``{path: forward FLOPs}``, paths as ``blocks.attn_qkv``; matmuls of two activations under
      their named scope or ``(activations)``.
    """
    closed = jax.make_jaxpr(loss_fn)(params, *args)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    names = [".".join(_key(k) for k in path) for path, _ in flat]
    rest = len(closed.jaxpr.invars) - len(names)
    out: dict[str, int] = {}
    _walk(closed.jaxpr, [*names, *([None] * rest)], 1, out, "")
    if depth is not None and depth >= 0:
        grouped: dict[str, int] = {}
        for k, v in out.items():
            short = ".".join(k.split(".")[:depth]) if k in names else k
            grouped[short or "(model)"] = grouped.get(short or "(model)", 0) + v
        out = grouped
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)
