"""Flax NNX and Linen models train through the same engine as plain pytrees.

In float64 (each test enables x64, the models are given float64 parameters and compute in
float64): the NNX GPT trains like the single-device optax loop on its weights, and the Linen path
computes what the pytree path does, so their losses and grad norms agree at 1e-10, and the first
grad norm is the plain ``jax.grad``'s (clipping hides a gradient's scale from the losses).
The BatchNorm tests run with the parameters replicated (stage 1) and split (stage 3): what is
Flax's own here, the module's state taken apart and put back, differs only there; ZeRO's stages
themselves are the pytree path's, checked stage by stage in tests/step/. The GPT runs at stage 3,
where its scanned layers are also gathered one at a time. Linen creates BatchNorm's running
statistics in float32 whatever the parameters' dtype; where they are float32, their bound is that
one rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from numerics import EPS

import jzero
from jzero.demo import gpt

TINY = gpt.GPTConfig(
    vocab_size=256, seq_len=16, num_layers=2, num_heads=2, d_model=32, d_ff=64, dtype="float64"
)
F64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}


pytestmark = pytest.mark.usefixtures("x64")  # conftest's float64


def _float64(model):
    """``model`` with its parameters in float64 (the built-in GPT stores float32 ones)."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.float64), state))
    return model


def _metrics(engine, batch):
    m = engine.train_step(batch)
    return float(m["loss"]), float(m["grad_norm"])


def _close(a, c):
    np.testing.assert_allclose(a, c, rtol=1e-10, atol=0)


def _reference_norm(grad_fn, *args):
    """The global norm of a plain ``jax.grad``, outside jzero."""
    return float(optax.global_norm(grad_fn(*args)))


_ADAMW = optax.adamw(1e-3)


@jax.jit
def _gpt_reference_step(params, opt_state, batch):
    """The single-device optax loop's step: ``jax.grad``, DeepSpeed's clipping at 1.0 (the
    engine's), AdamW. Returns the new params and state, the loss and the gradients' norm."""
    loss, grads = jax.value_and_grad(lambda p: gpt.loss_fn(p, batch, TINY))(params)
    norm = optax.global_norm(grads)
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), grads)
    updates, opt_state = _ADAMW.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, norm


def _cfg(stage):
    return {
        "train_batch_size": 16,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def test_nnx_gpt_trains_like_the_single_device_optax_loop():
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16, TINY.seq_len + 1), np.int32)
    batches = [{"tokens": t} for t in tokens]
    nnx_engine = jzero.initialize(
        model=lambda: _float64(gpt.GPT(TINY, rngs=nnx.Rngs(0))),
        loss_fn=gpt.nnx_loss_fn,
        optimizer=_ADAMW,
        config=_cfg(3),
    )
    # The same weights through the functional GPT's single-device loop.
    params = jax.tree.map(np.asarray, nnx_engine.params)
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float64)}
    opt_state = _ADAMW.init(params)
    for b in batches:
        params, opt_state, loss, norm = _gpt_reference_step(params, opt_state, b)
        _close(_metrics(nnx_engine, b), (float(loss), float(norm)))
    model = nnx_engine.model
    assert isinstance(model, gpt.GPT)
    w = nnx_engine.params["blocks"]["mlp_in"]
    # Beside the layer dimension the scan consumes: each layer is gathered on its own.
    assert w.sharding.spec == jax.sharding.PartitionSpec(None, "data")


class BNNet(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 8, rngs=rngs, **F64)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs, **F64)
        # NNX creates the running statistics in float32 whatever the dtypes: float64 ones.
        self.bn.mean = nnx.BatchStat(jnp.zeros(8, jnp.float64))
        self.bn.var = nnx.BatchStat(jnp.ones(8, jnp.float64))
        self.out = nnx.Linear(8, 1, rngs=rngs, **F64)

    def __call__(self, x):
        return self.out(self.bn(self.lin(x)))


def _bn_batch():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)) * 3 + 1
    return {"x": x, "y": x[:, :1] * 2}


def _expected_running_mean(batch, kernel, bias):
    h = batch["x"] @ np.asarray(kernel, np.float64) + np.asarray(bias, np.float64)
    return 0.1 * h.mean(0)  # momentum 0.9 from a zero start, over all 16 rows of the batch


