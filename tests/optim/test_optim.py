"""Tests of the DeepSpeed optimizer / LR-schedule mapping against hand-written references.

The references below are written from DeepSpeed's and PyTorch's update rules (FusedAdam,
FusedLamb, FusedLion, torch.optim.SGD / Adagrad, deepspeed.runtime.lr_schedules), in NumPy and
plain Python, independently of jzero.optim.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numerics import EPS

import jzero
from jzero.config import ConfigError, JzeroConfigWarning, load_config
from jzero.optim import build_lr_schedule, build_optimizer, current_lr

P0 = np.array([0.5, -1.0, 2.0], np.float32)
GRADS = [np.array([0.1, -0.2, 0.3], np.float32), np.array([-0.3, 0.1, 0.2], np.float32)]


def run(optimizer, scheduler=None, steps=2):
    """Applies ``steps`` updates with GRADS; returns the parameters and the last state."""
    raw = {"optimizer": optimizer}
    if scheduler:
        raw["scheduler"] = scheduler
    tx = build_optimizer(load_config(raw))
    params = {"w": jnp.asarray(P0)}
    state = tx.init(params)
    for g in GRADS[:steps]:
        updates, state = tx.update({"w": jnp.asarray(g)}, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    return np.asarray(params["w"]), state


# The updates run in float32, as jzero runs them: its hyperparameters stay float32 whatever the
# parameter dtype (jzero/optim/builder.py), so float64 parameters would not remove their
# rounding. Against the float64 references (the config's exact constants) a float32 run is off
# by each parameter's own rounding, a few EPS of it per step (rtol), and by the constants'
# rounding where a rule uses 1 - b: b = 0.999 rounds to within EPS of itself, so 1 - b, the
# second moment and 1 - b**t are off by up to EPS / (1 - b) relative, and each step's update
# (lr times a coefficient of order ``update``) with them (atol). A wrong term or coefficient
# moves a parameter by a good part of lr, orders above both.
def tol(lr, b2=0.0, update=1.0, steps=2):
    f32 = EPS["float32"]
    return {"rtol": 4 * steps * f32, "atol": 4 * steps * lr * update * f32 / (1 - b2)}


# --- references --------------------------------------------------------------------------


def ref_fused_adam(lr, b1, b2, eps, wd, adamw=True, bias_correction=True, steps=2):
    p, m, v = P0.astype(np.float64), np.zeros(3), np.zeros(3)
    for t, g in enumerate(GRADS[:steps], start=1):
        g = g.astype(np.float64)
        if not adamw:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        update = (m / bc1) / (np.sqrt(v / bc2) + eps)
        if adamw:
            update = update + wd * p
        p = p - lr * update
    return p


def ref_fused_lamb(lr, b1, b2, eps, wd, max_coeff, min_coeff, steps=2):
    p, m, v = P0.astype(np.float64), np.zeros(3), np.zeros(3)
    for t, g in enumerate(GRADS[:steps], start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        update = m / (np.sqrt(v) + eps) + wd * p
        w_norm, u_norm = np.linalg.norm(p), np.linalg.norm(update)
        coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
        p = p - step_size * coeff * update
    return p


def ref_torch_sgd(lr, momentum, dampening, wd, nesterov, steps=2):
    p, buf = P0.astype(np.float64), None
    for g in GRADS[:steps]:
        g = g + wd * p
        buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
        d = g + momentum * buf if nesterov else buf
        p = p - lr * d
    return p


def ref_torch_adagrad(lr, lr_decay, wd, init_acc, eps, steps=2):
    p, acc = P0.astype(np.float64), np.full(3, init_acc)
    for step, g in enumerate(GRADS[:steps], start=1):
        g = g + wd * p
        clr = lr / (1 + (step - 1) * lr_decay)
        acc = acc + g * g
        p = p - clr * g / (np.sqrt(acc) + eps)
    return p


def ref_fused_lion(lr, b1, b2, wd, steps=2):
    p, m = P0.astype(np.float64), np.zeros(3)
    for g in GRADS[:steps]:
        c = b1 * m + (1 - b1) * g
        p = p * (1 - lr * wd) - lr * np.sign(c)
        m = b2 * m + (1 - b2) * g
    return p


# --- optimizers --------------------------------------------------------------------------


def test_adam_is_adamw_by_default():
    params = {"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1}
    got, state = run({"type": "Adam", "params": params})
    np.testing.assert_allclose(got, ref_fused_adam(0.01, 0.8, 0.9, 1e-6, 0.1), **tol(0.01, 0.9))
    # A float32 hyperparameter: the constant rounded once, within EPS of it.
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.01, rel=EPS["float32"])


def test_adam_l2_mode_adds_decay_to_the_gradient():
    params = {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}
    got, _ = run({"type": "adam", "params": params})
    want = ref_fused_adam(0.01, 0.9, 0.999, 1e-8, 0.1, adamw=False)
    np.testing.assert_allclose(got, want, **tol(0.01, 0.999))
    assert not np.allclose(want, ref_fused_adam(0.01, 0.9, 0.999, 1e-8, 0.1))


def test_adamw_without_bias_correction():
    params = {"lr": 0.02, "weight_decay": 0.05, "bias_correction": False}
    got, _ = run({"type": "ADAMW", "params": params})
    want = ref_fused_adam(0.02, 0.9, 0.999, 1e-8, 0.05, bias_correction=False)
    # Without bias correction m / sqrt(v) is up to (1 - b1) / sqrt(1 - b2) = 3.2 per step.
    np.testing.assert_allclose(got, want, **tol(0.02, 0.999, update=3.2))


@pytest.mark.parametrize("max_coeff", [10.0, 0.5])  # 0.5 clamps the trust ratio
def test_lamb_matches_fused_lamb(max_coeff):
    params = {"lr": 0.01, "weight_decay": 0.01, "max_coeff": max_coeff}
    got, _ = run({"type": "Lamb", "params": params})
    want = ref_fused_lamb(0.01, 0.9, 0.999, 1e-8, 0.01, max_coeff, 0.01)
    # The trust ratio scales the update to the parameters' norm (about 2.3 here), or less.
    np.testing.assert_allclose(got, want, **tol(0.01, 0.999, update=2.5))


@pytest.mark.parametrize(
    ("momentum", "dampening", "nesterov"), [(0.0, 0.0, False), (0.9, 0.5, False), (0.9, 0.0, True)]
)
def test_sgd_matches_torch(momentum, dampening, nesterov):
    params = {"lr": 0.1, "momentum": momentum, "dampening": dampening, "nesterov": nesterov}
    got, _ = run({"type": "SGD", "params": {**params, "weight_decay": 0.01}})
    want = ref_torch_sgd(0.1, momentum, dampening, 0.01, nesterov)
    # The update: the gradient plus up to 2 x 0.9 of the buffer, under 1.
    np.testing.assert_allclose(got, want, **tol(0.1))


def test_adagrad_matches_torch():
    params = {"lr": 0.1, "lr_decay": 0.5, "weight_decay": 0.01, "initial_accumulator_value": 0.1}
    got, _ = run({"type": "Adagrad", "params": params})
    want = ref_torch_adagrad(0.1, 0.5, 0.01, 0.1, 1e-10)
    np.testing.assert_allclose(got, want, **tol(0.1))  # g / sqrt(acc): under 1


def test_lion_matches_fused_lion():
    params = {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1}
    got, _ = run({"type": "Lion", "params": params})
    np.testing.assert_allclose(got, ref_fused_lion(0.01, 0.9, 0.99, 0.1), **tol(0.01))  # sign


def test_deepspeed_defaults_are_used():
    got, state = run({"type": "AdamW", "params": {}})  # lr 1e-3, betas (0.9, 0.999), eps 1e-8
    np.testing.assert_allclose(got, ref_fused_adam(1e-3, 0.9, 0.999, 1e-8, 0.0), **tol(1e-3, 0.999))
    assert float(state.hyperparams["b2"]) == pytest.approx(0.999, rel=EPS["float32"])


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Lamb", "SGD", "Adagrad", "Lion"])
def test_update_jits_once_and_keeps_state_dtypes(name):
    params_cfg = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.1}
    tx = build_optimizer(load_config({"optimizer": {"type": name, "params": params_cfg}}))
    params = {"w": jnp.asarray(P0, jnp.bfloat16)}
    update = jax.jit(tx.update)
    state = first = tx.init(params)
    for g in GRADS:
        _, state = update({"w": jnp.asarray(g, jnp.bfloat16)}, state, params)
    assert update._cache_size() == 1
    assert jax.tree.map(lambda a: a.dtype, state) == jax.tree.map(lambda a: a.dtype, first)
    assert state.hyperparams["learning_rate"].dtype == jnp.float32


# --- schedules: DeepSpeed's formulas, as a function of last_batch_iteration ----------------


def ds_warmup_gamma(it, warm, kind):
    warm = max(2, warm)
    if it < warm:
        return math.log(it + 1) / math.log(warm) if kind == "log" else it / warm
    return None


def ds_warmup_lr(it, lo, hi, warm, kind):
    if it < 0:
        return lo
    gamma = ds_warmup_gamma(it, warm, kind)
    return lo + (hi - lo) * (1.0 if gamma is None else gamma)


def ds_warmup_decay_lr(it, total, lo, hi, warm, kind):
    if it < 0:
        return lo
    gamma = ds_warmup_gamma(it, warm, kind)
    if gamma is None:
        w = max(2, warm)
        gamma = max(0.0, (total - it) / max(1.0, total - w))
    return lo + (hi - lo) * gamma


def ds_warmup_cosine_lr(it, base, total, wmin, warm, cmin, kind):
    if it < 0:
        return 0.0
    w = max(2, warm)
    if it < w:
        return base * (wmin + ds_warmup_gamma(it, warm, kind) * (1 - wmin))
    progress = min(1.0, (it - w + 1) / max(1, total - w))
    return base * max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * progress)) / 2)


def ds_one_cycle_scale(it, first, second, stairs):
    total, batch = first + second, it + 1
    ratio = first / total
    cycle = math.floor(1 + batch / total)
    x = 1.0 + batch / total - cycle
    scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
    if stairs > 0:
        pos = batch % total
        pos = pos * stairs / first if pos <= first else (total - pos) * stairs / second
        scale = math.floor(pos) / stairs
    return scale


def ds_one_cycle_lr(it, lo, hi, first, second, stairs, decay_rate, decay_size):
    if it < 0:
        return lo
    if it < first + second:
        return lo + (hi - lo) * ds_one_cycle_scale(it, first, second, stairs)
    if decay_rate == 0 or decay_size == 0:
        return lo
    return lo / (1 + decay_rate * (it - first - second + 1) / decay_size)


def ds_one_cycle_mom(it, lo, hi, first, second):
    if it < 0:
        return lo
    if it < first + second:
        return hi - (hi - lo) * ds_one_cycle_scale(it, first, second, 0)
    return hi  # decay_mom_rate 0


STEPS = [0, 1, 2, 5, 9, 10, 11, 17, 30, 40, 55]
# The schedules compute in float32 from the step (jzero/optim/lr_schedules.py): a handful of
# operations (the iteration, a log or cos, a ratio, a product and a sum), each rounding to EPS
# relative, whose errors a sum lo + (hi - lo) * g can amplify a few times: 32 EPS (measured up
# to 7). ``abs`` only matters where the rate is 0.
SCHEDULE_TOL = {"rel": 32 * EPS["float32"], "abs": 1e-9}


def check_schedule(scheduler, reference, optimizer_lr=0.5):
    cfg = load_config(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": optimizer_lr}},
            "scheduler": scheduler,
        }
    )
    schedule = jax.jit(build_lr_schedule(cfg))
    for k in STEPS:
        # Update k uses DeepSpeed's rate after k scheduler.step() calls: iteration k - 1.
        want = reference(k - 1)
        assert float(schedule(jnp.int32(k))) == pytest.approx(want, **SCHEDULE_TOL), k
        assert float(current_lr(cfg, k)) == pytest.approx(want, **SCHEDULE_TOL), k


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    p = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": kind}
    check_schedule(
        {"type": "WarmupLR", "params": p}, lambda it: ds_warmup_lr(it, 0.01, 0.1, 10, kind)
    )


def test_warmup_lr_defaults_to_the_optimizer_lr():
    p = {"warmup_num_steps": 20}
    check_schedule(
        {"type": "WarmupLR", "params": p}, lambda it: ds_warmup_lr(it, 0.0, 0.5, 20, "log")
    )


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    p = {"total_num_steps": 40, "warmup_max_lr": 0.2, "warmup_num_steps": 10, "warmup_type": kind}
    check_schedule(
        {"type": "WarmupDecayLR", "params": p},
        lambda it: ds_warmup_decay_lr(it, 40, 0.0, 0.2, 10, kind),
    )


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind):
    p = {
        "total_num_steps": 40,
        "warmup_min_ratio": 0.1,
        "warmup_num_steps": 10,
        "cos_min_ratio": 0.05,
        "warmup_type": kind,
    }
    check_schedule(
        {"type": "WarmupCosineLR", "params": p},
        lambda it: ds_warmup_cosine_lr(it, 0.5, 40, 0.1, 10, 0.05, kind),
    )


@pytest.mark.parametrize(
    ("second", "stairs", "decay_rate", "decay_size"),
    [(None, 0, 0.0, 0), (6, 0, 0.5, 4), (12, 3, 0.0, 0)],
)
def test_one_cycle_lr(second, stairs, decay_rate, decay_size):
    p = {
        "cycle_min_lr": 0.01,
        "cycle_max_lr": 0.1,
        "cycle_first_step_size": 12,
        "cycle_second_step_size": second,
        "cycle_first_stair_count": stairs,
        "decay_lr_rate": decay_rate,
        "decay_step_size": decay_size,
    }
    snd = 12 if second is None else second
    check_schedule(
        {"type": "OneCycle", "params": p},
        lambda it: ds_one_cycle_lr(it, 0.01, 0.1, 12, snd, stairs, decay_rate, decay_size),
    )


def test_one_cycle_cycles_beta1_and_sets_beta2():
    p = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}
    tx = build_optimizer(
        load_config({"optimizer": {"type": "Adam"}, "scheduler": {"type": "OneCycle", "params": p}})
    )
    params = {"w": jnp.asarray(P0)}
    state = tx.init(params)
    for k in range(12):
        _, state = tx.update({"w": jnp.asarray(GRADS[0])}, state, params)
        b1, b2 = float(state.hyperparams["b1"]), float(state.hyperparams["b2"])
        assert b1 == pytest.approx(ds_one_cycle_mom(k - 1, 0.8, 0.9, 4, 4), **SCHEDULE_TOL), k
        assert b2 == pytest.approx(0.99, rel=EPS["float32"])
        lr = float(state.hyperparams["learning_rate"])
        want = ds_one_cycle_lr(k - 1, 0.01, 0.1, 4, 4, 0, 0, 0)
        assert lr == pytest.approx(want, **SCHEDULE_TOL)


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    p = {
        "lr_range_test_min_lr": 0.01,
        "lr_range_test_step_size": 4,
        "lr_range_test_step_rate": 2.0,
        "lr_range_test_staircase": staircase,
    }

    def ref(it):
        interval = (it + 1) / 4
        return 0.01 * (1 + 2.0 * (math.floor(interval) if staircase else interval))

    check_schedule({"type": "LRRangeTest", "params": p}, ref)


def test_constant_lr_without_scheduler():
    cfg = load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.25}}})
    assert float(current_lr(cfg, 7)) == 0.25
    assert float(current_lr(build_lr_schedule(cfg), jnp.int32(3))) == 0.25


# --- errors ------------------------------------------------------------------------------


def error_of(raw):
    with pytest.raises(ConfigError) as info:
        build_optimizer(load_config(raw, ()))
    return str(info.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"optimizer": {"type": "MuAdam"}},  # the 1-bit ones: tests/config/test_config_ds_accept
            "optimizer.type: 'MuAdam' is not a supported optimizer; it must be one of Adam, "
            "AdamW, Lamb, SGD, Adagrad, Lion, Muon (case-insensitive).",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"beta": [0.9, 0.99]}}},
            "optimizer.params.beta is not a parameter of AdamW (did you mean 'betas'?); the "
            "allowed parameters are lr, betas, eps, weight_decay, bias_correction, adam_w_mode, "
            "torch_adam, amsgrad, state_bits.",
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"max_grad_norm": 1.0}}},
            "optimizer.params.max_grad_norm is not an optimizer parameter (in DeepSpeed neither); "
            "set the top-level gradient_clipping instead.",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
            "optimizer.params.amsgrad: true is not supported (DeepSpeed's fused optimizers refuse "
            "it too); set it to false or remove it.",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": 0.9}}},
            "optimizer.params.betas: 0.9 is not allowed; it must be a list of two numbers, e.g. "
            "[0.9, 0.999].",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"lr": "fast"}}},
            "optimizer.params.lr: 'fast' is not allowed; it must be a number.",
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"nesterov": True}}},
            "optimizer.params.nesterov: true needs momentum > 0 and dampening 0 (as in "
            "torch.optim.SGD); set momentum and remove dampening, or set nesterov: false.",
        ),
        (
            {"scheduler": {"type": "StepLR"}},
            "scheduler.type: 'StepLR' is not a supported LR schedule; it must be one of "
            "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.",
        ),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
            "scheduler.params.total_num_steps is required by WarmupDecayLR; set it.",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
            "scheduler.params.warmup_type: 'cosine' is not allowed; it must be one of 'log', "
            "'linear'.",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}},
            "scheduler.params.warmup_num_step is not a parameter of WarmupLR (did you mean "
            "'warmup_num_steps'?); the allowed parameters are warmup_min_lr, warmup_max_lr, "
            "warmup_num_steps, warmup_type, last_batch_iteration.",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
            "scheduler.params.warmup_num_steps: 0 is not allowed; it must be a positive integer.",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 99}}},
            "scheduler.params.last_batch_iteration: 99 is not allowed; jzero resumes the "
            "schedule from the checkpoint's step, so remove it.",
        ),
    ],
)
def test_config_errors_are_raised_at_load(raw, message):
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert str(info.value) == message


def test_build_optimizer_needs_an_optimizer_section():
    assert error_of({}) == (
        "The config has no optimizer section, so there is no learning rate; add e.g. "
        "optimizer: {type: AdamW, params: {lr: 3.0e-4}}."
    )


def test_explicit_cycle_momentum_without_betas_warns():
    raw = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "scheduler": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_momentum": True},
        },
    }
    with pytest.warns(JzeroConfigWarning) as record:
        build_optimizer(load_config(raw))
    assert str(record[0].message) == (
        "scheduler.params.cycle_momentum: true has no effect with SGD, which has no betas "
        "(DeepSpeed disables it too); set it to false."
    )


def test_a_mask_that_leaves_out_a_whole_leaf_trains_at_every_stage():
    """``optax.masked`` with a leaf masked out entirely: its state holds an ``optax.MaskedNode``
    there, which the plan keeps as it is (it once broke the optimizer-state layout). In float64:
    every stage must compute the optax loop's losses and gradient norms (Adam hides a
    gradient's scale from the losses)."""
    with jax.enable_x64(True):
        params = {"a": jnp.ones((8, 4), jnp.float64), "b": jnp.full((8,), 0.5, jnp.float64)}
        tx = optax.masked(optax.adam(1e-2), {"a": True, "b": False})

        def loss(p, b):
            return jnp.mean((b["x"] @ p["a"].T) ** 2) + jnp.sum(p["b"] ** 2)

        batch = {"x": jnp.arange(32.0, dtype=jnp.float64).reshape(8, 4) / 32}

        @jax.jit
        def ref_step(p, s):
            value, grads = jax.value_and_grad(loss)(p, batch)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value, optax.global_norm(grads)

        ref_p, ref_s, want, want_norms = params, tx.init(params), [], []
        for _ in range(2):
            ref_p, ref_s, value, norm = ref_step(ref_p, ref_s)
            want.append(float(value))
            want_norms.append(float(norm))
        # Replicated (0) and sharded (3) state; stages 1-2 lay the state out like 3.
        for stage in (0, 3):
            cfg = {
                "train_batch_size": 8,
                "gradient_clipping": 0.0,
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            }
            e = jzero.initialize(params, loss, tx, cfg)
            metrics = [e.train_step(batch) for _ in range(2)]
            got = [float(m["loss"]) for m in metrics]
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=0)
            norms = [float(m["grad_norm"]) for m in metrics]
            np.testing.assert_allclose(norms, want_norms, rtol=1e-10, atol=0)
