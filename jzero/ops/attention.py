"""Attention that never holds a ``[T, T]`` score matrix: online softmax over key blocks.

The primitive (:class:`Partial`, :func:`empty_partial`, :func:`attend_block`, :func:`merge`,
:func:`finish`, :func:`block_mask`) is the flash-attention recurrence written as small pure
functions: attention over some key blocks is a :class:`Partial` (the un-normalised output, the
running maximum of the scores and the running sum of their exponentials), two partials over
disjoint key blocks merge into the partial over both, and :func:`finish` divides. Ring attention
(keys passed around a ring of devices) and :func:`blockwise_attention` (keys visited in blocks
on one device) are both loops of these.

Decisions:

* **Layout** ``[B, T, H, Dh]`` for q, k, v and the output (the built-in GPT's, and
  :func:`jzero.sequence_parallel_attention`'s default); the statistics are ``[B, H, Tq]``.
  **Grouped-query attention**: k and v may have ``Hkv`` heads with ``H % Hkv == 0``; query head
  ``h`` reads key/value head ``h // (H // Hkv)``.
* **Wide statistics**: scores, maxima, sums and the output accumulator are float32 (float64 for
  float64 inputs); the scores' matmul accumulates in that dtype, the probabilities are cast to
  v's dtype for the ``p @ v`` matmul (accumulated wide), as flash attention does.
* **No infinities**: a masked score is the wide dtype's most negative finite number, and the
  probabilities of masked places are zeroed explicitly, so a row with nothing to attend gives a
  zero sum (never ``inf - inf``) and :func:`finish` turns it into zeros, not NaN.
* **The running maximum carries no gradient** (``stop_gradient``): the finished output and the
  log-sum-exp (``max + log(sum)``) do not depend on it, so their gradients are exact, and no
  gradient flows through the maximum's choice of element.
* :func:`blockwise_attention`: an outer ``lax.scan`` over query blocks whose body is under
  ``jax.checkpoint``, an inner ``lax.scan`` over key blocks whose body is checkpointed too, and a
  ``lax.cond`` that skips a key block the mask hides entirely (under a causal mask, about half of
  them). What the backward pass keeps is one query block's per-key-block partials, ``O(T * H *
  Dh)``; the ``[block, block]`` score tiles are recomputed. A sequence of at most
  ``block_size`` tokens is one block: one :func:`attend_block` and :func:`finish`, no scan.
* **Lengths that are not a multiple of the block are padded** up to one (padded keys are masked,
  padded queries dropped from the output), so any length works; the padding costs at most one
  block of work.
* **cuDNN on GPU**: on a GPU backend, with 16-bit q, k, v, a causal mask and no segment ids or
  positions, :func:`blockwise_attention` calls ``jax.nn.dot_product_attention(...,
  implementation="cudnn", is_causal=True)`` (cuDNN's fused flash attention); where JAX refuses
  that call when tracing it (no cuDNN, a shape it does not take) the blockwise path runs. This
  branch is not exercised by the CPU test suite. Packed documents (segment ids) always take
  the blockwise path, which supports them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "Partial",
    "attend_block",
    "block_mask",
    "blockwise_attention",
    "blockwise_partial",
    "empty_partial",
    "finish",
    "merge",
]


class Partial(NamedTuple):
    """Attention of some queries over some key blocks, not yet normalised."""

    out: jax.Array
    """``[B, Tq, H, Dh]``: the sum of ``exp(score - max) * v`` over the keys seen (wide dtype)."""
    max: jax.Array
    """``[B, H, Tq]``: the running maximum of the scores (wide dtype; the most negative finite
    number while no key has been attended)."""
    sum: jax.Array
    """``[B, H, Tq]``: the running sum of ``exp(score - max)`` (wide dtype)."""


def _wide(dtype: jnp.dtype) -> jnp.dtype:
    """The statistics' dtype: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def empty_partial(q: jax.Array) -> Partial:
    """The partial over no keys, the identity of :func:`merge`.

    Args:
        q: the queries ``[B, Tq, H, Dh]``.

    Returns:
        A :class:`Partial` with a zero output and sum and the most negative finite maximum.
    """
    b, t, h, _ = q.shape
    wide = _wide(q.dtype)
    stats = (b, h, t)
    return Partial(
        out=jnp.zeros(q.shape, wide),
        max=jnp.full(stats, jnp.finfo(wide).min, wide),
        sum=jnp.zeros(stats, wide),
    )


