"""Mixture of experts: a token-choice top-k router, and dispatch to experts split over the
``expert`` mesh axis by one all-to-all each way (DeepSpeed-MoE's expert parallelism).

A user's MoE layer is one call, ``y, stats = moe_layer(router_logits, expert_fn, x)``, or the
three steps it is made of: :func:`route` (who goes where), :func:`dispatch` (tokens to their
experts' slots, and over the expert axis to the experts' devices), :func:`combine` (back,
weighted by the gates). ``jzero.moe`` is this module.

Decisions:

* **Token choice, top-k, capacity.** Each token picks its ``k`` most probable experts
  (``softmax`` of the router's logits; for ``k > 1`` the ``k`` gates are renormalised to sum to
  1, Mixtral's rule; for ``k = 1`` the gate is the probability, Switch's). Each expert takes at
  most ``capacity = max(min_capacity, ceil(k * T * capacity_factor / E))`` of a device's ``T``
  tokens; slots are given to all first choices before any second choice (GShard's priority),
  in token order within each, and a choice past the capacity is dropped (its share of the
  output is 0; the token's residual stream carries it). ``dropped_fraction`` counts them.
* **The load-balancing loss** is Switch's and GShard's ``E * sum_e f_e * P_e``: ``f_e`` the
  fraction of the device's token choices routed to expert ``e`` (all ``k`` of them), ``P_e``
  the mean router probability of ``e``. It is 1 when routing is uniform. Routing, capacity and
  this loss are per device, over its own tokens, as DeepSpeed computes them per rank: the
  step's loss averages the devices' losses.
* **Dispatch is dense one-hot einsums** (GShard's): ``[T, E, C]`` masks place each token in
  its slot and weight it back. Exact in any precision (each output element is one product
  with 1 plus zeros), shapes static whatever the router does. Its cost, ``T * E * C``, is small
  beside the experts' own for the token counts one device holds.
* **One all-to-all each way.** Inside the step's ``shard_map`` (``expert`` manual), the
  ``[E, C, d]`` slots are split into ``E_p`` groups of ``E / E_p`` experts and device ``j`` of
  the expert axis receives group ``j`` from every device: ``[E / E_p, E_p * C, d]``, its own
  experts' slots from all of its group. ``expert_fn`` runs on those with the device's own
  experts (an expert parameter rests split over ``expert`` on its experts dimension, so the
  loss sees ``E / E_p`` of them), and one all-to-all brings the outputs home. The backward
  pass is the same two the other way.
* **No hang, whatever the router does.** Both all-to-alls run on every device with the same
  static shapes every step: a device whose experts get no token sends and receives zeros. The
  collectives are in one SPMD program, never in per-expert hooks (DeepSpeed's ZeRO-3 MoE hang).
* **One model code with and without expert parallelism.** Where ``axis`` is not bound (a
  plain call, ``jax.jit`` alone) or has one device, there is no all-to-all and ``expert_fn``
  gets all ``E`` experts' slots, as the parameters then hold all ``E`` experts.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jzero._util import divisors, dotted
from jzero.distributed.mesh import EXPERT_AXIS
from jzero.distributed.sequence import _bound_axis_size

__all__ = [
    "EXPERT_AXIS",
    "MoEStats",
    "Routing",
    "capacity",
    "combine",
    "dense_reference",
    "dispatch",
    "expert_leaves",
    "moe_layer",
    "route",
]


class MoEStats(NamedTuple):
    """What one MoE layer reports: the load-balancing loss (to add to the loss, times a
    coefficient) and the fraction of token choices dropped by the capacity."""

    aux_loss: jax.Array
    dropped_fraction: jax.Array


class Routing(NamedTuple):
    """Where each of ``T`` tokens goes: ``dispatch_mask`` ``[T, E, C]`` (1 at a kept choice's
    expert and slot), ``combine_weights`` (the same, times the gate), and the layer's stats."""

    dispatch_mask: jax.Array
    combine_weights: jax.Array
    stats: MoEStats


def capacity(
    tokens: int,
    num_experts: int,
    experts_per_token: int = 2,
    capacity_factor: float = 1.25,
    min_capacity: int = 4,
) -> int:
    """The slots each expert has for one device's ``tokens``:
    ``max(min_capacity, ceil(experts_per_token * tokens * capacity_factor / num_experts))``."""
    need = math.ceil(experts_per_token * tokens * capacity_factor / num_experts)
    return max(int(min_capacity), need)


