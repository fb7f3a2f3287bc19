"""Adam's moments kept at rest as 8-bit codes with blockwise scales (``state_bits: 8``).

``quantized_adam_state(tx)`` wraps any transformation whose state holds ``optax.ScaleByAdamState``
nodes (jzero's :func:`~jzero.optim.transforms.scale_by_fused_adam`, ``optax.scale_by_adam``, and
the chains built from them): each such node rests as a :class:`QuantizedAdamState`, and every
update decodes it to float32, runs ``tx``'s own update there and encodes the new moments. The
idea is bitsandbytes' 8-bit blockwise Adam (Dettmers et al., 2022); the code is jzero's own.

Decisions:

* **Why.** With fp32 masters, Adam's two float32 moments are 8 of the 16 bytes a parameter
  costs; as an int8 and a uint8 code they are 2, plus one float32 scale per block and moment
  (4 / 256 bytes a parameter at the default block), so with rows of 256 elements or more the
  optimizer state per device is about 0.26x the fp32 state's at every ZeRO stage (1.9 bytes
  less a parameter than bf16 moments); the tests' toy (rows of 64, 5, 3) and tiny GPT (rows of
  32 to 128) measure 0.29x and 0.28x.
* **Codes have exactly the parameter's shape** (``int8`` for ``mu``, ``uint8`` for ``nu``), so
  the plan (``optax.tree_map_params``) shards and pads them exactly like the parameter and its
  gradient, and a checkpoint stores them like any other state leaf.
* **Blocks run along the last dimension**: a leaf of shape ``(..., L)`` has float32 scales of
  shape ``(..., ceil(L / block_size))``, the absolute maximum of each run of ``block_size``
  elements of a row (the last block of a row shorter, a row shorter than a block one block).
  A shard of rows (ZeRO splits the leading dimension) therefore carries its rows' scales and
  encodes them without reading another device's elements; the plan splits the scales as
  their moments are split where they share the dimension (an expert leaf's over ``expert``
  too), else on a dimension the shard count divides, else keeps them whole (they are small).
  The price of a short last dimension is one scale per row: 4 / L bytes a parameter and
  moment. A 0-d leaf is one block of one element with a 0-d scale (stored exactly: code 127
  or 255 times |x|); a leaf with no elements has codes and scales with no elements.
* **A logarithmic ("dynamic") code, closed form.** Like bitsandbytes' dynamic map, most
  resolution lies near zero, but here every step is the same ratio: with scale ``s`` (the
  block's absmax) code ``k >= 1`` stands for ``s * 2**((k - K) / 8)`` (eight codes an octave),
  ``K = 127`` for ``mu`` (the sign in the int8's sign, -127..127; -128 unused) and ``K = 255``
  for ``nu`` (uint8). Encoding is ``k = clip(round(K + 8 * log2(|x| / s)), 0, K)``: the nearest
  level in the log domain, no table; decoding reads the 256 levels from a float32 table (exact
  and the same on every backend). The block's absmax is code K and decodes exactly.
* **Error bounds.** For ``|x|`` at or above the smallest level's lower rounding edge
  (``s * 2**((1 - K - 0.5) / 8)``) the relative error is at most ``2**(1/16) - 1 = 4.4%``:
  the code's level is within half a step (a factor ``2**(1/16)``) of x. ``mu`` spans
  ``2**(-126/8) = 1.8e-5`` of its block's absmax; below the edge it rounds to zero, so a
  moment decays to zero instead of sticking at the smallest level (``b1 = 0.9`` takes it below
  the edge in one step). ``nu`` spans ``2**(-254/8) = 3e-10``, so ``sqrt(nu)`` has the same
  4.7 decades as ``mu`` with half its relative error (2.2%).
* **nu never rounds to zero.** A positive second moment below nu's smallest level is stored as
  that level (rounded up), never as zero; a zero code means an exact zero, which Adam's ``nu``
  only is where every gradient so far was zero, and there ``mu`` is zero too. So the stored
  ``nu`` is never below ``nu / 2**(1/16)`` and ``m / (sqrt(v) + eps)`` never explodes from a
  rounding (a ``nu`` quantised to zero under a nonzero ``mu`` would step by ``m / eps``).
  Rounding up only shrinks an update.
* **Nearest rounding, deterministic.** No stochastic rounding (it would need random state and
  break bit-identical replays). The known cost, shared with bitsandbytes: a ``nu`` decaying by
  ``b2 = 0.999`` a step while its block's absmax holds stays at its level (a step is 9%), so a
  moment that stopped receiving gradients decays more slowly relative to its block than in
  fp32; it errs on the small-update side.
* **Decoded after the gradients.** Decoding reads only the state, so XLA may run it, and the
  resharding GSPMD adds where a leaf's logical shape is split unevenly (a stack of 4 layers
  over 8 devices), at any time in the step, beside the stage-3 layer loops' gathers. XLA:CPU
  runs independent collectives in any order on each device, so devices met in different
  collectives and the step aborted (a rendezvous timeout on the demo's GPT at stage 3). The
  update therefore adds to every decoded level and scale an exact zero computed from the first
  element of every gradient (``g[0, ..., 0]``, one scalar; ``ravel(g)[0]`` gathered a leaf
  split on two dimensions whole): each decode waits for the whole backward pass, and
  ``jzero.hlo.unordered_collectives`` of the step is empty (``tests/optim/test_optim_state8.py``).
* **Computed wide.** The inner update sees float32 moments and returns float32 updates; only
  the stored moments are quantised. The step count and any other state (an injected learning
  rate, decay state) stay as the inner transformation made them.
* **With bf16.** ``bf16: {enabled: true}`` (fp32 masters) composes: the moments are encoded
  from float32 whatever the parameters' dtype. ``bf16.bf16_optimizer_states`` with
  ``state_bits: 8`` is refused where the config's optimizer is built (two narrowings of the
  same moments; 8-bit is already the smaller).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["QuantizedAdamState", "dequantize", "quantize", "quantized_adam_state"]

PER_OCTAVE = 8
"""Codes per factor of two: neighbouring levels differ by ``2**(1/8)``."""
MU_TOP = 127
"""``mu``'s largest code (int8, signed: -127..127)."""
NU_TOP = 255
"""``nu``'s largest code (uint8)."""

