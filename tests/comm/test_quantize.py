"""ZeRO++ quantized collectives: the block quantizer's error bound, the quantized all-gather
(qwZ) against the exact gather and its unquantized gradient, the quantized reduce-scatter (qgZ)
and all-reduce against the exact ones, and the int8 bytes the compiled programs move."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from numerics import EPS, needs_float16

from jzero.comm import (
    dequantize,
    quantize,
    quantized_all_gather,
    quantized_psum,
    quantized_psum_scatter,
)
from jzero.hlo import collectives
from jzero.rewrite import all_gather

N = 8
QMAX = {8: 127, 4: 7}
# float32 rounding on top of the quantizer's half a scale: the scale (absmax / qmax) and
# x / scale each round once (an element whose quotient sits on a .5 boundary then lands a whole
# scale away by at most |x| EPS more), and the dequantized q * scale rounds once more:
# 2 EPS (|x| + scale) an element. Sums over the N devices add (N - 1) EPS of the sum of
# magnitudes (float32 accumulation).
F32 = EPS["float32"]


def mesh(n=N):
    return jax.make_mesh(
        (n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
    )


def smap(f, in_specs, out_specs, n=N):
    return jax.jit(
        jax.shard_map(f, mesh=mesh(n), in_specs=in_specs, out_specs=out_specs, check_vma=False)
    )


def normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


@jax.jit
def host_round_trip_8(x):
    """What one device's piece becomes: quantized with its own blocks and dequantized."""
    q, s = quantize(x)
    return dequantize(q, s, x.shape, x.dtype)


def element_scales(scales, size, block=256):
    """Each element's block scale, for the first ``size`` elements of the flattened array."""
    return np.repeat(np.asarray(scales), block)[:size]


