"""DeepSpeed-Ulysses sequence parallelism (:mod:`jzero.parallel.sequence`): on mesh
``{data: 2, seq: 4}`` a causal attention's output and gradients equal the unsplit attention's
in float64 (1e-12), the compiled program holds the four all-to-alls over the seq groups, the
unbound axis calls the attention directly, grouped-query attention splits k/v heads alike, and
the head and length checks name the numbers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jzero
from jzero.parallel.sequence import (
    SEQ_AXIS,
    sequence_chunk,
    sequence_offset,
    sequence_parallel_attention,
)

B, T, H, DH = 2, 16, 4, 8
S = 4
SPEC = P("data", "seq")
RTOL = 1e-12


def causal_attention(q, k, v):
    """Softmax attention with a causal mask, ``[B, T, H, Dh]``; k/v heads repeated for GQA."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def qkv(heads=H, kv_heads=None, length=T, dtype=jnp.float64):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    kv_heads = heads if kv_heads is None else kv_heads
    return (
        jax.random.normal(kq, (B, length, heads, DH), dtype),
        jax.random.normal(kk, (B, length, kv_heads, DH), dtype),
        jax.random.normal(kv, (B, length, kv_heads, DH), dtype),
    )


def shapes(heads, kv_heads=None):
    """q, k, v as shapes only, for the checks at trace time."""
    kv_heads = heads if kv_heads is None else kv_heads
    return tuple(
        jax.ShapeDtypeStruct((B, T, h, DH), jnp.float32) for h in (heads, kv_heads, kv_heads)
    )


def sharded(fn, mesh, in_specs=SPEC, out_specs=SPEC):
    return jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(mesh.axis_names)
    )


def assert_close(got, want, rtol=RTOL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


@pytest.fixture(scope="module")
def mesh():
    return jzero.make_mesh({"data": 2, SEQ_AXIS: S})


@pytest.fixture(scope="module")
def forward(mesh):
    """The compiled sequence-parallel forward on ``{data: 2, seq: 4}``: its output, the
    unsplit attention's, and the compiled program's text."""
    with jax.enable_x64(True):
        q, k, v = qkv()
        fn = jax.jit(sharded(sequence_parallel_attention(causal_attention), mesh))
        compiled = fn.lower(q, k, v).compile()
        return (
            np.asarray(compiled(q, k, v)),
            np.asarray(causal_attention(q, k, v)),
            compiled.as_text(),
        )


def all_to_alls(hlo: str) -> list[str]:
    """The all-to-all instructions of a compiled program's text."""
    return [
        line for line in hlo.splitlines() if re.search(r"^\s*(ROOT )?%\S+ = .* all-to-all\(", line)
    ]


def test_output_equals_the_unsplit_attention(forward):
    got, want, _ = forward
    assert_close(got, want)


def test_gradients_equal_the_unsplit_attention(mesh):
    # all_to_all's transpose is the all-to-all the other way: the backward is Ulysses too.
    with jax.enable_x64(True):
        q, k, v = qkv()
        w = jax.random.normal(jax.random.key(1), q.shape, q.dtype)
        sp = sharded(sequence_parallel_attention(causal_attention), mesh)

        def grads(attn):
            return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v) * w), argnums=(0, 1, 2)))

        for got, want in zip(grads(sp)(q, k, v), grads(causal_attention)(q, k, v), strict=True):
            assert_close(got, want)


def test_the_compiled_forward_holds_four_all_to_alls_over_the_seq_groups(forward):
    ops = all_to_alls(forward[2])
    # Observed on XLA:CPU: q, k, v each one all-to-all in, the output one back, none fused;
    # each a tuple of S operands (one slice per peer).
    assert len(ops) == 4, ops
    for op in ops:
        # seq is the minor mesh axis: its groups are neighbours, not the data groups {0,4}...
        assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in op, op
        assert op.split("= ", 1)[1].startswith("(" + ", ".join(["f64[1,4,1,8]{3,2,1,0}"] * S) + ")")


