"""Blockwise attention (:mod:`jzero.ops.attention`): in float64 its output and its gradients
equal plain softmax attention's at 1e-12 (causal, non-causal, grouped-query, packed documents
with padding segment 0, lengths a multiple of the block and not, one block); a row with nothing
to attend gives zeros, never NaN, and merging is order-free; bf16 stays within the rounding
bound; and the compiled forward and backward hold no ``[T, T]`` buffer (the plain form does).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import EPS, max_rel_error

from jzero.ops import (
    attend_block,
    block_mask,
    blockwise_attention,
    empty_partial,
    finish,
    merge,
)

pytestmark = pytest.mark.float64
B, DH = 2, 4
RTOL = 1e-12


def plain_attention(q, k, v, mask):
    """Softmax attention over a whole ``[B, T, T]`` mask; k/v heads repeated for GQA."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def qkv(length, heads, kv_heads, dtype=jnp.float64, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (B, length, heads, DH), dtype),
        jax.random.normal(kk, (B, length, kv_heads, DH), dtype),
        jax.random.normal(kv, (B, length, kv_heads, DH), dtype),
    )


def packed_segments(length):
    """Two documents per row, the second row ending in padding (segment 0)."""
    seg = np.ones((B, length), np.int32)
    seg[:, length // 3 :] = 2
    seg[1, -length // 4 :] = 0
    return jnp.asarray(seg)


CASES = {
    # name: (T, block, heads, kv heads, causal, packed)
    "causal": (16, 4, 2, 2, True, False),
    "non-causal": (16, 4, 2, 2, False, False),
    "gqa, T not a multiple of the block": (13, 4, 4, 2, True, False),
    "packed documents with padding, gqa": (16, 4, 4, 2, True, True),
    "one block": (8, 8, 2, 1, True, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_equal_plain_attention(case):
    t, block, heads, kv_heads, causal, packed = CASES[case]
    q, k, v = qkv(t, heads, kv_heads)
    seg = packed_segments(t) if packed else None
    pos = jnp.arange(t)[None]
    mask = jnp.broadcast_to(block_mask(pos, pos, seg, seg, causal=causal), (B, t, t))
    probe = jax.random.normal(jax.random.key(1), q.shape, q.dtype)  # a cotangent of every output

    def blockwise(q, k, v):
        out = blockwise_attention(q, k, v, segment_ids=seg, causal=causal, block_size=block)
        return jnp.sum(out * probe), out

    def plain(q, k, v):
        out = plain_attention(q, k, v, mask)
        return jnp.sum(out * probe), out

    (_, got), got_grads = jax.jit(jax.value_and_grad(blockwise, (0, 1, 2), has_aux=True))(q, k, v)
    (_, want), want_grads = jax.value_and_grad(plain, (0, 1, 2), has_aux=True)(q, k, v)
    assert max_rel_error(got, want) <= RTOL
    assert max_rel_error(got_grads, want_grads) <= RTOL


def test_positions_set_the_causal_order():
    """Each document's own positions (restarting at 0) with its segment ids mask as the row's
    places do; positions in reverse turn the causal mask around."""
    t = 16
    q, k, v = qkv(t, 2, 2)
    seg = packed_segments(t)
    starts = jnp.argmax(seg[:, :, None] == seg[:, None, :], axis=-1)  # first place of the doc
    own = jnp.arange(t)[None] - starts
    got = blockwise_attention(q, k, v, segment_ids=seg, positions=own, block_size=4)
    want = blockwise_attention(q, k, v, segment_ids=seg, block_size=4)
    assert max_rel_error(got, want) <= RTOL
    backwards = blockwise_attention(q, k, v, positions=(t - jnp.arange(t))[None], block_size=4)
    pos = jnp.arange(t)[None]
    mask = jnp.broadcast_to(block_mask(pos, pos), (B, t, t))
    flipped = plain_attention(q[:, ::-1], k[:, ::-1], v[:, ::-1], mask)[:, ::-1]
    assert max_rel_error(backwards, flipped) <= RTOL


def test_a_row_with_nothing_to_attend_is_zero_not_nan():
    q, k, v = qkv(8, 2, 2)
    hidden = jnp.zeros((1, 8, 8), bool).at[:, 4:].set(jnp.tril(jnp.ones((4, 8), bool), 3))
    out = finish(attend_block(q, k, v, hidden), q.dtype)
    np.testing.assert_array_equal(out[:, :4], 0)
    assert not np.isnan(out).any() and np.abs(out[:, 4:]).min() > 0

    def total(q, k, v):
        return finish(attend_block(q, k, v, hidden), q.dtype).sum()

    assert all(np.isfinite(g).all() for g in jax.grad(total, (0, 1, 2))(q, k, v))
    # Merging a fully hidden block changes nothing.
    seen = attend_block(q, k, v, jnp.ones((1, 8, 8), bool))
    nothing = attend_block(q, k, v, jnp.zeros((1, 8, 8), bool))
    np.testing.assert_array_equal(finish(merge(seen, nothing), q.dtype), finish(seen, q.dtype))


def test_merge_is_order_free_and_empty_is_its_identity():
    q, k, v = qkv(12, 2, 2)
    pos = jnp.arange(12)[None]
    parts = [
        attend_block(q, k[:, s], v[:, s], block_mask(pos, pos[:, s]))
        for s in (slice(0, 4), slice(4, 8), slice(8, 12))
    ]
    forward = merge(merge(merge(empty_partial(q), parts[0]), parts[1]), parts[2])
    backward = merge(parts[2], merge(parts[1], merge(parts[0], empty_partial(q))))
    whole = plain_attention(q, k, v, jnp.broadcast_to(block_mask(pos, pos), (B, 12, 12)))
    assert max_rel_error(finish(forward, q.dtype), whole) <= RTOL
    assert max_rel_error(finish(backward, q.dtype), whole) <= RTOL


def test_bfloat16_stays_within_the_rounding_bound():
    """Each output is a convex combination of v's rows: rounding the probabilities to bf16 for
    the ``p @ v`` matmul moves it by at most one bf16 unit roundoff of max |v|, and rounding the
    output by one more of its own magnitude; the scores, maxima and sums are float32. The bound
    is three units (one of margin) of max |v|."""
    q, k, v = qkv(32, 4, 2, jnp.bfloat16)
    seg = packed_segments(32)
    got = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, segment_ids=seg, block_size=8))(
        q, k, v
    )
    assert got.dtype == jnp.bfloat16
    pos = jnp.arange(32)[None]
    mask = jnp.broadcast_to(block_mask(pos, pos, seg, seg), (B, 32, 32))
    wide = [x.astype(jnp.float64) for x in (q, k, v)]
    err = np.max(np.abs(np.asarray(got, np.float64) - plain_attention(*wide, mask)))
    assert err <= 3 * EPS["bfloat16"] * float(np.max(np.abs(wide[2]))), err


def test_on_a_gpu_16_bit_causal_attention_asks_cudnn_first(monkeypatch):
    """The backend reads as a GPU: plain causal bf16 attention calls cuDNN's fused attention
    (which JAX refuses here, no cuDNN: the blockwise path answers, bit for bit); packed
    documents or float32 never ask it."""
    calls = []
    fused = jax.nn.dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return fused(*args, **kwargs)

    q, k, v = (jax.random.normal(key, (B, 16, 2, 8), jnp.bfloat16)  # cuDNN: Dh % 8 == 0
               for key in jax.random.split(jax.random.key(3), 3))  # fmt: skip
    want = blockwise_attention(q, k, v, block_size=4)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    got = blockwise_attention(q, k, v, block_size=4)
    assert calls == [{"is_causal": True, "implementation": "cudnn"}]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    blockwise_attention(q, k, v, segment_ids=packed_segments(16), block_size=4)
    blockwise_attention(*(x.astype(jnp.float32) for x in (q, k, v)), block_size=4)
    assert len(calls) == 1


def test_bad_arguments_are_clear_errors():
    q, k, v = qkv(8, 3, 2)
    with pytest.raises(ValueError, match=r"3 heads and k, v have 2"):
        blockwise_attention(q, k, v)
    q, k, v = qkv(8, 2, 2)
    with pytest.raises(ValueError, match=r"block_size=0 must be a positive integer"):
        blockwise_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError, match=r"q has 8 tokens and k, v have 4"):
        blockwise_attention(q, k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match=r"segment_ids has shape \(2, 4\); it must be"):
        blockwise_attention(q, k, v, segment_ids=jnp.zeros((B, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"positions has shape \(3, 8\)"):
        blockwise_attention(q, k, v, positions=jnp.zeros((3, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"both q_seg and k_seg"):
        block_mask(jnp.arange(8)[None], jnp.arange(8)[None], jnp.zeros((B, 8), jnp.int32))


def _shapes(compiled_text):
    """Every array shape in a compiled program's text, as tuples of dims."""
    return {
        tuple(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"\b(?:pred|s32|s64|u32|f32|f64|bf16)\[([\d,]*)\]", compiled_text)
    }


def test_the_compiled_forward_and_backward_hold_no_t_by_t_buffer():
    """T = 64 in blocks of 8: no array has two dims of 64, nor as many elements as one head's
    scores; plain attention's program has both (so the check would see them)."""
    t = 64
    with jax.enable_x64(False):
        q, k, v = qkv(t, 2, 2, jnp.float32)
        seg = packed_segments(t)
        pos = jnp.arange(t)[None]
        mask = jnp.broadcast_to(block_mask(pos, pos, seg, seg), (B, t, t))

        def programs(attention):
            loss = lambda q, k, v: attention(q, k, v).sum()  # noqa: E731
            fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
            return _shapes(fn.lower(q, k, v).compile().as_text())

        blockwise = programs(
            lambda q, k, v: blockwise_attention(q, k, v, segment_ids=seg, block_size=8)
        )
        plain = programs(lambda q, k, v: plain_attention(q, k, v, mask))

    def square(shapes):
        return [s for s in shapes if s.count(t) >= 2 or np.prod(s, dtype=int) >= t * t]

    assert square(plain), plain
    assert not square(blockwise), square(blockwise)
