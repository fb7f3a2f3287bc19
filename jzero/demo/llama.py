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
* Attention is blockwise (flash-style): the keys and values are visited in blocks with a
  running maximum and sum (the online softmax); the backward pass (a ``jax.custom_vjp``) keeps
  only the output and a float32 log-sum-exp a head and token and rebuilds each block's
  probabilities, so neither pass keeps a ``[s, s]`` score matrix, as
  :class:`jzero.costs.Techniques`'s ``"blockwise"`` counts it. There is no dropout.
* The parameter count equals :meth:`jzero.costs.Architecture.params` (tested), biases
  included; experts are not built (``experts`` > 0 is refused).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jzero.costs import Architecture

__all__ = ["check", "init_params", "loss_fn"]

_EPS = 1e-5
_STD = 0.02
_ATTENTION_BLOCK = 512


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


def _rotary(x: jax.Array) -> jax.Array:
    """Rotary positions on ``[B, T, H, D]`` (half-split pairs, base 10000)."""
    t, d = x.shape[1], x.shape[-1]
    wide = _wide(x)
    freq = 10000.0 ** (-jnp.arange(0, d // 2, dtype=wide) * 2 / d)
    angle = jnp.arange(t, dtype=wide)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(wide), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


def _key_blocks(x: jax.Array, block: int) -> jax.Array:
    """``[B, H, T, D]`` as ``[T / block, B, H, block, D]``, the scan's blocks of keys."""
    b, h, t, d = x.shape
    return x.reshape(b, h, t // block, block, d).transpose(2, 0, 1, 3, 4)


def _wide(x: jax.Array) -> Any:
    """The dtype of the softmax's statistics: float32, or float64 for a float64 model."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _scores(q: jax.Array, k_blk: jax.Array, start: jax.Array) -> jax.Array:
    """The causally masked float32 (or wider) scores of all queries against one block of keys."""
    t, block, d = q.shape[2], k_blk.shape[2], q.shape[-1]
    s = jnp.einsum("bhtd,bhsd->bhts", q, k_blk).astype(_wide(q)) / math.sqrt(d)
    cols = start + jnp.arange(block)
    return jnp.where(jnp.arange(t)[:, None] >= cols[None, :], s, -jnp.inf)


def _flash_forward(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> tuple:
    """The output and the log-sum-exp of each query, the keys visited block by block."""
    b, h, t, d = q.shape

    def body(carry: tuple, xs: tuple) -> tuple[tuple, None]:
        out, top, total = carry
        k_blk, v_blk, start = xs
        s = _scores(q, k_blk, start)
        new_top = jnp.maximum(top, s.max(-1))
        p = jnp.exp(s - new_top[..., None])
        scale = jnp.exp(top - new_top)
        pv = jnp.einsum("bhts,bhsd->bhtd", p.astype(v_blk.dtype), v_blk).astype(_wide(q))
        return (out * scale[..., None] + pv, new_top, total * scale + p.sum(-1)), None

    init = (
        jnp.zeros((b, h, t, d), _wide(q)),
        jnp.full((b, h, t), -jnp.inf, _wide(q)),
        jnp.zeros((b, h, t), _wide(q)),
    )
    starts = jnp.arange(t // block) * block
    xs = (_key_blocks(k, block), _key_blocks(v, block), starts)
    (out, top, total), _ = jax.lax.scan(body, init, xs)
    return (out / total[..., None]).astype(q.dtype), top + jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    return _flash_forward(q, k, v, block)[0]


def _flash_fwd(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> tuple:
    out, lse = _flash_forward(q, k, v, block)
    return out, (q, k, v, out, lse)  # kept for the backward pass: no [T, T] scores


def _flash_bwd(block: int, res: tuple, d_out: jax.Array) -> tuple:
    q, k, v, out, lse = res
    t, d = q.shape[2], q.shape[-1]
    delta = jnp.sum(d_out.astype(_wide(q)) * out.astype(_wide(q)), -1)

    def body(dq: jax.Array, xs: tuple) -> tuple[jax.Array, tuple]:
        k_blk, v_blk, start = xs
        p = jnp.exp(_scores(q, k_blk, start) - lse[..., None])  # rebuilt, one block
        dv = jnp.einsum("bhts,bhtd->bhsd", p, d_out.astype(_wide(q)))
        dp = jnp.einsum("bhtd,bhsd->bhts", d_out, v_blk).astype(_wide(q))
        ds = p * (dp - delta[..., None]) / math.sqrt(d)
        dq = dq + jnp.einsum("bhts,bhsd->bhtd", ds, k_blk.astype(_wide(q)))
        dk = jnp.einsum("bhts,bhtd->bhsd", ds, q.astype(_wide(q)))
        return dq, (dk, dv)

    starts = jnp.arange(t // block) * block
    xs = (_key_blocks(k, block), _key_blocks(v, block), starts)
    dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(q.shape, _wide(q)), xs)

    def whole(blocks: jax.Array) -> jax.Array:  # [T / block, B, H, block, D] -> [B, H, T, D]
        return blocks.transpose(1, 2, 0, 3, 4).reshape(k.shape)

    return dq.astype(q.dtype), whole(dk).astype(k.dtype), whole(dv).astype(v.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of ``q``, ``k``, ``v`` ``[B, T, H, D]``: the keys in blocks of
    ``_ATTENTION_BLOCK`` (a divisor of T) with the online softmax; the backward pass rebuilds
    each block's probabilities from the kept log-sum-exp (flash-style)."""
    t = q.shape[1]
    block = min(_ATTENTION_BLOCK, t)
    while t % block:
        block -= 1
    heads_first = [x.swapaxes(1, 2) for x in (q, k, v)]
    return _flash(*heads_first, block).swapaxes(1, 2)


def _block(p: Mapping[str, Any], x: jax.Array, arch: Architecture) -> jax.Array:
    b, t, h = x.shape
    heads, kv_heads, d = arch.heads, arch.kv_heads or arch.heads, arch.head_dim
    a = p["attn"]
    y = _normalise(x, p["attn_norm"])
    q = (y @ a["wq"] + a.get("bq", 0)).reshape(b, t, heads, d)
    k = (y @ a["wk"] + a.get("bk", 0)).reshape(b, t, kv_heads, d)
    v = (y @ a["wv"] + a.get("bv", 0)).reshape(b, t, kv_heads, d)
    q, k = _rotary(q), _rotary(k)
    k, v = jnp.repeat(k, heads // kv_heads, axis=2), jnp.repeat(v, heads // kv_heads, axis=2)
    x = x + _blockwise_attention(q, k, v).reshape(b, t, h) @ a["wo"] + a.get("bo", 0)
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
    head = params["embed"].T if arch.tied else params["head"]
    logits = (x @ head.astype(dtype)).astype(_wide(x))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()
