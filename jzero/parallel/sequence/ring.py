"""Context parallelism by ring attention: attention over a sequence split across the
``context`` mesh axis, keys and values passed around the ring of its devices.

Each device keeps its queries and, for ``C`` steps, attends them to one ring member's keys
and values, accumulating an online softmax (:mod:`jzero.ops.attention`'s :class:`Partial`),
then hands those keys on to its neighbour with ``jax.lax.ppermute``. Unlike Ulysses
(:mod:`jzero.parallel.sequence.ulysses`) nothing splits the heads, so a model of few heads
spreads one sequence over as many devices as the sequence has chunks;
:func:`context_parallel_attention` runs Ulysses within each ring member and the ring across
members (two-dimensional sequence parallelism), each where its axis is bound.

Decisions:

* **Zig-zag layout** (:func:`jzero.parallel.sequence.layout.context_chunk`): member ``c``
  holds chunks ``c`` and ``2C-1-c`` of ``2C``. Under a causal mask the keys of an earlier
  member (``j < c``) are wholly visible to both query chunks through their first chunk and
  wholly hidden through their second; a later member's (``j > c``) are visible only to the
  second query chunk, and wholly. So every step past the first is half a block on every
  member (a ``lax.cond`` picks which half), and the first is three quarters of one (the
  chunk pair the mask hides is skipped). Every member does the same work each step, so none
  waits for another at the ``ppermute``.
* **What travels**: k, v (grouped-query attention: only the ``Hkv`` key/value heads), the
  keys' positions in the row and, for packed rows, their document ids; the queries and the
  running :class:`Partial` stay. ``C - 1`` ``ppermute`` s forward, each ``1/C`` of the
  row's keys and values per device. The backward pass is a ring of its own (a
  ``jax.custom_vjp``): the keys go around again with their gradients beside them, and one
  last ``ppermute`` returns each member's key and value gradients to it.
* **Memory: nothing of the visited keys is kept.** The forward pass keeps only this member's
  q, k, v, the output and its log-sum-exp, ``O(T/C)`` a device; the backward pass takes each
  step's gradients from flash attention's identity (the scores' gradient is
  ``p * (dO . v - rowsum(dO * O))``, with ``p`` from the final log-sum-exp), written as the
  gradient of a scalar through the step's :class:`Partial`, so the same forward code (and its
  blockwise form) serves both. Autodiff through the forward ring would keep every step's
  arrived keys and partials, ``O(T)`` a device: bytes per token the ring would not divide.
  With ``block_size`` (the built-in GPT passes its ``attention_block``) each step is itself
  blockwise (:func:`jzero.ops.blockwise_partial`), so no step, forward or backward, holds a
  ``[T/2C, T/2C]`` tile.
* **Inside a pipeline stage the keys are gathered, not passed** (``pipe`` bound, of size >
  1): the stages run different passes in one slot (a forward beside a backward or an idle
  slot, :func:`jzero.parallel.pipeline.run`), so one stage's ring would run its permutes
  where another stage runs none or others. A collective-permute has no replica groups: XLA
  meets it with every device of the program, and on the CPU every collective-permute of a
  program shares one rendezvous key (its channel id, 1), so a stage's ring permute met the
  pipeline's transfer or another stage's permute (wrong losses, or a hang where the counts
  differ). An ``all_gather`` over ``context`` is met within the ``context`` group only, one
  stage's devices, which all run the same pass. So there each member gathers the row's keys
  once (``C - 1`` blocks in, as the ring's permutes bring) and visits them in the ring's
  order, the same steps and sums; autodiff (not the backward ring) returns the keys'
  gradients by one reduce-scatter. The cost: the row's keys and values are held at once in
  the forward pass and kept for the backward pass, which autodiff takes through the gathered
  steps (the passed ring holds two blocks and its own backward ring keeps none), the backward
  pass sums the keys' gradients in a ``C``-block buffer, and the transfer is not overlapped
  with the steps.
* **Where ``context`` is unbound or of size 1** the function is attention over the sequence it
  is given, positions ``0 ... T-1``: one model code inside and outside the step.
* **Masks from positions**: causality compares the tokens' places in the row (not their
  documents' positions), documents by equal ids, as
  :func:`jzero.ops.attention.block_mask` does; padding (id 0) is a document of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jzero.distributed.mesh import CONTEXT_AXIS, PIPE_AXIS, SEQ_AXIS
from jzero.ops.attention import (
    Partial,
    attend_block,
    block_mask,
    blockwise_partial,
    empty_partial,
    finish,
    merge,
)
from jzero.parallel.sequence.layout import bound_axis_size, context_chunk
from jzero.parallel.sequence.ulysses import sequence_parallel_attention

__all__ = ["context_parallel_attention", "ring_attention"]


class _Keys(NamedTuple):
    """What travels around the ring: one member's keys, values, positions and documents."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    seg: jax.Array | None


