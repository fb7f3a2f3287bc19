"""The tiled loss and MLP (:mod:`jzero.ops.tiled`): in float64 their values and gradients equal
the plain forms' at 1e-12 (with and without a keep mask, lengths a multiple of the chunk and
not); bf16 stays within the rounding bound; the compiled forward and backward of the tiled loss
hold no ``[B, T, V]`` logits (the plain loss's do); bad chunks are clear errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import EPS, max_rel_error

from jzero.ops import tiled_cross_entropy, tiled_mlp

pytestmark = pytest.mark.float64
B, D, V = 2, 8, 24
RTOL = 1e-12


def inputs(t, dtype=jnp.float64):
    kh, kw, kt, kk = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(kh, (B, t, D), dtype)
    head = jax.random.normal(kw, (V, D), dtype)
    targets = jax.random.randint(kt, (B, t), 0, V)
    keep = jax.random.bernoulli(kk, 0.7, (B, t))
    return hidden, head, targets, keep


def plain_loss(hidden, head, targets, keep=None):
    """The built-in GPT's form: whole logits, ``log_softmax``, the picked entries summed."""
    logits = jnp.einsum("btd,vd->btv", hidden, head)
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
    return -(picked if keep is None else jnp.where(keep, picked, 0.0)).sum()


@pytest.mark.parametrize("t, chunk", [(16, 4), (13, 4), (8, 8)])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "keep"])
def test_the_tiled_loss_equals_the_plain_one(t, chunk, masked):
    hidden, head, targets, keep = inputs(t)
    keep = keep if masked else None

    def tiled(hidden, head):
        return tiled_cross_entropy(hidden, head, targets, chunk=chunk, weights=keep)

    got, got_grads = jax.jit(jax.value_and_grad(tiled, (0, 1)))(hidden, head)
    want, want_grads = jax.value_and_grad(plain_loss, (0, 1))(hidden, head, targets, keep)
    assert abs(float(got) - float(want)) <= RTOL * abs(float(want))
    assert max_rel_error(got_grads, want_grads) <= RTOL


@pytest.mark.parametrize("t, chunk", [(16, 4), (13, 4)])
def test_the_tiled_mlp_equals_the_plain_one(t, chunk):
    hidden = inputs(t)[0]
    k1, k2 = jax.random.split(jax.random.key(1))
    w_in, w_out = jax.random.normal(k1, (D, 4 * D)), jax.random.normal(k2, (4 * D, D))

    def mlp(weights, x):
        return jax.nn.gelu(x @ weights[0]) @ weights[1]

    def tiled(weights, x):
        return tiled_mlp(lambda y: mlp(weights, y), x, chunk=chunk)

    probe = jax.random.normal(jax.random.key(2), hidden.shape)

    def grads(fn):
        return jax.grad(lambda w, x: jnp.sum(fn(w, x) * probe), (0, 1))((w_in, w_out), hidden)

    assert max_rel_error(tiled((w_in, w_out), hidden), mlp((w_in, w_out), hidden)) <= RTOL
    assert max_rel_error(grads(jax.jit(tiled)), grads(mlp)) <= RTOL


def test_bfloat16_loss_stays_within_the_rounding_bound():
    """bf16 inputs, the matmul accumulated and the log-softmax taken in float32, against the
    float64 truth on the same bf16 values: a logit's D-term dot product is off by at most
    ``D`` float32 unit roundoffs of its scale ``sum |h| |w|``; a token's loss (log-sum-exp
    minus the picked logit) by twice that plus a few units; the sum over the ``n`` tokens by
    ``n`` units of the total more."""
    hidden, head, targets, _ = inputs(32, jnp.bfloat16)
    got = jax.jit(lambda h, w: tiled_cross_entropy(h, w, targets, chunk=8))(hidden, head)
    assert got.dtype == jnp.float32
    wide = hidden.astype(jnp.float64), head.astype(jnp.float64)
    scale = float(jnp.max(jnp.einsum("btd,vd->btv", jnp.abs(wide[0]), jnp.abs(wide[1]))))
    want = float(plain_loss(*wide, targets))
    n = targets.size
    bound = EPS["float32"] * (n * (2 * D + 4) * scale + n * abs(want))
    assert abs(float(got) - want) <= bound, (got, want, bound)


def test_the_compiled_tiled_loss_holds_no_whole_logits():
    """T = 64, V = 24, chunks of 8: no array with the dims T and V, nor B * T * V elements, in
    the forward and backward; the plain loss's program has them (so the check would see them)."""
    t = 64
    with jax.enable_x64(False):
        hidden, head, targets, keep = inputs(t, jnp.float32)

        def shapes(loss):
            fn = jax.jit(jax.value_and_grad(loss, (0, 1)))
            text = fn.lower(hidden, head).compile().as_text()
            return {
                tuple(int(d) for d in dims.split(",") if d)
                for dims in re.findall(r"\b(?:pred|s32|f32|bf16)\[([\d,]*)\]", text)
            }

        tiled = shapes(lambda h, w: tiled_cross_entropy(h, w, targets, chunk=8, weights=keep))
        plain = shapes(lambda h, w: plain_loss(h, w, targets, keep))

    def logits(found):
        return [s for s in found if (t in s and V in s) or np.prod(s, dtype=int) >= B * t * V]

    assert logits(plain), plain
    assert not logits(tiled), logits(tiled)


def test_bad_chunks_and_shapes_are_clear_errors():
    hidden, head, targets, _ = inputs(8)
    with pytest.raises(ValueError, match=r"chunk=-1 must be an integer >= 0"):
        tiled_cross_entropy(hidden, head, targets, chunk=-1)
    with pytest.raises(ValueError, match=r"head \(24, 4\)"):
        tiled_cross_entropy(hidden, head[:, :4], targets)
    with pytest.raises(ValueError, match=r"tiled_mlp: chunk=2.5"):
        tiled_mlp(jnp.tanh, hidden, chunk=2.5)