def _check_route(num_experts: int, experts_per_token: int, capacity_factor: float) -> None:
    if not 1 <= experts_per_token <= num_experts:
        raise ValueError(
            f"experts_per_token={experts_per_token} must be between 1 and the {num_experts} "
            f"experts the router scores; use experts_per_token <= {num_experts}."
        )
    if not capacity_factor > 0:
        raise ValueError(
            f"capacity_factor={capacity_factor} must be > 0 (1.0 gives each expert its even "
            "share of the token choices; 1.25 is the usual)."
        )


def route(
    router_logits: jax.Array,
    *,
    experts_per_token: int = 2,
    capacity_factor: float = 1.25,
    min_capacity: int = 4,
    slots: int | None = None,
) -> Routing:
    """Top-k routing of ``router_logits`` ``[T, E]`` (one device's tokens): masks and stats.

    ``slots`` overrides :func:`capacity`. The masks are in ``router_logits``' dtype."""
    tokens, num_experts = router_logits.shape
    k = int(experts_per_token)
    _check_route(num_experts, k, capacity_factor)
    c = (
        capacity(tokens, num_experts, k, capacity_factor, min_capacity)
        if slots is None
        else int(slots)
    )
    probs = jax.nn.softmax(router_logits, axis=-1)
    top, idx = jax.lax.top_k(probs, k)  # [T, k]
    gates = top / jnp.sum(top, axis=-1, keepdims=True) if k > 1 else top
    choice = jax.nn.one_hot(idx, num_experts, dtype=jnp.int32)  # [T, k, E]
    by_priority = jnp.swapaxes(choice, 0, 1).reshape(k * tokens, num_experts)  # 1st choices first
    position = jnp.cumsum(by_priority, axis=0) - 1  # each choice's slot at its expert
    position = jnp.swapaxes(position.reshape(k, tokens, num_experts), 0, 1)  # [T, k, E]
    slot = jnp.sum(position * choice, axis=-1)  # [T, k]
    kept = slot < c
    where = jax.nn.one_hot(jnp.where(kept, slot, c), c, dtype=router_logits.dtype)  # [T, k, C]
    placed = choice.astype(router_logits.dtype)[..., None] * where[:, :, None, :]  # [T, k, E, C]
    dispatch_mask = jnp.sum(placed, axis=1)
    combine_weights = jnp.sum(placed * gates[:, :, None, None], axis=1)
    routed = jnp.mean(jnp.sum(choice, axis=1).astype(probs.dtype), axis=0) / k  # f_e
    aux = num_experts * jnp.sum(routed * jnp.mean(probs, axis=0))
    dropped = 1.0 - jnp.sum(kept.astype(jnp.float32)) / (k * tokens)
    return Routing(dispatch_mask, combine_weights, MoEStats(aux, dropped))


def dispatch(x: jax.Array, routing: Routing, axis: str = EXPERT_AXIS) -> jax.Array:
    """Tokens ``x`` ``[T, d]`` into their experts' slots: ``[E, C, d]`` where ``axis`` is not
    bound, else ``[E / E_p, E_p * C, d]`` on each device, its own experts' slots from every
    device of its expert group (one all-to-all)."""
    slots = jnp.einsum("tec,td->ecd", routing.dispatch_mask.astype(x.dtype), x)
    size = _bound_axis_size(axis)
    if size is None or size == 1:
        return slots
    experts = slots.shape[0]
    if experts % size:
        raise ValueError(
            f"{experts} experts cannot be split over the {size} devices of the {axis!r} axis; "
            f"use an expert-parallel size among {divisors(experts)}."
        )
    return jax.lax.all_to_all(slots, axis, split_axis=0, concat_axis=1, tiled=True)


def combine(y: jax.Array, routing: Routing, axis: str = EXPERT_AXIS) -> jax.Array:
    """The experts' outputs (:func:`dispatch`'s layout) back to the tokens, ``[T, d]``,
    each the gate-weighted sum of its kept choices (one all-to-all where ``axis`` is bound)."""
    size = _bound_axis_size(axis)
    if size is not None and size > 1:
        y = jax.lax.all_to_all(y, axis, split_axis=1, concat_axis=0, tiled=True)
    return jnp.einsum("tec,ecd->td", routing.combine_weights.astype(y.dtype), y)


