"""``bf16: {enabled: true, bf16_master_weights_and_grads: true}``: the bfloat16 params are the
master weights (no float32 copy), updated in float32 and rounded back to bfloat16 in their
shards, to nearest or with ``stochastic_rounding``; bytes at rest, checkpoints, skipped steps
and training against the fp32-master run."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy

import jzero
from jzero.config import ConfigError, load_config
from jzero.demo import data, gpt
from jzero.engine import settings
from jzero.hlo import collectives_by_dtype, program_text
from jzero.optim import float32_update, low_precision_state, stochastic_round
from jzero.optim.master16 import apply_rounded, rounding_key
from jzero.plan import PlanOptions, model_state_bytes, to_logical
from jzero.step import init_train_state, make_gradient_step, make_train_step, streamed_groups

N = 8
BATCH = 16
BF16, F32 = jnp.dtype("bfloat16"), jnp.dtype("float32")


def bf16(masters=True, states=False, rounding=False, **extra):
    section = {"enabled": True, "bf16_master_weights_and_grads": masters}
    if states:
        section["bf16_optimizer_states"] = True
    if rounding:
        section["stochastic_rounding"] = True
    return {"bf16": {**section, **extra}}


# --- stochastic rounding itself ------------------------------------------------------------


def _neighbours(x):
    """The bfloat16 values at or below and above float32 ``x`` in magnitude, as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    lo = (bits & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    hi = ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32).astype(np.float64)
    return lo, hi


def test_stochastic_rounding_is_unbiased_and_returns_a_neighbour():
    rng = np.random.default_rng(0)
    # Values spread over magnitudes and signs, none a bfloat16 (their low 16 bits are random
    # and not zero), plus ones just above a bfloat16 and just below the next (p near 0 and 1).
    x = (rng.normal(size=24) * 10.0 ** rng.integers(-6, 6, size=24)).astype(np.float32)
    low = rng.integers(1, 1 << 16, size=24).astype(np.uint32)
    x = ((x.view(np.uint32) & np.uint32(0xFFFF0000)) | low).view(np.float32)
    x = np.concatenate([x, [1.0 + 2.0**-20, 1.0 + 2.0**-7 - 2.0**-20, -3.0 - 2.0**-12]])
    x = x.astype(np.float32)
    samples = 20_000
    wide = jnp.asarray(np.repeat(x[:, None], samples, axis=1))
    out = np.asarray(jax.jit(stochastic_round)(wide, jax.random.key(3)).astype(jnp.float32))
    out = out.astype(np.float64)
    lo, hi = _neighbours(x)
    # Only ever one of the two neighbouring bfloat16 values.
    assert np.all((out == lo[:, None]) | (out == hi[:, None]))
    # Unbiased: each sample is lo + ulp * Bernoulli(p), p = (x - lo) / ulp, so the mean of
    # `samples` of them is x in expectation with standard deviation ulp * sqrt(p (1 - p) / n)
    # (binomial). Six standard deviations (plus float64 slack for p near 0 or 1) is a bound
    # a correct rounding exceeds with probability ~1e-9 per value; rounding to nearest is off
    # by ulp x min(p, 1 - p), about sqrt(n) = 141 standard deviations at p = 1/2.
    ulp = hi - lo
    p = (x.astype(np.float64) - lo) / ulp
    assert np.all((p > 0) & (p < 1))
    sd = np.abs(ulp) * np.sqrt(p * (1 - p) / samples)  # ulp < 0 for negative x
    err = np.abs(out.mean(axis=1) - x.astype(np.float64))
    assert np.all(err <= 6 * sd + 1e-12 * np.abs(x)), (err / sd).max()
    # and the fraction rounded up is p, within the same binomial bound
    up = (out == hi[:, None]).mean(axis=1)
    assert np.all(np.abs(up - p) <= 6 * np.sqrt(p * (1 - p) / samples) + 1e-9)
    nearest = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    assert np.sum(np.abs(nearest - x) > 20 * sd) > 20  # the bound tells nearest from stochastic


