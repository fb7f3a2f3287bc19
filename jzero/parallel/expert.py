"""Mixture of experts: a token-choice top-k router, and dispatch to experts split over the
``expert`` mesh axis by one all-to-all each way (DeepSpeed-MoE's expert parallelism).

A user's MoE layer is one call, ``y, stats = moe_layer(router_logits, expert_fn, x)``, or the
three steps it is made of: :func:`route_sorted` (who goes where), :func:`dispatch` (tokens to
their experts' rows, and over the expert axis to the experts' devices), :func:`combine` (back,
weighted by the gates). ``jzero.moe`` is this module.

Decisions:

* **Token choice, top-k, capacity.** Each token picks its ``k`` most probable experts
  (``softmax`` of the router's logits; for ``k > 1`` the ``k`` gates are renormalised to sum to
  1, Mixtral's rule; for ``k = 1`` the gate is the probability, Switch's). Each expert takes at
  most ``capacity = max(min_capacity, ceil(k * T * capacity_factor / E))`` of a device's ``T``
  tokens; slots are given to all first choices before any second choice (GShard's priority),
  in token order within each, and a choice past the capacity is dropped (its share of the
  output is 0; the token's residual stream carries it). ``dropped_fraction`` counts them.
* **Dropless** (``drop_tokens=False``, DeepSpeed's argument): no capacity, no choice ever
  dropped. An expert gets each token at most once, so ``T`` rows per expert hold any routing.
* **The load-balancing loss** is Switch's and GShard's ``E * sum_e f_e * P_e``: ``f_e`` the
  fraction of the device's token choices routed to expert ``e`` (all ``k`` of them), ``P_e``
  the mean router probability of ``e``. It is 1 when routing is uniform. Routing, capacity and
  this loss are per device, over its own tokens, as DeepSpeed computes them per rank: the
  step's loss averages the devices' losses.
* **Dispatch by sorting** (MegaBlocks' and Megatron-Core's token permutation): the ``k * T``
  choices, in priority order, are stably sorted by expert (``argsort``); each choice's rank
  within its expert's segment (its index minus the segment's offset) is its position, the one
  the first-choices-first cumulative count gave, so capacity drops the same choices as
  before. Each expert's kept tokens are gathered into contiguous rows of an ``[E, N, d]``
  buffer, ``N = min(capacity, T)`` (``T`` dropless); the outputs come back by one gather per
  choice, weighted by its gate. Memory and work grow linearly with ``T``. The dense one-hot
  ``[T, E, C]`` masks this replaced (GShard's einsums; :func:`route` still builds them, for
  :func:`dense_reference` and inspection) grew with ``T * C``, the square of the tokens: the
  built-in GPT's step temporaries (``benchmarks/moe.py``'s second table, E_p 2) went 44x
  for 16x the tokens under them; they go 11x now. Exact in any precision: a gather moves
  values unchanged, and each output is the same products.
* **Experts as a batched matmul over padded rows, not ``jax.lax.ragged_dot``.** The experts
  run on the ``[E, N, d]`` buffer (``expert_fn``, a ``vmap`` or einsum over the experts
  dimension). ``ragged_dot`` on the ``k * T`` sorted rows alone would skip the padding, and is
  exact in float64 with its gradient, but on CPU this JAX lowers it by expanding the rows to
  ``[E, k * T, d]`` under a mask: ``E`` times the rows' work and memory. Measured
  (``benchmarks/moe.py``'s third table: a GELU MLP's forward and backward, 8 experts, top-2,
  d 128, d_ff 256, float32, 2048 tokens) it took 102 MiB and 128 ms, the padded buffer 20 MiB
  and 18 ms at capacity factor 1.25 and 64 MiB and 72 ms dropless (``N = T``, ``E / k`` times
  the rows it needs). GPU and TPU hand XLA a ragged-dot instruction instead (not measured
  here); where that is a grouped matmul, a grouped ``expert_fn`` over the sorted rows would
  beat the dropless buffer's padding.
* **One all-to-all each way.** Inside the step's ``shard_map`` (``expert`` manual), the
  ``[E, N, d]`` buffer is split into ``E_p`` groups of ``E / E_p`` experts and device ``j`` of
  the expert axis receives group ``j`` from every device: ``[E / E_p, E_p * N, d]``, its own
  experts' rows from all of its group. ``expert_fn`` runs on those with the device's own
  experts (an expert parameter rests split over ``expert`` on its experts dimension, so the
  loss sees ``E / E_p`` of them), and one all-to-all brings the outputs home. The backward
  pass is the same two the other way. all-to-all needs static shapes: the buffers are
  ``E * N * d`` per device, linear in ``T`` (``E * T * d`` dropless, the worst case).
* **No hang, whatever the router does.** Both all-to-alls run on every device with the same
  static shapes every step: a device whose experts get no token sends and receives zeros. The
  collectives are in one SPMD program, never in per-expert hooks (DeepSpeed's ZeRO-3 MoE hang).
* **One model code with and without expert parallelism.** Where ``axis`` is not bound (a
  plain call, ``jax.jit`` alone) or has one device, there is no all-to-all and ``expert_fn``
  gets all ``E`` experts' rows, as the parameters then hold all ``E`` experts.
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
from jzero.parallel.sequence import bound_axis_size

__all__ = [
    "EXPERT_AXIS",
    "MoEStats",
    "Routing",
    "SortedRouting",
    "capacity",
    "combine",
    "dense_reference",
    "dispatch",
    "expert_leaves",
    "expert_rows",
    "moe_layer",
    "route",
    "route_sorted",
]


class MoEStats(NamedTuple):
    """What one MoE layer reports: the load-balancing loss (to add to the loss, times a
    coefficient) and the fraction of token choices dropped by the capacity."""

    aux_loss: jax.Array
    dropped_fraction: jax.Array


class Routing(NamedTuple):
    """Where each of ``T`` tokens goes, as dense masks (:func:`route`): ``dispatch_mask``
    ``[T, E, C]`` (1 at a kept choice's expert and slot), ``combine_weights`` (the same, times
    the gate), and the layer's stats. ``T * E * C`` elements: the square of the tokens."""

    dispatch_mask: jax.Array
    combine_weights: jax.Array
    stats: MoEStats