# LEVELS[j] = 2**((j - 255) / 8) in float32, j = 0..255: code k of a moment with top code K
# decodes to scale * LEVELS[k + 255 - K] (k >= 1); code 0 is zero.
_LEVELS = np.exp2((np.arange(NU_TOP + 1, dtype=np.float64) - NU_TOP) / PER_OCTAVE).astype(
    np.float32
)


class QuantizedAdamState(NamedTuple):
    """An ``optax.ScaleByAdamState`` at rest: the step count and, per moment, codes with each
    parameter's shape and float32 scales with shape ``shape[:-1] + (blocks,)``."""

    count: jax.Array
    mu_codes: optax.Updates
    mu_scale: optax.Updates
    nu_codes: optax.Updates
    nu_scale: optax.Updates


def _scale_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    if not shape:
        return ()
    return (*shape[:-1], -(-shape[-1] // block_size))


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
    """``x`` (at least 1-d, with elements) as ``(..., blocks, length)``, the last dimension
    zero-padded to whole blocks; a row shorter than a block is one block."""
    n = x.shape[-1]
    length = min(block_size, n)
    blocks = -(-n // length)
    pad = blocks * length - n
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], blocks, length)


def quantize(x: jax.Array, signed: bool, block_size: int = 256) -> tuple[jax.Array, jax.Array]:
    """``x``'s codes (its shape; int8 if ``signed`` else uint8, ``x`` then >= 0) and float32
    block scales (``x.shape[:-1] + (ceil(x.shape[-1] / block_size),)``, ``()`` for a 0-d x).

    Code ``k`` is ``clip(round(K + 8 * log2(|x| / scale)), 0, K)`` with the sign of ``x``
    (``K`` = 127 signed, 255 unsigned); unsigned, a positive ``x`` gets at least code 1.
    """
    top = MU_TOP if signed else NU_TOP
    code_dtype = jnp.int8 if signed else jnp.uint8
    shape = tuple(x.shape)
    x = jnp.asarray(x, jnp.float32)
    if x.size == 0:
        return jnp.zeros(shape, code_dtype), jnp.zeros(_scale_shape(shape, block_size), jnp.float32)
    blocked = _blocks(x.reshape(shape or (1,)), block_size)
    scale = jnp.max(jnp.abs(blocked), axis=-1)
    safe = jnp.where(scale > 0, scale, 1.0)
    ratio = jnp.abs(blocked) / safe[..., None]  # in [0, 1]; log2(0) = -inf clips to code 0
    k = jnp.clip(jnp.round(top + PER_OCTAVE * jnp.log2(ratio)), 0, top)
    if signed:
        k = jnp.where(blocked < 0, -k, k)
    else:  # a positive nu is never stored as zero (see the module's decisions)
        k = jnp.where(ratio > 0, jnp.maximum(k, 1), 0)
    codes = k.astype(code_dtype).reshape(*blocked.shape[:-2], -1)[..., : (shape or (1,))[-1]]
    return codes.reshape(shape), scale.reshape(_scale_shape(shape, block_size))


def dequantize(
    codes: jax.Array, scale: jax.Array, block_size: int = 256, zero: jax.Array | None = None
) -> jax.Array:
    """The float32 values of ``codes`` (int8: ``mu``'s signed code; uint8: ``nu``'s) under
    their block ``scale``: ``sign * scale * 2**((|k| - K) / 8)``, zero for code 0.

    ``zero``: an exact float32 zero added to the levels and the scale, so the decoding runs
    only once it is computed (see the module's decisions)."""
    signed = codes.dtype == jnp.int8
    top = MU_TOP if signed else NU_TOP
    shape = tuple(codes.shape)
    if codes.size == 0:
        return jnp.zeros(shape, jnp.float32)
    k = codes.astype(jnp.int32)
    mag = jnp.abs(k)
    level = jnp.asarray(_LEVELS)[mag + (NU_TOP - top)]
    level = jnp.where(mag > 0, level, 0.0)
    if signed:
        level = jnp.where(k < 0, -level, level)
    if zero is not None:
        level, scale = level + zero, scale + zero
    blocked = _blocks(level.reshape(shape or (1,)), block_size)
    values = blocked * scale.reshape(blocked.shape[:-1])[..., None]
    return values.reshape(*blocked.shape[:-2], -1)[..., : (shape or (1,))[-1]].reshape(shape)


def _map_pair(fn: Any, tree: Any) -> tuple[Any, Any]:
    """Two trees of ``tree``'s structure from ``fn(leaf) -> (a, b)`` (a params placeholder,
    which has no leaves, comes back as itself twice, as ``optax.tree_map_params`` needs)."""
    leaves, treedef = jax.tree.flatten(tree)
    pairs = [fn(x) for x in leaves]
    return treedef.unflatten([a for a, _ in pairs]), treedef.unflatten([b for _, b in pairs])


def _is_adam(x: Any) -> bool:
    return isinstance(x, optax.ScaleByAdamState)


def _is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedAdamState)