def moe_layer(
    router_logits: jax.Array,
    expert_fn: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    *,
    experts_per_token: int = 2,
    capacity_factor: float = 1.25,
    min_capacity: int = 4,
    axis: str = EXPERT_AXIS,
) -> tuple[jax.Array, MoEStats]:
    """One MoE layer: route ``x``'s tokens by ``router_logits``, run ``expert_fn`` on each
    expert's slots, combine.

    Args:
      router_logits: ``[..., E]``, the router's scores of each token.
      expert_fn: ``[E_local, N, d] -> [E_local, N, d_out]``, expert ``i`` applied to row ``i``
        (a ``vmap`` over the experts dimension of the expert parameters, or einsums). Under
        expert parallelism ``E_local = E / E_p``: the device's own experts, as its expert
        parameters hold them.
      x: ``[..., d]`` tokens (leading dimensions as ``router_logits``').
      experts_per_token, capacity_factor, min_capacity: see :func:`route`.
      axis: the expert-parallel mesh axis.

    Returns:
      ``(y [..., d_out], MoEStats)``.
    """
    lead = x.shape[:-1]
    if router_logits.shape[:-1] != lead:
        raise ValueError(
            f"moe_layer: router_logits {router_logits.shape} and x {x.shape} must have the "
            "same leading (token) dimensions."
        )
    flat = x.reshape(-1, x.shape[-1])
    routing = route(
        router_logits.reshape(-1, router_logits.shape[-1]),
        experts_per_token=experts_per_token,
        capacity_factor=capacity_factor,
        min_capacity=min_capacity,
    )
    y = combine(expert_fn(dispatch(flat, routing, axis)), routing, axis)
    return y.reshape(*lead, y.shape[-1]), routing.stats


def dense_reference(
    router_logits: jax.Array,
    expert_fn: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    *,
    experts_per_token: int = 2,
    capacity_factor: float = 1.25,
    min_capacity: int = 4,
    groups: int = 1,
) -> tuple[jax.Array, MoEStats]:
    """:func:`moe_layer` computed without slots: every expert runs on every token and the
    output is masked by the router's kept choices. ``groups`` contiguous groups of the tokens
    are routed each on its own, as ``groups`` devices do (stats averaged over them); no
    all-to-all. For tests and for checking a model's MoE layer; ``E`` times the compute."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    logits = router_logits.reshape(-1, router_logits.shape[-1])
    if flat.shape[0] % groups:
        raise ValueError(f"dense_reference: {flat.shape[0]} tokens in {groups} equal groups?")
    num_experts = logits.shape[-1]
    every = expert_fn(jnp.broadcast_to(flat, (num_experts, *flat.shape)))  # [E, T, d_out]
    outs, stats = [], []
    n = flat.shape[0] // groups
    for g in range(groups):
        part = slice(g * n, (g + 1) * n)
        r = route(
            logits[part],
            experts_per_token=experts_per_token,
            capacity_factor=capacity_factor,
            min_capacity=min_capacity,
        )
        weight = jnp.sum(r.combine_weights, axis=-1)  # [n, E]: gate where kept, else 0
        outs.append(jnp.einsum("te,etd->td", weight.astype(every.dtype), every[:, part]))
        stats.append(r.stats)
    y = jnp.concatenate(outs, axis=0)
    mean = jax.tree.map(lambda *s: sum(s) / groups, *stats)
    return y.reshape(*lead, y.shape[-1]), MoEStats(*mean)


def _is_expert_name(path: str) -> bool:
    """A dotted path names an expert leaf: a component ``experts``/``expert`` or ending in
    ``_experts`` (``moe.experts.w1``, ``routed_experts``), not a shared expert (Qwen-MoE's
    ``shared_expert`` is a dense MLP every token runs)."""
    parts = path.lower().split(".")
    if any("shared" in part for part in parts):
        return False
    return any(part in ("experts", "expert") or part.endswith("_experts") for part in parts)


def expert_leaves(params: Any, patterns: Sequence[str] = ()) -> list[bool]:
    """Per leaf of ``params`` (flattening order), whether it holds experts: its dotted path
    matches one of ``patterns`` (``fnmatch`` globs, case-sensitive), or, with no patterns, its
    name says so (a path component ``experts``, ``expert`` or ``*_experts``, not ``shared``)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [dotted(p) for p, _ in flat]
    if patterns:
        return [any(fnmatch.fnmatchcase(p, pat) for pat in patterns) for p in paths]
    return [_is_expert_name(p) for p in paths]