class _Queries(NamedTuple):
    """What stays: this member's queries, their positions and documents."""

    q: jax.Array
    pos: jax.Array
    seg: jax.Array | None


def _half(x: jax.Array | None, which: int, dim: int = 1) -> jax.Array | None:
    """The first (``which=0``) or second zig-zag chunk of ``x`` along ``dim``."""
    if x is None:
        return None
    n = x.shape[dim] // 2
    return jax.lax.slice_in_dim(x, which * n, (which + 1) * n, axis=dim)


def _attend(q: _Queries, keys: _Keys, causal: bool, block: int | None) -> Partial:
    """The partial of ``q`` over ``keys`` under their mask: one :func:`attend_block`, or
    blockwise (:func:`blockwise_partial`) in blocks of ``block`` tokens."""
    if block is not None:
        segments = None if q.seg is None else (q.seg, keys.seg)
        return blockwise_partial(
            q.q, keys.k, keys.v, q.pos, keys.pos, segments, causal=causal, block_size=block
        )
    mask = block_mask(q.pos, keys.pos, q.seg, keys.seg, causal=causal)
    return attend_block(q.q, keys.k, keys.v, mask)


def _queries_half(q: _Queries, which: int) -> _Queries:
    return _Queries(_half(q.q, which), _half(q.pos, which, 0), _half(q.seg, which))


def _keys_half(keys: _Keys, which: int) -> _Keys:
    return _Keys(
        _half(keys.k, which),
        _half(keys.v, which),
        _half(keys.pos, which, 0),
        _half(keys.seg, which),
    )


def _second_only(q: _Queries, part: Partial) -> Partial:
    """``part`` (over the second query chunk) as a partial over all of ``q``: the first
    chunk's queries saw nothing."""
    none = empty_partial(_half(q.q, 0))
    return Partial(
        out=jnp.concatenate([none.out, part.out], axis=1),
        max=jnp.concatenate([none.max, part.max], axis=2),
        sum=jnp.concatenate([none.sum, part.sum], axis=2),
    )


def _own(q: _Queries, keys: _Keys, causal: bool, block: int | None) -> Partial:
    """The first step, this member's own keys: under a causal mask the first key chunk for
    every query, the second for the second query chunk (the first query chunk's view of the
    second key chunk is hidden, and skipped)."""
    if not causal:
        return _attend(q, keys, causal, block)
    first = _attend(q, _keys_half(keys, 0), causal, block)
    second = _attend(_queries_half(q, 1), _keys_half(keys, 1), causal, block)
    return merge(first, _second_only(q, second))