def _zero_after(updates: Any) -> jax.Array | None:
    """An exact float32 zero computed from the first element of every gradient leaf: what the
    decoding waits for (see the module's decisions); ``None`` without gradient elements."""
    # g[0, ..., 0], not ravel(g)[0]: a ravel of a leaf split on two dimensions (an expert leaf
    # over expert x data) gathers it whole; indexing reads one element (a scalar all-reduce).
    firsts = [g[(0,) * jnp.ndim(g)] for g in jax.tree.leaves(updates) if jnp.size(g)]
    if not firsts:
        return None
    # isnan(..) is 0 or 1, never NaN, and XLA does not fold a float times 0.0 away.
    return sum(jnp.isnan(g).astype(jnp.float32) for g in firsts) * jnp.float32(0.0)


def quantized_adam_state(
    tx: optax.GradientTransformation, block_size: int = 256
) -> optax.GradientTransformation:
    """``tx`` with every ``optax.ScaleByAdamState`` of its state kept as 8-bit codes.

    ``init`` replaces each ``ScaleByAdamState(count, mu, nu)`` with a
    :class:`QuantizedAdamState`: ``mu`` as int8 codes, ``nu`` as uint8 codes (each with its
    parameter's shape) and one float32 absmax scale per ``block_size`` elements of a row;
    ``update`` decodes them to float32, runs ``tx.update`` and encodes the new moments. Adam's
    state then costs 2 bytes a parameter (plus 8 / ``block_size`` for the scales) instead of 8.

    Args:
      tx: a transformation whose state contains ``optax.ScaleByAdamState`` nodes.
      block_size: elements of a row sharing one scale.

    Returns:
      The transformation, whose state is ``tx``'s with each Adam node quantised.

    Raises:
      ValueError: for a ``block_size`` < 1, or (at ``init``) a state with no
        ``ScaleByAdamState``.

    Example:
      >>> tx = quantized_adam_state(optax.adam(1e-3))
      >>> state = tx.init({"w": jnp.ones((4, 300))})
      >>> state[0].mu_codes["w"].dtype, state[0].nu_scale["w"].shape
      (dtype('int8'), (4, 2))
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(
            f"quantized_adam_state: block_size must be an integer >= 1, got {block_size!r}."
        )

    def empty(x: Any, code_dtype: Any) -> tuple[jax.Array, jax.Array]:
        shape = tuple(x.shape)
        return jnp.zeros(shape, code_dtype), jnp.zeros(_scale_shape(shape, block_size), jnp.float32)

    def encode(s: Any, fresh: bool) -> Any:
        if not _is_adam(s):
            return s
        if fresh:  # init: zeros, without computing their codes
            mu = _map_pair(lambda x: empty(x, jnp.int8), s.mu)
            nu = _map_pair(lambda x: empty(x, jnp.uint8), s.nu)
        else:
            mu = _map_pair(lambda x: quantize(x, True, block_size), s.mu)
            nu = _map_pair(lambda x: quantize(x, False, block_size), s.nu)
        return QuantizedAdamState(s.count, mu[0], mu[1], nu[0], nu[1])

    def decode(s: Any, zero: jax.Array | None) -> Any:
        if not _is_quantized(s):
            return s
        mu = jax.tree.map(lambda c, k: dequantize(c, k, block_size, zero), s.mu_codes, s.mu_scale)
        nu = jax.tree.map(lambda c, k: dequantize(c, k, block_size, zero), s.nu_codes, s.nu_scale)
        return optax.ScaleByAdamState(count=s.count, mu=mu, nu=nu)

    def init(params: Any) -> Any:
        state = tx.init(params)
        if not any(_is_adam(x) for x in jax.tree.leaves(state, is_leaf=_is_adam)):
            raise ValueError(
                "quantized_adam_state: the optimizer's state has no optax.ScaleByAdamState "
                "(Adam's moments) to quantise; wrap an Adam (optax.adam, optax.adamw, "
                "jzero.optim.scale_by_fused_adam) or a chain containing one."
            )
        return jax.tree.map(lambda s: encode(s, True), state, is_leaf=_is_adam)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        zero = _zero_after(updates)
        wide = jax.tree.map(lambda s: decode(s, zero), state, is_leaf=_is_quantized)
        if isinstance(tx, optax.GradientTransformationExtraArgs):
            updates, new_state = tx.update(updates, wide, params, **extra)
        else:
            updates, new_state = tx.update(updates, wide, params)
        return updates, jax.tree.map(lambda s: encode(s, False), new_state, is_leaf=_is_adam)

    return optax.GradientTransformationExtraArgs(init, update)
