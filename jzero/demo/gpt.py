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
* Positions (``positions``): a learned ``[seq_len, d_model]`` table by default; ``"rotary"``
  drops the table and rotates every attention layer's queries and keys by their tokens'
  positions instead (:func:`jzero.ops.rotary`, base ``rope_theta``). The positions are the
  ones the table would be read at (each token's place in the row, this device's places under
  sequence or context parallelism, packed documents' restarting positions), computed once
  before the layer scan and read by every layer; the rotation runs on this device's tokens
  before attention exchanges anything. With no table nothing per token is a parameter, so
  context parallelism divides every per-token byte (ZeRO-3 would gather the table whole).
* The fused q/k/v projection has a dimension of its own for q, k and v (``attn_qkv`` is
  ``[D, 3, D]``, its bias ``[3, D]``), so tensor parallelism (:mod:`jzero.parallel.tensor`)
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
* Mixture of experts (``num_experts`` > 0): every ``moe_every``-th block's MLP is a top-k
  routed MoE (:func:`jzero.moe.moe_layer`: token choice, capacity or dropless
  (``drop_tokens``), dispatch by sorting, Switch's load-balancing loss; under
  ``expert_parallel`` the step's all-to-alls carry the tokens to the devices holding their
  experts). The layers stay **one** top-level scan, over *units*: with
  ``moe_every = 1`` a unit is one MoE block, with ``moe_every = k > 1`` it is ``k - 1`` dense
  blocks then one MoE block (layers ``k-1, 2k-1, ...`` are the MoE ones), and the scan runs
  ``num_layers / k`` units. A unit's leaves (``blocks.*``, all with leading dim ``L / k``):

  - ``ln1_*``, ``attn_*``, ``ln2_*``: the MoE block's attention and norms, as a dense block's;
  - ``router`` ``[L/k, D, E]`` (no bias): the router's logits, accumulated in float32; its
    name holds no ``expert`` so expert parallelism never splits it (every device scores all
    ``E`` experts);
  - ``experts.w_fc`` ``[L/k, E, D, F]``, ``experts.b_fc`` ``[L/k, E, F]``,
    ``experts.w_proj`` ``[L/k, E, F, D]``, ``experts.b_proj`` ``[L/k, E, D]``: the experts'
    GELU MLPs, the experts dimension right after the scanned one, which is where expert
    parallelism finds and splits it (the path component ``experts`` names them). The names
    match no tensor-parallel rule, so AutoTP leaves the experts whole on each device;
  - ``dense.*`` (``moe_every > 1`` only): the unit's ``k - 1`` dense blocks, every leaf of a
    dense block stacked ``[L/k, k-1, ...]``; the scan body runs them by index, so the scan
    still consumes dim 0 and nothing else touches the stored leaf before it.

  Keeping one scan (not a scan of dense blocks beside one of MoE blocks) is what ZeRO stage 3's
  layer-by-layer gather and its stacked-layer detection read. The expert MLPs are initialised
  as the dense MLP (std 0.02; the output projection 0.02 / sqrt(2 * num_layers)), the router
  with std 0.02. The loss then returns ``(loss, {"moe_aux_loss", "moe_dropped_fraction"})``:
  the load-balancing losses summed over the MoE layers (the loss includes
  ``moe_aux_loss_coef`` times it) and the dropped fraction of token choices averaged over
  them; jzero's step reports both as metrics. With ``num_experts = 0`` (the default) none of
  this exists: the tree, the numbers and the compiled program are the dense model's.
* Long sequences (:mod:`jzero.ops`): a sequence longer than ``attention_block`` tokens runs
  :func:`jzero.ops.blockwise_attention` (no ``[T, T]`` scores), the head and the loss run over
  ``loss_chunk``-token chunks (:func:`jzero.ops.tiled_cross_entropy`, no ``[B, T, V]`` logits)
  and the dense blocks' MLP over ``mlp_chunk``-token chunks (:func:`jzero.ops.tiled_mlp`; 0,
  the default, is off). A sequence within them compiles the plain forms, so a short-context
  model's program is unchanged. To let the loss tile the head, both forms run the blocks as a
  *trunk* (the final activations, before the final LayerNorm) and the loss applies the head.
* Sequence parallelism (DeepSpeed-Ulysses, ``sequence_parallel_size``) is built in: where
  jzero's step binds a ``seq`` axis, the loss takes this device's ``T/S`` positions of the
  inputs and targets, the position table from this device's first position, and attention
  runs through :func:`jzero.parallel.sequence.sequence_parallel_attention` (all-to-all to
  the whole sequence for ``H/S`` heads, and back). Context parallelism (ring attention,
  ``context_parallel_size``) likewise: where the step binds a ``context`` axis, each device
  holds two zig-zag chunks of every row (inputs, targets, the packed loss's mask and the
  position table all in that order: :func:`jzero.parallel.sequence.sequence_chunk`,
  :func:`~jzero.parallel.sequence.sequence_positions`) and attention is
  :func:`jzero.parallel.sequence.context_parallel_attention` (the ring, with Ulysses inside
  each ring member where ``seq`` is bound too). Called anywhere else, it is the plain model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jzero.ops import blockwise_attention, rotary, tiled_cross_entropy, tiled_mlp
