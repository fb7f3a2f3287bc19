"""A user's own partition annotations on other mesh axes: kept, combined with ZeRO's data axis,
and really sharding the computation.

The toy model's layers are split over a ``model`` axis of 2 on a data=4 x model=2 mesh; each
stage (one per code path, :data:`STAGES`) must train exactly like data parallelism over 8
devices without annotations: in float64 (each test enables x64), losses and grad norms at
1e-10, since splitting a layer sums its products in another order, which float32 rounds
differently on each CPU; and the first grad norm is the one-device ``jax.grad``'s, since
clipping hides a gradient's scale from the losses.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from flax import linen, nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jzero

# Stage 0 (all-reduce, all replicated over data), 1 (the optimizer state sharded over data
# beside `model`) and 3 (the parameters too). Stage 2 differs from 1 only in reduce-scattering
# every micro-batch, which is the same collective without accumulation.
STAGES = (0, 1, 3)
BATCH = 32
MODEL_MESH = {"data": 4, "model": 2}
# The toy's layer width (64) is split over `model`: each device computes half of every layer.
SPECS = {
    "embed": P(None, "model"),
    "blocks": {"w": P(None, None, "model"), "b": P(None, "model")},
    "head": {"w": P("model", None), "b": P()},
    "odd": P(),
}


pytestmark = pytest.mark.usefixtures("x64")  # conftest's float64


def _metrics(engine, batch):
    m = engine.train_step(batch)
    return float(m["loss"]), float(m["grad_norm"])


def _grad_norm(loss, params, batch):
    """The global norm of the one-device gradient, outside jzero."""
    return float(optax.global_norm(jax.jit(jax.grad(loss))(params, batch)))


def config(stage, mesh):
    return {
        "train_batch_size": BATCH,
        "gradient_clipping": 0.5,
        "mesh": mesh,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def shard_shape(x):
    return x.addressable_shards[0].data.shape


@functools.cache
def first_grad_norm():
    return toy.first_grad_norm(BATCH)


@functools.cache
def runs(stage):
    """[((loss, grad_norm) with the model axis, the same without)] of 3 float64 steps; the
    model-axis engine and step."""
    params = toy.make_params(dtype=jnp.float64)
    batches = toy.make_batches(3, BATCH, dtype=np.float64)
    split = jzero.initialize(
        params,
        toy.loss_fn,
        optax.adamw(1e-2),
        config(stage, MODEL_MESH),
        options=jzero.InitOptions(param_specs=SPECS),
    )
    plain = jzero.initialize(params, toy.loss_fn, optax.adamw(1e-2), config(stage, {"data": -1}))
    compiled = split.lower(batches[0]).compile()
    losses = [(_metrics(split, b), _metrics(plain, b)) for b in batches]
    return losses, split, compiled


def test_config_mesh_section_builds_a_two_axis_auto_mesh():
    cfg = jzero.load_config({"mesh": {"data": -1, "model": 2}})
    mesh = jzero.make_mesh(cfg.mesh.sizes())
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    # Devices of one model group are neighbours: the model axis varies fastest.
    assert [d.id for d in mesh.devices[0]] == [0, 1]


@pytest.mark.parametrize(
    "axes, message",
    [
        ({"data": 2, "model": 2}, r"uses 4 devices but 8 are available; the product .* must be 8"),
        ({"data": -1, "model": 3}, r"8 is not divisible by 3"),
        ({"data": -1, "model": -1}, r"only one axis may be -1, but data, model are"),
        ({"model": 8}, r"has no 'data' axis"),
    ],
)
def test_a_mesh_that_does_not_fit_the_devices_is_a_clear_error(axes, message):
    with pytest.raises(ValueError, match=message):
        jzero.make_mesh(axes)


@pytest.mark.parametrize("stage", STAGES)
def test_model_axis_trains_like_data_parallel_at_every_stage(stage):
    losses, engine, _ = runs(stage)
    for split, plain in losses:
        np.testing.assert_allclose(split, plain, rtol=1e-10, atol=0)
    assert losses[0][1][1] == pytest.approx(first_grad_norm(), rel=1e-10, abs=0)
    assert engine.params["embed"].dtype == jnp.float64
    # It trained: Adam moves every entry by about lr (1e-2) a step, far beyond allclose's 1e-8.
    assert not np.allclose(engine.params["embed"], toy.make_params(dtype=jnp.float64)["embed"])
    w, b = engine.params["blocks"]["w"], engine.params["blocks"]["b"]  # after the steps
    # At rest: the user's `model` entry kept, ZeRO's data axis on a free dim at stage 3, never
    # the layer dimension the scan consumes (so `b`, whose other dim is `model`'s, stays whole).
    if stage == 3:
        assert w.sharding.spec == P(None, "data", "model") and shard_shape(w) == (4, 16, 32)
        assert b.sharding.spec == P(None, "model") and shard_shape(b) == (4, 32)
        assert engine.params["embed"].sharding.spec == P("data", "model")
    else:
        assert w.sharding.spec == P(None, None, "model") and shard_shape(w) == (4, 64, 32)
    assert engine.params["head"]["w"].sharding.spec[0] == "model"
    # Optimizer state: sharded over data from stage 1 on (its leading free dimension; at stage
    # 3 the one beside the scanned layer dimension), always keeping `model`.
    mu = engine.opt_state[0].mu["blocks"]["w"]
    if stage == 3:
        assert mu.sharding.spec == P(None, "data", "model") and shard_shape(mu) == (4, 16, 32)
    elif stage >= 1:
        assert mu.sharding.spec == P("data", None, "model") and shard_shape(mu) == (1, 64, 32)
    else:
        assert mu.sharding.spec == P(None, None, "model") and shard_shape(mu) == (4, 64, 32)


@pytest.mark.parametrize("stage", STAGES)
def test_the_compiled_step_computes_each_layer_on_its_model_shard(stage):
    _, engine, compiled = runs(stage)
    hlo = compiled.as_text()
    micro = BATCH // engine.plan.num_shards  # 8 rows a device on data=4
    # The layer matmul inside the scan yields [8, 32] per device: half of the 64 columns.
    layer_dots = re.findall(r"= f64\[(\d+),(\d+)\]\{[0-9,]*\} dot\(.*while/body", hlo)
    assert (str(micro), "32") in layer_dots
    state_in = compiled.input_shardings[0][0]
    assert "model" in tuple(state_in.params["blocks"]["w"].spec)


# --- Flax annotations are read into param_specs -------------------------------------------


class AnnotatedNNX(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        f64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}
        self.up = nnx.Linear(toy.IN, 64, kernel_init=init, rngs=rngs, **f64)
        down = jax.random.normal(rngs.params(), (64, toy.OUT), jnp.float64) * 0.1
        self.down = nnx.Param(down, sharding=("model", None))

    def __call__(self, x):
        return jnp.tanh(self.up(x)) @ self.down


class AnnotatedLinen(linen.Module):
    @linen.compact
    def __call__(self, x):
        init = linen.initializers.lecun_normal()
        f64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}
        up = linen.with_partitioning(init, (None, "model"))
        down = linen.with_partitioning(init, ("model", None))
        h = linen.Dense(64, kernel_init=up, **f64)(x)
        return linen.Dense(toy.OUT, kernel_init=down, **f64)(jnp.tanh(h))


def _nnx_loss(model, b):
    return jnp.mean((model(b["x"]) - b["y"]) ** 2)


def _tree_loss(p, b):
    out = jnp.tanh(b["x"] @ p["up"]["kernel"] + p["up"]["bias"]) @ p["down"]
    return jnp.mean((out - b["y"]) ** 2)


LINEN = AnnotatedLinen()


def _linen_loss(p, b):
    return jnp.mean((LINEN.apply({"params": p}, b["x"]) - b["y"]) ** 2)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_flax_partition_annotations_are_kept_and_train_like_data_parallel(kind):
    batches = toy.make_batches(2, BATCH, dtype=np.float64)
    if kind == "nnx":
        engine = jzero.initialize(
            model=lambda: AnnotatedNNX(nnx.Rngs(0)),
            loss_fn=_nnx_loss,
            optimizer=optax.adamw(1e-2),
            config=config(3, MODEL_MESH),
        )
        kernel, down, tree_loss = ("up", "kernel"), ("down",), _tree_loss
    else:
        engine = jzero.initialize(
            model=LINEN,
            loss_fn=_linen_loss,
            optimizer=optax.adamw(1e-2),
            config=config(3, MODEL_MESH),
            options=jzero.InitOptions(init_args=(batches[0]["x"][:2],)),
        )
        kernel, down, tree_loss = ("Dense_0", "kernel"), ("Dense_1", "kernel"), _linen_loss

    def leaf(tree, path):
        return functools.reduce(lambda t, k: t[k], path, tree)

    # (12, 64) split on dim 1 by the annotation; ZeRO puts data on dim 0.
    assert leaf(engine.params, kernel).sharding.spec == P("data", "model")
    assert leaf(engine.params, down).sharding.spec[0] == "model"
    weights = jax.tree.map(np.asarray, engine.params)
    assert {x.dtype for x in jax.tree.leaves(weights)} == {np.dtype(np.float64)}
    plain = jzero.initialize(weights, tree_loss, optax.adamw(1e-2), config(3, {"data": -1}))
    first = _grad_norm(tree_loss, weights, batches[0])
    for i, b in enumerate(batches):
        a, c = _metrics(engine, b), _metrics(plain, b)
        np.testing.assert_allclose(a, c, rtol=1e-10, atol=0)
        if i == 0:
            assert c[1] == pytest.approx(first, rel=1e-10, abs=0)
    assert leaf(engine.params, kernel).sharding.spec == P("data", "model")
    if kind == "nnx":
        assert isinstance(engine.model, AnnotatedNNX)


def test_a_data_axis_annotation_is_refused_with_the_fix():
    specs = dict(SPECS, odd=P("data"))
    with pytest.raises(ValueError, match=r"odd already uses the data axis 'data'.*Remove"):
        jzero.initialize(
            toy.make_params(),
            toy.loss_fn,
            optax.sgd(0.1),
            config(1, MODEL_MESH),
            options=jzero.InitOptions(param_specs=specs),
        )