def _visit(
    q: _Queries, keys: _Keys, earlier: jax.Array, causal: bool, block: int | None
) -> Partial:
    """A later step, another member's keys: under a causal mask an earlier member's first key
    chunk for every query, else every key for the second query chunk."""
    if not causal:
        return _attend(q, keys, causal, block)
    return jax.lax.cond(
        earlier,
        lambda: _attend(q, _keys_half(keys, 0), causal, block),
        lambda: _second_only(q, _attend(_queries_half(q, 1), keys, causal, block)),
    )


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    causal: bool = True,
    axis: str = CONTEXT_AXIS,
    block_size: int | None = None,
) -> jax.Array:
    """Attention of this ring member's queries over the whole row's keys, keys and values
    passed around the ``axis`` ring.

    Call it inside ``shard_map`` with ``axis`` manual, on each member's tokens in
    :func:`~jzero.parallel.sequence.layout.context_chunk`'s zig-zag order. Inside a pipeline
    stage (``pipe`` bound) the members gather the row's keys once instead of passing them (see
    the module's decisions): the same steps and result.

    Args:
      q: this member's queries ``[B, T/C, H, Dh]``.
      k: its keys ``[B, T/C, Hkv, Dh]`` (``Hkv`` dividing ``H``: grouped-query attention).
      v: its values, shaped as ``k``.
      segment_ids: int ``[B, T/C]``, the documents of this member's tokens in packed rows (a
        token sees only its own document's), or ``None``.
      causal: a token sees only the tokens at its place in the row or before.
      axis: the context-parallel mesh axis.
      block_size: each ring step's attention in blocks of this many tokens
        (:func:`jzero.ops.blockwise_partial`), so no ``[T/C, T/C]`` score tile exists even
        in one step's recomputation; ``None``: each step is one block.

    Returns:
      ``[B, T/C, H, Dh]`` in q's dtype: this member's rows of the attention output. Where
      ``axis`` is unbound or of size 1, plain attention over ``q``, ``k``, ``v``.

    Raises:
      ValueError: under a bound ``axis``, an odd number of tokens (not two zig-zag chunks).

    Example:
      >>> step = jax.shard_map(lambda q, k, v: ring_attention(q, k, v), mesh=mesh,
      ...     in_specs=P("data", "context"), out_specs=P("data", "context"))  # doctest: +SKIP
    """
    size = bound_axis_size(axis) or 1
    t = q.shape[1]
    if size == 1:
        pos = jnp.arange(t, dtype=jnp.int32)
        queries = _Queries(q, pos, segment_ids)
        part = _attend(queries, _Keys(k, v, pos, segment_ids), causal, block_size)
        return finish(part, q.dtype)
    if t % 2:
        raise ValueError(
            f"ring_attention: {t} tokens on each of the {size} members of {axis!r} are not two "
            "zig-zag chunks; give each member an even number of tokens (a row of a multiple "
            f"of {2 * size}), cut by jzero.sequence_chunk."
        )
    pos = context_chunk(jnp.arange(t * size, dtype=jnp.int32), axis, 0)
    if _in_pipeline_stage():
        queries, keys = _Queries(q, pos, segment_ids), _Keys(k, v, pos, segment_ids)
        own = jax.checkpoint(functools.partial(_own, causal=causal, block=block_size))
        visit = jax.checkpoint(functools.partial(_visit, causal=causal, block=block_size))
        acc = _gathered(queries, keys, own(queries, keys), visit, axis, size)
        return finish(acc, q.dtype)
    ring = _Ring(axis, size, causal, block_size)
    return _ring_attention(ring, q, k, v, pos, segment_ids)


def _in_pipeline_stage() -> bool:
    """Whether this trace runs inside a pipeline stage (``pipe`` bound, of size > 1), where
    the stages run different passes in one slot."""
    return (bound_axis_size(PIPE_AXIS) or 1) > 1


def _gathered(
    queries: _Queries, keys: _Keys, acc: Partial, visit: Callable[..., Partial], axis: str,
    size: int,
) -> Partial:  # fmt: skip
    """The ring's later steps in the same order over the row's keys gathered once
    (``all_gather`` within the ``axis`` group; its transpose, a reduce-scatter, returns the
    keys' gradients), for inside a pipeline stage: see the module's decisions."""
    c = jax.lax.axis_index(axis)
    every = jax.tree.map(lambda x: jax.lax.all_gather(x, axis), keys)

    def step(acc: Partial, s: jax.Array) -> tuple[Partial, None]:
        source = (c - s) % size
        visited = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, source, 0, False), every)
        return merge(acc, visit(queries, visited, source < c)), None

    acc, _ = jax.lax.scan(step, acc, jnp.arange(1, size))
    return acc


