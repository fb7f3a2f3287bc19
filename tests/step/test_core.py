"""The core promises: ZeRO stages 0-3 train exactly like one device, with the memory and the
communication the ZeRO paper says, proven from the compiled program."""

import functools
import math

import jax
import numpy as np
import optax
import pytest
import toy
from numerics import max_rel_error

import jzero
from jzero.distributed import CompileCounter
from jzero.hlo import collectives
from jzero.plan import model_state_bytes

STAGES = (0, 1, 2, 3)
GLOBAL_BATCH = 32
CLIP = 0.5


def config(stage, accum=1, **extra):
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "sgd": lambda: optax.sgd(0.1),
}


STEPS = 3  # a parity check needs a few steps, not a curve


@functools.cache
def reference(opt, clip):
    """The plain single-device optax loop in float64 (computed once per setting), with
    DeepSpeed's clipping rule when ``clip``: ``(params, batches, losses, gradient global norms,
    final params)``."""
    return toy.reference_float64(OPTIMIZERS[opt], GLOBAL_BATCH, steps=STEPS, clip=clip)


# Every stage against the optax loop in float64: the point is that every stage's sharded step is
# the optax loop's arithmetic (a float32 run differs by each CPU's reduction order, which Adam
# amplifies near zero gradients). Per stage, two settings that between them take every path:
# - AdamW, one micro-batch (no scan), clipping active on every step: the update then ignores the
#   gradient's scale, so grad_norm is compared too and catches a gradient scaled by a constant;
# - SGD, 4 micro-batches (the scan; stage 2 reduce-scatters in it), gradient_clipping 0: the
#   gradient's scale reaches the update and the parameters, and a lost micro-batch shows.
# Steps after the first compile nothing (the state comes back with the shardings it went in with).
SETTINGS = {"adamw-accum1-clipped": ("adamw", 1, CLIP), "sgd-accum4-unclipped": ("sgd", 4, 0.0)}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("stage", STAGES)
def test_parity_with_single_device_optax(stage, setting):
    opt, accum, clip = SETTINGS[setting]
    params, batches, ref_losses, ref_norms, ref_params = reference(opt, clip)
    cfg = dict(config(stage, accum), gradient_clipping=clip)
    with jax.enable_x64(True):
        engine = jzero.initialize(params, toy.loss_fn, OPTIMIZERS[opt](), cfg)
        metrics = [engine.train_step(batches[0])]
        with CompileCounter() as later:
            metrics += [engine.train_step(b) for b in batches[1:]]
        losses = [float(m["loss"]) for m in metrics]
        norms = [float(m["grad_norm"]) for m in metrics]
        final = jax.device_get(engine.params)
    assert later.programs == 0, later.names
    assert engine.global_step == STEPS
    if clip:
        assert min(norms) > clip  # clipping is active on every step
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-10, atol=0)
    assert max_rel_error(final, ref_params) < 1e-9
    assert {leaf.dtype for leaf in jax.tree.leaves(final)} == {np.dtype(np.float64)}
    # The test model has leaves of 5 and 12 rows, which 8 devices do not divide: stages 1-3
    # shard every leaf anyway, padded, and the padding never reaches the numbers above.
    if stage:
        assert all(leaf.state_dim is not None for leaf in engine.plan.leaves)
        padded = {leaf.path for leaf in engine.plan.leaves if leaf.padding}
        assert {"head.b", "odd", "embed"} <= padded
    if stage in (1, 2) and accum > 1:
        # Stage 2 reduce-scatters every micro-batch's gradient, stage 1 the accumulated one
        # once. The step just run: its program comes from the run's compilation cache.
        with jax.enable_x64(True):
            exe = engine.lower(batches[0]).compile()
        psi = sum(math.prod(leaf.stored_shape()) * 8 for leaf in engine.plan.leaves)
        reductions = accum if stage == 2 else 1
        assert collectives(exe)["reduce-scatter"].bytes == pytest.approx(reductions * psi, rel=0.05)


def _engine(stage, accum=1, loss=toy.loss_fn, params=None, **cfg):
    params = toy.make_params() if params is None else params
    return jzero.initialize(params, loss, optax.adamw(1e-3), config(stage, accum, **cfg))