def _check_heads(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"Attention takes q, k, v shaped [B, T, H, Dh]; got q {q.shape}, k {k.shape}, "
            f"v {v.shape}. Reshape the heads out of the model dimension first."
        )
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape.")
    if q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"q {q.shape} and k {k.shape} must agree on the batch and head dimensions (dims 0 "
            "and 3)."
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q has {q.shape[2]} heads and k, v have {k.shape[2]}: grouped-query attention "
            "needs the key/value heads to divide the query heads. Use a divisor of "
            f"{q.shape[2]} key/value heads."
        )


def attend_block(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> Partial:
    """The partial attention of queries over one block of keys.

    Args:
        q: queries ``[B, Tq, H, Dh]``.
        k: keys ``[B, Tk, Hkv, Dh]`` with ``H % Hkv == 0`` (query head ``h`` reads key head
            ``h // (H // Hkv)``).
        v: values, shaped as ``k``.
        mask: bool, broadcastable to ``[B, Tq, Tk]``; ``True`` where a query may attend a key
            (:func:`block_mask` builds one).

    Returns:
        The :class:`Partial` over these keys; scores scaled by ``1 / sqrt(Dh)``.

    Raises:
        ValueError: shapes that do not fit together.
    """
    _check_heads(q, k, v)
    b, tq, h, dh = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    wide = _wide(q.dtype)
    qg = q.reshape(b, tq, hkv, h // hkv, dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=wide)
    scores = scores * jnp.asarray(1 / math.sqrt(dh), wide)
    allowed = jnp.broadcast_to(mask, (b, tq, tk))[:, None, None]  # [B, 1, 1, Tq, Tk]
    scores = jnp.where(allowed, scores, jnp.finfo(wide).min)
    top = jax.lax.stop_gradient(scores.max(-1))  # [B, Hkv, G, Tq]
    probs = jnp.where(allowed, jnp.exp(scores - top[..., None]), 0)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v, preferred_element_type=wide)
    return Partial(
        out=out.reshape(b, tq, h, dh),
        max=top.reshape(b, h, tq),
        sum=probs.sum(-1).reshape(b, h, tq),
    )


def merge(a: Partial, b: Partial) -> Partial:
    """The partial over the keys of both ``a`` and ``b`` (disjoint key sets, same queries).

    Args:
        a: one partial.
        b: the other; :func:`empty_partial` is the identity.

    Returns:
        Their online-softmax combination: each rescaled to the larger maximum, then added.
    """
    top = jnp.maximum(a.max, b.max)
    scale_a, scale_b = jnp.exp(a.max - top), jnp.exp(b.max - top)

    def per_query(s: jax.Array) -> jax.Array:  # [B, H, Tq] -> [B, Tq, H, 1]
        return jnp.swapaxes(s, 1, 2)[..., None]

    return Partial(
        out=a.out * per_query(scale_a) + b.out * per_query(scale_b),
        max=top,
        sum=a.sum * scale_a + b.sum * scale_b,
    )


def finish(p: Partial, dtype: jnp.dtype) -> jax.Array:
    """The attention output of a partial: its output divided by its sum.

    Args:
        p: the partial over all the keys.
        dtype: the result's dtype (usually q's).

    Returns:
        ``[B, Tq, H, Dh]`` in ``dtype``; a query that attended no key gets zeros.
    """
    total = jnp.swapaxes(p.sum, 1, 2)[..., None]  # [B, Tq, H, 1]
    seen = total > 0
    return jnp.where(seen, p.out / jnp.where(seen, total, 1), 0).astype(dtype)


def block_mask(
    q_pos: jax.Array,
    k_pos: jax.Array,
    q_seg: jax.Array | None = None,
    k_seg: jax.Array | None = None,
    *,
    causal: bool = True,
) -> jax.Array:
    """Which queries may attend which keys, from their positions and documents.

    Args:
        q_pos: int ``[B or 1, Tq]``: the queries' positions in the whole sequence.
        k_pos: int ``[B or 1, Tk]``: the keys' positions.
        q_seg: int ``[B, Tq]`` document ids of packed rows (or ``None``): a query sees only keys
            of its own document. Padding (id 0) is a document like any other.
        k_seg: the keys' document ids; given exactly when ``q_seg`` is.
        causal: a query sees only keys at its position or before.

    Returns:
        bool ``[B, Tq, Tk]`` (``B`` the largest leading dim given), ``True`` where allowed.

    Raises:
        ValueError: only one of ``q_seg`` and ``k_seg`` given.
    """
    if (q_seg is None) != (k_seg is None):
        raise ValueError(
            "block_mask needs both q_seg and k_seg (the queries' and keys' document ids) or "
            "neither; pass the missing one."
        )
    q_pos, k_pos = jnp.atleast_2d(q_pos), jnp.atleast_2d(k_pos)
    mask = jnp.ones((max(q_pos.shape[0], k_pos.shape[0]), q_pos.shape[1], k_pos.shape[1]), bool)
    if causal:
        mask = mask & (k_pos[:, None, :] <= q_pos[:, :, None])
    if q_seg is not None:
        mask = mask & (k_seg[:, None, :] == q_seg[:, :, None])
    return mask


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(
            f"blockwise_attention: block_size={block_size!r} must be a positive integer (the "
            "tokens per query and key block; 512 is the usual)."
        )


def _use_cudnn(q: jax.Array) -> bool:
    """Whether cuDNN's fused attention can take q (GPU, 16-bit, a head size it supports); the
    caller checks that the mask is the plain causal one."""
    return (
        jax.default_backend() == "gpu"
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 128
    )


def _varying_like(part: Partial, *data: object) -> Partial:
    """``part`` varying over the manual mesh axes any array of ``data`` varies over: inside
    ``shard_map`` (a ring step's keys, Ulysses's heads) a scan's carry and a ``cond``'s two
    branches must agree on them, and an empty partial made of constants varies over none."""
    axes: set[str] = set()
    for x in jax.tree.leaves(data):
        aval = jax.typeof(x)
        manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10; older JAX: ``vma``
        axes |= set(manual.varying if manual is not None else getattr(aval, "vma", None) or ())
    if not axes:
        return part
    return jax.tree.map(lambda x: jax.lax.pcast(x, tuple(sorted(axes)), to="varying"), part)


def _blocks(x: jax.Array, n: int, size: int) -> jax.Array:
    """``x`` ``[B, n * size, ...]`` as ``[n, B, size, ...]``: the scans' leading block dim."""
    return jnp.moveaxis(x.reshape(x.shape[0], n, size, *x.shape[2:]), 1, 0)


def _pad_seq(x: jax.Array, pad: int) -> jax.Array:
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    causal: bool = True,
    block_size: int = 512,
) -> jax.Array:
    """Softmax self-attention computed block by block, never holding a ``[T, T]`` matrix.

    Flash attention's recurrence: for each block of ``block_size`` queries (an outer
    ``lax.scan`` under ``jax.checkpoint``), the keys are visited a block at a time (an inner
    ``lax.scan``, its body checkpointed too) and folded in with :func:`attend_block` and
    :func:`merge`; a key block the mask hides entirely is skipped (``lax.cond``). The backward
    pass recomputes the score tiles, one query block at a time. A length of at most
    ``block_size`` is one block (no scan); a length that is not a multiple of ``block_size`` is
    padded up to one (the padded keys masked, the padded queries dropped).

    On a GPU, with 16-bit inputs, ``causal``, no ``segment_ids`` and no ``positions``, the call
    goes to cuDNN's fused attention (``jax.nn.dot_product_attention(...,
    implementation="cudnn", is_causal=True)``) instead, or the blockwise path where JAX refuses
    that call when tracing it; that branch is not run by the CPU test suite. Packed documents
    (``segment_ids``) are supported by the blockwise path.

    Args:
        q: queries ``[B, T, H, Dh]``.
        k: keys ``[B, T, Hkv, Dh]``, ``H % Hkv == 0`` (grouped-query attention).
        v: values, shaped as ``k``.
        segment_ids: int ``[B, T]`` document ids of packed rows: a token attends only tokens of
            its own document (padding, id 0, is a document like any other).
        positions: int ``[B or 1, T]`` positions for the causal mask (default: the place in the
            row, ``0 .. T-1``).
        causal: a token attends only tokens at its position or before.
        block_size: tokens per query and key block.

    Returns:
        ``[B, T, H, Dh]`` in q's dtype; scores scaled by ``1 / sqrt(Dh)``, the softmax in
        float32 (float64 for float64 inputs).

    Raises:
        ValueError: shapes that do not fit together (q, k, v, the segment ids or positions), or
            a ``block_size`` that is not a positive integer.
    """
    _check_heads(q, k, v)
    _check_block_size(block_size)
    b, t, h, dh = q.shape
    if k.shape[1] != t:
        raise ValueError(
            f"blockwise_attention is self-attention: q has {t} tokens and k, v have "
            f"{k.shape[1]}. Pass q, k and v of the same sequence."
        )
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(
            f"blockwise_attention: segment_ids has shape {segment_ids.shape}; it must be "
            f"[B, T] = {(b, t)}, one document id per token of each row."
        )
    if positions is not None and jnp.atleast_2d(positions).shape not in ((b, t), (1, t)):
        raise ValueError(
            f"blockwise_attention: positions has shape {positions.shape}; it must be [B, T] = "
            f"{(b, t)} or [1, T] (the same for every row)."
        )
    if causal and segment_ids is None and positions is None and _use_cudnn(q):
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        except (RuntimeError, ValueError, NotImplementedError):
            pass  # refused when traced (no cuDNN, or a shape it does not take): blockwise below
    pos = jnp.arange(t)[None] if positions is None else jnp.atleast_2d(positions)
    segments = None if segment_ids is None else (segment_ids, segment_ids)
    part = blockwise_partial(q, k, v, pos, pos, segments, causal=causal, block_size=block_size)
    return finish(part, q.dtype)