from jzero.parallel.expert import MoEStats, moe_layer
from jzero.parallel.sequence import (
    CONTEXT_AXIS,
    bound_axis_size,
    context_parallel_attention,
    sequence_chunk,
    sequence_offset,
    sequence_parallel_attention,
    sequence_positions,
)

__all__ = ["EXPERT_TP_PLAN", "GPT", "GPTConfig", "apply", "init_params", "loss_fn", "nnx_loss_fn"]

PyTree = Any
_DTYPES = ("float32", "bfloat16", "float16", "float64")
_POSITIONS = ("learned", "rotary")
_INIT_STD = 0.02
_LN_EPS = 1e-5
_MIN_CAPACITY = 4  # the fewest slots an expert has on a device, however few its tokens

EXPERT_TP_PLAN = {
    "blocks.experts.w_fc": [None, None, None, "model"],
    "blocks.experts.b_fc": [None, None, "model"],
    "blocks.experts.w_proj": [None, None, "model"],
    "blocks.experts.b_proj": "replicate",
}
"""DeepSpeed's expert tensor parallelism for this GPT's experts, as ``tensor_parallel.tp_plan``
rules: each expert's MLP split over ``model`` too (column-wise in, row-wise out). AutoTP's own
rules leave the experts whole."""


_POSITIVE = (
    "vocab_size",
    "seq_len",
    "num_layers",
    "num_heads",
    "d_model",
    "d_ff",
    "attention_block",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    num_experts: int = 0
    """Experts of each MoE MLP; 0 (the default) is the dense model, else at least 2."""
    experts_per_token: int = 2
    """Experts each token is routed to (top-k); at most ``num_experts``."""
    capacity_factor: float = 1.25
    """Slots per expert as a multiple of its even share of a device's token choices; a choice
    past them is dropped (the token's residual stream carries it)."""
    drop_tokens: bool = True
    """``False`` for dropless MoE (DeepSpeed's ``drop_tokens``): no capacity, every choice
    reaches its expert, each expert's buffer sized for all of a device's tokens."""
    moe_every: int = 1
    """An MoE MLP in every ``moe_every``-th block (the others dense); divides ``num_layers``."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (summed over the MoE layers) in the loss."""
    attention_block: int = 512
    """Tokens per query and key block of attention: a sequence longer than this runs
    :func:`jzero.ops.blockwise_attention` (no ``[T, T]`` scores; cuDNN's fused attention on a
    GPU in 16-bit), a shorter one the plain ``einsum`` attention."""
    loss_chunk: int = 1024
    """Tokens per chunk of the output head and the loss (:func:`jzero.ops.tiled_cross_entropy`:
    no ``[B, T, V]`` logits) when a device's sequence is longer; 0 computes it whole."""
    mlp_chunk: int = 0
    """Tokens per chunk of the dense blocks' MLP (:func:`jzero.ops.tiled_mlp`: no whole
    ``[B, T, d_ff]`` hidden layer, one more MLP forward in the backward pass) when a device's
    sequence is longer; 0 (the default) computes it whole. MoE blocks are not tiled."""
    positions: Literal["learned", "rotary"] = "learned"
    """How a token's place enters the model: ``"learned"``, a ``[seq_len, d_model]`` table
    (``embed.positions``) added to the token embeddings; ``"rotary"``, rotary position
    embeddings of every attention layer's queries and keys (:func:`jzero.ops.rotary`) and no
    table, so no per-token parameter that ZeRO-3 gathers whole under sequence or context
    parallelism. Rotary needs an even head dimension (``d_model / num_heads``)."""
    rope_theta: float = 10000.0
    """The base of the rotary frequencies (read under ``positions: rotary``)."""

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        for name in ("loss_chunk", "mlp_chunk"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(
                    f"GPTConfig.{name} must be an integer >= 0 (tokens per chunk; 0 computes the "
                    f"whole sequence at once), got {value!r}."
                )
        self._check_moe()
        if self.d_model % self.num_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by num_heads="
                f"{self.num_heads}. Choose num_heads among the divisors of d_model."
            )
        self._check_positions()
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"GPTConfig.dtype={self.dtype!r} is not supported. It must be one of {_DTYPES}."
            )

    def _check_positions(self) -> None:
        """``positions`` and ``rope_theta``: each error names the value, what is allowed and the
        fix."""
        if self.positions not in _POSITIONS:
            raise ValueError(
                f"GPTConfig.positions={self.positions!r} is not supported. It must be one of "
                f"{_POSITIONS}: 'learned' for a position table, 'rotary' for rotary position "
                "embeddings of queries and keys."
            )
        theta = self.rope_theta
        if not isinstance(theta, int | float) or isinstance(theta, bool) or not theta > 0:
            raise ValueError(
                f"GPTConfig.rope_theta={theta!r} must be a number > 0 (the base of the rotary "
                "frequencies; 10000 is the usual)."
            )
        object.__setattr__(self, "rope_theta", float(theta))  # YAML may give 10000 for 1e4
        head_dim = self.d_model // self.num_heads
        if self.rotary and head_dim % 2:
            raise ValueError(
                f"GPTConfig.positions='rotary' needs an even head dimension, but d_model="
                f"{self.d_model} / num_heads={self.num_heads} is {head_dim}. Choose d_model and "
                "num_heads with an even quotient, or positions='learned'."
            )

    def _check_moe(self) -> None:
        """The MoE fields: each error names the value, what is allowed and the fix."""
        e, k = self.num_experts, self.experts_per_token
        if not _is_int(e) or e < 0 or e == 1:
            raise ValueError(
                f"GPTConfig.num_experts={e!r} is not allowed: use 0 for the dense model or an "
                "integer >= 2 for a mixture of experts (one expert is the dense MLP)."
            )
        for name in ("experts_per_token", "moe_every"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if not isinstance(self.drop_tokens, bool):
            raise ValueError(
                f"GPTConfig.drop_tokens must be true or false, got {self.drop_tokens!r}."
            )
        for name in ("capacity_factor", "moe_aux_loss_coef"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"GPTConfig.{name} must be a number, got {value!r}.")
            object.__setattr__(self, name, float(value))  # YAML may give 2 for 2.0
        if not self.capacity_factor > 0:
            raise ValueError(
                f"GPTConfig.capacity_factor={self.capacity_factor} must be > 0 (1.0 gives each "
                "expert its even share of the token choices; 1.25 is the usual)."
            )
        if not self.moe_aux_loss_coef >= 0:
            raise ValueError(
                f"GPTConfig.moe_aux_loss_coef={self.moe_aux_loss_coef} must be >= 0 (0 turns "
                "the load-balancing loss off; 0.01 is the usual)."
            )
        if e == 0:
            return
        if k > e:
            raise ValueError(
                f"GPTConfig.experts_per_token={k} exceeds num_experts={e}: a token is routed to "
                f"k distinct experts. Use experts_per_token <= {e} or raise num_experts."
            )
        if self.num_layers % self.moe_every:
            fits = [m for m in range(1, self.num_layers + 1) if self.num_layers % m == 0]
            raise ValueError(
                f"GPTConfig.num_layers={self.num_layers} is not divisible by moe_every="
                f"{self.moe_every}: the layers run as num_layers / moe_every units of "
                f"moe_every - 1 dense blocks and one MoE block. Use moe_every among {fits}, or "
                f"num_layers a multiple of {self.moe_every}."
            )

    @property
    def rotary(self) -> bool:
        """Whether positions are rotary (no position table)."""
        return self.positions == "rotary"

    @property
    def moe(self) -> bool:
        """Whether the model has MoE blocks (``num_experts`` > 0)."""
        return self.num_experts > 0

    @property
    def num_units(self) -> int:
        """The scan's length: ``num_layers``, or ``num_layers / moe_every`` units with MoE."""
        return self.num_layers // self.moe_every if self.moe else self.num_layers

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


def _init_attention(k_qkv: jax.Array, k_out: jax.Array, d: int, resid_std: float) -> dict:
    """A block's norms and attention (no layer dim), dense and MoE blocks alike."""
    return {
        "ln1_scale": jnp.ones((d,), jnp.float32),
        "ln1_bias": jnp.zeros((d,), jnp.float32),
        "attn_qkv": _normal(k_qkv, (d, 3, d), _INIT_STD),
        "attn_qkv_bias": jnp.zeros((3 * d,), jnp.float32),
        "attn_out": _normal(k_out, (d, d), resid_std),
        "attn_out_bias": jnp.zeros((d,), jnp.float32),
        "ln2_scale": jnp.ones((d,), jnp.float32),
        "ln2_bias": jnp.zeros((d,), jnp.float32),
    }


def _init_block(key: jax.Array, cfg: GPTConfig) -> dict[str, jax.Array]:
    """One layer's parameters (no layer dim); ``init_params`` vmaps this over the layers."""
    d, f = cfg.d_model, cfg.d_ff
    resid_std = _INIT_STD / math.sqrt(2 * cfg.num_layers)
    k_qkv, k_out, k_in, k_mlp_out = jax.random.split(key, 4)
    return {
        **_init_attention(k_qkv, k_out, d, resid_std),
        "mlp_in": _normal(k_in, (d, f), _INIT_STD),
        "mlp_in_bias": jnp.zeros((f,), jnp.float32),
        "mlp_out": _normal(k_mlp_out, (f, d), resid_std),
        "mlp_out_bias": jnp.zeros((d,), jnp.float32),
    }


def _init_moe_block(key: jax.Array, cfg: GPTConfig) -> dict[str, Any]:
    """One MoE block's parameters (no layer dim): a dense block's attention and norms, the
    router, and ``experts`` (each leaf with the experts dimension first)."""
    d, f, e = cfg.d_model, cfg.d_ff, cfg.num_experts
    resid_std = _INIT_STD / math.sqrt(2 * cfg.num_layers)
    k_qkv, k_out, k_router, k_fc, k_proj = jax.random.split(key, 5)
    return {
        **_init_attention(k_qkv, k_out, d, resid_std),
        "router": _normal(k_router, (d, e), _INIT_STD),
        "experts": {
            "w_fc": _normal(k_fc, (e, d, f), _INIT_STD),
            "b_fc": jnp.zeros((e, f), jnp.float32),
            "w_proj": _normal(k_proj, (e, f, d), resid_std),
            "b_proj": jnp.zeros((e, d), jnp.float32),
        },
    }


def _init_unit(key: jax.Array, cfg: GPTConfig) -> dict[str, Any]:
    """One scan unit of an MoE model (no unit dim): the MoE block, and with ``moe_every = k >
    1`` its ``k - 1`` dense blocks under ``dense``, stacked on a leading dim of ``k - 1``."""
    if cfg.moe_every == 1:
        return _init_moe_block(key, cfg)
    k_dense, k_moe = jax.random.split(key)
    dense_keys = jax.random.split(k_dense, cfg.moe_every - 1)
    return {
        **_init_moe_block(k_moe, cfg),
        "dense": jax.vmap(lambda k: _init_block(k, cfg))(dense_keys),
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


def _causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None = None,
    block: int | None = None,
) -> jax.Array:
    """Causal softmax attention of [B, T, H, Dh] heads, the softmax in float32 (or wider);
    with ``segments`` ([B, T] document ids of packed rows) a token sees only its document's.
    A sequence longer than ``block`` tokens runs blockwise (:func:`jzero.ops.blockwise_attention`);
    under sequence parallelism ``T`` here is the whole sequence's."""
    t, head_dim = q.shape[1], q.shape[-1]
    if block is not None and t > block:
        return blockwise_attention(q, k, v, segment_ids=segments, block_size=block)
    wide = _wide(q.dtype)
    scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(wide) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    if segments is not None:
        causal = causal & (segments[:, None, :, None] == segments[:, None, None, :])
    scores = jnp.where(causal, scores, jnp.finfo(wide).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhts,bshd->bthd", probs, v)


# Under sequence parallelism (a `seq` axis bound by jzero's step) each device holds T/S tokens;
# attention then sees the whole sequence for H/S heads. Elsewhere it is the plain call.
_ulysses_attention = sequence_parallel_attention(_causal_attention)


def _parallel_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, block: int
) -> jax.Array:
    """Attention of this device's q, k, v (``segments``: the whole rows' document ids, or
    ``None``): ring attention where jzero's step binds a ``context`` axis of more than one
    device (with Ulysses inside each ring member where ``seq`` is bound too; each ring step is
    one block of the member's tokens, so ``block`` is not read), else Ulysses where ``seq`` is
    bound, else the plain call (blockwise past ``block`` tokens)."""
    if (bound_axis_size(CONTEXT_AXIS) or 1) == 1:
        return _ulysses_attention(q, k, v, segments, block)
    local = None if segments is None else sequence_chunk(segments)
    return context_parallel_attention(q, k, v, local, block_size=block)


def _attention(
    p: Mapping[str, jax.Array],
    x: jax.Array,
    cfg: GPTConfig,
    segments: jax.Array | None = None,
    rope: jax.Array | None = None,
) -> jax.Array:
    """Causal multi-head self-attention; ``x`` is [B, T, D] (this device's tokens),
    ``segments`` the whole rows' document ids (or ``None``), ``rope`` this device's tokens'
    positions ([T] or [B, T]) for rotary positions (``None`` with a learned table)."""
    b, t, d = x.shape
    num_heads = cfg.num_heads
    head_dim = d // num_heads
    qkv = jnp.einsum("btd,dcn->btcn", x, p["attn_qkv"]) + p["attn_qkv_bias"].reshape(3, d)
    qkv = qkv.reshape(b, t, 3, num_heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if rope is not None:  # per token, so before any exchange of keys (Ulysses, the ring)
        q, k = rotary(q, rope, theta=cfg.rope_theta), rotary(k, rope, theta=cfg.rope_theta)
    out = _parallel_attention(q, k, v, segments, cfg.attention_block).reshape(b, t, d)
    return out @ p["attn_out"] + p["attn_out_bias"]


def _block(
    p: Mapping[str, jax.Array],
    x: jax.Array,
    cfg: GPTConfig,
    segments: jax.Array | None = None,
    rope: jax.Array | None = None,
) -> jax.Array:
    """One pre-LayerNorm transformer block; ``p`` is already in the compute dtype (``segments``
    and ``rope`` as :func:`_attention` reads them). The MLP runs over chunks of
    ``cfg.mlp_chunk`` tokens when the sequence is longer."""
    x = x + _attention(p, _layer_norm(x, p["ln1_scale"], p["ln1_bias"]), cfg, segments, rope)
    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    if cfg.mlp_chunk and x.shape[1] > cfg.mlp_chunk:

        def mlp(h: jax.Array) -> jax.Array:
            h = jax.nn.gelu(h @ p["mlp_in"] + p["mlp_in_bias"])
            return h @ p["mlp_out"] + p["mlp_out_bias"]

        return x + tiled_mlp(mlp, h, chunk=cfg.mlp_chunk)
    h = jax.nn.gelu(h @ p["mlp_in"] + p["mlp_in_bias"])
    return x + h @ p["mlp_out"] + p["mlp_out_bias"]


def _experts_mlp(p: Mapping[str, jax.Array], slots: jax.Array) -> jax.Array:
    """Expert ``i``'s GELU MLP on row ``i`` of ``slots`` ``[E_local, N, D]``; ``p`` holds the
    experts the loss sees (all ``E``, or under expert parallelism this device's ``E / E_p``)."""
    h = jnp.einsum("end,edf->enf", slots, p["w_fc"]) + p["b_fc"][:, None, :]
    h = jax.nn.gelu(h)
    return jnp.einsum("enf,efd->end", h, p["w_proj"]) + p["b_proj"][:, None, :]


def _moe_block(
    p: Mapping[str, Any],
    x: jax.Array,
    cfg: GPTConfig,
    segments: jax.Array | None = None,
    rope: jax.Array | None = None,
) -> tuple[jax.Array, MoEStats]:
    """A pre-LayerNorm block whose MLP is the routed experts; ``p`` in the compute dtype.

    The router's logits are accumulated in float32 (or wider): the top-k choice and the
    load-balancing loss read probabilities that low-precision logits would round together."""
    x = x + _attention(p, _layer_norm(x, p["ln1_scale"], p["ln1_bias"]), cfg, segments, rope)
    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    logits = jnp.einsum("btd,de->bte", h, p["router"], preferred_element_type=_wide(h.dtype))
    y, stats = moe_layer(
        logits,
        lambda slots: _experts_mlp(p["experts"], slots),
        h,
        experts_per_token=cfg.experts_per_token,
        capacity_factor=cfg.capacity_factor,
        min_capacity=_MIN_CAPACITY,
        drop_tokens=cfg.drop_tokens,
    )
    return x + y.astype(x.dtype), stats


def _unit(
    p: Mapping[str, Any],
    x: jax.Array,
    cfg: GPTConfig,
    segments: jax.Array | None = None,
    rope: jax.Array | None = None,
) -> tuple[jax.Array, MoEStats]:
    """One scan unit of an MoE model: its ``moe_every - 1`` dense blocks, then its MoE block.

    The dense blocks are indexed out of the unit's ``[k-1, ...]`` leaves in a Python loop (no
    inner scan): ``k`` is small, and the outer scan stays the only one over stored weights."""
    dense = p.get("dense")
    for j in range(cfg.moe_every - 1):
        x = _block(jax.tree.map(lambda w, j=j: w[j], dense), x, cfg, segments, rope)
    return _moe_block(p, x, cfg, segments, rope)


def _moe_aux(stats: MoEStats) -> dict[str, jax.Array]:
    """The per-unit stats (stacked on dim 0 by the scan) as the loss's aux: the load-balancing
    losses summed over the MoE layers, the dropped fractions averaged."""
    return {
        "moe_aux_loss": jnp.sum(stats.aux_loss),
        "moe_dropped_fraction": jnp.mean(stats.dropped_fraction),
    }


def _embed(
    tokens_table: jax.Array,
    positions: jax.Array | None,
    tokens: jax.Array,
    cfg: GPTConfig,
    at: jax.Array | None = None,
) -> jax.Array:
    """Token plus position embeddings; ``at``: each token's position (packed rows restart it
    at each document), else its place in the row. ``positions`` is ``None`` under rotary
    positions: the token embeddings alone (attention places the tokens)."""
    t = tokens.shape[-1]
    if t > cfg.seq_len:
        raise ValueError(
            f"The input has {t} tokens per sequence but GPTConfig.seq_len={cfg.seq_len}. "
            "Shorten the input or raise seq_len."
        )
    if positions is None:
        return jnp.take(tokens_table, tokens, axis=0).astype(cfg.compute_dtype)
    if at is not None:
        return (jnp.take(tokens_table, tokens, axis=0) + positions[at]).astype(cfg.compute_dtype)
    if (bound_axis_size(CONTEXT_AXIS) or 1) > 1:  # zig-zag chunks: each token's own place
        table = jnp.take(positions, sequence_positions(t), axis=0)
    else:
        offset = sequence_offset(t)  # this device's first position under sequence parallelism
        table = (
            positions[:t]
            if isinstance(offset, int)
            else jax.lax.dynamic_slice_in_dim(positions, offset, t)
        )
    x = jnp.take(tokens_table, tokens, axis=0) + table
    return x.astype(cfg.compute_dtype)


def _rotary_positions(t: int, cfg: GPTConfig, at: jax.Array | None = None) -> jax.Array | None:
    """The positions rotary attention reads for this device's ``t`` tokens (``None`` with a
    learned table): ``at`` for packed rows (restarting at each document), else each token's
    place in the row (:func:`jzero.parallel.sequence.sequence_positions`: ``arange(t)``, the
    zig-zag chunks' places under context parallelism, this device's share under Ulysses)."""
    if not cfg.rotary:
        return None
    return at if at is not None else sequence_positions(t)


class _Head(NamedTuple):
    """What the output head reads besides the activations: the final LayerNorm's parameters
    and the (tied) token table."""

    ln_f: Mapping[str, jax.Array]
    tokens_table: jax.Array


def _head(ln_f: Mapping[str, jax.Array], tokens_table: jax.Array, x: jax.Array) -> jax.Array:
    """Final LayerNorm and the tied output head; float32 (or wider) logits [B, T, V]."""
    x = _layer_norm(x, ln_f["scale"], ln_f["bias"])
    logits = jnp.einsum("btd,vd->btv", x, tokens_table.astype(x.dtype))
    return logits.astype(_wide(x.dtype))


def _mean_loss(
    head: _Head, x: jax.Array, targets: jax.Array, cfg: GPTConfig, keep: jax.Array | None = None
) -> jax.Array:
    """Mean next-token cross-entropy of the final activations ``x`` [B, T, D] (before the final
    LayerNorm) against ``targets`` [B, T]; with ``keep``, only the kept targets count, the sum
    still divided by every target place. Over ``cfg.loss_chunk``-token chunks
    (:func:`jzero.ops.tiled_cross_entropy`) when the sequence is longer."""
    if cfg.loss_chunk and x.shape[1] > cfg.loss_chunk:
        y = _layer_norm(x, head.ln_f["scale"], head.ln_f["bias"])
        table = head.tokens_table.astype(y.dtype)
        total = tiled_cross_entropy(y, table, targets, chunk=cfg.loss_chunk, weights=keep)
        return total / targets.size
    log_probs = jax.nn.log_softmax(_head(head.ln_f, head.tokens_table, x), axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)
    if keep is None:
        return -picked.mean()
    picked = picked[..., 0]
    return -jnp.where(keep, picked, 0.0).sum() / picked.size


def _next_token_loss(
    trunk: Callable[[jax.Array], jax.Array], head: _Head, tokens: jax.Array, cfg: GPTConfig
) -> jax.Array:
    """Mean next-token cross-entropy in nats; ``tokens`` is int [B, T + 1], ``trunk`` maps
    inputs to the final activations."""
    loss, _ = _next_token_loss_and_aux(lambda inputs: (trunk(inputs), {}), head, tokens, cfg)
    return loss


def _next_token_loss_and_aux(
    forward: Callable[[jax.Array], tuple[jax.Array, dict]],
    head: _Head,
    tokens: jax.Array,
    cfg: GPTConfig,
) -> tuple[jax.Array, dict]:
    """:func:`_next_token_loss` of a ``forward`` that returns ``(activations, aux)``; the aux
    too."""
    # Under sequence parallelism each device takes its own T/S positions of both.
    inputs, targets = sequence_chunk(tokens[:, :-1]), sequence_chunk(tokens[:, 1:])
    x, aux = forward(inputs)
    return _mean_loss(head, x, targets, cfg), aux


def _packed_loss_and_aux(
    model: GPT, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The next-token loss of packed rows (:mod:`jzero.data`'s ``segment_ids`` and
    ``positions``): attention stays within each document, and a target counts only where it
    continues its input's document (not across a boundary, not on padding, segment 0). The sum
    is divided by every target place, as the unpacked loss is: so each device's share is the
    same under any split of the sequence, and one document's per-token terms never depend on
    another document."""
    tokens, seg = batch["tokens"], batch["segment_ids"]
    inputs, targets = sequence_chunk(tokens[:, :-1]), sequence_chunk(tokens[:, 1:])
    at = sequence_chunk(batch["positions"][:, :-1])
    keep = sequence_chunk((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0))
    x, aux = model._trunk(inputs, seg[:, :-1], at)
    return _mean_loss(model._head_params(), x, targets, model.cfg, keep), aux


def _moe_loss(
    forward: Callable[[jax.Array], tuple[jax.Array, dict]],
    head: _Head,
    tokens: jax.Array,
    cfg: GPTConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """An MoE model's ``(loss, aux)``: the cross-entropy plus ``moe_aux_loss_coef`` times the
    load-balancing loss, and the aux of :func:`_moe_aux`."""
    ce, aux = _next_token_loss_and_aux(forward, head, tokens, cfg)
    return ce + cfg.moe_aux_loss_coef * aux["moe_aux_loss"].astype(ce.dtype), aux


# ----------------------------------------------------------------------------------------------
# (a) Functional form.


def init_params(key: jax.Array, cfg: GPTConfig) -> dict:
    """Initialises the functional GPT's parameters (float32); jittable.

    Args:
        key: a PRNG key.
        cfg: the model config.

    Returns:
        ``{"embed": {"tokens": [V, D], "positions": [T, D]}, "blocks": {name: [L, ...]},
        "ln_f": {"scale": [D], "bias": [D]}}`` (no ``embed.positions`` under rotary
        positions); with MoE, ``blocks`` holds ``L / moe_every`` units (see the module's
        docstring for their leaves).
    """
    k_tok, k_pos, k_blocks = jax.random.split(key, 3)
    layer_keys = jax.random.split(k_blocks, cfg.num_units)  # layers, or MoE units
    init_layer = _init_unit if cfg.moe else _init_block
    embed = {"tokens": _normal(k_tok, (cfg.vocab_size, cfg.d_model), _INIT_STD)}
    if not cfg.rotary:
        embed["positions"] = _normal(k_pos, (cfg.seq_len, cfg.d_model), _INIT_STD)
    return {
        "embed": embed,
        "blocks": jax.vmap(lambda k: init_layer(k, cfg))(layer_keys),
        "ln_f": {
            "scale": jnp.ones((cfg.d_model,), jnp.float32),
            "bias": jnp.zeros((cfg.d_model,), jnp.float32),
        },
    }


def apply(params: dict, tokens: jax.Array, cfg: GPTConfig, *, return_aux: bool = False) -> Any:
    """Runs the functional GPT.

    Args:
        params: parameters from :func:`init_params` (or the same tree, e.g. trained).
        tokens: int token ids [B, T] with T <= ``cfg.seq_len``.
        cfg: the model config.
        return_aux: also return the MoE layers' stats (``{}`` for a dense model).

    Returns:
        float32 logits [B, T, vocab_size]; with ``return_aux``, ``(logits, aux)``, the aux as
        :func:`loss_fn` returns it.
    """
    logits, aux = _forward(params, tokens, cfg)
    return (logits, aux) if return_aux else logits


def _forward(params: dict, tokens: jax.Array, cfg: GPTConfig) -> tuple[jax.Array, dict]:
    x, aux = _trunk(params, tokens, cfg)
    return _head(params["ln_f"], params["embed"]["tokens"], x), aux


def _trunk(params: dict, tokens: jax.Array, cfg: GPTConfig) -> tuple[jax.Array, dict]:
    """The embeddings and the blocks: the final activations [B, T, D] (before the final
    LayerNorm) and the MoE aux."""
    x = _embed(params["embed"]["tokens"], params["embed"].get("positions"), tokens, cfg)
    rope = _rotary_positions(tokens.shape[-1], cfg)
    # The only op between the stored stacked weights and the scan: the cast (ZeRO-3 gathers there).
    blocks = jax.tree.map(lambda w: w.astype(cfg.compute_dtype), params["blocks"])
    if cfg.moe:

        def moe_body(carry: jax.Array, unit: dict) -> tuple[jax.Array, MoEStats]:
            return _unit(unit, carry, cfg, None, rope)

        x, stats = jax.lax.scan(moe_body, x, blocks)
        return x, _moe_aux(stats)

    def body(carry: jax.Array, layer: dict) -> tuple[jax.Array, None]:
        return _block(layer, carry, cfg, None, rope), None

    x, _ = jax.lax.scan(body, x, blocks)
    return x, {}


def _params_head(params: dict) -> _Head:
    return _Head(params["ln_f"], params["embed"]["tokens"])


def loss_fn(params: dict, batch: Mapping[str, jax.Array], cfg: GPTConfig) -> Any:
    """Next-token cross-entropy of the functional GPT, in nats per token (per byte).

    Args:
        params: the parameters.
        batch: ``{"tokens": int [B, T + 1]}``; position t predicts token t + 1.
        cfg: the model config.

    Returns:
        The scalar mean loss (float32). With MoE, ``(loss, aux)``: the loss plus
        ``moe_aux_loss_coef * aux["moe_aux_loss"]``, and ``aux`` ``{"moe_aux_loss": summed
        over the MoE layers, "moe_dropped_fraction": averaged over them}``.
    """
    head = _params_head(params)
    if cfg.moe:
        return _moe_loss(lambda x: _trunk(params, x, cfg), head, batch["tokens"], cfg)
    return _next_token_loss(lambda x: _trunk(params, x, cfg)[0], head, batch["tokens"], cfg)


def unstack_blocks(params: dict) -> dict:
    """The same parameters with ``blocks`` as a list of per-layer dicts, for
    :func:`unrolled_loss_fn`; jittable."""
    blocks = params["blocks"]
    layers = jax.tree.leaves(blocks)[0].shape[0]
    return {**params, "blocks": [jax.tree.map(lambda w, i=i: w[i], blocks) for i in range(layers)]}


def unrolled_loss_fn(params: dict, batch: Mapping[str, jax.Array], cfg: GPTConfig) -> Any:
    """:func:`loss_fn` written as a Python loop over layers (``params["blocks"]`` a list, from
    :func:`unstack_blocks`), as most Flax models are: the same numbers, no ``scan``. With MoE
    the list holds the units and the result is ``(loss, aux)``, as :func:`loss_fn`'s."""

    def cast(tree: Any) -> Any:
        return jax.tree.map(lambda w: w.astype(cfg.compute_dtype), tree)

    def trunk(tokens: jax.Array) -> jax.Array:
        x = _embed(params["embed"]["tokens"], params["embed"].get("positions"), tokens, cfg)
        rope = _rotary_positions(tokens.shape[-1], cfg)
        for layer in params["blocks"]:
            x = _block(cast(layer), x, cfg, None, rope)
        return x

    def forward(tokens: jax.Array) -> tuple[jax.Array, dict]:
        x = _embed(params["embed"]["tokens"], params["embed"].get("positions"), tokens, cfg)
        rope = _rotary_positions(tokens.shape[-1], cfg)
        stats = []
        for unit in params["blocks"]:
            x, unit_stats = _unit(cast(unit), x, cfg, None, rope)
            stats.append(unit_stats)
        stacked = MoEStats(*(jnp.stack(s) for s in zip(*stats, strict=True)))
        return x, _moe_aux(stacked)

    head = _params_head(params)
    if cfg.moe:
        return _moe_loss(forward, head, batch["tokens"], cfg)
    return _next_token_loss(trunk, head, batch["tokens"], cfg)


# ----------------------------------------------------------------------------------------------
# (b) Flax NNX form.


class _Params(nnx.Module):
    """A bag of ``nnx.Param`` leaves, named like the functional form's dict; a nested mapping
    (an MoE unit's ``experts`` and ``dense``) becomes a nested bag, so the module's pure dict
    has the functional tree's paths (``blocks.experts.w_fc``)."""

    def __init__(self, arrays: Mapping[str, Any]):
        for name, value in arrays.items():
            setattr(self, name, _Params(value) if isinstance(value, Mapping) else nnx.Param(value))

    def arrays(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, var in vars(self).items():
            if isinstance(var, nnx.Param):
                out[name] = var[...]
            elif isinstance(var, _Params):
                out[name] = var.arrays()
        return out


class _Block(_Params):
    """One transformer block (stacked over layers by ``nnx.vmap`` in :class:`GPT`)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        super().__init__(_init_block(rngs.params(), cfg))
        self.cfg = cfg

    def __call__(
        self, x: jax.Array, segments: jax.Array | None = None, rope: jax.Array | None = None
    ) -> jax.Array:
        return _block(self.arrays(), x, self.cfg, segments, rope)


class _Unit(_Params):
    """One scan unit of an MoE GPT (stacked over units by ``nnx.vmap`` in :class:`GPT`)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        super().__init__(_init_unit(rngs.params(), cfg))
        self.cfg = cfg

    def __call__(
        self, x: jax.Array, segments: jax.Array | None = None, rope: jax.Array | None = None
    ) -> tuple[jax.Array, MoEStats]:
        return _unit(self.arrays(), x, self.cfg, segments, rope)


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
        embed = {"tokens": _normal(rngs.params(), (cfg.vocab_size, cfg.d_model), _INIT_STD)}
        if not cfg.rotary:
            embed["positions"] = _normal(rngs.params(), (cfg.seq_len, cfg.d_model), _INIT_STD)
        self.embed = _Params(embed)

        layer = _Unit if cfg.moe else _Block

        @nnx.split_rngs(splits=cfg.num_units)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> _Block | _Unit:
            return layer(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.ln_f = _Params(
            {
                "scale": jnp.ones((cfg.d_model,), jnp.float32),
                "bias": jnp.zeros((cfg.d_model,), jnp.float32),
            }
        )

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Returns float32 logits [B, T, vocab_size] for int tokens [B, T]; for packed rows,
        their document ids ``segment_ids`` [B, T] (attention stays within a document) and
        each token's ``positions`` [B, T] (under sequence parallelism: the whole rows' ids,
        this device's positions)."""
        return self.forward(tokens, segment_ids, positions)[0]

    def forward(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``(logits, aux)`` for int tokens [B, T] (packed rows: as ``__call__``): the aux is
        the MoE layers' stats as :func:`loss_fn` returns them (``{}`` for a dense model)."""
        x, aux = self._trunk(tokens, segment_ids, positions)
        head = self._head_params()
        return _head(head.ln_f, head.tokens_table, x), aux

    def _head_params(self) -> _Head:
        return _Head(self.ln_f.arrays(), self.embed.tokens[...])

    def _trunk(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The embeddings and the blocks: the final activations [B, T, D] (before the final
        LayerNorm) and the MoE aux."""
        cfg = self.cfg
        table = None if cfg.rotary else self.embed.positions[...]
        x = _embed(self.embed.tokens[...], table, tokens, cfg, positions)
        rope = _rotary_positions(tokens.shape[-1], cfg, positions)
        # A cast copy of the stacked blocks, so the cast sits before the scan as in `apply`.
        graphdef, state = nnx.split(self.blocks)
        blocks = nnx.merge(graphdef, jax.tree.map(lambda w: w.astype(cfg.compute_dtype), state))
        if cfg.moe:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
            def run_units(carry: jax.Array, unit: _Unit) -> tuple[jax.Array, MoEStats]:
                return unit(carry, segment_ids, rope)

            x, stats = run_units(x, blocks)
            return x, _moe_aux(stats)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(carry: jax.Array, block: _Block) -> jax.Array:
            return block(carry, segment_ids, rope)

        return run(x, blocks), {}


def nnx_loss_fn(model: GPT, batch: Mapping[str, jax.Array]) -> Any:
    """Next-token cross-entropy of the NNX GPT, in nats per token; with MoE ``(loss, aux)``.
    See :func:`loss_fn`."""
    if "segment_ids" in batch:  # packed rows of documents (jzero.data)
        ce, aux = _packed_loss_and_aux(model, batch)
        if not model.cfg.moe:
            return ce
        return ce + model.cfg.moe_aux_loss_coef * aux["moe_aux_loss"].astype(ce.dtype), aux
    head = model._head_params()
    if model.cfg.moe:
        return _moe_loss(model._trunk, head, batch["tokens"], model.cfg)
    return _next_token_loss(lambda x: model._trunk(x)[0], head, batch["tokens"], model.cfg)