@pytest.fixture(scope="module")
def compiled():
    """The compiled step of each stage (accumulation 1) with its engine."""
    batch = toy.make_batches(1, GLOBAL_BATCH)[0]
    out = {}
    for stage in STAGES:
        engine = _engine(stage)
        out[stage] = (engine, engine.lower(batch).compile(), batch)
    return out


def _bytes(tree):
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("stage", STAGES)
def test_argument_bytes_equal_the_plan(compiled, stage):
    engine, exe, batch = compiled[stage]
    plan = engine.plan
    state_bytes = model_state_bytes(plan)
    scalars = _bytes((engine.state.step, engine.state.loss_scale))  # replicated scalars
    predicted = state_bytes["params"] + state_bytes["opt_state"] + scalars + _bytes(batch) // 8
    assert exe.memory_analysis().argument_size_in_bytes == predicted


def _share(leaf, sharded):
    """Elements of ``leaf`` one of 8 devices holds: its sharded dimension rounded up to a
    multiple of 8 and split 8 ways (the ZeRO formula up to the padding), else all of it."""
    if not sharded:
        return math.prod(leaf.shape)
    d, m = leaf.state_dim, leaf.merged  # m leading dimensions rest as one (4 layers x 64 rows)
    length = math.prod(leaf.shape[d : d + m])
    rows = -(-length // 8)  # the sharded dimension's rows per device, padded
    return rows * math.prod(leaf.shape) // length


def test_what_each_stage_shards(compiled):
    """Per-device model-state bytes are ZeRO's formula per leaf, up to the padding of the
    leaves 8 does not divide (embed 12 rows, head.b and odd 5; the 4-layer stacks' state rests
    merged with their rows, exact): every leaf is sharded from stage 1 on."""
    count_bytes = 4  # adamw's step count stays whole
    for s in STAGES:
        plan = compiled[s][0].plan
        b = model_state_bytes(plan)
        assert all(leaf.state_dim is not None for leaf in plan.leaves) == (s > 0)
        spec = plan.stage

        def total(sharded, leaves=plan.leaves):
            return 4 * sum(_share(leaf, sharded) for leaf in leaves)

        assert b["opt_state"] == 2 * total(spec.shard_opt_state) + count_bytes
        assert b["grads"] == total(spec.shard_grads)
        assert b["params"] == total(spec.shard_params)
        # The padding is under one row of the padded dimension per leaf and device.
        if s:
            logical = 4 * sum(math.prod(leaf.shape) for leaf in plan.leaves) / 8
            rows = 4 * sum(
                math.prod(leaf.shape[leaf.state_dim + leaf.merged :]) for leaf in plan.leaves
            )
            one_moment = (b["opt_state"] - count_bytes) / 2
            assert logical <= one_moment < logical + rows


def _psi_bytes(engine):
    """Bytes of the parameters as the collectives carry them: padded where a leaf rests
    padded (its gradient is reduce-scattered and its shards gathered at that length)."""
    return sum(math.prod(leaf.stored_shape()) * 4 for leaf in engine.plan.leaves)


@pytest.mark.parametrize("stage", STAGES)
def test_collectives_match_zero_volumes(compiled, stage):
    engine, exe, _ = compiled[stage]
    psi = _psi_bytes(engine)
    c = collectives(exe)
    if stage == 0:
        assert c["reduce-scatter"].count == 0 and c["all-gather"].count == 0
        assert c["all-reduce"].bytes == pytest.approx(psi, rel=0.05)
        return
    # Stages 1-3: the gradients are reduce-scattered; only leaves ZeRO left whole (and
    # scalars) are all-reduced.
    assert c["reduce-scatter"].bytes == pytest.approx(psi, rel=0.05)
    assert c["all-reduce"].bytes < 0.05 * psi
    gathered = c["all-gather"].bytes
    if stage < 3:
        assert gathered == pytest.approx(psi, rel=0.05)
    else:
        # Forward and backward gathers: ZeRO-3's 3 Psi in all.
        assert gathered + c["reduce-scatter"].bytes == pytest.approx(3 * psi, rel=0.05)


def test_stage3_never_gathers_the_whole_model():
    # 8 layers of 256x256: parameters (2 MiB) dominate the activations.
    params = toy.make_params(num_layers=8, d=256)
    batch = toy.make_batches(1, 16)[0]
    cfg = {
        "train_batch_size": 16,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine = jzero.initialize(params, toy.loss_fn, optax.adamw(1e-3), cfg)
    mem = engine.lower(batch).compile().memory_analysis()
    full_params = _bytes(params)
    peak = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    assert peak < full_params, (peak, full_params)
    # And the step still trains.
    first = float(engine.train_step(batch)["loss"])
    for _ in range(3):
        last = float(engine.train_step(batch)["loss"])
    assert last < first


def test_aux_metrics_and_learning_rate():
    engine = jzero.initialize(
        toy.make_params(),
        toy.loss_with_aux,
        optax.inject_hyperparams(optax.adamw)(learning_rate=3e-3),
        config(2, accum=2),
    )
    m = engine.train_step(toy.make_batches(1, GLOBAL_BATCH)[0])
    assert set(m) == {"loss", "grad_norm", "lr", "mae", "nonfinite", "skipped"}
    assert float(m["lr"]) == float(np.float32(3e-3))  # the hyperparameter, as stored
    assert 0 < float(m["mae"]) < 10


def test_params_given_as_a_function_of_a_key_are_created_in_their_shards():
    cfg = config(3)
    engine = jzero.initialize(lambda key: toy.make_params(), toy.loss_fn, optax.sgd(0.1), cfg)
    w = engine.params["blocks"]["w"]
    assert w.sharding.spec == jax.sharding.PartitionSpec(None, "data")  # leading divisible dim
    assert w.addressable_shards[0].data.shape == (4, 8, 64)


def test_describe_lists_every_leaf_and_what_stayed_whole():
    text = _engine(3).describe()
    for path in ("embed", "blocks.w", "blocks.b", "head.w", "head.b", "odd"):
        assert path in text
    assert "5 (+3 on dim 0)" in text and "5x3 (+3 on dim 0)" in text  # head.b, odd
    assert "leaves ZeRO left whole" not in text
    assert "ZeRO stage 3" in text


def test_persistence_threshold_keeps_small_params_whole():
    engine = jzero.initialize(
        toy.make_params(),
        toy.loss_fn,
        optax.sgd(0.1),
        {"train_batch_size": 32, "zero_optimization": {"stage": 3}},
    )
    # Every toy leaf is below DeepSpeed's default of 1e5 elements: params stay whole,
    # their gradients and optimizer state are still sharded.
    for leaf in engine.plan.leaves:
        assert leaf.param_dim is None
    assert engine.plan.leaves[1].state_dim is not None
    assert "stage3_param_persistence_threshold=100,000" in engine.describe()


# -- errors a user can cause -----------------------------------------------------------------


def test_bad_stage_is_a_clear_error():
    with pytest.raises(ValueError, match=r"zero_optimization\.stage: 4 .* 0, 1, 2, 3"):
        _engine(4)


def test_bad_batch_arithmetic_is_a_clear_error():
    with pytest.raises(ValueError, match=r"train_batch_size") as e:
        jzero.initialize(
            toy.make_params(),
            toy.loss_fn,
            optax.sgd(0.1),
            {
                "train_batch_size": 30,
                "train_micro_batch_size_per_gpu": 4,
                "zero_optimization": {"stage": 1},
            },
        )
    assert "30" in str(e.value) and "8" in str(e.value)


def test_wrong_batch_size_at_step_is_a_clear_error():
    engine = _engine(1)
    with pytest.raises(ValueError, match=r"Batch leaf 'x' has leading dim 16 but train_batch_size"):
        engine.train_step(toy.make_batches(1, 16)[0])


def test_too_many_devices_is_a_clear_error():
    with pytest.raises(ValueError, match=r"asks for 16 devices but only 8 cpu") as e:
        _engine(1, mesh={"data": 16})
    assert "--xla_force_host_platform_device_count=16" in str(e.value)
