"""The built-in GPT: a small byte-level decoder-only transformer, in two forms.

Both forms share one :class:`GPTConfig` and one block function, so they compute the same numbers
from the same weights:

* the functional form (:func:`init_params`, :func:`apply`, :func:`loss_fn`) is a plain pytree of
  nested dicts of arrays, for users who bring their own training loop;
* the Flax NNX form (:class:`GPT`, :func:`nnx_loss_fn`) is an ``nnx.Module`` whose
  ``nnx.state(model, nnx.Param).to_pure_dict()`` has exactly the functional form's tree
  structure, so weights move between the two with ``nnx.replace_by_pure_dict``.

Decisions:

* Architecture: learned token and position embeddings, pre-LayerNorm blocks (causal multi-head
  self-attention written with ``einsum``, then a GELU MLP), a final LayerNorm and a **tied**
  output head (logits are the final activations times the token embedding transposed). Dense
  layers carry biases.
* The fused q/k/v projection has a dimension of its own for q, k and v (``attn_qkv`` is
  ``[D, 3, D]``, its bias ``[3, D]``), so tensor parallelism (:mod:`jzero.distributed.tensor`)
  splits it per head group: each device of the ``model`` axis holds the q, k and v columns of
  its heads and runs attention on them with no communication. A flat ``[D, 3D]`` leaf could
  not rest split that way under one ``PartitionSpec``. Its bias stays flat (``[3D]``, small,
  replicated over ``model``), so ZeRO merges its 4-layer stack into exact contiguous shards
  (a ``[4, 3, 128]`` stack would be split on its last dimension, with layout copies).
* Layers are stacked: every leaf of ``params["blocks"]`` has a leading dim of ``num_layers`` and
  all blocks run under **one** ``jax.lax.scan`` (``nnx.scan`` in the NNX form; the NNX blocks are
  created with ``nnx.vmap`` over split RNG streams). The stacked weights are the scan's scanned
  operands (``xs``), never closure constants, and the only op between a stored parameter and the
  scan is the cast to the compute dtype (absent when the compute dtype is float32). ZeRO stage 3
  relies on this: it gathers one layer's weights inside the scan body, and a cast placed before
  the scan lets it gather the low-precision copy at half the bytes.
* Precision: parameters are stored in float32; ``GPTConfig.dtype`` is the compute dtype.
  LayerNorm statistics, attention softmax and the logits are computed in float32.
* Initialisation: normal with std 0.02; the two residual projections (attention output, MLP
  output) use 0.02 / sqrt(2 * num_layers); biases and LayerNorm offsets are zero and LayerNorm
  scales are one.
* No dropout: the model is deterministic, so forward passes need no RNG.
* Sequence parallelism (DeepSpeed-Ulysses, ``sequence_parallel_size``) is built in: where
  jzero's step binds a ``seq`` axis, the loss takes this device's ``T/S`` positions of the
  inputs and targets, the position table from this device's first position, and attention
  runs through :func:`jzero.distributed.sequence.sequence_parallel_attention` (all-to-all to
  the whole sequence for ``H/S`` heads, and back). Called anywhere else, it is the plain model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jzero.distributed.sequence import sequence_chunk, sequence_offset, sequence_parallel_attention

__all__ = ["GPT", "GPTConfig", "apply", "init_params", "loss_fn", "nnx_loss_fn"]

PyTree = Any
_DTYPES = ("float32", "bfloat16", "float16", "float64")
_INIT_STD = 0.02
_LN_EPS = 1e-5


@dataclass(frozen=True)
class GPTConfig:
    """Shape and precision of the built-in GPT; validated when built."""

    vocab_size: int = 256
    """Number of token ids; 256 for bytes."""
    seq_len: int = 128
    """Longest input sequence (size of the learned position table)."""
    num_layers: int = 4
    """Number of transformer blocks, stacked on the leading dim of every block parameter."""
    num_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 128
    """Width of the residual stream."""
    d_ff: int = 512
    """Width of the MLP hidden layer."""
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    """Compute dtype. Parameters are always stored in float32 and cast to this at use
    (``float64``, under ``jax_enable_x64``, with float64 parameters, is for numerical tests:
    every operation then runs in float64, the statistics included)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "d_model", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by num_heads="
                f"{self.num_heads}. Choose num_heads among the divisors of d_model."
            )
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"GPTConfig.dtype={self.dtype!r} is not supported. It must be one of {_DTYPES}."
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GPTConfig:
        """Builds a config from a mapping such as a parsed YAML section.

        Args:
            d: field names to values; missing fields keep their defaults.

        Returns:
            The validated config.

        Raises:
            ValueError: if ``d`` has a key that is not a field, or a value is invalid.
        """
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(allowed))
        if unknown:
            raise ValueError(
                f"Unknown GPT config key(s) {unknown}. The allowed keys are {allowed}; "
                "remove or rename the unknown ones."
            )
        return cls(**d)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The compute dtype as a NumPy dtype."""
        return jnp.dtype(self.dtype)


# ----------------------------------------------------------------------------------------------
# Shared pieces: per-layer init and the block function, used by both forms.


def config_for(cfg: Any) -> GPTConfig:
    """The built-in GPT of a :class:`jzero.config.Config`'s ``model`` section.

    Under ``bf16`` or ``fp16`` the model computes in that dtype unless ``model.dtype`` is set.
    """
    model = dict(cfg.model)
    if "dtype" not in model and (cfg.bf16.enabled or cfg.fp16.enabled):
        model["dtype"] = "bfloat16" if cfg.bf16.enabled else "float16"
    return GPTConfig.from_dict(model)


def _normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(key, shape, jnp.float32)


def _init_block(key: jax.Array, cfg: GPTConfig) -> dict[str, jax.Array]:
    """One layer's parameters (no layer dim); ``init_params`` vmaps this over the layers."""
    d, f = cfg.d_model, cfg.d_ff
    resid_std = _INIT_STD / math.sqrt(2 * cfg.num_layers)
    k_qkv, k_out, k_in, k_mlp_out = jax.random.split(key, 4)
    return {
        "ln1_scale": jnp.ones((d,), jnp.float32),
        "ln1_bias": jnp.zeros((d,), jnp.float32),
        "attn_qkv": _normal(k_qkv, (d, 3, d), _INIT_STD),
        "attn_qkv_bias": jnp.zeros((3 * d,), jnp.float32),
        "attn_out": _normal(k_out, (d, d), resid_std),
        "attn_out_bias": jnp.zeros((d,), jnp.float32),
        "ln2_scale": jnp.ones((d,), jnp.float32),
        "ln2_bias": jnp.zeros((d,), jnp.float32),
        "mlp_in": _normal(k_in, (d, f), _INIT_STD),
        "mlp_in_bias": jnp.zeros((f,), jnp.float32),
        "mlp_out": _normal(k_mlp_out, (f, d), resid_std),
        "mlp_out_bias": jnp.zeros((d,), jnp.float32),
    }


