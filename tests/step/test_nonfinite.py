"""Non-finite gradients at every precision: the ``nonfinite``/``skipped`` metrics, skipping a
step with every bit of the sharded state kept (float32 included), the config rule that decides
whether a run skips, and the ``lr`` metric left out when the learning rate is unknown."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from numerics import EPS

import jzero
from jzero.distributed import make_mesh
from jzero.engine.settings import precision as from_config
from jzero.plan import PlanOptions, make_plan
from jzero.plan.precision import Precision
from jzero.step import StepOptions, init_train_state, make_train_step

STAGE = 2  # gradients and optimizer state sharded: the skip must keep shards as they were
BATCH = 16
GOOD = toy.make_batches(3, BATCH)


def _poisoned(batch: dict) -> dict:
    bad = dict(batch, x=batch["x"].copy())
    bad["x"][0, 0] = np.nan
    return bad


BAD = _poisoned(toy.make_batches(1, BATCH, seed=7)[0])
POISONED = [GOOD[0], BAD, GOOD[1], GOOD[2]]  # the bad batch is step 2 of 4
BAD_STEP = 1


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


@functools.cache
def _stepper(skip: bool):
    """One plan and one jitted step per setting, reused by every run."""
    tx = optax.adam(1e-3)  # a plain optax optimizer: the learning rate is unknown to the step
    params = toy.make_params()
    plan = make_plan(
        params,
        tx,
        make_mesh({"data": 8}),
        STAGE,
        PlanOptions(precision=Precision(skip_nonfinite=skip)),
    )
    step = make_train_step(plan, toy.loss_fn, tx, StepOptions(gradient_clipping=1.0))
    return plan, tx, step


def _run(skip: bool, batches: list[dict], before_bad=None):
    plan, tx, step = _stepper(skip)
    state = init_train_state(plan, toy.make_params(), tx)
    metrics = []
    for b in batches:
        if before_bad is not None and b is BAD:
            before_bad.append(jax.device_get(state))  # a host copy: the step donates the state
        state, m = step(state, b)
        metrics.append(jax.device_get(m))
        if before_bad is not None and b is BAD:
            before_bad.append(jax.device_get(state))
    return state, metrics


def _series(metrics, key):
    return [float(m[key]) for m in metrics]


def test_float32_reports_nonfinite_gradients_without_skipping_by_default():
    state, metrics = _run(False, POISONED)
    nonfinite = _series(metrics, "nonfinite")
    # Without a skip the NaN update poisons the params, so every later step is non-finite too.
    assert nonfinite == [0.0, 1.0, 1.0, 1.0]
    assert _series(metrics, "skipped") == [0.0] * 4
    assert "loss_scale" not in metrics[0]  # only under mixed precision
    assert "lr" not in metrics[0]  # optax.adam(1e-3) does not tell the step its learning rate
    assert all(np.isnan(x).any() for x in jax.tree.leaves(jax.device_get(state.params)))
    assert int(state.step) == 4
    assert int(state.loss_scale.skipped) == 0 and int(state.loss_scale.nonfinite) == 3


def test_float32_skip_nonfinite_keeps_every_bit_of_the_sharded_state():
    snapshots: list = []
    state, metrics = _run(True, POISONED, before_bad=snapshots)
    ref_state, ref_metrics = _run(True, GOOD)  # the same three good batches, same order
    assert _series(metrics, "nonfinite") == [0.0, 1.0, 0.0, 0.0]
    assert _series(metrics, "skipped") == [0.0, 1.0, 0.0, 0.0]
    assert _series(ref_metrics, "skipped") == [0.0] * 3
    # The skipped step changed nothing: params (the masters in float32), optimizer state and
    # the step count are the bits they were before it.
    before, after = snapshots
    for field in ("step", "params", "opt_state"):
        assert _leaves_equal(getattr(before, field), getattr(after, field)), field
    assert int(after.loss_scale.skipped) == 1 and int(after.loss_scale.nonfinite) == 1
    # ...so the run is the run that never saw the bad batch, bit for bit.
    params = jax.device_get(state.params)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    assert _leaves_equal(state.params, ref_state.params)
    assert _leaves_equal(state.opt_state, ref_state.opt_state)
    assert int(state.step) == int(ref_state.step) == 3
    good = [m for i, m in enumerate(metrics) if i != BAD_STEP]
    assert _series(good, "loss") == _series(ref_metrics, "loss")
    assert int(state.loss_scale.skipped) == 1 and int(state.loss_scale.nonfinite) == 1
    # The state really is sharded at this stage.
    plan = _stepper(True)[0]
    sharded = [x for x in jax.tree.leaves(state.opt_state) if not x.sharding.is_fully_replicated]
    assert sharded and plan.stage.shard_grads


def _fake_config(*, bf16=False, fp16=False, top=None, bf16_skip=False, check=True, drop=()):
    """A real default config with the precision keys set, missing keys in ``drop``."""
    cfg = jzero.load_config({})
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    fields.update(
        skip_nonfinite=top,
        bf16=types.SimpleNamespace(
            enabled=bf16, skip_nonfinite=bf16_skip, check_grad_overflow=check
        ),
        fp16=dataclasses.replace(cfg.fp16, enabled=fp16),
    )
    for key in drop:
        if key.startswith("bf16."):
            delattr(fields["bf16"], key.removeprefix("bf16."))
        else:
            fields.pop(key)
    return types.SimpleNamespace(**fields)


@pytest.mark.parametrize(
    ("kwargs", "skips"),
    [
        # float32: only when asked for.
        ({}, False),
        ({"top": False}, False),
        ({"top": True}, True),
        ({"drop": ("skip_nonfinite",)}, False),
        # fp16: always.
        ({"fp16": True}, True),
        ({"fp16": True, "top": False}, True),
        # bf16: the top-level key when set, else bf16.skip_nonfinite or check_grad_overflow.
        ({"bf16": True}, True),
        ({"bf16": True, "check": False}, False),
        ({"bf16": True, "check": False, "bf16_skip": True}, True),
        ({"bf16": True, "top": False}, False),
        ({"bf16": True, "top": False, "bf16_skip": True}, False),
        ({"bf16": True, "top": True, "check": False}, True),
        ({"bf16": True, "drop": ("skip_nonfinite", "bf16.check_grad_overflow")}, True),
    ],
    ids=[
        "fp32-default",
        "fp32-top-false",
        "fp32-top-true",
        "fp32-no-key",
        "fp16-default",
        "fp16-top-false",
        "bf16-default",
        "bf16-check-off",
        "bf16-check-off-bf16-skip",
        "bf16-top-false",
        "bf16-top-false-bf16-skip",
        "bf16-top-true-check-off",
        "bf16-no-keys",
    ],
)
def test_from_config_decides_who_skips(kwargs, skips):
    prec = from_config(_fake_config(**kwargs))
    assert prec.skips is skips
    assert prec.mixed is bool(kwargs.get("bf16") or kwargs.get("fp16"))


def _config(**extra):
    return {
        "train_batch_size": BATCH,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": STAGE},
        **extra,
    }


def test_skip_nonfinite_from_the_config_in_float32_and_lr_from_a_config_optimizer():
    cfg = _config(skip_nonfinite=True, optimizer={"type": "AdamW", "params": {"lr": 2e-3}})
    engine = jzero.initialize(toy.make_params(), toy.loss_fn, config=cfg)
    assert engine.plan.options.precision.skips and not engine.plan.options.precision.mixed
    metrics = [jax.device_get(engine.train_step(b)) for b in POISONED]
    assert _series(metrics, "nonfinite") == [0.0, 1.0, 0.0, 0.0]
    assert _series(metrics, "skipped") == [0.0, 1.0, 0.0, 0.0]
    # The float32 rate: the config's 2e-3 rounded once, within one unit roundoff of it.
    assert all(float(m["lr"]) == pytest.approx(2e-3, rel=EPS["float32"], abs=0) for m in metrics)
    poisoned = jax.device_get(engine.state.params)
    # The same engine (same compiled step) from scratch on the good batches only.
    engine.state = init_train_state(engine.plan, toy.make_params(), engine.optimizer)
    for b in GOOD:
        engine.train_step(b)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(poisoned))
    assert _leaves_equal(poisoned, engine.state.params)
    assert int(engine.state.step) == 3


def test_bf16_skips_nonfinite_steps_by_default():
    engine = jzero.initialize(
        toy.make_params(), toy.loss_fn, optax.adamw(1e-3), _config(bf16={"enabled": True})
    )
    engine.train_step(GOOD[0])
    before = jax.device_get((engine.state.master, engine.state.params, engine.state.opt_state))
    m = jax.device_get(engine.train_step(BAD))
    assert float(m["nonfinite"]) == 1.0 and float(m["skipped"]) == 1.0
    assert float(m["loss_scale"]) == 1.0
    assert "lr" not in m
    after = (engine.state.master, engine.state.params, engine.state.opt_state)
    assert _leaves_equal(before, after)
    assert int(engine.state.step) == 1
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(engine.params)))
    m = jax.device_get(engine.train_step(GOOD[1]))
    assert float(m["nonfinite"]) == 0.0 and float(m["skipped"]) == 0.0
    assert engine.state.params["embed"].dtype == jnp.bfloat16
