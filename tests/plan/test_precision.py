"""Mixed precision: bf16/fp16 compute from float32 master weights kept in the optimizer's
shards, DeepSpeed's loss scaling, and the communication and accumulation dtypes."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from numerics import EPS, needs_float16

import jzero
from jzero.engine import settings
from jzero.hlo import collectives, program_text
from jzero.plan import PlanOptions, host_state_bytes, model_state_bytes
from jzero.step import logical_view

STAGES = (0, 1, 2, 3)
N = 8
BATCH = 32


def config(stage, accum=1, **extra):
    return {
        "train_batch_size": BATCH,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


def engine(stage, accum=1, params=None, loss=toy.loss_fn, lr=1e-2, **extra):
    params = toy.make_params() if params is None else params
    return jzero.initialize(params, loss, optax.adamw(lr), config(stage, accum, **extra))


TRACK = toy.make_batches(2, BATCH) * 10  # 20 steps that the model can fit


@functools.cache
def fp32_losses():
    e = engine(0)
    metrics = [e.train_step(b) for b in TRACK]
    FIRST_NORMS["fp32"] = float(metrics[0]["grad_norm"])
    return [float(m["loss"]) for m in metrics]


FIRST_NORMS = {}  # each cached run's first grad_norm


@functools.cache
def bf16_run(stage):
    e = engine(stage, bf16={"enabled": True})
    metrics = [e.train_step(b) for b in TRACK]
    FIRST_NORMS[stage] = float(metrics[0]["grad_norm"])
    return e, [float(m["loss"]) for m in metrics]


@functools.cache
def float64_first_norm():
    """optax's global norm of the toy's float64 gradient on TRACK's first batch."""
    with jax.enable_x64(True):
        batch = jax.tree.map(lambda x: np.asarray(x, np.float64), TRACK[0])
        grads = jax.grad(toy.loss_fn)(toy.make_params(dtype=jnp.float64), batch)
        return float(optax.global_norm(grads))


# Masters whole (0), sharded with whole 16-bit params (2; stage 1 lays them out alike and
# differs only in the gradient reduction: its float32 masters train the GPT in
# test_master16.py::test_bf16_masters_train_the_gpt_like_fp32_masters), sharded with sharded
# params (3).
@pytest.mark.rounding
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_tracks_float32_with_float32_masters_in_the_optimizer_shards(stage):
    e, losses = bf16_run(stage)
    ref = fp32_losses()
    assert losses[-1] < 0.7 * losses[0]  # it trains
    # The final loss comes from a forward that rounds each activation to bf16 about 8 times
    # (embedding, 4 layers, head, the odd term), each within EPS relative, evaluating float32
    # masters that track the float32 run's (bf16 gradients only perturb Adam's normalised
    # steps): within 8 EPS (3.1%; measured 0.5%).
    assert abs(losses[-1] - ref[-1]) / ref[-1] < 8 * EPS["bfloat16"]
    assert losses != ref  # the forward really ran in bfloat16
    # Clipping (1.0) and Adam hide a gradient's scale from the losses: the first grad_norm is
    # the float64 gradient's, within 16 unit roundoffs (the toy rounds each gradient's path
    # about 16 times, tests/step/test_parity.py). A gradient x2 is 100% off.
    first = float64_first_norm()
    assert FIRST_NORMS[stage] == pytest.approx(first, rel=16 * EPS["bfloat16"], abs=0)
    assert FIRST_NORMS["fp32"] == pytest.approx(first, rel=16 * EPS["float32"], abs=0)
    plan = e.plan
    for p, m, sp, sm, su in zip(
        jax.tree.leaves(e.state.params),
        jax.tree.leaves(e.state.master),
        jax.tree.leaves(plan.params),
        jax.tree.leaves(plan.master),
        jax.tree.leaves(plan.update_layout),
        strict=True,
    ):
        assert p.dtype == jnp.bfloat16 and m.dtype == jnp.float32
        assert m.sharding == sm == su  # masters are laid out like the optimizer state
        assert p.sharding == sp
    # The 16-bit params are exactly the rounded masters (at their logical shapes: the masters
    # may rest padded or merged, jzero.plan.padding).
    view = logical_view(plan, e.state)
    for p, m in zip(jax.tree.leaves(view.params), jax.tree.leaves(view.master), strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m).astype(jnp.bfloat16))
    mu = e.state.opt_state[0].mu
    for m, om in zip(jax.tree.leaves(e.state.master), jax.tree.leaves(mu), strict=True):
        assert om.dtype == jnp.float32 and om.sharding == m.sharding


