"""Training with clipping off matches a single-device optax loop, and ``grad_norm`` is the
reference's global norm: tests that catch a gradient scaled by a constant.

With DeepSpeed's default ``gradient_clipping: 1.0`` active on every step, clipped SGD and Adam
ignore the gradient's scale, so every test here runs with ``gradient_clipping: 0``, and every
one checks ``grad_norm`` against ``optax.tree.norm`` of the reference's gradients. The float32
masters under fp16 are checked bit for bit on data whose gradients are exact in fp16.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from numerics import EPS, max_rel_error, needs_float16

import jzero
from jzero.demo.gpt import GPTConfig, init_params
from jzero.demo.gpt import loss_fn as gpt_loss
from jzero.step import logical_view

BATCH = 32


def config(stage, accum=1, **extra):
    return {
        "train_batch_size": BATCH,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 0.0,  # the gradient's scale reaches the update
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


def reference(loss, params, tx, batches):
    """The single-device optax loop: (losses, gradient global norms, final params) on the host."""
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, optax.tree.norm(grads)

    losses, norms = [], []
    for b in batches:
        params, opt_state, value, norm = step(params, opt_state, b)
        losses.append(float(value))
        norms.append(float(norm))
    return losses, norms, jax.device_get(params)


def train(engine, batches):
    """Runs the engine: (losses, grad norms) as floats."""
    metrics = [engine.train_step(b) for b in batches]
    return [float(m["loss"]) for m in metrics], [float(m["grad_norm"]) for m in metrics]


# SGD and AdamW at every stage in float64, with clipping off and on, one micro-batch and four:
# tests/step/test_core.py::test_parity_with_single_device_optax.


# -- grad_norm under mixed precision -------------------------------------------------------------
# The bound, from the 16-bit dtype's unit roundoff: the toy's forward and backward round each
# gradient's path to the compute dtype at most about 16 times (embedding, 4 layers, head, the odd
# term, each way), and those relative errors add at most linearly in the norm, so the engine's
# norm and loss lie within 16 * EPS of the float32 reference's (bf16 6.3%, fp16 0.8%; measured
# 0.1% and 0.006%). A gradient off by a factor of 2 is off by 100%. float32 is compared in
# float64 by test_core.py::test_parity_with_single_device_optax, at every stage.
MIXED = {
    "bf16": (3, {"bf16": {"enabled": True}}, 16 * EPS["bfloat16"]),
    "fp16": (1, {"fp16": {"enabled": True, "initial_scale_power": 8}}, 16 * EPS["float16"]),
}


@functools.cache
def float32_sgd_reference():
    params, batches = toy.make_params(), toy.make_batches(3, BATCH)
    return reference(toy.loss_fn, params, optax.sgd(0.05), batches)


@pytest.mark.rounding
@pytest.mark.parametrize(
    "precision", [pytest.param(p, marks=needs_float16) if p == "fp16" else p for p in sorted(MIXED)]
)
def test_grad_norm_is_the_global_norm_of_the_reference_gradients(precision):
    stage, extra, rtol = MIXED[precision]
    engine = jzero.initialize(
        toy.make_params(), toy.loss_fn, optax.sgd(0.05), config(stage, **extra)
    )
    losses, norms = train(engine, toy.make_batches(3, BATCH))
    ref_losses, ref_norms, _ = float32_sgd_reference()
    np.testing.assert_allclose(norms, ref_norms, rtol=rtol)
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)


# -- fp16: the loss scale is undone exactly ------------------------------------------------------
# The masters are float32 whatever the params' dtype (jzero.plan casts them), so float64 masters
# are not possible. Instead the data make every gradient exact in fp16: inputs are small
# integers, the loss is linear in the parameters, and batch sizes, the loss scale and the
# learning rate are powers of two. The fp16 gradient of the scaled loss, its fp16 reduction,
# the division by the scale and SGD's update are then all exact, so the float32 masters must
# equal the float32 reference bit for bit, and so must grad_norm (a sum of exact squares).
def _linear_loss(p, b):
    return jnp.mean(jnp.sum((b["x"] @ p["w"]) * b["y"], -1) + b["z"] @ p["b"])


@jax.jit  # one program (exact arithmetic: no fusion or order changes a bit of it)
def _reference_grad(params, batch):
    grads = jax.grad(_linear_loss)(params, batch)
    return grads, optax.tree.norm(grads)


def _integer_batches(n, dtype):
    rng = np.random.default_rng(3)
    shapes = {"x": (BATCH, 16), "y": (BATCH, 8), "z": (BATCH, 5)}
    return [
        {k: rng.integers(-2, 3, shape).astype(dtype) for k, shape in shapes.items()}
        for _ in range(n)
    ]


@needs_float16
@pytest.mark.rounding
@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_unscaled_sgd_updates_are_exact(stage):
    rng = np.random.default_rng(0)
    params = {
        "w": (rng.normal(size=(16, 8)) * 0.1).astype(np.float32),  # sharded from stage 1
        "b": (rng.normal(size=(5,)) * 0.1).astype(np.float32),  # 8 does not divide it: whole
    }
    # Dynamic scaling from 2**6, doubling after every 2 clean steps: 64, 64, 128, 128.
    fp16 = {"enabled": True, "initial_scale_power": 6, "loss_scale_window": 2}
    engine = jzero.initialize(params, _linear_loss, optax.sgd(0.125), config(stage, fp16=fp16))
    ref = params
    for b in _integer_batches(4, np.float16):
        m = engine.train_step(b)
        grads, norm = _reference_grad(ref, jax.tree.map(lambda x: x.astype(np.float32), b))
        ref = jax.tree.map(lambda p, g: p - np.float32(0.125) * np.asarray(g), ref, grads)
        assert float(m["skipped"]) == 0
        assert float(m["grad_norm"]) == float(norm)
        master = jax.device_get(logical_view(engine.plan, engine.state).master)
        for k in ref:
            np.testing.assert_array_equal(master[k], ref[k], err_msg=k)
    assert float(m["loss_scale"]) == 128  # the scale changed on the way, and was undone each time


# -- the built-in GPT ------------------------------------------------------------------------
# In float64 (the model's ``dtype="float64"`` runs every op, its statistics included, in
# float64): the point is that jzero's sharded step is the optax loop's arithmetic. In float32,
# Adam turns the rounding of a near-zero gradient entry (different reduction orders) into an
# update of up to lr, so the parameters after 3 steps differ by a machine- and ISA-dependent
# 1e-5..1.6e-4 of their scale, and no float32 bound both holds everywhere and stays tight.
GPT = GPTConfig(seq_len=8, num_layers=2, num_heads=2, d_model=16, d_ff=32, dtype="float64")


def _gpt_loss(params, batch):
    return gpt_loss(params, batch, GPT)


@functools.cache
def gpt_setup():
    # Random weights of init_params' shapes, made on the host (no compile): scales near one,
    # everything else small.
    rng = np.random.default_rng(4)
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), GPT))
    params = jax.tree_util.tree_map_with_path(
        lambda path, s: rng.normal(size=s.shape) * 0.02 + ("scale" in jax.tree_util.keystr(path)),
        shapes,
    )
    batches = [{"tokens": rng.integers(0, 256, (16, 9)).astype(np.int32)} for _ in range(3)]
    with jax.enable_x64(True):
        return params, batches, reference(_gpt_loss, params, optax.adam(1e-2), batches)


# Stage 3 only: the stacked layers sharded at rest, gathered in the scan; stage 0's step is
# the toy's (test_core.py::test_parity_with_single_device_optax[0-*]). Two micro-batches of 8
# rows: the mean of their mean losses is the whole batch's, so every micro-batch must count.
@pytest.mark.parametrize("stage", [3])
def test_gpt_matches_single_device_optax(stage):
    params, batches, (ref_losses, ref_norms, ref_params) = gpt_setup()
    cfg = dict(config(stage, accum=2), train_batch_size=16)
    with jax.enable_x64(True):
        engine = jzero.initialize(params, _gpt_loss, optax.adam(1e-2), cfg)
        losses, norms = train(engine, batches)
        final = jax.device_get(engine.params)
        sharded = not engine.params["blocks"]["mlp_in"].sharding.is_fully_replicated
    assert {x.dtype for x in jax.tree.leaves(final)} == {np.dtype(np.float64)}
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-10, atol=0)
    assert max_rel_error(final, ref_params) < 1e-9
    if stage == 3:  # the stacked layers really are sharded at rest
        assert sharded


# -- other optax optimizers under sharding ------------------------------------------------------
def _no_decay_on_vectors(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


SHARDED_OPTIMIZERS = {
    # Per-tensor trust ratios: the norms must be of whole leaves, not of shards.
    "lamb": (3, lambda: optax.lamb(1e-2, weight_decay=1e-2)),
    # Factored second moments of shapes unlike the params' (blocks.w is 2x128x128).
    "adafactor": (3, lambda: optax.adafactor(1e-2)),
    # A weight-decay mask: optax.MaskedNode leaves in the state.
    "masked_adamw": (2, lambda: optax.adamw(1e-2, weight_decay=0.5, mask=_no_decay_on_vectors)),
}


@pytest.mark.parametrize("name", sorted(SHARDED_OPTIMIZERS))
def test_other_optax_optimizers_match_single_device_optax_when_sharded(name):
    stage, make_tx = SHARDED_OPTIMIZERS[name]
    with jax.enable_x64(True):
        params = toy.make_params(num_layers=2, d=128, dtype=jnp.float64)
        batches = toy.make_batches(3, BATCH, dtype=np.float64)
        ref_losses, ref_norms, ref_params = reference(toy.loss_fn, params, make_tx(), batches)
        engine = jzero.initialize(params, toy.loss_fn, make_tx(), config(stage))
        losses, norms = train(engine, batches)
        final = jax.device_get(engine.params)
        sharded = [
            x for x in jax.tree.leaves(engine.opt_state) if not x.sharding.is_fully_replicated
        ]
    assert sharded  # the optimizer state really is sharded
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-10, atol=0)
    assert max_rel_error(final, ref_params) < 1e-9
    if name == "masked_adamw":  # the mask mattered: without it the vectors decay too
        unmasked = optax.adamw(1e-2, weight_decay=0.5)
        with jax.enable_x64(True):
            _, _, other = reference(toy.loss_fn, params, unmasked, batches)
        assert max_rel_error(final["blocks"]["b"], other["blocks"]["b"]) > 1e-4
