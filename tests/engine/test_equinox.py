"""Equinox models: a transformer of ``eqx.nn`` layers (Embedding, MultiheadAttention, MLP,
LayerNorm, Linear; its blocks a Python list), as ``params=`` (``eqx.partition``) and as
``model=``, trains like the single-device optax loop (float64, each test enables x64: 1e-10)
with its parameters split (stage 3) and not, stage 3 gathers about one block at a time,
activation checkpointing lowers the temporaries, and a checkpoint restores into a fresh
``model=`` engine."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzero

V, D, H, F, L, T, BATCH = 32, 32, 4, 64, 2, 8, 8
F64 = jnp.float64


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key, width=D):
        k1, k2 = jax.random.split(key)
        self.ln1 = eqx.nn.LayerNorm(width, dtype=F64)
        self.attn = eqx.nn.MultiheadAttention(H, width, key=k1, dtype=F64)
        self.ln2 = eqx.nn.LayerNorm(width, dtype=F64)
        self.mlp = eqx.nn.MLP(width, width, 2 * width, depth=1, key=k2, dtype=F64)

    def __call__(self, x):
        h = jax.vmap(self.ln1)(x)
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attn(h, h, h, mask=mask)
        return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class LM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key, width=D, layers=L):
        keys = jax.random.split(key, layers + 2)
        self.embed = eqx.nn.Embedding(V, width, key=keys[0], dtype=F64)
        self.blocks = [Block(k, width) for k in keys[2:]]
        self.ln = eqx.nn.LayerNorm(width, dtype=F64)
        self.head = eqx.nn.Linear(width, V, key=keys[1], dtype=F64)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.ln)(x))


pytestmark = pytest.mark.usefixtures("x64")  # conftest's float64


def model_loss(model, batch):
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
    return -picked.mean()


def batches(n=3, length=T):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, V, (BATCH, length + 1), dtype=np.int32)} for _ in range(n)]


def config(stage, **extra):
    return {
        "train_batch_size": BATCH,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


@functools.cache
def reference():
    """The single-device optax loop on the partitioned module: losses and grad norms."""
    params, static = eqx.partition(LM(jax.random.key(0)), eqx.is_inexact_array)
    tx = optax.adamw(1e-2)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(lambda p: model_loss(eqx.combine(p, static), batch))(
            params
        )
        norm = optax.global_norm(grads)
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 0.5 / (norm + 1e-6)), grads)
        updates, state = tx.update(grads, state, params)
        return eqx.apply_updates(params, updates), state, loss, norm

    state, out = tx.init(params), []
    for b in batches():
        params, state, loss, norm = step(params, state, b)
        out.append((float(loss), float(norm)))
    return out


def model_engine(stage, key=0, **extra):
    """A ``model=`` engine with AdamW: the constructor built directly in its shards."""
    return jzero.initialize(
        model=lambda: LM(jax.random.key(key)), loss_fn=model_loss, optimizer=optax.adamw(1e-2),
        config=config(stage, **extra),
    )  # fmt: skip


@pytest.fixture(scope="module")
def model3(tmp_path_factory):
    """The stage-3 ``model=`` engine trained on ``batches()`` (in float64, as every test here),
    saved after the first step and exported after the last; the training, checkpoint and export
    tests read it: ``(losses and grad norms, leaf paths, describe(), its folder, the trained
    parameters on the host)``."""
    root = tmp_path_factory.mktemp("equinox")
    with jax.enable_x64(True):
        engine = model_engine(3, checkpoint={"directory": str(root / "ckpt")})
        assert isinstance(engine.model, LM)
        data, metrics = batches(), []
        for i, b in enumerate(data):
            m = engine.train_step(b)
            metrics.append((float(m["loss"]), float(m["grad_norm"])))
            if i == 0:
                engine.save()
                engine.wait_until_finished()
        engine.save_16bit_model(root / "export")
        paths = [leaf.path for leaf in engine.plan.leaves]
        described = engine.describe()
        trained = jax.device_get(engine.params)
        engine.close()
    return metrics, paths, described, root, trained


# What is Equinox's own in these paths: the user's ``eqx.partition`` (``params=``; its static
# half closed over by the loss), and a constructor built in its shards (``model=``: replicated
# at stages 0-2, split at stage 3). ZeRO's stages themselves are the pytree path's, checked
# stage by stage in tests/step/. Stage 3 is where the loss sees the tree re-gathered, so both
# forms run there; ``model=`` also with its parameters replicated (stage 1: its optimizer state
# split). The stage-3 ``model=`` run is the module's ``model3``, which the checkpoint and export
# tests below read too; their fresh engines build the stage-1 run's programs, so those come from
# the run's compilation cache.
@pytest.mark.parametrize(("form", "stage"), [("params", 3), ("model", 1), ("model", 3)])
def test_an_equinox_transformer_trains_like_the_single_device_optax_loop(form, stage, request):
    if form == "params":
        params, static = eqx.partition(LM(jax.random.key(0)), eqx.is_array)
        engine = jzero.initialize(
            params, lambda p, b: model_loss(eqx.combine(p, static), b), optax.adamw(1e-2),
            config(stage),
        )  # fmt: skip
    elif stage == 1:  # a constructor: built directly in its shards
        engine = model_engine(stage)
        assert isinstance(engine.model, LM)
    if form == "model" and stage == 3:  # the module's run, read by the tests below too
        got, paths, described = request.getfixturevalue("model3")[:3]
    else:
        got = [engine.train_step(b) for b in batches()]
        got = [(float(m["loss"]), float(m["grad_norm"])) for m in got]
        paths = [leaf.path for leaf in engine.plan.leaves]
        described = engine.describe()
    np.testing.assert_allclose(got, reference(), rtol=1e-10, atol=0)
    assert "blocks.0.attn.query_proj.weight" in paths  # readable, in describe() too
    assert "blocks.0.attn.query_proj.weight" in described


def _temp(stage, layers=4, width=64, length=T, **extra):
    engine = jzero.initialize(
        model=lambda: LM(jax.random.key(0), width, layers), loss_fn=model_loss,
        optimizer=optax.sgd(1e-2), config=config(stage, **extra),
    )  # fmt: skip
    batch = batches(1, length)[0]
    engine.resolve(batch)
    compiled = engine.lower(batch).compile()
    params = sum(leaf.size * 8 for leaf in jax.tree.leaves(engine.params))
    return compiled.memory_analysis().temp_size_in_bytes, params, engine


def test_stage3_gathers_about_one_block_of_an_unrolled_equinox_model_at_a_time():
    temp, params, engine = _temp(3)
    one_block = sum(
        x.size * 8 for x in jax.tree.leaves(eqx.filter(engine.model.blocks[0], eqx.is_array))
    )
    # Holding every block gathered at once would take the whole model (params) and more;
    # the step's temporaries stay within a few blocks' worth (4 blocks: about 1.6 of them,
    # under half the model, where all 4 at once would be over both bounds).
    assert temp < params / 2, (temp, params)
    assert temp < 4 * one_block, (temp, one_block)


def test_activation_checkpointing_lowers_the_temporaries_with_the_same_losses():
    """128-token sequences: each block's attention scores outweigh the small weights."""
    shape = {"layers": 4, "width": 32, "length": 128}
    plain, _, a = _temp(0, **shape)
    full, _, b = _temp(0, **shape, activation_checkpointing={"policy": "full"})
    assert full < 0.75 * plain, (full, plain)
    for batch in batches(2, 128):
        assert float(a.train_step(batch)["loss"]) == pytest.approx(
            float(b.train_step(batch)["loss"]), rel=1e-10, abs=0
        )