def _divisible_params():
    rng = np.random.default_rng(0)
    return {
        "embed": jnp.asarray(rng.normal(size=(16, 64)) * 0.1, jnp.float32),
        "blocks": {"w": jnp.asarray(rng.normal(size=(4, 64, 64)) * 0.1, jnp.float32)},
        "head": jnp.asarray(rng.normal(size=(64, 8)) * 0.1, jnp.float32),
    }


@pytest.mark.parametrize("stage", STAGES)
def test_per_device_bytes_equal_the_k12_formulas(stage):
    params = _divisible_params()
    psi = sum(x.size for x in jax.tree.leaves(params))
    cfg = config(stage, bf16={"enabled": True})
    tx = optax.adam(1e-3)
    plan = jzero.make_plan(
        params,
        tx,
        jzero.make_mesh({"data": N}),
        stage,
        PlanOptions().replace(
            persistence_threshold=0, precision=settings.precision(jzero.load_config(cfg))
        ),
    )
    formula = {0: 16 * psi, 1: 4 * psi + 12 * psi / N, 2: 2 * psi + 14 * psi / N, 3: 16 * psi / N}
    count = 4  # Adam's step count, a replicated int32
    assert sum(model_state_bytes(plan).values()) == formula[stage] + count
    assert not any(host_state_bytes(plan).values())


def test_compiled_arguments_match_the_plan_under_bf16():
    # What the compiled step takes as arguments (params, masters, moments) is what the plan says.
    for stage in (2, 3):  # the cached runs above: whole and sharded params
        e, _ = bf16_run(stage)
        b = toy.make_batches(1, BATCH)[0]
        exe = e.lower(b).compile()
        mb = model_state_bytes(e.plan)
        scalars = 4 + 5 * 4  # step and the loss-scale state
        batch = sum(x.nbytes for x in b.values()) // N
        expect = mb["params"] + mb["master_params"] + mb["opt_state"] + scalars + batch
        assert exe.memory_analysis().argument_size_in_bytes == expect


def _deepspeed_scaler(overflows, steps, init, window, hysteresis, min_scale):
    """DeepSpeed's dynamic loss scaler as its docs describe it, written independently."""
    scale, cur_hyst, last_overflow, out = init, hysteresis, -1, []
    for it in range(steps):
        out.append(scale)
        if it in overflows:
            if cur_hyst == 1:
                scale = max(scale / 2, min_scale)
            else:
                cur_hyst -= 1
            last_overflow = it
        elif (it - last_overflow) % window == 0:
            cur_hyst = hysteresis
            scale *= 2
    return out


