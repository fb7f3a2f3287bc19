"""The token layout of sequence and context parallelism: which of a row's tokens each device
holds, and their positions.

A batch enters the step's ``shard_map`` with its rows replicated over ``context`` and ``seq``;
:func:`sequence_chunk` cuts each row into this device's tokens, :func:`sequence_positions`
gives their places in the row (for position embeddings), and :func:`context_chunk` gives one
ring member's tokens (what Ulysses's all-to-all gathers within a ``seq`` group).

Decisions:

* **Zig-zag over ``context``.** The row is cut into ``2C`` equal chunks and ring member ``c``
  holds chunks ``c`` and ``2C-1-c``, in that order: under a causal mask member ``c``'s
  queries see ``c + 1/2`` chunks of the first half and ``2C-1-c + 1/2`` of the second, the
  same ``2C`` chunks in all for every member, so every member does the same work
  (:mod:`jzero.parallel.sequence.ring`). Contiguous chunks would leave member 0 idle while
  member ``C-1`` attends to the whole row.
* **Then contiguous over ``seq``.** Within one ring member's ``T/C`` tokens, device ``s`` of
  ``seq`` holds the contiguous ``s``-th ``1/S`` of them: the order Ulysses's all-to-all
  concatenates in, so after it each ``seq`` device sees its ring member's tokens in the
  member's order.
* **One function for every layout.** Each function reads which axes are bound (``shard_map``
  with them manual) and of what size; an unbound axis or one of size 1 leaves the row as it
  is, so a model calls them unconditionally and is the plain model outside the step.
* Positions are an array (:func:`sequence_positions`) because zig-zag tokens are not
  contiguous; :func:`sequence_offset` (one start position) serves the contiguous Ulysses
  layout and refuses a bound ``context`` axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jzero.distributed.mesh import CONTEXT_AXIS, SEQ_AXIS

__all__ = [
    "bound_axis_size",
    "context_chunk",
    "sequence_chunk",
    "sequence_offset",
    "sequence_positions",
]


def bound_axis_size(axis: str) -> int | None:
    """The size of the mapped axis ``axis`` where it is bound (``shard_map`` with it manual,
    or ``vmap``/``pmap`` naming it), else ``None``."""
    try:
        return jax.lax.axis_size(axis)
    except NameError:  # JAX: "unbound axis name: seq"
        return None


def _split_size(axis: str) -> int:
    """The size of ``axis`` where bound, else 1."""
    return bound_axis_size(axis) or 1


def _check_divides(fn: str, x: jax.Array, dim: int, parts: int, axes: str) -> None:
    """Raises ``ValueError`` naming the length when ``parts`` does not divide dimension ``dim``."""
    length = x.shape[dim]
    if length % parts:
        raise ValueError(
            f"{fn}: a sequence of {length} tokens (dimension {dim} of shape {tuple(x.shape)}) "
            f"cannot be cut into the {parts} equal pieces {axes} needs. Pad or cut the sequence "
            f"to a multiple of {parts}, or choose axis sizes whose pieces divide {length}."
        )


def context_chunk(x: jax.Array, axis: str = CONTEXT_AXIS, dim: int = 1) -> jax.Array:
    """This ring member's zig-zag tokens of ``x``: chunks ``c`` and ``2C-1-c`` of ``2C`` along
    ``dim``, concatenated, for a row that enters ``shard_map`` replicated over ``axis``.

    Args:
      x: the full-length array, the same on every device of ``axis``.
      axis: the context-parallel mesh axis.
      dim: the sequence dimension of ``x``.

    Returns:
      ``x``'s ``T/C`` tokens of ring member ``jax.lax.axis_index(axis)``; ``x`` itself where
      ``axis`` is unbound or of size 1.

    Raises:
      ValueError: a length along ``dim`` that ``2C`` does not divide.
    """
    size = _split_size(axis)
    if size == 1:
        return x
    _check_divides("context_chunk", x, dim, 2 * size, f"the {size} devices of {axis!r} (2x)")
    piece = x.shape[dim] // (2 * size)
    c = jax.lax.axis_index(axis)
    first = jax.lax.dynamic_slice_in_dim(x, c * piece, piece, axis=dim)
    second = jax.lax.dynamic_slice_in_dim(x, (2 * size - 1 - c) * piece, piece, axis=dim)
    return jnp.concatenate([first, second], axis=dim)


def sequence_chunk(
    x: jax.Array, axis: str = SEQ_AXIS, dim: int = 1, *, context_axis: str = CONTEXT_AXIS
) -> jax.Array:
    """This device's tokens of ``x`` along ``dim``, for a batch that enters ``shard_map``
    replicated over ``axis`` (and ``context_axis``): its ring member's zig-zag tokens
    (:func:`context_chunk`), then the contiguous ``j``-th ``1/S`` of them for device ``j`` of
    ``axis``.

    Args:
      x: the full-length array, the same on every device of ``axis`` and ``context_axis``.
      axis: the sequence-parallel (Ulysses) mesh axis.
      dim: the sequence dimension of ``x``.
      context_axis: the context-parallel (ring) mesh axis.

    Returns:
      ``x``'s ``T/(C*S)`` tokens on this device; ``x`` itself where both axes are unbound or
      of size 1.

    Raises:
      ValueError: a length along ``dim`` that the axes' sizes do not divide.
    """
    x = context_chunk(x, context_axis, dim)
    size = _split_size(axis)
    if size == 1:
        return x
    if x.shape[dim] % size:
        where = (
            f" (one ring member's tokens of {context_axis!r})"
            if _split_size(context_axis) > 1
            else ""
        )
        raise ValueError(
            f"sequence_chunk: a sequence of {x.shape[dim]} tokens{where} (dimension {dim} of "
            f"shape {tuple(x.shape)}) cannot be split evenly over the {size} devices of the "
            f"{axis!r} axis. Pad or cut the sequence to a multiple of {size}, or choose a "
            f"{axis!r} size among the divisors of {x.shape[dim]}."
        )
    local = x.shape[dim] // size
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * local, local, axis=dim)


def sequence_positions(
    local_len: int, axis: str = SEQ_AXIS, *, context_axis: str = CONTEXT_AXIS
) -> jax.Array:
    """The places in the row of this device's ``local_len`` tokens (:func:`sequence_chunk`'s
    order), for position embeddings and causal masks.

    Args:
      local_len: the number of tokens each device holds (``T/(C*S)``).
      axis: the sequence-parallel (Ulysses) mesh axis.
      context_axis: the context-parallel (ring) mesh axis.

    Returns:
      int32 ``[local_len]``: ``arange(local_len)`` where both axes are unbound, else this
      device's chunk of ``arange(T)``.
    """
    total = local_len * _split_size(axis) * _split_size(context_axis)
    return sequence_chunk(jnp.arange(total, dtype=jnp.int32), axis, 0, context_axis=context_axis)


def sequence_offset(local_len: int, axis: str = SEQ_AXIS) -> jax.Array | int:
    """The global position of this device's first token under Ulysses's contiguous layout,
    for position embeddings: this device's index on ``axis`` times ``local_len`` (0 where
    ``axis`` is unbound).

    Args:
      local_len: the number of tokens each device holds (``T/S``).
      axis: the sequence-parallel mesh axis.

    Returns:
      ``jax.lax.axis_index(axis) * local_len`` (a traced int32 scalar) under a bound ``axis``;
      the Python int 0 where it is unbound.

    Raises:
      ValueError: under a bound ``context`` axis of more than one device, whose zig-zag tokens
        have no single offset.
    """
    if _split_size(CONTEXT_AXIS) > 1:
        raise ValueError(
            f"sequence_offset: under context parallelism (a bound {CONTEXT_AXIS!r} axis of "
            f"{_split_size(CONTEXT_AXIS)} devices) a device's tokens are two zig-zag chunks "
            "with no single start position. Use sequence_positions(local_len), the position "
            "of each token, instead."
        )
    if bound_axis_size(axis) is None:
        return 0
    return jax.lax.axis_index(axis) * local_len