def test_the_output_differs_when_the_all_to_all_is_a_no_op(mesh, monkeypatch):
    # Without the all-to-all each device would attend within its own chunk: the causal mask
    # then sees local positions only, and the equality tests above fail.
    monkeypatch.setattr(jax.lax, "all_to_all", lambda x, *args, **kwargs: x)
    with jax.enable_x64(True):
        q, k, v = qkv()
        got = jax.jit(sharded(sequence_parallel_attention(causal_attention), mesh))(q, k, v)
        err = np.max(np.abs(np.asarray(got) - causal_attention(q, k, v)))
    assert err > 0.1


def test_an_unbound_or_size_one_axis_calls_the_attention_directly():
    with jax.enable_x64(True):
        q, k, v = qkv()
        attn = sequence_parallel_attention(causal_attention)
        assert_close(attn(q, k, v), causal_attention(q, k, v), rtol=0)
        assert "all_to_all" not in str(jax.make_jaxpr(attn)(q, k, v))  # unbound under jit too
        single = jzero.make_mesh({"data": 8, SEQ_AXIS: 1})
        q8, k8, v8 = (jnp.concatenate([x] * 4) for x in (q, k, v))
        assert "all_to_all" not in str(jax.make_jaxpr(sharded(attn, single))(q8, k8, v8))
        assert "all_to_all" in str(
            jax.make_jaxpr(sharded(attn, jzero.make_mesh({"data": 2, SEQ_AXIS: 4})))(q, k, v)
        )


def test_grouped_query_attention_splits_the_kv_heads_alike():
    with jax.enable_x64(True):
        q, k, v = qkv(heads=4, kv_heads=2)
        mesh = jzero.make_mesh({"data": 4, SEQ_AXIS: 2})
        q, k, v = (jnp.concatenate([x, x[::-1]]) for x in (q, k, v))  # batch 4 for data: 4
        got = jax.jit(sharded(sequence_parallel_attention(causal_attention), mesh))(q, k, v)
        assert_close(got, causal_attention(q, k, v))


def test_a_head_count_the_seq_axis_does_not_divide_is_an_error(mesh):
    q, k, v = shapes(heads=6)
    fn = sharded(sequence_parallel_attention(causal_attention), mesh)
    with pytest.raises(
        ValueError, match=r"q has 6 heads.*4 devices.*divisors of 6 heads: 1, 2, 3, 6"
    ):
        jax.eval_shape(fn, q, k, v)
    q, k, v = shapes(heads=8, kv_heads=2)  # fewer k/v heads than devices
    with pytest.raises(ValueError, match=r"k has 2 heads.*repeat k's and v's heads 2 times"):
        jax.eval_shape(fn, q, k, v)


def test_a_length_the_seq_axis_does_not_divide_is_an_error(mesh):
    x = jax.ShapeDtypeStruct((B, 10, H, DH), jnp.float32)
    fn = sharded(sequence_chunk, mesh, in_specs=P("data"))
    with pytest.raises(ValueError, match=r"sequence of 10 tokens.*4 devices.*multiple of 4"):
        jax.eval_shape(fn, x)


def test_each_device_gets_its_chunk_and_offset(mesh):
    x = jnp.arange(B * T * 3).reshape(B, T, 3)

    def local(x):
        chunk = sequence_chunk(x)
        offset = sequence_offset(chunk.shape[1])
        positions = offset + jnp.arange(chunk.shape[1])
        return chunk, positions, jnp.reshape(offset, (1,))

    chunk, positions, offsets = jax.jit(
        sharded(local, mesh, in_specs=P("data"), out_specs=(SPEC, P(SEQ_AXIS), P(SEQ_AXIS)))
    )(x)
    np.testing.assert_array_equal(chunk, x)  # device j of seq returned x's chunk j
    np.testing.assert_array_equal(positions, np.arange(T))
    np.testing.assert_array_equal(offsets, [0, 4, 8, 12])
    assert sequence_chunk(x) is x and sequence_offset(4) == 0  # unbound: identity and 0
