"""Stage 2 never holds the whole stacked gradient: each layer's gradient is reduce-scattered
inside the layer scan's backward loop, so the compiled step's temporaries are stage 1's less
the (n-1)/n of the layers' gradients that stage 1 holds whole (plus one more 1/n for the
all-to-all to the resting layout, and one layer); and it trains exactly like a
single-device optax loop, with accumulation, at either all-to-all layout (more layers than
devices, and fewer).

Everything runs in float64 (tests/support/numerics.py); byte counts are of float64 leaves."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numerics import optax_loop

import jzero
from jzero import hlo

D, ROWS, N = 32, 8, 8  # width, rows a micro-batch, the 8 CPU devices
ITEM = 8  # bytes of a float64 element

pytestmark = pytest.mark.float64


def loss(p, b):
    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]), None

    h, _ = jax.lax.scan(layer, b["x"] @ p["embed"], p["layers"])
    return jnp.mean(h**2)


def params(layers):
    rng = np.random.default_rng(0)
    return {
        "embed": rng.normal(size=(D, D)) / np.sqrt(D),
        "layers": {
            "w": rng.normal(size=(layers, D, D)) / np.sqrt(D),
            "b": rng.normal(size=(layers, D)) * 0.1,
        },
    }


def batches(accum, n=3):
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(ROWS * accum, D))} for _ in range(n)]


def engine(layers, stage, accum=1, clipping=0.0):
    cfg = {
        "train_batch_size": ROWS * accum,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clipping,
        "zero_optimization": {"stage": stage},
    }
    return jzero.initialize(params(layers), loss, optax.adam(1e-2), cfg)


@functools.cache
def compiled(layers, stage):
    return engine(layers, stage).lower(batches(1, 1)[0]).compile()


def layer_grad_bytes(layers):
    return layers * (D * D + D) * ITEM


def test_the_stacked_gradient_is_born_sharded():
    layers = 16
    one, two = compiled(layers, 1), compiled(layers, 2)
    m1, m2 = one.memory_analysis(), two.memory_analysis()
    grads = layer_grad_bytes(layers)
    # Stage 1 holds the layers' gradient whole; stage 2 its 1/N shards twice (the backward's
    # pieces of every layer and the all-to-all's blocks of the resting layout), and one
    # layer's whole gradient (the backward's cotangent before its reduce-scatter).
    extra = grads // N + grads // layers
    bound = m1.temp_size_in_bytes - (N - 1) * grads // N + extra
    assert m2.temp_size_in_bytes <= bound, (m1.temp_size_in_bytes, m2.temp_size_in_bytes)

    def peak(m):
        return (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            + (m.temp_size_in_bytes)
        )

    assert peak(m2) <= peak(m1) - (N - 1) * grads // N + extra
    # The reduce-scatter runs in the backward loop at stage 2, after it at stage 1.
    assert "reduce-scatter" in {c.kind for c in hlo.loop_collectives(two)}
    assert "reduce-scatter" not in {c.kind for c in hlo.loop_collectives(one)}
    assert hlo.collectives(two)["all-to-all"].count == 2  # each stacked leaf to its layout


def reference(layers, data):
    """The single-device optax loop: (losses, gradient global norms)."""
    return optax_loop(loss, params(layers), optax.adam(1e-2), data)


@pytest.mark.parametrize("layers", [4, 16])  # fewer layers than devices, and more
def test_stage2_trains_exactly_with_accumulation(layers):
    data = batches(accum=2)
    run = engine(layers, 2, accum=2)
    metrics = [run.train_step(b) for b in data]
    losses, norms = reference(layers, data)
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], losses, rtol=1e-10)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], norms, rtol=1e-10)
    # The optimizer state and parameters end where the reference's do: the gradients reached
    # their leaves in the plan's layout, not shuffled between layers or devices.
    got = jax.tree.map(np.asarray, run.params)
    ref = params(layers)
    tx = optax.adam(1e-2)
    opt = tx.init(ref)
    for b in data:
        grads = jax.grad(loss)(ref, b)
        updates, opt = tx.update(grads, opt, ref)
        ref = optax.apply_updates(ref, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), got, ref)


def test_stage2_clips_as_stage1_does():
    data = batches(accum=1)
    one, two = engine(4, 1, clipping=0.05), engine(4, 2, clipping=0.05)
    for b in data:
        m1, m2 = one.train_step(b), two.train_step(b)
        np.testing.assert_allclose(float(m2["grad_norm"]), float(m1["grad_norm"]), rtol=1e-10)
        np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-10)
