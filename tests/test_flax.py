"""Flax NNX and Linen models train through the same engine as plain pytrees."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx

import jzero
from jzero.models import gpt

TINY = gpt.GPTConfig(vocab_size=256, seq_len=16, num_layers=2, num_heads=2, d_model=32, d_ff=64)


def _cfg(stage):
    return {
        "train_batch_size": 16,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nnx_gpt_matches_the_pytree_path(stage):
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16, TINY.seq_len + 1), np.int32)
    batches = [{"tokens": t} for t in tokens]
    nnx_engine = jzero.initialize(
        model=lambda: gpt.GPT(TINY, rngs=nnx.Rngs(0)),
        loss_fn=gpt.nnx_loss_fn,
        optimizer=optax.adamw(1e-3),
        config=_cfg(stage),
    )
    # The same weights through the plain pytree path.
    params = jax.tree.map(np.asarray, nnx_engine.params)
    tree_engine = jzero.initialize(
        params, lambda p, b: gpt.loss_fn(p, b, TINY), optax.adamw(1e-3), _cfg(stage)
    )
    for b in batches:
        a = float(nnx_engine.train_step(b)["loss"])
        c = float(tree_engine.train_step(b)["loss"])
        assert a == pytest.approx(c, rel=1e-5)
    model = nnx_engine.model
    assert isinstance(model, gpt.GPT)
    if stage == 3:
        w = nnx_engine.params["blocks"]["mlp_in"]
        # Beside the layer dimension the scan consumes: each layer is gathered on its own.
        assert w.sharding.spec == jax.sharding.PartitionSpec(None, "data")


class BNNet(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.bn(self.lin(x)))


def _bn_batch():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)).astype(np.float32) * 3 + 1
    return {"x": x, "y": x[:, :1] * 2}


def _expected_running_mean(batch, kernel, bias):
    h = batch["x"] @ np.asarray(kernel) + np.asarray(bias)
    return 0.1 * h.mean(0)  # momentum 0.9 from a zero start, over all 16 rows of the batch


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
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
    np.testing.assert_allclose(engine.state.extra["bn"]["mean"], expected, rtol=1e-5, atol=1e-6)
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
        x = linen.Dense(8)(x)
        x = linen.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return linen.Dense(1)(x)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_linen_with_batch_stats_matches_the_pytree_path(stage):
    batch = _bn_batch()
    model = LinenBN()

    def loss(params, state, b):
        out, updates = model.apply({"params": params, **state}, b["x"], mutable=list(state))
        return jnp.mean((out - b["y"]) ** 2), updates

    engine = jzero.initialize(
        model=model,
        loss_fn=loss,
        optimizer=optax.adamw(1e-2),
        config=_cfg(stage),
        init_args=(batch["x"][:2],),
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
    expected = _expected_running_mean(batch, params["Dense_0"]["kernel"], params["Dense_0"]["bias"])
    for step in range(2):
        a = float(engine.train_step(batch)["loss"])
        c = float(tree_engine.train_step(batch)["loss"])
        assert a == pytest.approx(c, rel=1e-5)
        if step == 0:
            mean = engine.model["batch_stats"]["BatchNorm_0"]["mean"]
            np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=1e-6)


def test_linen_with_extra_collections_needs_a_stateful_loss():
    model = LinenBN()
    with pytest.raises(ValueError, match=r"loss_fn\(params, state, batch\)"):
        jzero.initialize(
            model=model,
            loss_fn=lambda p, b: 0.0,
            optimizer=optax.sgd(0.1),
            config=_cfg(1),
            init_args=(np.ones((2, 4), np.float32),),
        )