def test_stochastic_rounding_keeps_bfloat16_values_and_special_ones():
    values = [0.0, -0.0, 1.0, -2.5, 3.0e38, 2.0**-130, np.inf, -np.inf]
    exact = jnp.asarray(values, jnp.bfloat16).astype(jnp.float32)  # each a bfloat16 value
    wide = jnp.tile(exact, (512, 1))
    out = stochastic_round(wide, jax.random.key(0))
    assert out.dtype == BF16
    np.testing.assert_array_equal(
        np.asarray(out.astype(jnp.float32)).view(np.uint32),
        np.asarray(wide.astype(jnp.bfloat16).astype(jnp.float32)).view(np.uint32),
    )
    nan = stochastic_round(jnp.full((512,), jnp.nan, jnp.float32), jax.random.key(1))
    assert bool(jnp.all(jnp.isnan(nan)))
    # The bits depend only on the key: the same key rounds the same way, another one does not.
    x = jnp.full((4096,), 1.0 + 2.0**-9, jnp.float32)  # p = 1/2
    a, b = stochastic_round(x, rounding_key(5, 0)), stochastic_round(x, rounding_key(5, 0))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(stochastic_round(x, rounding_key(6, 0))))
    assert not np.array_equal(np.asarray(a), np.asarray(stochastic_round(x, rounding_key(5, 1))))
    with pytest.raises(ValueError, match="to bfloat16, not to float16"):
        stochastic_round(x, rounding_key(0, 0), jnp.float16)


def test_float32_update_runs_the_inner_optimizer_on_upcast_params():
    params = {"w": jnp.asarray([[1.0, 2.0], [3.0, -4.0]], jnp.bfloat16)}
    grads = {"w": jnp.asarray([[0.5, -0.25], [1e-3, 2.0]], jnp.bfloat16)}
    inner = optax.adamw(1e-3, weight_decay=0.1)
    tx = float32_update(inner)
    state = tx.init(params)
    assert state[0].mu["w"].dtype == F32  # the moments of float32 params
    updates, new = tx.update(grads, state, params)
    wide = jax.tree.map(lambda x: x.astype(jnp.float32), (grads, params))
    ref_updates, ref = inner.update(wide[0], inner.init(wide[1]), wide[1])
    assert updates["w"].dtype == F32
    np.testing.assert_array_equal(updates["w"], ref_updates["w"])
    np.testing.assert_array_equal(new[0].nu["w"], ref[0].nu["w"])
    # nearest: the float32 sum rounded to bfloat16, as optax.apply_updates does
    rounded = apply_rounded(params, updates)["w"]
    assert rounded.dtype == BF16
    np.testing.assert_array_equal(rounded, (wide[1]["w"] + updates["w"]).astype(jnp.bfloat16))
    # with bf16_optimizer_states inside: bf16 moments, still a float32 update
    narrow = float32_update(low_precision_state(inner)).init(params)
    assert narrow[0].mu["w"].dtype == BF16


# --- config --------------------------------------------------------------------------------


def test_config_keys_and_their_errors():
    cfg = load_config(bf16(rounding=True))
    prec = settings.precision(cfg)
    assert prec.master_dtype == BF16 and prec.low_precision_masters and not prec.mixed
    assert prec.stochastic_rounding and prec.comm_dtype == BF16 and prec.skips
    assert prec.accumulator(BF16) == F32  # micro-batches are summed in float32
    assert not settings.precision(load_config(bf16())).stochastic_rounding
    plain = settings.precision(load_config({"bf16": {"enabled": True}}))
    assert plain.mixed and plain.master_dtype is None
    with pytest.raises(ConfigError, match=r"bf16_master_weights_and_grads needs bf16.enabled"):
        load_config({"bf16": {"bf16_master_weights_and_grads": True}})
    with pytest.raises(ConfigError, match=r"with fp16.enabled: true is not supported"):
        load_config({"fp16": {"enabled": True}, "bf16": {"bf16_master_weights_and_grads": True}})
    with pytest.raises(ConfigError, match=r"stochastic_rounding rounds .* which is off"):
        load_config({"bf16": {"enabled": True, "stochastic_rounding": True}})
    nvme = {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "stage": 3}
    with pytest.raises(ConfigError, match=r"does not compose with .*device: nvme"):
        load_config({**bf16(), "zero_optimization": nvme})
    # "auto" is checked once it is resolved: float32 params make it false.
    auto = {"enabled": "auto", "bf16_master_weights_and_grads": True}
    raw = {"train_batch_size": 8, "bf16": auto}
    with pytest.raises(ConfigError, match=r'"auto" resolved to false.*set bf16.enabled: true'):
        jzero.initialize(toy.make_params(num_layers=1, d=8), toy.loss_fn, optax.adam(1e-3), raw)


# --- bytes at rest, every stage -------------------------------------------------------------