def _assert_running_mean(mean, expected):
    """The running mean is the float64 mean of all 16 rows; a mean over one device's 2 rows
    is off by tens of percent. Stored in float32 (Linen creates it so), it is that value rounded
    once: within one float32 unit roundoff of each entry (twice that for the float64 arithmetic).
    """
    mean = np.asarray(mean)
    rtol = {np.float64: 1e-10, np.float32: 2 * EPS["float32"]}[mean.dtype.type]
    np.testing.assert_allclose(mean, expected, rtol=rtol, atol=0)


@pytest.mark.parametrize("stage", [1, 3])
def test_nnx_batchnorm_statistics_update_over_the_global_batch(stage):
    batch = _bn_batch()

    def loss(model, b):
        return jnp.mean((model(b["x"]) - b["y"]) ** 2)

    engine = jzero.initialize(
        model=lambda: BNNet(nnx.Rngs(0)),
        loss_fn=loss,
        optimizer=optax.sgd(0.0),
        config={**_cfg(stage), "skip_nonfinite": True},
    )
    expected = _expected_running_mean(
        batch, engine.params["lin"]["kernel"], engine.params["lin"]["bias"]
    )
    engine.train_step(batch)
    assert engine.state.extra["bn"]["mean"].dtype == np.float64
    _assert_running_mean(engine.state.extra["bn"]["mean"], expected)
    assert np.asarray(engine.model.bn.mean.value).shape == (8,)
    # A NaN batch is skipped, and its NaN statistics do not reach the running averages.
    before = jax.tree.map(np.asarray, engine.state.extra)
    poisoned = {"x": batch["x"] * np.nan, "y": batch["y"]}
    assert float(engine.train_step(poisoned)["skipped"]) == 1.0
    for a, b in zip(jax.tree.leaves(engine.state.extra), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


class LinenBN(linen.Module):
    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.Dense(8, **F64)(x)
        x = linen.BatchNorm(use_running_average=not train, momentum=0.9, **F64)(x)
        return linen.Dense(1, **F64)(x)


LINEN_BN = LinenBN()


def _linen_loss(params, state, b):
    out, updates = LINEN_BN.apply({"params": params, **state}, b["x"], mutable=list(state))
    return jnp.mean((out - b["y"]) ** 2), updates


@jax.jit
def _linen_grad(params, state, batch):
    """Data parallelism's gradient for this model: BatchNorm normalises each device's rows (2
    of the 16 on 8 devices) with their own statistics, so the mean of the 8 devices' gradients,
    not the whole batch's."""
    shards = jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), batch)
    grads = jax.vmap(jax.grad(lambda p, b: _linen_loss(p, state, b)[0]), (None, 0))(params, shards)
    return jax.tree.map(lambda g: g.mean(0), grads)


@pytest.mark.parametrize("stage", [1, 3])
def test_linen_with_batch_stats_matches_the_pytree_path(stage):
    batch = _bn_batch()
    model, loss = LINEN_BN, _linen_loss

    engine = jzero.initialize(
        model=model,
        loss_fn=loss,
        optimizer=optax.adamw(1e-2),
        config=_cfg(stage),
        options=jzero.InitOptions(init_args=(batch["x"][:2],)),
    )
    params = jax.tree.map(np.asarray, engine.params)
    stats = jax.tree.map(np.asarray, engine.state.extra)
    # In training mode BatchNorm normalises with the batch's own statistics, so the running
    # ones the pytree path keeps fixed do not enter its loss.
    tree_engine = jzero.initialize(
        params,
        lambda p, b: loss(p, stats, b)[0],
        optax.adamw(1e-2),
        _cfg(stage),
    )
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float64)}
    expected = _expected_running_mean(batch, params["Dense_0"]["kernel"], params["Dense_0"]["bias"])
    first = _reference_norm(_linen_grad, params, stats, batch)
    for step in range(2):
        a, c = _metrics(engine, batch), _metrics(tree_engine, batch)
        _close(a, c)
        if step == 0:
            _close(c[1], first)
            _assert_running_mean(engine.model["batch_stats"]["BatchNorm_0"]["mean"], expected)


def test_linen_with_extra_collections_needs_a_stateful_loss():
    model = LinenBN()
    with pytest.raises(ValueError, match=r"loss_fn\(params, state, batch\)"):
        jzero.initialize(
            model=model,
            loss_fn=lambda p, b: 0.0,
            optimizer=optax.sgd(0.1),
            config=_cfg(1),
            options=jzero.InitOptions(init_args=(np.ones((2, 4)),)),
        )
