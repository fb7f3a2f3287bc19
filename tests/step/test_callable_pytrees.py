"""Parameters that are callable pytrees (an Equinox module, a callable dataclass registered
with JAX) are values: jzero never calls them, and they train like any pytree (float64, each
test enables x64, at 1e-10 against the single-device optax loop)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzero

CALLS = []


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    """A callable pytree: two arrays and a ``__call__``, as an Equinox module is."""

    w: jax.Array
    b: jax.Array

    def __call__(self, x):
        CALLS.append(x.shape)
        return jnp.tanh(x @ self.w + self.b)


pytestmark = pytest.mark.usefixtures("x64")  # conftest's float64


def loss(layer, batch):
    return jnp.mean((layer(batch["x"]) - batch["y"]) ** 2)


def make():
    k1, k2 = jax.random.split(jax.random.key(0))
    return Layer(jax.random.normal(k1, (16, 8), jnp.float64), jnp.zeros((8,), jnp.float64))


def batches():
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(32, 16)), "y": rng.normal(size=(32, 8))} for _ in range(3)]


# Stage 3 only: the callable's leaves are sharded, gathered and rebuilt into it (stage 0 keeps
# them whole and takes none of that path; its handling of a pytree is the toy's, in
# test_core.py::test_parity_with_single_device_optax[0-*]).
@pytest.mark.parametrize("stage", [3])
def test_a_callable_pytree_is_trained_not_called(stage):
    CALLS.clear()
    cfg = {"train_batch_size": 32, "zero_optimization": {"stage": stage,
           "stage3_param_persistence_threshold": 0}}  # fmt: skip
    engine = jzero.initialize(make(), loss, optax.adam(1e-2), cfg)
    assert CALLS == []  # building the engine called nothing but shapes
    tx, params = optax.adam(1e-2), make()
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        norm = optax.global_norm(grads)  # DeepSpeed's default clipping, 1.0
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    for b in batches():
        params, state, expected = step(params, state, b)
        got = float(engine.train_step(b)["loss"])
        assert got == pytest.approx(float(expected), rel=1e-10, abs=0)
    assert isinstance(engine.params, Layer)
    np.testing.assert_allclose(engine.params.w, params.w, rtol=1e-9)


def test_a_callable_pytree_as_model_is_refused_without_a_call():
    CALLS.clear()
    with pytest.raises(TypeError, match=r"got Layer \(jzero never calls a model"):
        jzero.initialize(model=make(), loss_fn=loss, optimizer=optax.sgd(0.1),
                         config={"train_batch_size": 32})  # fmt: skip
    assert CALLS == []


def test_a_function_among_the_params_is_refused_by_name_never_called():
    """An Equinox module held in a plain dict brings its activation function as a leaf."""
    import equinox as eqx

    mlp = eqx.nn.MLP(4, 2, 8, depth=1, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"params leaf m\.activation is a .*not an array.*"
                       r"model=module"):  # fmt: skip
        jzero.initialize({"m": mlp}, lambda p, b: 0.0, optax.sgd(0.1), {"train_batch_size": 8})
