"""Stage 3's ``overlap_comm``: a layer scan whose gathered weights are fetched one layer ahead.

The replay (:mod:`jzero.rewrite.interpreter`) hands a scan over stacked layers here when
``overlap_comm`` is on at stage 3 and :func:`can_overlap` takes it; the buckets of stages 0-2
and XLA's scheduler options are :mod:`jzero.comm.overlap`'s.

Decisions:

* **Fetched one layer ahead, forward and backward**: iteration ``i`` gathers layer ``i + 1``
  (data independent of layer ``i``'s compute) and runs layer ``i`` with the weights the previous
  iteration gathered; the backward pass, a custom VJP, gathers layer ``i - 1`` ahead and
  reduce-scatters layer ``i + 1``'s gradient beside layer ``i``'s backward pass.
* **The backward pass re-gathers**: per layer only its input and what the remat policy saves
  are kept, never a gathered weight, so the weights live at once are a constant few layers.
* **The ties are the replay's own** (:func:`jzero.rewrite.trace.first_element`,
  :func:`jzero.rewrite.trace.tie_to`): a gather waits for one element of the cotangent it meets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jzero.rewrite.trace import first_element, is_floating, tie_to

__all__ = ["can_overlap", "overlapped_scan"]


def _vjp_parts(
    f: Callable[..., Any], args: tuple, weights: list[Any], consts: list[Any]
) -> tuple[Any, list[Any], tuple[Any, tuple]]:
    """``f(*args)`` and its VJP split into what must be kept per layer and what need not.

    The VJP function is a pytree whose leaves are its residuals. Leaves that *are* one of
    ``weights`` (the gathered weights the layer ran with) or ``consts`` (the same in every
    layer) are left out and recorded by position, to be supplied again by :func:`_rebuild`:
    the weights gathered anew, the consts as they are. The rest (the layer's input, what the
    checkpoint policy saves) is returned to be stacked over the layers.
    """
    out, vjp_fn = jax.vjp(f, *args)
    leaves, tree = jax.tree.flatten(vjp_fn)
    by_id = {id(x): ("w", i) for i, x in enumerate(weights)}
    by_id.update({id(x): ("c", i) for i, x in enumerate(consts) if id(x) not in by_id})
    where = tuple(by_id.get(id(leaf), ("r", 0)) for leaf in leaves)
    kept = [leaf for leaf, (kind, _) in zip(leaves, where, strict=True) if kind == "r"]
    return out, kept, (tree, where)


def _rebuild(static: tuple[Any, tuple], kept: list[Any], weights: list[Any], consts: list[Any]):
    """The VJP function of :func:`_vjp_parts` from its kept residuals and fresh weights."""
    tree, where = static
    it = iter(kept)
    leaves = [
        next(it) if kind == "r" else weights[i] if kind == "w" else consts[i] for kind, i in where
    ]
    return jax.tree.unflatten(tree, leaves)


def _at(xs: Sequence[Any], i: Any) -> list[Any]:
    return [jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs]


def _put(bufs: Sequence[Any], i: Any, vals: Sequence[Any]) -> list[Any]:
    return [
        jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0)
        for b, v in zip(bufs, vals, strict=True)
    ]


def _zeros(xs: Sequence[Any], length: int) -> list[Any]:
    return [jnp.zeros((length, *jnp.shape(x)), jnp.result_type(x)) for x in xs]


def can_overlap(carry: Sequence[Any], out_avals: Sequence[Any], length: int) -> bool:
    """Whether :func:`overlapped_scan` takes a scan: two layers or more, and a floating carry
    and floating per-layer outputs (their cotangents flow through the backward loop)."""
    avals = [*carry, *out_avals]
    return length >= 2 and all(is_floating(x) for x in avals)


def overlapped_scan(
    layer: Callable[[list[Any], list[Any], list[Any]], tuple[list[Any], list[Any]]],
    gathers: Sequence[Callable[[Any], Any] | None],
    consts: Sequence[Any],
    init: Sequence[Any],
    xs: Sequence[Any],
    length: int,
    policy: Any,
) -> tuple[list[Any], list[Any]]:
    """A layer scan whose gathered weights are fetched one layer ahead (stage 3's
    ``overlap_comm``), forward and backward, with the gradients of ``jax.lax.scan`` of the
    same body.

    Forward: layer 0 is gathered before the loop; iteration ``i`` gathers layer ``i + 1`` (data
    independent of layer ``i``'s compute, so the two can run together) and computes layer ``i``
    with the weights the previous iteration gathered, which the loop carries. Backward (a custom
    VJP, in reverse): iteration ``i`` gathers layer ``i - 1`` ahead, reduce-scatters layer
    ``i + 1``'s weight gradient (computed by the previous iteration and carried) and computes
    layer ``i``'s backward pass; nothing of one depends on the others. The backward pass
    re-gathers each layer instead of keeping the forward's gathered weights: per layer only the
    layer's input and what ``policy`` saves are kept (no gathered weight), so the weights live
    at any time are a constant few layers (the layer in use, the one being fetched, the
    gradient being reduced), whatever the number of layers. The first and last layers run
    outside the loops (the loops have nothing to fetch or reduce there).

    Args:
      layer: ``layer(carry, x, consts) -> (carry, y)``, one layer; ``x`` holds the gathered
        weights at the positions ``gathers`` names.
      gathers: per scanned operand, ``None``, or the gather of one layer's shard (its
        transpose is the gradient's reduce-scatter).
      consts: the values every layer reads (not scanned).
      init: the initial carry (floating).
      xs: the scanned operands, stacked on dimension 0: shards where ``gathers`` has a
        gather, layer inputs otherwise.
      length: the number of layers (>= 2).
      policy: the ``jax.checkpoint`` policy of one layer: what it keeps for its backward pass.

    Returns:
      ``(carry, ys)`` as ``jax.lax.scan`` returns them.
    """
    pend = [g is not None for g in gathers]
    fetch = [g for g in gathers if g is not None]

    def merged(plain: Sequence[Any], weights: Sequence[Any]) -> list[Any]:
        a, b = iter(plain), iter(weights)
        return [next(b) if p else next(a) for p in pend]

    def body(carry: Any, plain: Any, weights: Any, consts: Any) -> Any:
        return layer(list(carry), merged(plain, weights), list(consts))

    f = jax.checkpoint(body, policy=policy) if policy is not None else body

    def gather_all(shards: Sequence[Any], anchor: Any = None) -> list[Any]:
        return [g(tie_to(s, anchor)) for g, s in zip(fetch, shards, strict=True)]

    static: dict[str, Any] = {}
    last = length - 1

    def fwd(consts: list[Any], init: list[Any], xs: list[Any]) -> Any:
        plain = [x for x, p in zip(xs, pend, strict=True) if not p]
        shards = [x for x, p in zip(xs, pend, strict=True) if p]
        y_avals = jax.eval_shape(
            lambda c, x, w: body(c, x, w, consts)[1],
            init,
            _at(plain, 0),
            gather_all(_at(shards, 0)),
        )

        def step(state: Any, i: Any) -> Any:
            carry, weights, ys = state
            ahead = gather_all(_at(shards, i + 1))  # layer i + 1, beside layer i's compute
            (carry, y), kept, st = _vjp_parts(
                f, (carry, _at(plain, i), weights, consts), weights, consts
            )
            static["loop"] = st
            return (list(carry), ahead, _put(ys, i, y)), kept

        ys = [jnp.zeros((length, *a.shape), a.dtype) for a in y_avals]
        first = (list(init), gather_all(_at(shards, 0)), ys)
        (carry, weights, ys), kept = jax.lax.scan(step, first, jnp.arange(last))
        (carry, y), kept_last, static["last"] = _vjp_parts(
            f, (carry, _at(plain, last), weights, consts), weights, consts
        )
        return (list(carry), _put(ys, last, y)), (consts, plain, shards, kept, kept_last)

    def bwd(res: Any, cts: Any) -> Any:
        consts, plain, shards, kept, kept_last = res
        ct_carry, ct_ys = cts
        fc = [i for i, c in enumerate(consts) if is_floating(c)]
        fx = [i for i, x in enumerate(plain) if is_floating(x)]

        def reduce(ct_weights: list[Any], shards_i: list[Any]) -> list[Any]:
            """The transpose of a layer's gathers: its gradients' reduce-scatter."""
            return jax.vjp(gather_all, shards_i)[1](ct_weights)[0]

        def add(acc: list[Any], ct: Any) -> list[Any]:
            return [a + ct[i] for a, i in zip(acc, fc, strict=True)]

        def floats(ct: Any) -> list[Any]:
            return [ct[i] for i in fx]

        # The last layer; layer last - 1 is fetched beside it. Both wait for the cotangent.
        anchor = first_element(cts)
        vjp = _rebuild(static["last"], kept_last, gather_all(_at(shards, last), anchor), consts)
        ahead = gather_all(_at(shards, last - 1), anchor)
        ct_carry, ct_x, ct_w, ct_k = vjp((ct_carry, _at(ct_ys, last)))
        acc = [ct_k[i] for i in fc]
        ct_shards = _zeros(_at(shards, 0), length)
        ct_plain = _put(_zeros(floats(_at(plain, 0)), length), last, floats(ct_x))

        def step(state: Any, i: Any) -> Any:
            ct_carry, weights, ct_above, acc, ct_shards, ct_plain = state
            below = gather_all(_at(shards, i - 1))  # layer i - 1, ahead
            ct_shards = _put(ct_shards, i + 1, reduce(ct_above, _at(shards, i + 1)))
            vjp = _rebuild(static["loop"], _at(kept, i), weights, consts)
            ct_carry, ct_x, ct_w, ct_k = vjp((ct_carry, _at(ct_ys, i)))
            state = (list(ct_carry), below, ct_w, add(acc, ct_k), ct_shards)
            return (*state, _put(ct_plain, i, floats(ct_x))), None

        first = (list(ct_carry), ahead, ct_w, acc, ct_shards, ct_plain)
        state, _ = jax.lax.scan(step, first, jnp.arange(1, last), reverse=True)
        ct_carry, weights, ct_above, acc, ct_shards, ct_plain = state
        # Layer 0, beside layer 1's reduce-scatter; then layer 0's own.
        vjp = _rebuild(static["loop"], _at(kept, 0), weights, consts)
        ct_shards = _put(ct_shards, 1, reduce(ct_above, _at(shards, 1)))
        ct_init, ct_x, ct_w, ct_k = vjp((ct_carry, _at(ct_ys, 0)))
        acc = add(acc, ct_k)
        ct_plain = _put(ct_plain, 0, floats(ct_x))
        ct_shards = _put(ct_shards, 0, reduce(ct_w, _at(shards, 0)))
        ct_consts: list[Any] = [None] * len(consts)  # None: no gradient (integer inputs)
        for a, i in zip(acc, fc, strict=True):
            ct_consts[i] = a
        ct_xs: list[Any] = [None] * len(plain)
        for a, i in zip(ct_plain, fx, strict=True):
            ct_xs[i] = a
        return ct_consts, list(ct_init), merged(ct_xs, ct_shards)

    @jax.custom_vjp
    def run(consts: list[Any], init: list[Any], xs: list[Any]) -> Any:
        return fwd(consts, init, xs)[0]

    run.defvjp(fwd, bwd)
    return run(list(consts), list(init), list(xs))
