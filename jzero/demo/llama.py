"""A Llama-shaped decoder as pure functions, for ``jzero plan`` to measure abstractly.

:func:`init_params` and :func:`loss_fn` describe the model of a
:class:`jzero.costs.Architecture`: RMSNorm, rotary positions, grouped-query attention, a SwiGLU
(or GELU) MLP and an untied (or tied) output head. ``jzero plan --preset`` builds it as an
abstract engine (shapes only) and compiles its step, so the planner measures the shape
``jzero estimate --preset`` counts.

Decisions:

* The blocks are stacked (every leaf ``[L, ...]``) and run by one ``jax.lax.scan``; the only op
  between the stored stacks and the scan is the cast to the compute dtype, where stage 3
  gathers one layer at a time (as in :mod:`jzero.demo.gpt`).
* It runs what the built-in GPT runs past its defaults (``attention_block`` 512, ``loss_chunk``
  1024): :func:`jzero.ops.blockwise_attention` (grouped-query heads as they are, no ``[s, s]``
  score matrix in either pass, as :class:`jzero.costs.Techniques`'s ``"blockwise"`` counts
  it) and :func:`jzero.ops.tiled_cross_entropy` (no whole ``[s, V]`` logits). There is no
  dropout.
* The parameter count equals :meth:`jzero.costs.Architecture.params` (tested), biases
  included; experts are not built (``experts`` > 0 is refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jzero.costs import Architecture
from jzero.ops import blockwise_attention, rotary, tiled_cross_entropy

__all__ = ["check", "init_params", "loss_fn"]

_EPS = 1e-5
_STD = 0.02
_ATTENTION_BLOCK = 512  # the built-in GPT's attention_block and loss_chunk defaults
_LOSS_CHUNK = 1024


def check(arch: Architecture) -> None:
    """Refuses what this model does not build.

    Raises:
      ValueError: for experts or learned positions.
    """
    if arch.experts:
        raise ValueError(
            f"experts: {arch.experts} is not supported by the Llama-shaped planner (it builds "
            "dense MLPs only); plan a dense architecture, or use jzero estimate for a mixture "
            "of experts."
        )
    if arch.positions != "rotary":
        raise ValueError(
            f"positions: {arch.positions!r} is not supported by the Llama-shaped planner; it "
            "uses rotary positions (positions='rotary')."
        )


def _norm_params(arch: Architecture, layers: tuple[int, ...] = ()) -> dict[str, jax.Array]:
    out = {"scale": jnp.ones((*layers, arch.hidden), jnp.float32)}
    if arch.norm == "layernorm":
        out["bias"] = jnp.zeros((*layers, arch.hidden), jnp.float32)
    return out


def _block_params(key: jax.Array, arch: Architecture) -> dict[str, Any]:
    """One block's parameters (no layer dim)."""
    h, f = arch.hidden, arch.ffn
    kv = (arch.kv_heads or arch.heads) * arch.head_dim
    keys = jax.random.split(key, 7)

    def w(k: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        return _STD * jax.random.normal(k, shape, jnp.float32)

    attn = {"wq": w(keys[0], (h, h)), "wk": w(keys[1], (h, kv)), "wv": w(keys[2], (h, kv))}
    attn["wo"] = w(keys[3], (h, h))
    if arch.bias != "none":
        attn.update(bq=jnp.zeros((h,)), bk=jnp.zeros((kv,)), bv=jnp.zeros((kv,)))
    if arch.bias == "all":
        attn["bo"] = jnp.zeros((h,))
    mlp = {"w_up": w(keys[4], (h, f)), "w_down": w(keys[5], (f, h))}
    if arch.mlp == "swiglu":
        mlp["w_gate"] = w(keys[6], (h, f))
    if arch.bias == "all":
        mlp.update(b_up=jnp.zeros((f,)), b_down=jnp.zeros((h,)))
        if arch.mlp == "swiglu":
            mlp["b_gate"] = jnp.zeros((f,))
    return {"attn_norm": _norm_params(arch), "attn": attn, "mlp_norm": _norm_params(arch), **mlp}


def init_params(key: jax.Array, arch: Architecture) -> dict:
    """The model's parameters (float32); jittable.

    Args:
      key: a PRNG key.
      arch: the shape (dense, rotary positions).

    Returns:
      ``{"embed": [V, h], "blocks": {name: [L, ...]}, "norm": {...}, "head": [h, V]}`` (no
      ``head`` when ``arch.tied``).

    Raises:
      ValueError: for experts or learned positions.
    """
    check(arch)
    k_embed, k_blocks, k_head = jax.random.split(key, 3)
    params = {
        "embed": _STD * jax.random.normal(k_embed, (arch.vocab, arch.hidden), jnp.float32),
        "blocks": jax.vmap(lambda k: _block_params(k, arch))(
            jax.random.split(k_blocks, arch.layers)
        ),
        "norm": _norm_params(arch),
    }
    if not arch.tied:
        params["head"] = _STD * jax.random.normal(k_head, (arch.hidden, arch.vocab), jnp.float32)
    return params


def _normalise(x: jax.Array, p: Mapping[str, jax.Array]) -> jax.Array:
    x32 = x.astype(_wide(x))
    if "bias" in p:  # LayerNorm
        x32 = x32 - x32.mean(-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + _EPS)
    y = y * p["scale"].astype(x32.dtype) + p.get("bias", 0.0)
    return y.astype(x.dtype)


def _wide(x: jax.Array) -> Any:
    """The dtype of the softmax's statistics: float32, or float64 for a float64 model."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _block(p: Mapping[str, Any], x: jax.Array, arch: Architecture) -> jax.Array:
    b, t, h = x.shape
    heads, kv_heads, d = arch.heads, arch.kv_heads or arch.heads, arch.head_dim
    a = p["attn"]
    y = _normalise(x, p["attn_norm"])
    q = (y @ a["wq"] + a.get("bq", 0)).reshape(b, t, heads, d)
    k = (y @ a["wk"] + a.get("bk", 0)).reshape(b, t, kv_heads, d)
    v = (y @ a["wv"] + a.get("bv", 0)).reshape(b, t, kv_heads, d)
    where = jnp.arange(t)
    q, k = rotary(q, where), rotary(k, where)
    attended = blockwise_attention(q, k, v, block_size=_ATTENTION_BLOCK)  # GQA: kv heads as given
    x = x + attended.reshape(b, t, h) @ a["wo"] + a.get("bo", 0)
    y = _normalise(x, p["mlp_norm"])
    up = y @ p["w_up"] + p.get("b_up", 0)
    if "w_gate" in p:
        up = jax.nn.silu(y @ p["w_gate"] + p.get("b_gate", 0)) * up
    else:
        up = jax.nn.gelu(up)
    return x + up @ p["w_down"] + p.get("b_down", 0)


def loss_fn(
    params: dict, batch: Mapping[str, jax.Array], arch: Architecture, dtype: Any = jnp.float32
) -> jax.Array:
    """Next-token cross-entropy, in nats per token.

    Args:
      params: from :func:`init_params`.
      batch: ``{"tokens": int [B, T + 1]}``; position t predicts token t + 1.
      arch: the shape.
      dtype: the compute dtype (the parameters are cast to it).

    Returns:
      The scalar mean loss (float32; float64 for a float64 ``dtype``).
    """
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"].astype(dtype)[inputs]
    # The only op between the stored stacked weights and the scan: the cast (ZeRO-3 gathers there).
    blocks = jax.tree.map(lambda w: w.astype(dtype), params["blocks"])

    def body(carry: jax.Array, layer: dict) -> tuple[jax.Array, None]:
        return _block(layer, carry, arch), None

    x, _ = jax.lax.scan(body, x, blocks)
    x = _normalise(x, params["norm"])
    head = params["embed"] if arch.tied else params["head"].T  # [V, D]
    total = tiled_cross_entropy(x, head.astype(dtype), targets, chunk=_LOSS_CHUNK)
    return total / targets.size