def test_a_checkpoint_restores_into_a_fresh_model_engine(model3):
    """Saved after ``model3``'s first step, restored into a stage-1 engine built from another
    key: its next two steps are ``model3``'s (the second step's loss reads the restored
    parameters, the third's their update from the restored moments)."""
    metrics, root = model3[0], model3[3]
    fresh = model_engine(1, key=5, checkpoint={"directory": str(root / "ckpt")})
    fresh.restore()
    got = [fresh.train_step(b) for b in batches()[1:]]
    got = [(float(m["loss"]), float(m["grad_norm"])) for m in got]
    np.testing.assert_allclose(got, metrics[1:], rtol=1e-10, atol=0)


def test_an_export_loads_into_a_fresh_model_engine_by_name(model3):
    """The export names tensors by the module's paths; init_from reads them back, and a
    name_map reads the same file under other names."""
    root, trained = model3[3], model3[4]
    for name_map in (None, lambda path: path):
        fresh = jzero.initialize(
            model=lambda: LM(jax.random.key(5)), loss_fn=model_loss, optimizer=optax.sgd(1e-2),
            config=config(1),
            options=jzero.InitOptions(init_from=str(root / "export"), name_map=name_map),
        )  # fmt: skip
        for x, y in zip(jax.tree.leaves(jax.device_get(fresh.params)), jax.tree.leaves(trained),
                        strict=True):  # fmt: skip
            np.testing.assert_array_equal(x, y)
    assert isinstance(fresh.model, LM)


class Permuted(eqx.Module):
    """A floating weight and an integer index table: the table is state, not a parameter."""

    w: jax.Array
    order: jax.Array

    def __call__(self, x):
        return jnp.tanh(x[:, self.order] @ self.w)


def test_integer_arrays_are_carried_as_state_not_trained():
    module = Permuted(jnp.ones((4, 3), F64), jnp.array([3, 2, 1, 0], jnp.int32))
    engine = jzero.initialize(
        model=module,
        loss_fn=lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
        optimizer=optax.sgd(0.1),
        config={"train_batch_size": 8},
    )
    assert [leaf.path for leaf in engine.plan.leaves] == ["w"]
    rng = np.random.default_rng(0)
    engine.train_step({"x": rng.normal(size=(8, 4)), "y": rng.normal(size=(8, 3))})
    model = engine.model
    np.testing.assert_array_equal(model.order, [3, 2, 1, 0])
    assert not np.allclose(model.w, 1.0)  # trained


def test_numpy_floating_arrays_of_a_module_are_parameters():
    """``eqx.is_inexact_array`` takes NumPy arrays too: such a weight is trained, not closed
    over as a constant."""
    module = Permuted(np.ones((4, 3)), jnp.array([3, 2, 1, 0], jnp.int32))
    engine = jzero.initialize(
        model=module,
        loss_fn=lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
        optimizer=optax.sgd(0.1),
        config={"train_batch_size": 8},
    )
    assert [leaf.path for leaf in engine.plan.leaves] == ["w"]
    rng = np.random.default_rng(0)
    engine.train_step({"x": rng.normal(size=(8, 4)), "y": rng.normal(size=(8, 3))})
    assert not np.allclose(engine.model.w, 1.0)
