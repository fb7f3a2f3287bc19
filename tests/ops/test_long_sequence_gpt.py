"""The built-in GPT's long-sequence keys (``attention_block``, ``loss_chunk``, ``mlp_chunk``):
with small blocks and chunks (8 and 12 on a 32-token sequence, so some are padded) its loss and
gradients equal the plain model's in float64 at 1e-12, in the functional form and in the NNX
form on packed rows, and its compiled step holds no ``[T, T]`` scores, no ``[B, T, V]`` logits
and no whole ``[B, T, d_ff]`` MLP layer (the plain model's holds all three); the keys are
validated in ``GPTConfig`` and in the ``model`` section."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from numerics import max_rel_error

import jzero
from jzero.demo.gpt import GPT, GPTConfig, init_params, loss_fn, nnx_loss_fn

pytestmark = pytest.mark.float64
RTOL = 1e-12
T = 32
PLAIN = GPTConfig(
    vocab_size=64, seq_len=T, num_layers=2, num_heads=2, d_model=16, d_ff=48, dtype="float64",
    attention_block=T, loss_chunk=0, mlp_chunk=0,
)  # fmt: skip
TILED = dataclasses.replace(PLAIN, attention_block=8, loss_chunk=12, mlp_chunk=12)


def params64():
    return jax.tree.map(lambda x: x.astype(jnp.float64), init_params(jax.random.key(0), PLAIN))


def packed_batch():
    """Four rows of 33 tokens, each two documents and padding (segment 0) at its end."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, PLAIN.vocab_size, (4, T + 1), dtype=np.int32)
    seg = np.zeros((4, T + 1), np.int32)
    pos = np.zeros((4, T + 1), np.int32)
    for row, (cut, end) in enumerate([(5, 30), (17, 33), (9, 20), (1, 28)]):
        seg[row, :cut], seg[row, cut:end] = 1, 2
        pos[row, :cut], pos[row, cut:end] = np.arange(cut), np.arange(end - cut)
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


def assert_same(got, want):
    (loss, grads), (want_loss, want_grads) = got, want
    assert abs(float(loss) - float(want_loss)) <= RTOL * abs(float(want_loss))
    assert max_rel_error(grads, want_grads) <= RTOL


def whole(compiled_text):
    """The arrays of a compiled program that hold a whole sequence's scores (two dims of T),
    logits (T and V) or MLP layer (T and d_ff)."""
    shapes = {
        tuple(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"\b(?:pred|s32|f32|f64)\[([\d,]*)\]", compiled_text)
    }
    wide = (PLAIN.vocab_size, PLAIN.d_ff)
    return sorted(s for s in shapes if s.count(T) >= 2 or (T in s and any(w in s for w in wide)))


def test_the_functional_gpt_with_blocks_and_chunks_equals_the_plain_one():
    params = params64()
    batch = {"tokens": packed_batch()["tokens"]}

    def run(cfg):
        step = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, cfg)))
        compiled = step.lower(params).compile()
        return compiled(params), whole(compiled.as_text())

    (tiled, tiled_whole), (plain, plain_whole) = run(TILED), run(PLAIN)
    assert_same(tiled, plain)
    kinds = [lambda s: s.count(T) >= 2, lambda s: PLAIN.vocab_size in s, lambda s: PLAIN.d_ff in s]
    assert all(any(map(kind, plain_whole)) for kind in kinds), plain_whole
    assert not tiled_whole, tiled_whole


def test_the_moe_gpt_with_blocks_and_chunks_equals_the_plain_one():
    """Every block an MoE block: blockwise attention and the tiled loss (the experts' MLP is
    not tiled); the loss, its aux and the gradients as the plain model's."""
    moe = {"num_experts": 2, "experts_per_token": 1, "num_layers": 1}
    plain = dataclasses.replace(PLAIN, **moe)
    tiled = dataclasses.replace(TILED, **moe)
    params = jax.tree.map(lambda x: x.astype(jnp.float64), init_params(jax.random.key(0), plain))
    batch = {"tokens": packed_batch()["tokens"]}

    def run(cfg):
        step = jax.value_and_grad(lambda p: loss_fn(p, batch, cfg), has_aux=True)
        (loss, aux), grads = jax.jit(step)(params)
        return (loss, grads), aux

    (got, got_aux), (want, want_aux) = run(tiled), run(plain)
    assert_same(got, want)
    for name in want_aux:
        np.testing.assert_allclose(got_aux[name], want_aux[name], rtol=RTOL, atol=0)


def test_the_nnx_gpt_on_packed_rows_with_blocks_and_chunks_equals_the_plain_one():
    batch = {k: jnp.asarray(v) for k, v in packed_batch().items()}
    params = params64()

    def run(cfg):
        model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(1)))
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, params)
        graphdef, state = nnx.split(model)[0], state

        def loss(s):
            return nnx_loss_fn(nnx.merge(graphdef, s), batch)

        return jax.jit(jax.value_and_grad(loss))(state)

    assert_same(run(TILED), run(PLAIN))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("attention_block", 0, r"attention_block must be a positive integer, got 0"),
        ("loss_chunk", -1, r"loss_chunk must be an integer >= 0"),
        ("mlp_chunk", 2.5, r"mlp_chunk must be an integer >= 0"),
    ],
)
def test_the_keys_are_validated(key, value, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig.from_dict({key: value})
    with pytest.raises(jzero.ConfigError, match=f"model.{key}"):
        jzero.load_config({"model": {key: value}})


def test_under_ulysses_and_stage_3_the_tiled_gpt_trains_like_the_plain_one():
    """``sequence_parallel_size`` 2 at ZeRO stage 3: blockwise attention runs inside the
    all-to-alls (the whole 32 tokens, one head a device), the loss and the MLP over each
    device's 16 tokens in chunks of 12, the head and MLP weights gathered by stage 3; the first
    step's loss and gradient norm equal the plain model's on one device."""
    params = params64()
    batch = {"tokens": packed_batch()["tokens"]}
    engine = jzero.initialize(
        params,
        lambda p, b: loss_fn(p, b, TILED),
        optax.sgd(1e-2),
        {
            "train_batch_size": 4,
            "sequence_parallel_size": 2,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        },
    )
    metrics = engine.train_step(batch)
    loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch, PLAIN))(params)
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-10, abs=0)
    assert float(metrics["grad_norm"]) == pytest.approx(
        float(optax.global_norm(grads)), rel=1e-10, abs=0
    )