def _wide(dtype: Any) -> jnp.dtype:
    """The dtype of statistics, softmax and logits: float32, or float64 for a float64 model."""
    return jnp.promote_types(dtype, jnp.float32)


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """LayerNorm over the last dim, statistics in float32 (or wider), result in ``x``'s dtype."""
    wide = _wide(x.dtype)
    x32 = x.astype(wide)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + _LN_EPS)
    return (y * scale.astype(wide) + bias.astype(wide)).astype(x.dtype)


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention of [B, T, H, Dh] heads, the softmax in float32 (or wider)."""
    t, head_dim = q.shape[1], q.shape[-1]
    wide = _wide(q.dtype)
    scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(wide) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(wide).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhts,bshd->bthd", probs, v)


# Under sequence parallelism (a `seq` axis bound by jzero's step) each device holds T/S tokens;
# attention then sees the whole sequence for H/S heads. Elsewhere it is the plain call.
_ulysses_attention = sequence_parallel_attention(_causal_attention)


def _attention(p: Mapping[str, jax.Array], x: jax.Array, num_heads: int) -> jax.Array:
    """Causal multi-head self-attention; ``x`` is [B, T, D] (this device's tokens)."""
    b, t, d = x.shape
    head_dim = d // num_heads
    qkv = jnp.einsum("btd,dcn->btcn", x, p["attn_qkv"]) + p["attn_qkv_bias"].reshape(3, d)
    qkv = qkv.reshape(b, t, 3, num_heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out = _ulysses_attention(q, k, v).reshape(b, t, d)
    return out @ p["attn_out"] + p["attn_out_bias"]


def _block(p: Mapping[str, jax.Array], x: jax.Array, num_heads: int) -> jax.Array:
    """One pre-LayerNorm transformer block; ``p`` is already in the compute dtype."""
    x = x + _attention(p, _layer_norm(x, p["ln1_scale"], p["ln1_bias"]), num_heads)
    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    h = jax.nn.gelu(h @ p["mlp_in"] + p["mlp_in_bias"])
    return x + h @ p["mlp_out"] + p["mlp_out_bias"]


def _embed(
    tokens_table: jax.Array, positions: jax.Array, tokens: jax.Array, cfg: GPTConfig
) -> jax.Array:
    t = tokens.shape[-1]
    if t > cfg.seq_len:
        raise ValueError(
            f"The input has {t} tokens per sequence but GPTConfig.seq_len={cfg.seq_len}. "
            "Shorten the input or raise seq_len."
        )
    offset = sequence_offset(t)  # this device's first position under sequence parallelism
    table = (
        positions[:t]
        if isinstance(offset, int)
        else jax.lax.dynamic_slice_in_dim(positions, offset, t)
    )
    x = jnp.take(tokens_table, tokens, axis=0) + table
    return x.astype(cfg.compute_dtype)


def _head(ln_f: Mapping[str, jax.Array], tokens_table: jax.Array, x: jax.Array) -> jax.Array:
    """Final LayerNorm and the tied output head; float32 (or wider) logits [B, T, V]."""
    x = _layer_norm(x, ln_f["scale"], ln_f["bias"])
    logits = jnp.einsum("btd,vd->btv", x, tokens_table.astype(x.dtype))
    return logits.astype(_wide(x.dtype))


def _next_token_loss(logits_fn: Callable[[jax.Array], jax.Array], tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats; ``tokens`` is int [B, T + 1]."""
    # Under sequence parallelism each device takes its own T/S positions of both.
    inputs, targets = sequence_chunk(tokens[:, :-1]), sequence_chunk(tokens[:, 1:])
    log_probs = jax.nn.log_softmax(logits_fn(inputs), axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)
    return -picked.mean()


# ----------------------------------------------------------------------------------------------
# (a) Functional form.


def init_params(key: jax.Array, cfg: GPTConfig) -> dict:
    """Initialises the functional GPT's parameters (float32); jittable.

    Args:
        key: a PRNG key.
        cfg: the model config.

    Returns:
        ``{"embed": {"tokens": [V, D], "positions": [T, D]}, "blocks": {name: [L, ...]},
        "ln_f": {"scale": [D], "bias": [D]}}``.
    """
    k_tok, k_pos, k_blocks = jax.random.split(key, 3)
    layer_keys = jax.random.split(k_blocks, cfg.num_layers)
    return {
        "embed": {
            "tokens": _normal(k_tok, (cfg.vocab_size, cfg.d_model), _INIT_STD),
            "positions": _normal(k_pos, (cfg.seq_len, cfg.d_model), _INIT_STD),
        },
        "blocks": jax.vmap(lambda k: _init_block(k, cfg))(layer_keys),
        "ln_f": {
            "scale": jnp.ones((cfg.d_model,), jnp.float32),
            "bias": jnp.zeros((cfg.d_model,), jnp.float32),
        },
    }


def apply(params: dict, tokens: jax.Array, cfg: GPTConfig) -> jax.Array:
    """Runs the functional GPT.

    Args:
        params: parameters from :func:`init_params` (or the same tree, e.g. trained).
        tokens: int token ids [B, T] with T <= ``cfg.seq_len``.
        cfg: the model config.

    Returns:
        float32 logits [B, T, vocab_size].
    """
    x = _embed(params["embed"]["tokens"], params["embed"]["positions"], tokens, cfg)
    # The only op between the stored stacked weights and the scan: the cast (ZeRO-3 gathers there).
    blocks = jax.tree.map(lambda w: w.astype(cfg.compute_dtype), params["blocks"])

    def body(carry: jax.Array, layer: dict) -> tuple[jax.Array, None]:
        return _block(layer, carry, cfg.num_heads), None

    x, _ = jax.lax.scan(body, x, blocks)
    return _head(params["ln_f"], params["embed"]["tokens"], x)


def loss_fn(params: dict, batch: Mapping[str, jax.Array], cfg: GPTConfig) -> jax.Array:
    """Next-token cross-entropy of the functional GPT, in nats per token (per byte).

    Args:
        params: the parameters.
        batch: ``{"tokens": int [B, T + 1]}``; position t predicts token t + 1.
        cfg: the model config.

    Returns:
        The scalar mean loss (float32).
    """
    return _next_token_loss(lambda x: apply(params, x, cfg), batch["tokens"])


def unstack_blocks(params: dict) -> dict:
    """The same parameters with ``blocks`` as a list of per-layer dicts, for
    :func:`unrolled_loss_fn`; jittable."""
    blocks = params["blocks"]
    layers = jax.tree.leaves(blocks)[0].shape[0]
    return {**params, "blocks": [jax.tree.map(lambda w, i=i: w[i], blocks) for i in range(layers)]}


def unrolled_loss_fn(params: dict, batch: Mapping[str, jax.Array], cfg: GPTConfig) -> jax.Array:
    """:func:`loss_fn` written as a Python loop over layers (``params["blocks"]`` a list, from
    :func:`unstack_blocks`), as most Flax models are: the same numbers, no ``scan``."""

    def logits(tokens: jax.Array) -> jax.Array:
        x = _embed(params["embed"]["tokens"], params["embed"]["positions"], tokens, cfg)
        for layer in params["blocks"]:
            x = _block(jax.tree.map(lambda w: w.astype(cfg.compute_dtype), layer), x, cfg.num_heads)
        return _head(params["ln_f"], params["embed"]["tokens"], x)

    return _next_token_loss(logits, batch["tokens"])


# ----------------------------------------------------------------------------------------------
# (b) Flax NNX form.


class _Params(nnx.Module):
    """A flat bag of ``nnx.Param`` leaves, named like the functional form's dict."""

    def __init__(self, arrays: Mapping[str, jax.Array]):
        for name, value in arrays.items():
            setattr(self, name, nnx.Param(value))

    def arrays(self) -> dict[str, jax.Array]:
        return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Param)}


class _Block(_Params):
    """One transformer block (stacked over layers by ``nnx.vmap`` in :class:`GPT`)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        super().__init__(_init_block(rngs.params(), cfg))
        self.num_heads = cfg.num_heads

    def __call__(self, x: jax.Array) -> jax.Array:
        return _block(self.arrays(), x, self.num_heads)


class GPT(nnx.Module):
    """The built-in GPT as a Flax NNX module; same math and parameter tree as :func:`apply`.

    Args:
        cfg: the model config.
        rngs: RNG streams; only ``params`` is used.

    Example:
        >>> model = GPT(GPTConfig(num_layers=2, d_model=32, num_heads=2, d_ff=64),
        ...             rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((1, 8), jnp.int32)).shape
        (1, 8, 256)
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _Params(
            {
                "tokens": _normal(rngs.params(), (cfg.vocab_size, cfg.d_model), _INIT_STD),
                "positions": _normal(rngs.params(), (cfg.seq_len, cfg.d_model), _INIT_STD),
            }
        )

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> _Block:
            return _Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.ln_f = _Params(
            {
                "scale": jnp.ones((cfg.d_model,), jnp.float32),
                "bias": jnp.zeros((cfg.d_model,), jnp.float32),
            }
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Returns float32 logits [B, T, vocab_size] for int tokens [B, T]."""
        cfg = self.cfg
        table = self.embed.tokens[...]
        x = _embed(table, self.embed.positions[...], tokens, cfg)
        # A cast copy of the stacked blocks, so the cast sits before the scan as in `apply`.
        graphdef, state = nnx.split(self.blocks)
        blocks = nnx.merge(graphdef, jax.tree.map(lambda w: w.astype(cfg.compute_dtype), state))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(carry: jax.Array, block: _Block) -> jax.Array:
            return block(carry)

        return _head(self.ln_f.arrays(), table, run(x, blocks))


def nnx_loss_fn(model: GPT, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Next-token cross-entropy of the NNX GPT, in nats per token; see :func:`loss_fn`."""
    return _next_token_loss(model, batch["tokens"])
