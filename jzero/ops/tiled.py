"""Sequence-tiled computations: the output head's loss and a position-wise MLP, a chunk of
tokens at a time, so their widest intermediate is never whole.

The loss of a language model holds ``[B, T, V]`` float32 logits (at a 128k vocabulary and 8k
tokens, 4 GiB per sequence), and an MLP its ``[B, T, 4D]`` hidden layer, forward and backward.
Both are position-wise: each token's result needs only that token's row, so they can be
computed over chunks of the sequence under ``jax.checkpoint`` and the intermediate of one chunk
is all that exists, in the forward pass and in the backward pass (which recomputes it).

Decisions:

* **A ``lax.scan`` over chunks with the body under ``jax.checkpoint``**: the scan keeps one
  chunk's intermediate alive, the checkpoint keeps the backward pass from saving every chunk's.
  The price is one more forward of the tiled part in the backward pass (the head's matmul, or
  the MLP's).
* **``chunk = 0`` or a sequence of at most ``chunk`` tokens is computed whole**: no scan, the
  same program as the plain form.
* **A length that is not a multiple of ``chunk`` is padded** up to one; padded places weigh
  nothing in the loss and their MLP outputs are dropped.
* :func:`tiled_cross_entropy` returns the **weighted sum** of the per-token losses (a caller
  divides by what its mean is over: the token count, or the kept targets); the head's matmul
  accumulates in float32 (float64 for float64 inputs) and the log-softmax is taken there.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["tiled_cross_entropy", "tiled_mlp"]


def _check_chunk(name: str, chunk: int) -> None:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
        raise ValueError(
            f"{name}: chunk={chunk!r} must be an integer >= 0 (tokens per chunk; 0 computes the "
            "whole sequence at once)."
        )


def _chunks(x: jax.Array, n: int, chunk: int) -> jax.Array:
    """``x`` ``[B, T, ...]`` padded to ``n * chunk`` tokens, as ``[n, B, chunk, ...]``."""
    pad = n * chunk - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)


def _nll_sum(
    hidden: jax.Array, head: jax.Array, targets: jax.Array, weights: jax.Array | None
) -> jax.Array:
    """The weighted sum of ``-log softmax(hidden @ head.T)[target]`` over ``[B, T]``."""
    wide = jnp.promote_types(hidden.dtype, jnp.float32)
    logits = jnp.einsum("btd,vd->btv", hidden, head, preferred_element_type=wide)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - picked
    if weights is None:
        return nll.sum()
    return jnp.where(weights != 0, nll * weights.astype(wide), 0).sum()


def tiled_cross_entropy(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    chunk: int = 1024,
    weights: jax.Array | None = None,
) -> jax.Array:
    """The output head and the cross-entropy over sequence chunks: no ``[B, T, V]`` logits.

    Computes ``sum(weights * -log_softmax(hidden @ head.T)[targets])`` a chunk of ``chunk``
    tokens at a time (a ``lax.scan`` under ``jax.checkpoint``), so one chunk's ``[B, chunk, V]``
    logits are all that exists in the forward and the backward pass. The value and gradients
    are the plain form's.

    Args:
        hidden: ``[B, T, D]``, the activations the head reads (after any final norm).
        head: ``[V, D]``, the output head's weights (a tied embedding table), in the dtype the
            matmul should run in.
        targets: int ``[B, T]``, the token each place predicts.
        chunk: tokens per chunk; ``0``, or ``T <= chunk``, computes the whole sequence at once.
            A ``T`` that is not a multiple is padded (the padding weighs nothing).
        weights: ``[B, T]`` weights of the places (a bool keep mask, or floats); ``None`` for
            all ones. A place of weight 0 contributes nothing, whatever its logits.

    Returns:
        The weighted sum of the per-token losses, a float32 scalar (float64 for float64
        inputs); divide it by the count the mean is over.

    Raises:
        ValueError: ``chunk`` not an integer >= 0, or shapes that do not fit together.
    """
    _check_chunk("tiled_cross_entropy", chunk)
    b, t, d = hidden.shape
    if head.ndim != 2 or head.shape[1] != d or targets.shape != (b, t):
        raise ValueError(
            f"tiled_cross_entropy takes hidden [B, T, D], head [V, D] and targets [B, T]; got "
            f"hidden {hidden.shape}, head {head.shape}, targets {targets.shape}."
        )
    if chunk == 0 or t <= chunk:
        return _nll_sum(hidden, head, targets, weights)
    n = -(-t // chunk)
    ones = jnp.ones((b, t), jnp.promote_types(hidden.dtype, jnp.float32))
    w = ones if weights is None else weights
    xs = (_chunks(hidden, n, chunk), _chunks(targets, n, chunk), _chunks(w, n, chunk))

    @jax.checkpoint
    def step(total: jax.Array, part: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        return total + _nll_sum(part[0], head, part[1], part[2]), None

    total, _ = jax.lax.scan(step, jnp.zeros((), ones.dtype), xs)
    return total


def tiled_mlp(
    fn: Callable[[jax.Array], jax.Array], x: jax.Array, *, chunk: int = 1024
) -> jax.Array:
    """A position-wise function over sequence chunks, rematerialised: its intermediate
    (an MLP's ``[B, chunk, 4D]`` hidden layer) is never whole.

    Args:
        fn: ``[B, c, D] -> [B, c, D']``, the same function at each place (no mixing along the
            sequence), for any ``c``; it may close over parameters (their gradients are summed
            over the chunks).
        x: ``[B, T, D]``.
        chunk: tokens per chunk; ``0``, or ``T <= chunk``, calls ``fn(x)`` once. A ``T`` that
            is not a multiple is padded (the padded places' outputs are dropped).

    Returns:
        ``fn(x)``, ``[B, T, D']``, computed a chunk at a time (a ``lax.scan`` under
        ``jax.checkpoint``).

    Raises:
        ValueError: ``chunk`` not an integer >= 0.
    """
    _check_chunk("tiled_mlp", chunk)
    b, t = x.shape[:2]
    if chunk == 0 or t <= chunk:
        return fn(x)
    n = -(-t // chunk)

    @jax.checkpoint
    def step(_: None, part: jax.Array) -> tuple[None, jax.Array]:
        return None, fn(part)

    _, out = jax.lax.scan(step, None, _chunks(x, n, chunk))
    return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, *out.shape[3:])[:, :t]