class _Ring(NamedTuple):
    """The static settings of one ring attention: its axis and size, the mask, the blocks."""

    axis: str
    size: int
    causal: bool
    block: int | None

    def neighbours(self) -> list[tuple[int, int]]:
        return [(i, (i + 1) % self.size) for i in range(self.size)]

    def pass_on(self, tree: object) -> object:
        """Every array of ``tree`` handed to the next member of the ring."""
        return jax.tree.map(lambda x: jax.lax.ppermute(x, self.axis, self.neighbours()), tree)

    def partial(self, q: _Queries, keys: _Keys, s: jax.Array | int) -> Partial:
        """The partial of ``q`` over the keys that arrived at step ``s`` (0: this member's)."""
        if isinstance(s, int) and s == 0:
            return _own(q, keys, self.causal, self.block)
        source = (jax.lax.axis_index(self.axis) - s) % self.size  # c - s around the ring
        return _visit(q, keys, source < jax.lax.axis_index(self.axis), self.causal, self.block)


def _ring_forward(ring: _Ring, queries: _Queries, keys: _Keys) -> Partial:
    """The partial of ``queries`` over every member's keys, the keys passed around."""

    def step(carry: tuple[Partial, _Keys], s: jax.Array) -> tuple[tuple[Partial, _Keys], None]:
        acc, keys = carry
        keys = ring.pass_on(keys)
        return (merge(acc, ring.partial(queries, keys, s)), keys), None

    (acc, _), _ = jax.lax.scan(
        step, (ring.partial(queries, keys, 0), keys), jnp.arange(1, ring.size)
    )
    return acc


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(
    ring: _Ring,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    seg: jax.Array | None,
) -> jax.Array:
    """:func:`ring_attention` on a bound axis of more than one member (``pos``: this member's
    tokens' places in the row, ``seg``: their documents or ``None``), with its own backward
    ring."""
    acc = _ring_forward(ring, _Queries(q, pos, seg), _Keys(k, v, pos, seg))
    return finish(acc, q.dtype)


def _ring_attention_fwd(
    ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array, seg: jax.Array | None
) -> tuple[jax.Array, tuple]:
    """The forward ring, keeping this member's inputs, the output and its log-sum-exp."""
    acc = _ring_forward(ring, _Queries(q, pos, seg), _Keys(k, v, pos, seg))
    out = finish(acc, q.dtype)
    lse = acc.max + jnp.log(jnp.where(acc.sum > 0, acc.sum, 1))  # [B, H, Tq]
    return out, (q, k, v, pos, seg, out, lse)