@pytest.mark.parametrize(
    "bits,dtype",
    [
        (8, jnp.float32),
        (4, jnp.float32),
        (8, jnp.bfloat16),
        pytest.param(8, jnp.float16, marks=needs_float16),
    ],
)
def test_round_trip_within_half_a_scale(bits, dtype):
    # 5 x 103 = 515 elements: three blocks of 256, the last padded; the second all zeros.
    x = np.asarray(normal(0, (5, 103), jnp.float32)) * np.linspace(0.01, 30, 515).reshape(5, 103)
    x.reshape(-1)[256:512] = 0
    x = jnp.asarray(x, dtype)
    q, scales = jax.jit(quantize, static_argnums=(1,))(x, bits)
    assert q.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    assert q.shape == (3, 256 * bits // 8) and q.nbytes == 3 * 256 * bits // 8
    assert scales.shape == (3,) and scales.dtype == jnp.float32
    back = jax.jit(dequantize, static_argnums=(2, 3, 4))(q, scales, x.shape, dtype, bits)
    assert back.shape == x.shape and back.dtype == dtype

    x32 = np.asarray(x, np.float32).reshape(-1)
    err = np.abs(np.asarray(back, np.float32).reshape(-1) - x32)
    per = element_scales(scales, x.size)
    # Half a scale, float32's rounding (F32 above), and the rounding of the product to a 16-bit
    # dtype (its unit roundoff).
    ulp = 0.0 if dtype == jnp.float32 else np.abs(x32) * 2.0 ** -(jnp.finfo(dtype).nmant + 1)
    assert np.all(err <= per / 2 + 2 * F32 * (np.abs(x32) + per) + ulp)
    absmax = [np.abs(x32[:256]).max(), np.abs(x32[512:]).max()]
    # A float32 division, which XLA may turn into a product with 1 / qmax: two roundings.
    want = np.divide(np.asarray(absmax, np.float64), QMAX[bits])
    np.testing.assert_allclose(np.asarray(scales)[[0, 2]], want, rtol=2 * F32, atol=0)
    assert scales[1] == 1 and np.all(err[256:512] == 0)  # the zero block: exact, no NaN
    assert err.max() > 0  # really quantized


def test_non_finite_block_stays_non_finite():
    x = normal(1, (512,)).at[3].set(jnp.inf).at[300].set(jnp.nan)
    back = host_round_trip_8(x)
    assert not np.isfinite(np.asarray(back[:256])).any()  # overflow checks still see it
    assert not np.isfinite(np.asarray(back[256:])).any()
    assert np.isfinite(np.asarray(host_round_trip_8(normal(1, (512,))))).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        quantize(jnp.ones(8), bits=3)
    with pytest.raises(ValueError, match="even"):
        quantize(jnp.ones(8), bits=4, block=7)


@pytest.mark.parametrize("bits,dim,dtype", [(8, 1, jnp.float32), (4, 0, jnp.bfloat16)])
def test_all_gather_is_the_dequantized_shards(bits, dim, dtype):
    # Shards of 6 x 50 = 300 elements: not a multiple of the block, so padding travels.
    shape = [6, 50]
    shape[dim] *= N
    x = normal(2, tuple(shape), dtype)
    spec = P(*([None] * dim + ["data"]))
    gather = smap(lambda s: quantized_all_gather(s, "data", dim, bits=bits)[None], spec, P("data"))
    got = np.asarray(gather(x), np.float32)  # every device's gathered copy

    shards = jnp.split(x, N, axis=dim)

    @jax.jit  # one program for the 8 shards, not each operation of it
    def round_trip(s):
        q, sc = quantize(s, bits)
        return dequantize(q, sc, s.shape, s.dtype, bits)

    expected = np.asarray(jnp.concatenate([round_trip(s) for s in shards], axis=dim), np.float32)
    for copy in got:
        assert np.array_equal(copy, expected)
    err = np.abs(got[0] - np.asarray(x, np.float32))
    # Half a scale is absmax / (2 qmax) of the shard's block; float32 rounds (F32 above: under
    # 3 EPS absmax), and a 16-bit dtype rounds the product to its own unit roundoff of it.
    absmax = np.abs(np.asarray(x, np.float32)).max()
    bound = absmax / (2 * QMAX[bits]) + 3 * EPS[np.dtype(dtype).name] * absmax
    assert 0 < err.max() <= bound


@pytest.mark.parametrize("grad_dtype", [None, jnp.bfloat16])
def test_all_gather_gradient_is_the_exact_reduce_scatter(grad_dtype):
    x = normal(3, (N * 4, 24))
    w = normal(4, (N, N * 4, 24))  # a different cotangent on every device

    def loss(gather_fn):
        def local(s, w):
            return jnp.sum(gather_fn(s, "data", 0, grad_dtype) * w[0])[None]

        f = smap(local, (P("data"), P("data")), P("data"))
        return jax.jit(jax.grad(lambda x: jnp.sum(f(x, w))))(x)

    got = loss(quantized_all_gather)
    exact = loss(all_gather)
    assert np.array_equal(np.asarray(got), np.asarray(exact))  # the backward is not quantized
    # The sum of the N devices' cotangents, each rounded to the gradient dtype (bf16) and
    # summed in it: N roundings, each within its unit roundoff of the sum of magnitudes.
    eps = EPS["float32" if grad_dtype is None else "bfloat16"]
    w64 = np.asarray(w, np.float64)
    err = np.abs(np.asarray(got, np.float64) - w64.sum(axis=0))
    assert np.all(err <= N * eps * np.abs(w64).sum(axis=0))


@pytest.mark.parametrize("bits", [8, 4])
def test_psum_scatter_close_to_exact(bits):
    g = normal(5, (N, 6, N * 40))  # device d contributes g[d]; chunks of 6 x 40 = 240 elements
    dim = 1
    scatter = smap(
        lambda s: quantized_psum_scatter(s[0], "data", dim, bits=bits)[None], P("data"), P("data")
    )
    got = np.asarray(scatter(g))  # (device, 6, 40)
    g64 = np.asarray(g, np.float64)
    exact = np.stack(np.split(g64.sum(axis=0), N, axis=dim))

    # Each device's chunk i is off by half its block scale per element: sum them over devices.
    bound = np.zeros_like(exact)
    scales = jax.jit(lambda c: quantize(c, bits)[1])
    for d in range(N):
        for i, c in enumerate(np.split(np.asarray(g[d]), N, axis=dim)):
            sc = scales(jnp.asarray(c))
            bound[i] += element_scales(sc, c.size).reshape(c.shape) / 2
    err = np.abs(got - exact)
    # And float32's rounding (F32 above) of each contribution and of their sum.
    magnitudes = np.stack(np.split(np.abs(g64).sum(axis=0), N, axis=dim))
    assert np.all(err <= bound + (N + 1) * F32 * (magnitudes + 2 * bound))
    assert err.max() > 1e-4  # really quantized


def test_psum_any_shape():
    x = normal(6, (N, 5, 7)) * jnp.arange(1, N + 1)[:, None, None]
    reduce = smap(lambda s: quantized_psum(s[0], "data")[None], P("data"), P("data"))
    got = np.asarray(reduce(x))
    exact = np.asarray(x, np.float64).sum(axis=0)
    for copy in got:
        assert np.array_equal(copy, got[0])
    # Reduce-scatter: half a scale of each device's block; gather: half a scale of the sum.
    per_device = np.abs(np.asarray(x)).reshape(N, -1).max(axis=1)
    bound = (per_device.sum() + np.abs(got[0]).max()) / (2 * 127)
    bound += (N + 1) * F32 * 2 * per_device.sum()  # float32's rounding (F32 above)
    err = np.abs(got[0] - exact)
    assert 0 < err.max() <= bound


def test_axis_of_size_one_is_exact():
    x = normal(7, (5, 9))

    def f(s):
        g = quantized_all_gather(s, "data", 1)
        return g, quantized_psum_scatter(s, "data", 0), quantized_psum(s, "data")

    out = smap(f, P(), (P(), P(), P()), n=1)(x)
    for o in out:
        assert np.array_equal(np.asarray(o), np.asarray(x))
    gather = smap(lambda s: quantized_all_gather(s, "data", 0), P(), P(), n=1)
    grad = jax.grad(lambda x: jnp.sum(gather(x) * 3.0))(x)
    assert np.array_equal(np.asarray(grad), np.full(x.shape, 3.0, np.float32))


def op_lines(text, op):
    return [line for line in text.splitlines() if f" {op}(" in line or f" {op}-start(" in line]


@pytest.mark.parametrize("bits,element,ratio", [(8, "s8", 0.3), (4, "u8", 0.15)])
def test_all_gather_moves_quantized_bytes(bits, element, ratio):
    # Compared: the all-gathers' output buffers (what collectives() counts for an all-gather),
    # quantized against float32, for the same 8 x 4096 float32 array sharded on dim 0.
    x = normal(8, (N, 4096))
    quantized = smap(lambda s: quantized_all_gather(s, "data", 0, bits=bits), P("data"), P())
    exact = smap(lambda s: jax.lax.all_gather(s, "data", axis=0, tiled=True), P("data"), P())
    q_prog, e_prog = quantized.lower(x).compile(), exact.lower(x).compile()
    q_stats, e_stats = collectives(q_prog), collectives(e_prog)
    assert q_stats["all-gather"].count == 1 and e_stats["all-gather"].count == 1
    assert e_stats["all-gather"].bytes == x.nbytes
    assert q_stats["all-gather"].bytes <= ratio * e_stats["all-gather"].bytes
    lines = op_lines(q_prog.as_text(), "all-gather")
    assert lines and all(f"{element}[" in line and "f32[" not in line for line in lines)


def test_psum_scatter_moves_quantized_bytes():
    # Compared: the bytes each device puts into the exchange. collectives() counts a
    # reduce-scatter as its input buffer (the device's full-size float32 contribution) and an
    # all-to-all as its buffer, which has its input's size: the quantized contribution.
    g = normal(9, (N * N, 512))  # each device contributes an 8 x 512 float32 block
    quantized = smap(lambda s: quantized_psum_scatter(s, "data", 0), P("data"), P("data"))
    exact = smap(
        lambda s: jax.lax.psum_scatter(s, "data", scatter_dimension=0, tiled=True),
        P("data"),
        P("data"),
    )
    q_prog, e_prog = quantized.lower(g).compile(), exact.lower(g).compile()
    q_stats, e_stats = collectives(q_prog), collectives(e_prog)
    assert e_stats["reduce-scatter"].bytes == g.nbytes // N
    assert q_stats["all-to-all"].count == 1
    assert q_stats["all-to-all"].bytes <= 0.3 * e_stats["reduce-scatter"].bytes
    for kind in ("reduce-scatter", "all-reduce", "all-gather"):
        assert q_stats[kind].count == 0, kind  # no full-size float reduction besides
    lines = op_lines(q_prog.as_text(), "all-to-all")
    assert lines and all("s8[" in line and "f32[" not in line for line in lines)


def test_a_piece_smaller_than_a_block_sends_its_own_size_and_one_scale():
    x = normal(10, (N * 8,))  # 8 values a device: one block of 8, not a padded block of 256
    gather = smap(lambda s: quantized_all_gather(s, "data", 0), P("data"), P())
    assert collectives(gather.lower(x).compile())["all-gather"].bytes == N * (8 + 4)
    got = np.asarray(gather(x))
    for s, piece in zip(np.split(np.asarray(x), N), np.split(got, N), strict=True):
        absmax = np.abs(s).max()  # half a scale, and float32's rounding (F32 above)
        assert np.abs(piece - s).max() <= absmax / (2 * 127) + 3 * F32 * absmax


@pytest.mark.parametrize("quantized_forward", [True, False])
def test_gather_with_quantized_gradient_reduces_by_the_quantized_exchange(quantized_forward):
    # qgZ through a gather's transpose (stage 3): the backward is quantized_psum_scatter of the
    # cotangent, whether or not the forward gather is quantized too (qwZ).
    x = normal(11, (N * 4, 64))
    w = normal(12, (N, N * 4, 64))

    def gather(s):
        if quantized_forward:
            return quantized_all_gather(s, "data", 0, grad_bits=8)
        return all_gather(s, "data", 0, grad_bits=8)

    f = smap(lambda s, w: jnp.sum(gather(s) * w[0])[None], (P("data"), P("data")), P("data"))
    got = jax.jit(jax.grad(lambda x: jnp.sum(f(x, w))))(x)
    reduce = smap(lambda c: quantized_psum_scatter(c[0], "data", 0), P("data"), P("data"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(reduce(w)))
    exact = np.asarray(w).sum(axis=0)
    bound = N * np.abs(np.asarray(w)).max() / (2 * 127)  # half a scale from each device
    assert 0 < np.abs(np.asarray(got) - exact).max() <= bound  # quantized, and close
