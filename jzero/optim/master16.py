"""16-bit master weights (DeepSpeed's ``bf16.bf16_master_weights_and_grads``): the bfloat16
params are the masters, updated in float32 and rounded back, to nearest or stochastically.

Decisions:

* **Why.** Mixed precision keeps a float32 copy of every parameter next to its bfloat16 one:
  4 of the 16 bytes a parameter costs under Adam. With 16-bit masters the copy is gone: the
  params rest in bfloat16 and are what the optimizer updates.
* **Updated in float32** (:func:`float32_update`): the optimizer sees the gradients and the
  masters upcast to float32 (exactly: every bfloat16 is a float32), so its arithmetic, and its
  state unless ``bf16_optimizer_states`` narrows it, is the float32 one; the updates it returns
  are float32. ``optax.apply_updates`` adds them to the bfloat16 masters in float32 and rounds
  the sum to nearest bfloat16; the step does that in the update layout (each device its
  shard), then gathers the params as usual.
* **Stochastic rounding** (:func:`stochastic_round`, ``bf16.stochastic_rounding``): an update
  smaller than half a bfloat16 ulp of its weight (2^-9 relative) is lost to nearest rounding
  every time; rounding up with probability (distance to the lower neighbour) / ulp keeps it in
  expectation. It adds 16 uniform random bits below bfloat16's mantissa to the float32 bit
  pattern and truncates them, so the result is always one of the two bfloat16 neighbours, and
  exactly unbiased for finite values (inf and NaN round to nearest).
* **Reproducible keys** (:func:`rounding_key`): the random bits of leaf ``i`` at step ``s`` come
  from ``fold_in(fold_in(key(seed), s), i)``, ``s`` the state's update count (a skipped step
  does not advance it), drawn for the leaf's logical shape: the same bits at every ZeRO stage
  and mesh (partitionable threefry), and a restored run continues with the keys it would have
  used.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["float32_update", "rounding_key", "stochastic_round", "apply_rounded"]

PyTree = Any

ROUNDING_SEED = 0x5EED
"""The seed of the stochastic-rounding keys (folded with the step and the leaf index)."""


def _widen(tree: PyTree) -> PyTree:
    """Floating array leaves of ``tree`` as float32; anything else (optax's placeholders,
    integers, ``None``) as it is."""

    def widen(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float32:
            return x.astype(jnp.float32)
        return x

    return jax.tree.map(widen, tree)


def float32_update(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` run in float32 on 16-bit params and gradients.

    ``init`` and ``update`` hand ``tx`` the params (and gradients) with every floating leaf
    upcast to float32, so its state is the one float32 params would get (moments in float32,
    unless ``tx`` narrows them itself, as :func:`jzero.optim.low_precision_state` does) and its
    updates are float32. The state's structure is ``tx``'s.

    Args:
      tx: the optimizer.

    Returns:
      The wrapped transformation.
    """

    def init(params: PyTree) -> Any:
        return tx.init(_widen(params))

    def update(updates: PyTree, state: Any, params: PyTree = None, **extra: Any) -> Any:
        return tx.update(
            _widen(updates), state, None if params is None else _widen(params), **extra
        )

    return optax.GradientTransformationExtraArgs(init, update)


def rounding_key(step: jax.Array, index: int, seed: int = ROUNDING_SEED) -> jax.Array:
    """The stochastic-rounding key of parameter leaf ``index`` at update count ``step``."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), index)


def stochastic_round(x: jax.Array, key: jax.Array, dtype: Any = jnp.bfloat16) -> jax.Array:
    """``x`` (float32) rounded to ``dtype`` (bfloat16) up or down at random, unbiased.

    With ``lo <= x < hi`` the two neighbouring bfloat16 values (of ``x``'s sign, by magnitude),
    the result is ``hi`` with probability ``(|x| - |lo|) / (|hi| - |lo|)`` and ``lo`` otherwise:
    ``r``, 16 uniform random bits, is added to the low 16 bits of ``x``'s float32 pattern,
    which carries into bfloat16's last mantissa bit exactly when ``r >= 2^16 - low``, and the
    low bits are then dropped. Exact bfloat16 values stay as they are; inf and NaN round to
    nearest (a carry could turn a NaN into a zero); a value beyond bfloat16's largest may round
    up to inf, as nearest rounding does past half an ulp.

    Args:
      x: a float32 array.
      key: a PRNG key.
      dtype: ``bfloat16`` (the only 16-bit float whose bits are float32's upper half).

    Returns:
      ``x`` in ``dtype``.
    """
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(
            f"stochastic_round rounds float32 to bfloat16, not to {jnp.dtype(dtype).name}."
        )
    x = jnp.asarray(x, jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    out = jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
    return jnp.where(jnp.isfinite(x), out, x.astype(jnp.bfloat16))


def apply_rounded(
    params: PyTree, updates: PyTree, step: jax.Array | None = None, seed: int = ROUNDING_SEED
) -> PyTree:
    """``optax.apply_updates`` for 16-bit masters: ``params + updates`` in float32, rounded to
    the params' dtype, to nearest (``step`` ``None``) or stochastically with leaf ``i``'s key
    :func:`rounding_key` ``(step, i)`` (bfloat16 leaves; others to nearest)."""
    if step is None:
        return optax.apply_updates(params, updates)
    treedef = jax.tree.structure(params)
    out = []
    for i, (p, u) in enumerate(
        zip(jax.tree.leaves(params), treedef.flatten_up_to(updates), strict=True)
    ):
        wide = p.astype(jnp.float32) + jnp.asarray(u, jnp.float32)
        if p.dtype == jnp.bfloat16:
            out.append(stochastic_round(wide, rounding_key(step, i, seed)))
        else:
            out.append(wide.astype(p.dtype))
    return treedef.unflatten(out)