def _ring_attention_bwd(ring: _Ring, res: tuple, d_out: jax.Array) -> tuple:
    """The backward ring: the keys go around again with their gradients beside them, each
    step's gradients taken through the surrogate of :func:`_surrogate` (flash attention's
    backward: only the output and its log-sum-exp are kept, never the visited keys)."""
    q, k, v, pos, seg, out, lse = res
    wide = jnp.promote_types(q.dtype, jnp.float32)
    d_out = d_out.astype(wide)
    delta = jnp.swapaxes(jnp.sum(d_out * out.astype(wide), axis=-1), 1, 2)  # [B, H, Tq]
    queries_at = functools.partial(_Queries, pos=pos, seg=seg)

    def grads(keys: _Keys, s: jax.Array | int) -> tuple[jax.Array, jax.Array, jax.Array]:
        def surrogate(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            part = ring.partial(queries_at(q), keys._replace(k=k, v=v), s)
            return _surrogate(part, d_out, delta, lse)

        found = jax.grad(surrogate, argnums=(0, 1, 2))(q, keys.k, keys.v)
        return tuple(g.astype(wide) for g in found)

    keys = _Keys(k, v, pos, seg)
    dq, dk, dv = grads(keys, 0)

    def step(carry: tuple, s: jax.Array) -> tuple[tuple, None]:
        dq, keys, dkv = carry
        keys, dkv = ring.pass_on((keys, dkv))
        gq, gk, gv = grads(keys, s)
        return (dq + gq, keys, (dkv[0] + gk, dkv[1] + gv)), None

    (dq, _, (dk, dv)), _ = jax.lax.scan(step, (dq, keys, (dk, dv)), jnp.arange(1, ring.size))
    dk, dv = ring.pass_on((dk, dv))  # the last keys' gradients home to their member
    no_grad = jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), (pos, seg))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_grad)


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def _surrogate(part: Partial, d_out: jax.Array, delta: jax.Array, lse: jax.Array) -> jax.Array:
    """A scalar whose gradient through ``part`` (the partial of some queries over some keys)
    is those keys' share of the attention's gradient, given the whole attention's output
    gradient ``d_out`` [B, Tq, H, Dh], ``delta`` = rowsum(d_out * out) and log-sum-exp
    ``lse`` [B, H, Tq] (all constants): ``sum_ts p_ts (d_out_t . v_s - delta_t)`` with
    ``p_ts = exp(score_ts - lse_t)``, written through the partial's
    ``out = sum_s exp(score_ts - max_t) v_s`` and ``sum``. Its derivative in the scores is
    ``p (d_out . v - delta)`` and in the values ``p^T d_out``: flash attention's backward."""
    scale = jnp.exp(part.max - lse)  # [B, H, Tq]; 0 where nothing was attended
    dot = jnp.swapaxes(jnp.sum(part.out * d_out, axis=-1), 1, 2)  # [B, H, Tq]
    return jnp.sum(scale * (dot - delta * part.sum))


def context_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    causal: bool = True,
    axis: str = CONTEXT_AXIS,
    seq_axis: str = SEQ_AXIS,
    block_size: int | None = None,
) -> jax.Array:
    """Attention of this device's tokens over the whole row under context parallelism, with
    Ulysses beside it: ring attention over ``axis``, inside Ulysses's all-to-alls over
    ``seq_axis``, each where its axis is bound (plain attention where neither is).

    Each device holds :func:`~jzero.parallel.sequence.layout.sequence_chunk`'s tokens: its
    ring member's zig-zag tokens, of which the ``j``-th contiguous ``1/S`` on device ``j`` of
    ``seq_axis``. Ulysses's all-to-all gives each ``seq`` device its member's tokens for
    ``H/S`` heads; the ring then runs over the members.

    Args:
      q: this device's queries ``[B, T/(C*S), H, Dh]``.
      k: its keys ``[B, T/(C*S), Hkv, Dh]`` (grouped-query attention: ``Hkv`` divides ``H``;
        under Ulysses ``S`` divides both).
      v: its values, shaped as ``k``.
      segment_ids: int ``[B, T/(C*S)]``, the documents of this device's tokens in packed
        rows, or ``None``.
      causal: a token sees only the tokens at its place in the row or before.
      axis: the context-parallel (ring) mesh axis.
      seq_axis: the sequence-parallel (Ulysses) mesh axis.
      block_size: each ring step's attention blockwise in blocks of this many tokens (see
        :func:`ring_attention`); ``None``: one block a step.

    Returns:
      ``[B, T/(C*S), H, Dh]`` in q's dtype: this device's rows of the attention output.

    Raises:
      ValueError: a head count ``S`` does not divide, or an odd number of tokens per ring
        member.

    Example:
      >>> def loss(params, batch):  # inside jzero's step, context and seq bound  # doctest: +SKIP
      ...     tokens = jzero.sequence_chunk(batch["tokens"])
      ...     pos = jzero.sequence_positions(tokens.shape[1])   # for position embeddings
      ...     out = jzero.context_parallel_attention(q, k, v)
    """
    if segment_ids is not None and (bound_axis_size(seq_axis) or 1) > 1:
        # The ring member's documents: Ulysses's attention sees the member's tokens.
        segment_ids = jax.lax.all_gather(segment_ids, seq_axis, axis=1, tiled=True)
    ring = functools.partial(ring_attention, causal=causal, axis=axis, block_size=block_size)
    return sequence_parallel_attention(ring, seq_axis)(q, k, v, segment_ids)