def divisible_params():
    """Leaves whose leading dimension 8 divides: nothing rests padded, so every global nbytes
    below is exactly 2 or 4 bytes times the parameter count."""
    rng = np.random.default_rng(0)
    return {
        "bias": jnp.asarray(rng.normal(size=(64,)) * 0.1, jnp.float32),
        "embed": jnp.asarray(rng.normal(size=(16, 64)) * 0.3, jnp.float32),
        "w": jnp.asarray(rng.normal(size=(4, 64, 64)) / 8, jnp.float32),
        "head": jnp.asarray(rng.normal(size=(64, 8)) / 8, jnp.float32),
    }


def mlp_loss(params, batch):
    h = batch["x"].astype(params["embed"].dtype) @ params["embed"] + params["bias"]
    for i in range(params["w"].shape[0]):
        h = jnp.tanh(h @ params["w"][i])
    out = (h @ params["head"]).astype(jnp.float32)
    return jnp.mean((out - batch["y"]) ** 2)


def mlp_batches(num, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(BATCH, 16)).astype(np.float32),
            "y": rng.normal(size=(BATCH, 8)).astype(np.float32),
        }
        for _ in range(num)
    ]


def mlp_engine(stage, section, directory=None):
    cfg = {
        "train_batch_size": BATCH,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        **section,
    }
    if directory is not None:
        cfg["checkpoint"] = {"directory": str(directory)}
    return jzero.initialize(divisible_params(), mlp_loss, config=cfg)