class SortedRouting(NamedTuple):
    """Where each of ``T`` tokens goes, by index (:func:`route_sorted`); every array is linear
    in ``T``. Choice ``j`` of token ``t`` is ``[j, t]`` (read flat: the priority order).

    * ``source`` ``[E, N]`` int32: the token in each of expert ``e``'s ``N`` rows, its kept
      choices in priority order, then ``T`` (an empty row, zeros) in the rest;
    * ``row`` ``[k, T]`` int32: each choice's row in the flattened ``[E * N]`` buffer, ``E * N``
      where it was dropped;
    * ``gates`` ``[k, T]``: each choice's gate, 0 where it was dropped;
    * ``stats``: the layer's :class:`MoEStats`.
    """

    source: jax.Array
    row: jax.Array
    gates: jax.Array
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


def expert_rows(
    tokens: int,
    num_experts: int,
    experts_per_token: int = 2,
    capacity_factor: float = 1.25,
    min_capacity: int = 4,
    *,
    drop_tokens: bool = True,
    slots: int | None = None,
) -> int:
    """``N``, the rows each expert has in :func:`route_sorted`'s buffer for one device's
    ``tokens``: the capacity (``slots`` if given, else :func:`capacity`), at most ``tokens``
    (an expert gets a token at most once, so rows past it would stay empty); ``tokens`` when
    ``drop_tokens`` is false."""
    if not drop_tokens:
        return int(tokens)
    c = capacity(tokens, num_experts, experts_per_token, capacity_factor, min_capacity)
    return min(int(tokens), c if slots is None else int(slots))


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
    """Top-k routing of ``router_logits`` ``[T, E]`` (one device's tokens) as dense masks and
    stats: :func:`dense_reference`'s, and a readable form of what :func:`route_sorted` keeps
    (``T * E * C`` elements: :func:`moe_layer` uses :func:`route_sorted`).

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


def route_sorted(
    router_logits: jax.Array,
    *,
    experts_per_token: int = 2,
    capacity_factor: float = 1.25,
    min_capacity: int = 4,
    slots: int | None = None,
    drop_tokens: bool = True,
) -> SortedRouting:
    """Top-k routing of ``router_logits`` ``[T, E]`` (one device's tokens) by sorting the
    choices by expert: the same choices kept, gates and stats as :func:`route`, as indices.

    ``slots`` overrides :func:`capacity`; ``drop_tokens=False`` keeps every choice (no
    capacity, ``T`` rows per expert). The gates are in ``router_logits``' dtype."""
    tokens, num_experts = router_logits.shape
    k = int(experts_per_token)
    _check_route(num_experts, k, capacity_factor)
    n = expert_rows(
        tokens, num_experts, k, capacity_factor, min_capacity, drop_tokens=drop_tokens, slots=slots
    )
    probs = jax.nn.softmax(router_logits, axis=-1)
    top, idx = jax.lax.top_k(probs, k)  # [T, k]
    gates = top / jnp.sum(top, axis=-1, keepdims=True) if k > 1 else top
    expert = jnp.swapaxes(idx, 0, 1).reshape(k * tokens).astype(jnp.int32)  # 1st choices first
    order = jnp.argsort(expert, stable=True).astype(jnp.int32)  # by expert, priority kept
    by_expert = expert[order]
    counts = jnp.zeros(num_experts, jnp.int32).at[expert].add(1)
    offsets = jnp.cumsum(counts) - counts  # each expert's first index in the sorted order
    rank = jnp.arange(k * tokens, dtype=jnp.int32) - offsets[by_expert]  # its position there
    empty = num_experts * n
    sorted_row = jnp.where(rank < n, by_expert * n + rank, empty)  # rank < n iff < capacity
    source = jnp.full(empty, tokens, jnp.int32).at[sorted_row].set(order % tokens, mode="drop")
    row = jnp.zeros(k * tokens, jnp.int32).at[order].set(sorted_row)  # back in priority order
    row = row.reshape(k, tokens)
    kept = row < empty
    gate = jnp.where(kept, jnp.swapaxes(gates, 0, 1), 0)
    routed = counts.astype(probs.dtype) / tokens / k  # f_e
    aux = num_experts * jnp.sum(routed * jnp.mean(probs, axis=0))
    dropped = 1.0 - jnp.sum(kept.astype(jnp.float32)) / (k * tokens)
    return SortedRouting(source.reshape(num_experts, n), row, gate, MoEStats(aux, dropped))


def dispatch(x: jax.Array, routing: Routing | SortedRouting, axis: str = EXPERT_AXIS) -> jax.Array:
    """Tokens ``x`` ``[T, d]`` into their experts' rows: ``[E, N, d]`` where ``axis`` is not
    bound, else ``[E / E_p, E_p * N, d]`` on each device, its own experts' rows from every
    device of its expert group (one all-to-all). ``N`` is :func:`expert_rows` for a
    :class:`SortedRouting` (a gather), the capacity ``C`` for a :class:`Routing` (an einsum
    with its dense mask)."""
    if isinstance(routing, SortedRouting):
        slots = jnp.take(x, routing.source, axis=0, mode="fill", fill_value=0)
    else:
        slots = jnp.einsum("tec,td->ecd", routing.dispatch_mask.astype(x.dtype), x)
    size = bound_axis_size(axis)
    if size is None or size == 1:
        return slots
    experts = slots.shape[0]
    if experts % size:
        raise ValueError(
            f"{experts} experts cannot be split over the {size} devices of the {axis!r} axis; "
            f"use an expert-parallel size among {divisors(experts)}."
        )
    return jax.lax.all_to_all(slots, axis, split_axis=0, concat_axis=1, tiled=True)


def combine(y: jax.Array, routing: Routing | SortedRouting, axis: str = EXPERT_AXIS) -> jax.Array:
    """The experts' outputs (:func:`dispatch`'s layout) back to the tokens, ``[T, d]``,
    each the gate-weighted sum of its kept choices (one all-to-all where ``axis`` is bound)."""
    size = bound_axis_size(axis)
    if size is not None and size > 1:
        y = jax.lax.all_to_all(y, axis, split_axis=1, concat_axis=0, tiled=True)
    if not isinstance(routing, SortedRouting):
        return jnp.einsum("tec,ecd->td", routing.combine_weights.astype(y.dtype), y)
    flat = y.reshape(-1, y.shape[-1])  # [E * N, d]
    picked = jnp.take(flat, routing.row, axis=0, mode="fill", fill_value=0)  # [k, T, d]
    return jnp.sum(picked * routing.gates.astype(y.dtype)[..., None], axis=0)


def moe_layer(
    router_logits: jax.Array,
    expert_fn: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    *,
    experts_per_token: int = 2,
    capacity_factor: float = 1.25,
    min_capacity: int = 4,
    drop_tokens: bool = True,
    axis: str = EXPERT_AXIS,
) -> tuple[jax.Array, MoEStats]:
    """One MoE layer: route ``x``'s tokens by ``router_logits`` (:func:`route_sorted`), run
    ``expert_fn`` on each expert's rows, combine.

    Args:
      router_logits: ``[..., E]``, the router's scores of each token.
      expert_fn: ``[E_local, N, d] -> [E_local, N, d_out]``, expert ``i`` applied to row ``i``
        (a ``vmap`` over the experts dimension of the expert parameters, or einsums). Under
        expert parallelism ``E_local = E / E_p``: the device's own experts, as its expert
        parameters hold them.
      x: ``[..., d]`` tokens (leading dimensions as ``router_logits``').
      experts_per_token, capacity_factor, min_capacity: see :func:`route`.
      drop_tokens: ``False`` for dropless: every choice reaches its expert (``capacity_factor``
        and ``min_capacity`` then play no part; ``N = T`` rows per expert).
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
    routing = route_sorted(
        router_logits.reshape(-1, router_logits.shape[-1]),
        experts_per_token=experts_per_token,
        capacity_factor=capacity_factor,
        min_capacity=min_capacity,
        drop_tokens=drop_tokens,
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
    drop_tokens: bool = True,
    groups: int = 1,
) -> tuple[jax.Array, MoEStats]:
    """:func:`moe_layer` computed without slots: every expert runs on every token and the
    output is masked by the router's kept choices (:func:`route`'s dense masks; with
    ``drop_tokens=False`` a slot for every token). ``groups`` contiguous groups of the tokens
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
            slots=None if drop_tokens else n,
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
