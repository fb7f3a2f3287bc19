"""Transformers whose weights carry their authors' own names, which no AutoTP name rule knows:
a Flax NNX one with einsum-style fused weights (GQA attention: q ``[d, H, Dh]``, a fused kv
``[2, d, Hkv, Dh]``, out ``[H, Dh, d]``; a gated MLP ``gating_einsum [2, d, f]`` and ``linear
[f, d]``; a tied embedding; rotary positions) and an Equinox one of ``eqx.nn`` layers
(``eqx.nn.MultiheadAttention``, ``eqx.nn.MLP``: weights ``[out, in]``), for
tests/distributed/test_autotp_program.py. Float64, tiny shapes."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

V, D, H, HKV, DH, F, L, T = 64, 32, 4, 2, 8, 64, 2, 12
F64 = jnp.float64


def _param(rngs, shape, std=0.1):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, F64))


def _rope(x):
    """Rotary positions on ``[b, t, heads, Dh]`` (rotate-half form)."""
    t, half = x.shape[1], x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=F64) / half))
    angle = jnp.arange(t, dtype=F64)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


class RMSNorm(nnx.Module):
    def __init__(self):
        self.scale = nnx.Param(jnp.ones((D,), F64))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]


class Attention(nnx.Module):
    """Grouped-query attention with einsum weights."""

    def __init__(self, rngs):
        self.q_einsum = _param(rngs, (D, H, DH))
        self.kv_einsum = _param(rngs, (2, D, HKV, DH))
        self.attn_vec_einsum = _param(rngs, (H, DH, D))

    def __call__(self, x):
        b, t, _ = x.shape
        q = _rope(jnp.einsum("btd,dhk->bthk", x, self.q_einsum[...]))
        kv = jnp.einsum("btd,cdhk->cbthk", x, self.kv_einsum[...])
        k, v = _rope(kv[0]), kv[1]
        q = q.reshape(b, t, HKV, H // HKV, DH)
        s = jnp.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(DH)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
        o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, -1), v).reshape(b, t, H, DH)
        return jnp.einsum("bthk,hkd->btd", o, self.attn_vec_einsum[...])


class FeedForward(nnx.Module):
    def __init__(self, rngs):
        self.gating_einsum = _param(rngs, (2, D, F))
        self.linear = _param(rngs, (F, D))

    def __call__(self, x):
        g = jnp.einsum("btd,cdf->cbtf", x, self.gating_einsum[...])
        return jnp.einsum("btf,fd->btd", jax.nn.gelu(g[0]) * g[1], self.linear[...])


class Block(nnx.Module):
    def __init__(self, rngs):
        self.pre_attention_norm = RMSNorm()
        self.attn = Attention(rngs)
        self.pre_ffw_norm = RMSNorm()
        self.mlp = FeedForward(rngs)

    def __call__(self, x):
        x = x + self.attn(self.pre_attention_norm(x))
        return x + self.mlp(self.pre_ffw_norm(x))


class Embedder(nnx.Module):
    def __init__(self, rngs):
        self.input_embedding = _param(rngs, (V, D), 1.0)


class NNXTransformer(nnx.Module):
    """Gemma-style names: ``embedder.input_embedding`` (tied to the output), ``layers``."""

    def __init__(self, rngs):
        self.embedder = Embedder(rngs)
        self.layers = nnx.List([Block(rngs) for _ in range(L)])
        self.final_norm = RMSNorm()

    def __call__(self, tokens):
        table = self.embedder.input_embedding[...]
        x = jnp.take(table, tokens, axis=0)
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x) @ table.T


def nnx_loss(model, batch):
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, 1:, None], -1)
    return -picked.mean()


class EqxBlock(eqx.Module):
    norm1: eqx.nn.RMSNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.RMSNorm
    feedforward: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.RMSNorm(D, dtype=F64)
        self.attention = eqx.nn.MultiheadAttention(H, D, key=k1, dtype=F64)
        self.norm2 = eqx.nn.RMSNorm(D, dtype=F64)
        self.feedforward = eqx.nn.MLP(D, D, F, depth=1, activation=jax.nn.gelu, key=k2, dtype=F64)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=jnp.tril(jnp.ones((x.shape[0],) * 2, bool)))
        return x + jax.vmap(self.feedforward)(jax.vmap(self.norm2)(x))


class EqxTransformer(eqx.Module):
    """An untied ``readout`` (``[V, D]``: Equinox's ``[out, in]``)."""

    tok: eqx.nn.Embedding
    body: list
    norm: eqx.nn.RMSNorm
    readout: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, L + 2)
        self.tok = eqx.nn.Embedding(V, D, key=keys[0], dtype=F64)
        self.body = [EqxBlock(k) for k in keys[2:]]
        self.norm = eqx.nn.RMSNorm(D, dtype=F64)
        self.readout = eqx.nn.Linear(D, V, key=keys[1], dtype=F64)

    def __call__(self, tokens):
        x = jax.vmap(self.tok)(tokens)
        for block in self.body:
            x = block(x)
        return jax.vmap(self.readout)(jax.vmap(self.norm)(x))


def eqx_loss(model, batch):
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
    return -picked.mean()