@pytest.mark.rounding
@needs_float16
def test_fp16_skips_overflowing_steps_and_follows_the_scale_schedule():
    overflow = {1, 3, 4, 9}  # 0-based steps whose batch makes the loss overflow
    steps = 14
    fp16 = {
        "enabled": True,
        "initial_scale_power": 6,
        "loss_scale_window": 3,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    e = engine(2, fp16=fp16)
    batches = toy.make_batches(steps, BATCH)
    expected_scale = _deepspeed_scaler(overflow, steps, 64.0, 3, 2, 1.0)
    applied = 0
    for i, b in enumerate(batches):
        if i in overflow:
            b = dict(b, x=b["x"].copy())
            b["x"][0, 0] = np.inf
        before = jax.tree.map(np.asarray, (e.state.params, e.state.master, e.state.opt_state))
        m = e.train_step(b)
        assert float(m["loss_scale"]) == expected_scale[i], i
        assert float(m["skipped"]) == float(i in overflow)
        after = jax.tree.map(np.asarray, (e.state.params, e.state.master, e.state.opt_state))
        same = [
            np.array_equal(x, y)
            for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
        ]
        if i in overflow:
            assert all(same), f"step {i} overflowed but the state changed"
        else:
            applied += 1
            # Every weight moved, 16-bit params and masters alike (Adam's step count in the
            # optimizer state changes on any applied step, so it proves nothing).
            weights = jax.tree.leaves((before[0], before[1])), jax.tree.leaves((after[0], after[1]))
            assert not any(np.array_equal(x, y) for x, y in zip(*weights, strict=True)), i
        assert int(e.state.step) == applied  # the schedule's step does not advance on a skip
    assert int(e.state.loss_scale.skipped) == len(overflow)
    assert float(m["loss"]) < 1.2  # and it still trains in fp16


@needs_float16
def test_fp16_static_loss_scale_never_changes():
    e = engine(1, fp16={"enabled": True, "loss_scale": 128})
    for b in toy.make_batches(3, BATCH):
        m = e.train_step(b)
        assert float(m["loss_scale"]) == 128 and float(m["skipped"]) == 0


@pytest.mark.parametrize("skip", [False, True])
def test_bf16_nonfinite_steps_are_counted_and_optionally_skipped(skip):
    # check_grad_overflow (default true, as in DeepSpeed 0.19) skips too: off to apply the step.
    e = engine(1, bf16={"enabled": True, "skip_nonfinite": skip, "check_grad_overflow": skip})
    good, bad = toy.make_batches(2, BATCH)
    bad = dict(bad, x=bad["x"].copy())
    bad["x"][0, 0] = np.nan
    e.train_step(good)
    before = np.asarray(e.state.master["embed"])
    m = e.train_step(bad)
    assert float(m["nonfinite"]) == 1 and float(m["skipped"]) == float(skip)
    assert int(e.state.loss_scale.nonfinite) == 1
    unchanged = np.array_equal(before, np.asarray(e.state.master["embed"]))
    assert unchanged == skip


def _collective_bytes(stage, comm, compute="bf16"):
    extra = {"communication_data_type": comm}
    if compute == "bf16":
        extra["bf16"] = {"enabled": True}
    e = engine(stage, **extra)
    stats = collectives(program_text(e.lower(toy.make_batches(1, BATCH)[0])))
    return {k: s.bytes for k, s in stats.items()}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_communication_halves_the_collective_bytes(stage):
    wide, narrow = _collective_bytes(stage, "fp32"), _collective_bytes(stage, "bf16")
    # Gradient reductions (the scalar metrics' all-reduces aside) move half the bytes.
    grads = "all-reduce" if stage == 0 else "reduce-scatter"
    assert wide[grads] > 1000
    assert narrow[grads] == pytest.approx(wide[grads] / 2, abs=64)
    if stage in (1, 2):
        assert narrow["all-gather"] == wide["all-gather"] / 2
    if stage == 3:  # stage 3 gathers the 16-bit params it holds, whatever the setting
        assert narrow["all-gather"] == wide["all-gather"]


def test_grad_accum_dtype_sets_the_accumulator():
    bf16 = {"enabled": True}
    wide = engine(2, accum=2, bf16=bf16)
    narrow = engine(2, accum=2, bf16=bf16, data_types={"grad_accum_dtype": "bf16"})
    assert (
        model_state_bytes(wide.plan, 2)["grads"] == 2 * model_state_bytes(narrow.plan, 2)["grads"]
    )
    b = toy.make_batches(1, BATCH)[0]

    # The accumulation loop carries float32 gradient shards by default, bf16 when asked: the
    # 4-layer stack's shard of 32 rows (4 layers x 64 rows rest merged, 1/8 each).
    def loop_carries(e):
        text = e.lower(b).as_text()
        return " ".join(line for line in text.splitlines() if "stablehlo.while" in line)

    wide_loop, narrow_loop = loop_carries(wide), loop_carries(narrow)
    assert "tensor<32x64xf32>" in wide_loop and "tensor<32x64xbf16>" not in wide_loop
    assert "tensor<32x64xbf16>" in narrow_loop and "tensor<32x64xf32>" not in narrow_loop


def test_both_precisions_at_once_is_an_error():
    with pytest.raises(ValueError, match="fp16.enabled and bf16.enabled are both true"):
        engine(0, bf16={"enabled": True}, fp16={"enabled": True})


def test_model_state_keys_under_mixed_precision():
    e, _ = bf16_run(2)
    mb = model_state_bytes(e.plan)
    assert set(mb) == {"params", "grads", "master_params", "opt_state"}
    psi_bytes = sum(math.prod(x.shape) for x in jax.tree.leaves(e.plan.abstract_params))
    assert mb["params"] == 2 * psi_bytes  # 16-bit params, whole at stage 2


def test_stage3_gathers_16_bit_params_even_when_the_model_upcasts_them():
    def upcasting_loss(params, batch):
        return toy.loss_fn(jax.tree.map(lambda x: x.astype(jnp.float32), params), batch)

    b = toy.make_batches(1, BATCH)[0]
    gathered = {}
    for name, loss in (("bf16", toy.loss_fn), ("upcast", upcasting_loss)):
        e = engine(3, loss=loss, bf16={"enabled": True})
        gathered[name] = collectives(program_text(e.lower(b)))["all-gather"].bytes
    assert gathered["upcast"] == gathered["bf16"]
