"""Rotary position embeddings (RoPE): each token's queries and keys rotated by its position.

A pair of a head's channels is rotated by the angle ``position * theta ** (-2i / Dh)``, so the
score of a query and a key depends on their positions' difference only, and a model carries no
position table: nothing per token is a parameter, which is what lets sequence and context
parallelism divide every per-token byte.

Decisions:

* **Rotate-half pairs**: channel ``i`` pairs with channel ``i + Dh/2`` (the first half of the
  head holds the pairs' first members), which needs an even head dimension.
* **Positions are given, not assumed**: an int ``[T]`` (the same for every row) or ``[B, T]``
  (packed documents restart at 0). Under sequence or context parallelism a device passes its
  own tokens' places in the row, so the rotation is elementwise per token and runs before any
  exchange of keys.
* **Angles in the wide dtype**: positions, frequencies, ``cos`` and ``sin`` are float32 (float64
  for float64 inputs); the result is cast back to the input's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["rotary"]


def rotary(x: jax.Array, positions: jax.Array, *, theta: float = 10000.0) -> jax.Array:
    """Rotary position embedding of queries or keys.

    Args:
      x: ``[B, T, H, Dh]`` heads, ``Dh`` even.
      positions: int ``[T]`` or ``[B, T]``: each token's position.
      theta: the base of the frequencies (10000 in the RoPE paper).

    Returns:
      ``x`` rotated, in ``x``'s dtype.

    Raises:
      ValueError: an odd head dimension, or positions of another length than ``x``'s tokens.

    Example:
      >>> q = jnp.ones((1, 4, 2, 8))
      >>> rotary(q, jnp.arange(4)).shape
      (1, 4, 2, 8)
    """
    t, d = x.shape[1], x.shape[-1]
    if d % 2:
        raise ValueError(
            f"rotary: the head dimension {d} (last of shape {tuple(x.shape)}) is odd; rotary "
            "positions rotate pairs of channels. Use an even head dimension."
        )
    if positions.ndim not in (1, 2) or positions.shape[-1] != t:
        raise ValueError(
            f"rotary: positions of shape {tuple(positions.shape)} do not match the {t} tokens "
            f"of x {tuple(x.shape)}; pass int [{t}] or [batch, {t}] positions."
        )
    wide = jnp.promote_types(x.dtype, jnp.float32)
    freq = theta ** (-jnp.arange(0, d // 2, dtype=wide) * 2 / d)
    angle = positions.astype(wide)[..., None] * freq  # [T, Dh/2] or [B, T, Dh/2]
    if angle.ndim == 2:
        angle = angle[None]
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(wide), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)
