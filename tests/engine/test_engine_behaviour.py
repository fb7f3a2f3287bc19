"""Engine behaviours a user relies on: ``evaluate``, ``checkpoint.max_to_keep``, the data
position carried by checkpoints, and what donation does to a parameter handle held across a
``train_step``."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy

import jzero
from jzero.config import JzeroMeshWarning
from jzero.demo.data import BatchIterator
from jzero.distributed import make_mesh

BATCH = 32


def config(stage, **extra):
    return {
        "train_batch_size": BATCH,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


@jax.enable_x64(True)
def test_evaluate_is_the_mean_loss_of_the_current_params_and_changes_nothing():
    # Stage 3 (params gathered inside the eval step), a loss with aux (evaluate returns the loss).
    # In float64: evaluate's sharded mean is the one-device loss to 1e-10, on any CPU.
    params0 = toy.make_params(dtype=jnp.float64)
    engine = jzero.initialize(params0, toy.loss_with_aux, optax.sgd(0.1), config(3))
    train = toy.make_batches(1, BATCH, dtype=np.float64)[0]
    held_out = toy.make_batches(1, 16, seed=5, dtype=np.float64)[0]
    before = float(engine.evaluate(held_out))  # 16 rows: any multiple of the 8 devices
    assert before == pytest.approx(float(toy.loss_fn(params0, held_out)), rel=1e-10, abs=0)
    engine.train_step(train)
    params = jax.device_get(engine.params)
    after = engine.evaluate(held_out)
    assert after.shape == () and after.dtype == jnp.float64
    assert float(after) == pytest.approx(float(toy.loss_fn(params, held_out)), rel=1e-10, abs=0)
    # It reads the trained params: one SGD step moves the held-out loss by far more than 0.1%.
    assert float(after) != pytest.approx(before, rel=1e-3)
    # Evaluating updates nothing.
    assert engine.global_step == 1 and engine.iteration == 1
    now = jax.device_get(engine.params)
    for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"divisible by the data-parallel size 8 .* \[12\]"):
        engine.evaluate(toy.make_batches(1, 12, dtype=np.float64)[0])


# -- checkpoints: rotation and the data position ------------------------------------------------
VOCAB, SEQ = 32, 8
TOKENS = np.random.default_rng(0).integers(0, VOCAB, 4000).astype(np.uint8)


def _token_params():
    """float64 (the resume tests enable x64), so that the first grad norm can be checked
    against ``jax.grad`` at 1e-10."""
    rng = np.random.default_rng(1)
    return {"embed": rng.normal(size=(VOCAB, 16)) * 0.3, "out": rng.normal(size=(16, VOCAB)) * 0.3}


def _token_loss(p, batch):
    tokens = batch["tokens"]
    logits = jnp.tanh(p["embed"][tokens[:, :-1]]) @ p["out"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def _token_engine(directory):
    cfg = config(
        2,
        train_batch_size=16,
        checkpoint={"directory": str(directory), "save_interval_steps": 1, "max_to_keep": 2},
    )
    engine = jzero.initialize(_token_params(), _token_loss, optax.adam(1e-2), cfg)
    engine.data_iterator = BatchIterator(TOKENS, 16, SEQ, seed=7)
    return engine


@pytest.fixture(scope="module")
def five_saved_steps(tmp_path_factory):
    """Five float64 steps with a checkpoint after each and max_to_keep 2: (directory, losses,
    grad norms, the one-device gradient norm of the first batch)."""
    directory = tmp_path_factory.mktemp("ckpt")
    with jax.enable_x64(True), _token_engine(directory) as engine:
        first = BatchIterator(TOKENS, 16, SEQ, seed=7).next()
        grads = jax.jit(jax.grad(_token_loss))(_token_params(), first)
        metrics = [engine.train_step(engine.data_iterator.next()) for _ in range(5)]
        losses = [float(m["loss"]) for m in metrics]
        norms = [float(m["grad_norm"]) for m in metrics]
        return directory, losses, norms, float(optax.global_norm(grads))


def test_max_to_keep_leaves_only_the_newest_checkpoints_on_disk(five_saved_steps):
    directory = five_saved_steps[0]
    on_disk = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    assert on_disk == [4, 5]


def test_resume_continues_with_the_next_batch_not_batch_0(five_saved_steps):
    directory, losses, norms, first = five_saved_steps
    # Adam hides a gradient's scale from the losses; the first grad norm is jax.grad's.
    assert norms[0] == pytest.approx(first, rel=1e-10, abs=0)
    with jax.enable_x64(True), _token_engine(directory) as engine:
        assert engine.data_iterator.step == 0
        meta = engine.restore(4)
        assert meta["data"] == {"step": 4, "seed": 7}
        assert engine.data_iterator.step == 4
        batch = engine.data_iterator.next()
        fresh = BatchIterator(TOKENS, 16, SEQ, seed=7)
        expected = [fresh.next()["tokens"] for _ in range(5)]
        np.testing.assert_array_equal(batch["tokens"], expected[4])
        assert not np.array_equal(batch["tokens"], expected[0])
        # The resumed step is the fifth step of the run that never stopped, bit for bit.
        m = engine.train_step(batch)
        assert (float(m["loss"]), float(m["grad_norm"])) == (losses[4], norms[4])


# -- donation ---------------------------------------------------------------------------------
def test_a_held_params_handle_is_deleted_by_the_next_step_and_a_copy_survives():
    """The step donates the state, so ``engine.params`` taken before a ``train_step`` is
    deleted by it (but for padded leaves, handed out as copies);
    ``jax.tree.map(jnp.copy, engine.params)`` (or ``jax.device_get``) keeps it."""
    engine = jzero.initialize(toy.make_params(), toy.loss_fn, optax.sgd(0.1), config(3))
    held = engine.params
    copy = jax.tree.map(jnp.copy, engine.params)
    # Values read from the copy: on CPU a NumPy view of a leaf (``jax.device_get`` or
    # ``np.asarray`` of a replicated one is zero-copy) holds its buffer, and XLA then copies
    # instead of donating it, so that one leaf would survive.
    values = jax.device_get(copy)
    engine.train_step(toy.make_batches(1, BATCH)[0])
    # Every leaf handed out as the state's own array is gone; a leaf that rests padded
    # (head.b's 5 rows on 8 devices) is handed out as a copy at its logical shape, and stays.
    padded = {leaf.path for leaf in engine.plan.leaves if leaf.param_shape != leaf.shape}
    assert padded == {"embed", "head.b", "odd"}  # 12 and 5 rows; the stacks take dim 1
    for p, x in jax.tree_util.tree_flatten_with_path(held)[0]:
        assert x.is_deleted() == (jax.tree_util.keystr(p, simple=True, separator=".") not in padded)
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        np.asarray(held["blocks"]["w"])
    np.testing.assert_array_equal(np.asarray(held["head"]["b"]), values["head"]["b"])
    for c, v in zip(jax.tree.leaves(copy), jax.tree.leaves(values), strict=True):
        np.testing.assert_array_equal(np.asarray(c), v)
    # The engine's own handle is the new state's.
    assert not any(x.is_deleted() for x in jax.tree.leaves(engine.params))


def _mesh_warnings(stage, mesh):
    """The JzeroMeshWarning messages of an abstract ``initialize`` (nothing is created)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # pyproject ignores this class outside this test
        jzero.initialize(
            toy.make_params(),
            toy.loss_fn,
            optax.sgd(0.1),
            config(stage),
            abstract=True,
            options=jzero.InitOptions(mesh=mesh),
        )
    return [str(w.message) for w in caught if issubclass(w.category, JzeroMeshWarning)]


def test_a_stage_over_a_data_axis_of_one_device_warns_with_the_fix():
    """Without XLA_FLAGS a CPU has one device, and a stage "shards" over it silently: the
    warning names the mesh and, on one CPU device, the flag that gives eight."""
    (lone,) = _mesh_warnings(3, make_mesh({"data": 1}, devices=jax.devices()[:1]))
    assert "ZeRO stage 3" in lone and "{'data': 1}" in lone and "nothing is split" in lone
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in lone
    # Eight devices, all on replica groups: the data axis still splits nothing.
    (hybrid,) = _mesh_warnings(1, make_mesh({"replica": 8, "data": 1}))
    assert "{'replica': 8, 'data': 1}" in hybrid and "mesh: {data: -1}" in hybrid
    assert "XLA_FLAGS" not in hybrid
    assert _mesh_warnings(0, make_mesh({"data": 1}, devices=jax.devices()[:1])) == []
    assert _mesh_warnings(3, make_mesh({"data": 8})) == []