def blockwise_partial(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    segments: tuple[jax.Array, jax.Array] | None = None,
    *,
    causal: bool = True,
    block_size: int = 512,
) -> Partial:
    """The :class:`Partial` of ``q`` over the keys ``k``, ``v``, block by block: the body of
    :func:`blockwise_attention`, for queries and keys of any two lengths (a ring step's).

    Queries and keys are cut into blocks of ``block_size`` (padded: the padded keys masked,
    the padded queries dropped); an outer ``lax.scan`` over query blocks under
    ``jax.checkpoint`` visits the key blocks in an inner one (its body checkpointed too),
    skipping those the mask hides entirely. Within one block each way it is one
    :func:`attend_block`.

    Args:
        q: queries ``[B, Tq, H, Dh]``.
        k: keys ``[B, Tk, Hkv, Dh]`` (``Hkv`` divides ``H``).
        v: values, shaped as ``k``.
        q_pos: int ``[B or 1, Tq]``: the queries' positions in the row.
        k_pos: int ``[B or 1, Tk]``: the keys'.
        segments: packed rows' document ids, int ``([B, Tq], [B, Tk])`` for the queries and
            the keys, or ``None``.
        causal: a query sees only keys at its position or before.
        block_size: tokens per query and key block.

    Returns:
        The partial over all of ``k``'s keys, in the wide dtype (:func:`finish` normalises it).
    """
    _check_heads(q, k, v)
    _check_block_size(block_size)
    b, tq, h, dh = q.shape
    tk = k.shape[1]
    q_pos, k_pos = jnp.atleast_2d(q_pos), jnp.atleast_2d(k_pos)
    q_seg, k_seg = (None, None) if segments is None else segments
    if tq <= block_size and tk <= block_size:
        return attend_block(q, k, v, block_mask(q_pos, k_pos, q_seg, k_seg, causal=causal))
    nq, nk = -(-tq // block_size), -(-tk // block_size)
    qb = _blocks(_pad_seq(q, nq * block_size - tq), nq, block_size)
    qposb = _blocks(_pad_seq(q_pos, nq * block_size - tq), nq, block_size)
    kb, vb = (_blocks(_pad_seq(x, nk * block_size - tk), nk, block_size) for x in (k, v))
    kposb = _blocks(_pad_seq(k_pos, nk * block_size - tk), nk, block_size)
    qsegb = ksegb = None
    if q_seg is not None:
        qsegb = _blocks(_pad_seq(q_seg, nq * block_size - tq), nq, block_size)
        ksegb = _blocks(_pad_seq(k_seg, nk * block_size - tk), nk, block_size)
    realb = (jnp.arange(nk * block_size) < tk).reshape(nk, 1, 1, block_size)  # not padding

    def key_step(acc: Partial, key_block: tuple) -> tuple[Partial, None]:
        qi, qpos, qseg, kj, vj, kpos, kseg, kreal = key_block
        mask = block_mask(qpos, kpos, qseg, kseg, causal=causal) & kreal

        def attend(acc: Partial) -> Partial:
            return merge(acc, attend_block(qi, kj, vj, mask))

        return jax.lax.cond(mask.any(), attend, lambda acc: acc, acc), None

    def query_step(_: None, query_block: tuple) -> tuple[None, Partial]:
        qi, qpos, qseg = query_block
        # The query block rides along each key step (broadcast, not stacked).
        step = jax.checkpoint(
            lambda acc, kv: key_step(acc, (qi, qpos, qseg, *kv)), prevent_cse=False
        )
        keys = (kb, vb, kposb, ksegb, realb)
        acc, _ = jax.lax.scan(step, _varying_like(empty_partial(qi), query_block, keys), keys)
        return None, acc

    _, parts = jax.lax.scan(
        jax.checkpoint(query_step, prevent_cse=False), None, (qb, qposb, qsegb)
    )  # out [nq, B, block, H, Dh]; max, sum [nq, B, H, block]
    return Partial(
        out=jnp.moveaxis(parts.out, 0, 1).reshape(b, nq * block_size, h, dh)[:, :tq],
        max=jnp.moveaxis(parts.max, 0, 2).reshape(b, h, nq * block_size)[..., :tq],
        sum=jnp.moveaxis(parts.sum, 0, 2).reshape(b, h, nq * block_size)[..., :tq],
    )