def per_param(opt_state, psi):
    """Adam's moments in ``opt_state`` (not its step count or the injected learning rate):
    their global bytes, and device 0's."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert len(found) == 1
    leaves = jax.tree.leaves((found[0].mu, found[0].nu))
    assert sum(x.size for x in leaves) == 2 * psi  # nothing rests padded
    total = sum(x.nbytes for x in leaves)
    device0 = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.itemsize for x in leaves)
    return total, device0


# Stage 1 rests like stage 2 (moments sharded, params whole) and its gradients like stage 0's
# (whole): its plan bytes are test_precision.py::test_per_device_bytes_equal_the_k12_formulas.
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bytes_at_rest_are_6_plus_2_of_gradients_against_14(stage):
    psi = sum(x.size for x in jax.tree.leaves(divisible_params()))
    batch = mlp_batches(1)[0]
    # At rest between steps: params + master + the optimizer's per-parameter state (Adam's
    # moments); not the step count and learning rate (8 bytes whatever the model), not the
    # gradients, which live in the step's buffers only: 2 bytes of bf16 gradients a
    # parameter there (a full copy at stages 0-1, a shard from stage 2).
    with (
        mlp_engine(stage, bf16(states=True)) as lean,
        mlp_engine(stage, {"bf16": {"enabled": True}}) as mixed,
    ):
        rest = {}
        for name, e in (("lean", lean), ("mixed", mixed)):
            st = e.state
            params = sum(x.nbytes for x in jax.tree.leaves(st.params))
            master = sum(x.nbytes for x in jax.tree.leaves(st.master))
            moments, moments0 = per_param(st.opt_state, psi)
            rest[name] = (params, master, moments)
            # per device, the stage's sharding: params split at 3, the rest from 1
            params0 = sum(
                int(np.prod(x.sharding.shard_shape(x.shape))) * x.itemsize
                for x in jax.tree.leaves(st.params)
            )
            assert params0 == params // (N if stage == 3 else 1)
            assert moments0 == moments // (N if stage >= 1 else 1)
        assert rest["lean"] == (2 * psi, 0, 4 * psi)  # bf16 params = masters, bf16 moments
        assert rest["mixed"] == (2 * psi, 4 * psi, 8 * psi)  # bf16 copy, fp32 masters, moments
        assert sum(rest["lean"]) == 6 * psi and sum(rest["mixed"]) == 14 * psi
        assert lean.state.master == ()
        assert {x.dtype for x in jax.tree.leaves(lean.state.params)} == {BF16}
        # The plan agrees, its gradients bfloat16 (2 bytes a parameter, sharded from stage 2):
        # 8 bytes a parameter before sharding with them, against 16.
        mb = model_state_bytes(lean.plan)
        assert "master_params" not in mb
        assert mb["grads"] == 2 * psi // (N if stage >= 2 else 1)
        assert sum(rest["lean"]) + 2 * psi == 8 * psi
        assert sum(rest["mixed"]) + 2 * psi == 16 * psi
        # The compiled step takes exactly that state (and the batch and scalars) as arguments,
        # and reduces the gradients in bfloat16.
        lowered = lean.lower(batch)
        args = lowered.compile().memory_analysis().argument_size_in_bytes
        scalars = 4 + 5 * 4  # the step and the loss-scale state (opt_state counts its own)
        rows = sum(x.nbytes for x in batch.values()) // N
        expect = mb["params"] + mb["opt_state"] + scalars + rows
        assert args == expect
        reduce = "all-reduce" if stage == 0 else "reduce-scatter"
        by_dtype = collectives_by_dtype(program_text(lowered))
        assert by_dtype[reduce]["bf16"].bytes >= 2 * psi // N
        assert "f32" not in by_dtype[reduce] or by_dtype[reduce]["f32"].bytes < 64  # scalars
        m = lean.train_step(batch)
        assert np.isfinite(float(m["loss"])) and m["loss"].dtype == F32
        assert {x.dtype for x in jax.tree.leaves(lean.state.params)} == {BF16}
        print(
            f"stage {stage} bytes at rest: bf16 masters+states {sum(rest['lean'])} B "
            f"({sum(rest['lean']) // psi}/param), fp32 masters {sum(rest['mixed'])} B"
        )


# --- the update ----------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", [False, True])
def test_one_step_is_the_float32_update_rounded_to_bf16_in_shards(rounding):
    params = divisible_params()
    prec = settings.precision(load_config(bf16(rounding=rounding)))
    tx = float32_update(optax.adamw(1e-2, weight_decay=0.01))
    plan = jzero.make_plan(
        params,
        tx,
        jzero.make_mesh({"data": N}),
        2,
        PlanOptions().replace(persistence_threshold=0, precision=prec),
    )
    batch = mlp_batches(1)[0]
    state = init_train_state(plan, params, tx)
    grads = make_gradient_step(plan, mlp_loss)(state, batch)[0]
    assert {g.dtype for g in jax.tree.leaves(grads)} == {BF16}  # reduced bf16 gradients

    # The reference, outside jzero's step: the optimizer in float32 on the bf16 masters and
    # gradients (at their logical shapes), the sum rounded to nearest, or stochastically with
    # step 0's keys.
    def reference(st, g):
        masters = to_logical(st.params, plan.compute_params)
        updates, new_opt = tx.update(
            to_logical(g, plan.abstract_params), to_logical(st.opt_state, plan.abstract_opt_state),
            masters,
        )  # fmt: skip
        assert {u.dtype for u in jax.tree.leaves(updates)} == {F32}
        near = apply_rounded(masters, updates)
        return apply_rounded(masters, updates, 0 if rounding else None), new_opt, near, masters

    ref, ref_opt, near, old = jax.tree.map(np.asarray, jax.jit(reference)(state, grads))
    new = make_train_step(plan, mlp_loss, tx)(state, batch)[0]
    assert new.master == () and int(new.step) == 1
    got, got_opt = jax.jit(
        lambda s: (
            to_logical(s.params, plan.compute_params),
            to_logical(s.opt_state, plan.abstract_opt_state),
        )
    )(new)
    for k in params:
        assert got[k].dtype == BF16
        np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint16), ref[k].view(np.uint16))
        assert not np.array_equal(np.asarray(got[k]), old[k])  # it moved
    for a, b in zip(jax.tree.leaves(got_opt), jax.tree.leaves(ref_opt), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    diff = [np.abs(ref[k].view(np.int16).astype(int) - near[k].view(np.int16)) for k in params]
    if rounding:  # stochastic differs from nearest somewhere, and by one ulp at most
        assert max(d.max() for d in diff) == 1 and sum(d.sum() for d in diff) > 10
    else:
        assert max(d.max() for d in diff) == 0


# --- skipped steps and checkpoints --------------------------------------------------------


def bits(tree):
    return [np.asarray(x).ravel().view(np.uint8).copy() for x in jax.tree.leaves(tree)]


def test_skipped_steps_keep_every_bit_and_a_restored_run_continues_identically(tmp_path):
    good = mlp_batches(3)
    bad = {**good[1], "x": np.full_like(good[1]["x"], np.nan)}
    section = bf16(states=True, rounding=True)
    with mlp_engine(3, section, tmp_path) as e:
        e.train_step(good[0])
        before = bits((e.state.params, e.state.opt_state, e.state.step))
        m = e.train_step(bad)
        assert float(m["skipped"]) == 1.0 and float(m["nonfinite"]) == 1.0
        after = bits((e.state.params, e.state.opt_state, e.state.step))
        assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
        assert int(e.state.step) == 1
        e.train_step(good[1])
        assert e.save()
        saved = bits((e.state.params, e.state.opt_state, e.state.step))
        e.train_step(good[2])
        continued = bits((e.state.params, e.state.opt_state))
    with mlp_engine(3, section, tmp_path) as fresh:
        fresh.restore()
        restored = bits((fresh.state.params, fresh.state.opt_state, fresh.state.step))
        assert all(np.array_equal(a, b) for a, b in zip(saved, restored, strict=True))
        assert fresh.state.master == ()
        assert {x.dtype for x in jax.tree.leaves(fresh.state.params)} == {BF16}
        fresh.train_step(good[2])  # the same stochastic-rounding keys (step 2) as the first run
        again = bits((fresh.state.params, fresh.state.opt_state))
        assert all(np.array_equal(a, b) for a, b in zip(continued, again, strict=True))


# --- training ------------------------------------------------------------------------------


# The GPT's init as one program (op by op, its random draws are a compilation per shape); the
# same program as test_optim_state16.py's, so the run's compilation cache holds it once.
init_gpt = jax.jit(gpt.init_params, static_argnums=1)


def test_bf16_masters_train_the_gpt_like_fp32_masters():
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=2, d_model=32, d_ff=128, num_heads=2)
    tokens = data.load_tokens("stdlib", max_bytes=64 * 1024) % 64
    it = data.BatchIterator(tokens, 16, cfg.seq_len, seed=0)
    batches = [it.next() for _ in range(25)]
    runs = {
        "fp32 masters": {"bf16": {"enabled": True}},
        "bf16 masters": bf16(),
        "bf16 masters + stochastic rounding": bf16(rounding=True),
    }
    losses, final = {}, {}
    for name, section in runs.items():
        config = {
            "train_batch_size": 16,
            "zero_optimization": {"stage": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            **section,
        }
        params = init_gpt(jax.random.key(0), cfg)
        with jzero.initialize(params, lambda p, b: gpt.loss_fn(p, b, cfg), config=config) as e:
            out = [float(e.train_step(b)["loss"]) for b in batches]
            final[name] = bits(e.state.params)
        losses[name] = float(np.mean(out[-5:]))
        assert out[-1] < out[0] - 0.5, out  # it trains
    # A bf16 master rounds each update to 2^-9 of the weight: AdamW's steps of ~lr = 3e-3 on
    # weights of ~0.02-1 are mostly above half that ulp, so the 25-step loss follows the fp32
    # masters' closely (within the issue's 2%; measured 0.5% at 25 steps and at 50, the loss
    # down by 0.95 by then); stochastic rounding keeps the smaller steps in expectation, at the
    # price of noise of the same size.
    for name, loss in losses.items():
        print(f"GPT mean loss of steps 21-25, {name}: {loss:.4f}")
    ref = losses["fp32 masters"]
    assert abs(losses["bf16 masters"] - ref) <= 0.02 * ref
    assert abs(losses["bf16 masters + stochastic rounding"] - ref) <= 0.02 * ref
    nearest, sr = final["bf16 masters"], final["bf16 masters + stochastic rounding"]
    assert not all(np.array_equal(a, b) for a, b in zip(nearest, sr, strict=True))


def test_offloaded_and_streamed_bf16_masters_match_the_device_run():
    # The optimizer state in host memory, its update streamed in groups of leaves
    # (sub_group_size): the same float32 update rounded to nearest, bit for bit.
    batches = mlp_batches(2)
    streamed = {"offload_optimizer": {"device": "cpu"}, "sub_group_size": 1200}
    finals = []
    for zero in ({}, streamed):
        cfg = {
            "train_batch_size": BATCH,
            "zero_optimization": {"stage": 2, **zero},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            **bf16(states=True),
        }
        with jzero.initialize(divisible_params(), mlp_loss, config=cfg) as e:
            for b in batches:
                e.train_step(b)
            if zero:  # two groups: [bias, embed] and [head, w]
                assert streamed_groups(e.plan, 1200, e.optimizer) == [[0, 1], [2, 3]]
                kinds = {x.sharding.memory_kind for x in jax.tree.leaves(e.state.opt_state)}
                assert kinds == {"pinned_host"}
            finals.append(bits((e.state.params, e.state.opt_state)))
    assert all(np.array_equal(a, b) for a, b in zip(*finals, strict=True))
    cfg["bf16"]["stochastic_rounding"] = True  # streamed groups round to nearest: refused
    with pytest.raises(ValueError, match=r"stochastic_rounding rounds the update of the whole"):
        with jzero.initialize(divisible_params(), mlp_loss, config=cfg) as e:
            e.train_step(batches[0])
