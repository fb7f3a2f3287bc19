"""``bf16: {enabled: true, bf16_optimizer_states: true}``: the optimizer state rests in bfloat16
(half the bytes per device), training follows the fp32-state run, checkpoints keep it as is.
Training the GPT with 8-bit moments (test_optim_state8.py) is checked here beside it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy

import jzero
from jzero.config import ConfigError, load_config
from jzero.demo import data, gpt
from jzero.optim import low_precision_state
from jzero.plan import model_state_bytes

# The GPT's init compiled once (op by op its random draws are one compilation per shape).
init_gpt = jax.jit(gpt.init_params, static_argnums=1)


def bf16(states, **extra):
    return {"bf16": {"enabled": True, "bf16_optimizer_states": states, **extra}}


def toy_engine(stage, states, directory=None):
    cfg = {
        "train_batch_size": 16,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        **bf16(states),
    }
    if directory is not None:
        cfg["checkpoint"] = {"directory": str(directory)}
    return jzero.initialize(toy.make_params(num_layers=2, d=16), toy.loss_fn, config=cfg)


def adam_state(opt_state):
    """The ``ScaleByAdamState`` inside the config's AdamW (under inject_hyperparams)."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert len(found) == 1
    return found[0]


def shard_bytes(tree):
    """Bytes on device 0 of the arrays of ``tree``, from their shard shapes."""
    leaves = jax.tree.leaves(tree)
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in leaves)


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_state_halves_the_adam_moments_per_device(stage):
    with toy_engine(stage, False) as wide, toy_engine(stage, True) as narrow:
        planned = {
            k: model_state_bytes(e.plan)["opt_state"] for k, e in (("f32", wide), ("bf16", narrow))
        }
        w, n = adam_state(wide.state.opt_state), adam_state(narrow.state.opt_state)
        for moment in ("mu", "nu"):
            assert {x.dtype for x in jax.tree.leaves(getattr(w, moment))} == {jnp.dtype("float32")}
            assert {x.dtype for x in jax.tree.leaves(getattr(n, moment))} == {jnp.dtype("bfloat16")}
            assert shard_bytes(getattr(n, moment)) * 2 == shard_bytes(getattr(w, moment))
        # The step count (int32) and the injected learning rate (a float32 scalar) are unchanged.
        scalars = [x for x in jax.tree.leaves(narrow.state.opt_state) if x.ndim == 0]
        assert [(x.dtype, x.shape) for x in scalars] == [
            (x.dtype, x.shape) for x in jax.tree.leaves(wide.state.opt_state) if x.ndim == 0
        ]
        assert jnp.dtype("int32") in {x.dtype for x in scalars}
        assert {x.dtype for x in scalars} <= {jnp.dtype("int32"), jnp.dtype("float32")}
        fixed = shard_bytes(scalars)
        # The plan sees the bf16 dtypes: its opt-state bytes (moments + scalars) halve too.
        assert planned["bf16"] - fixed == (planned["f32"] - fixed) // 2
        assert planned["f32"] == shard_bytes(wide.state.opt_state)
        assert planned["bf16"] == shard_bytes(narrow.state.opt_state)
        # The fp32 master weights stay as they are.
        assert (
            model_state_bytes(narrow.plan)["master_params"]
            == model_state_bytes(wide.plan)["master_params"]
        )
        print(f"stage {stage} opt_state B/device: fp32 {planned['f32']}, bf16 {planned['bf16']}")


def test_a_checkpoint_of_the_bf16_state_restores_bit_identically(tmp_path):
    batch = toy.make_batches(1, 16)[0]
    with toy_engine(3, True, tmp_path) as engine:
        engine.train_step(batch)  # moments that are not zeros
        saved = [np.asarray(x) for x in jax.tree.leaves(engine.state.opt_state)]
        assert engine.save()
    with toy_engine(3, True, tmp_path) as fresh:
        fresh.restore()
        restored = jax.tree.leaves(fresh.state.opt_state)
        assert jnp.dtype("bfloat16") in {x.dtype for x in restored}
        for a, b in zip(restored, saved, strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(
                np.asarray(a).ravel().view(np.uint8), b.ravel().view(np.uint8)
            )


def test_bf16_and_8bit_states_train_the_gpt_like_the_fp32_state():
    """bf16 (``bf16_optimizer_states``) and 8-bit (``state_bits: 8``, test_optim_state8.py)
    Adam moments against the fp32 state, all three under bf16 compute with fp32 masters: one
    fp32-state run serves both comparisons."""
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=2, d_model=32, d_ff=128, num_heads=2)
    tokens = data.load_tokens("stdlib", max_bytes=64 * 1024) % 64
    it = data.BatchIterator(tokens, 16, cfg.seq_len, seed=0)
    batches = [it.next() for _ in range(50)]
    runs = {"fp32": (False, 32), "bf16": (True, 32), "8-bit": (False, 8)}
    losses, opt_bytes = {}, {}
    for name, (states, bits) in runs.items():
        config = {
            "train_batch_size": 16,
            "zero_optimization": {"stage": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "state_bits": bits}},
            **bf16(states),
        }
        params = init_gpt(jax.random.key(0), cfg)
        with jzero.initialize(params, lambda p, b: gpt.loss_fn(p, b, cfg), config=config) as e:
            out = [float(e.train_step(b)["loss"]) for b in batches]
            opt_bytes[name] = model_state_bytes(e.plan)["opt_state"]
        losses[name] = float(np.mean(out[-5:]))
        assert out[-1] < out[0] - 0.5, (name, out)  # it trains
    print(f"GPT opt_state B/device: {opt_bytes}")
    print(f"GPT mean loss of steps 46-50: {losses}")
    # Rounding a moment to bf16 is a relative error of at most 2^-9 per step; the moments are
    # running averages of the gradients, so those errors average out rather than add up, and
    # the update m / (sqrt(v) + eps) moves by about that relative amount: the direction barely
    # changes, and the loss after 50 steps stays within the 2%.
    assert abs(losses["bf16"] - losses["fp32"]) <= 0.02 * losses["fp32"]
    # Each 8-bit moment is within 4.4% (mu) and sqrt(nu) within 2.2% of its float32 value,
    # errors of both signs that the running averages average rather than add up; the update
    # moves by about that relative amount per element, its direction barely, so after 50 steps
    # the loss stays within the 2% of the fp32 state's.
    assert abs(losses["8-bit"] - losses["fp32"]) <= 0.02 * losses["fp32"]
    assert opt_bytes["8-bit"] < opt_bytes["bf16"] < opt_bytes["fp32"]


def test_bf16_optimizer_states_without_bf16_says_the_fix():
    with pytest.raises(ConfigError, match=r"bf16.bf16_optimizer_states needs bf16.enabled: true"):
        load_config({"bf16": {"bf16_optimizer_states": True}})
    # "auto" is checked once it is resolved: float32 params make it false.
    with pytest.raises(ConfigError, match=r"needs bf16.enabled: true.*set bf16.enabled: true"):
        jzero.initialize(
            toy.make_params(num_layers=1, d=8),
            toy.loss_fn,
            optax.adam(1e-3),
            {"train_batch_size": 8, "bf16": {"enabled": "auto", "bf16_optimizer_states": True}},
        )


def test_the_wrapper_is_the_inner_update_from_the_state_rounded_to_bf16():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.ones(3)}
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    inner = optax.adam(1e-3)
    # A state with moments that bf16 cannot hold exactly, as after a few steps.
    state = inner.init(params)
    for _ in range(3):
        _, state = inner.update(grads, state, params)
        grads = jax.tree.map(lambda g: g * 0.7 + 0.1, grads)

    tx = low_precision_state(inner)
    assert tx.init(params)[0].mu["w"].dtype == jnp.bfloat16  # (ScaleByAdamState, EmptyState)
    assert tx.init(params)[0].count.dtype == jnp.int32
    stored = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, state
    )
    updates, (new, _) = tx.update(grads, stored, params)

    # The reference: optax's own Adam, in float32, from the state rounded to bf16 by hand and
    # read back as float32; its new moments rounded to bf16 by hand. Exactly equal.
    by_hand = jax.tree.map(
        lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, stored
    )
    ref_updates, (ref, _) = inner.update(grads, by_hand, params)
    assert ref.mu["w"].dtype == jnp.float32 and not np.array_equal(ref.mu["w"], state[0].mu["w"])
    for k in params:
        assert updates[k].dtype == jnp.float32
        np.testing.assert_array_equal(updates[k], ref_updates[k])
        np.testing.assert_array_equal(new.mu[k], ref.mu[k].astype(jnp.bfloat16))
        np.testing.assert_array_equal(new.nu[k], ref.nu[k].astype(jnp.bfloat16))
        assert new.mu[k].dtype == new.nu[k].dtype == jnp.bfloat16
    assert new.count.dtype == jnp.int32 and int(new.count) == int(state[0].count) + 1

    # And Adam's formula written out (to float32 rounding: optax orders the operations its way).
    count = state[0].count + 1
    for k in params:
        mu = stored[0].mu[k].astype(jnp.float32) * 0.9 + 0.1 * grads[k]
        nu = stored[0].nu[k].astype(jnp.float32) * 0.999 + 0.001 * grads[k] ** 2
        step = -1e-3 * (mu / (1 - 0.9**count)) / (jnp.sqrt(nu / (1 - 0.999**count)) + 1e-8)
        np.testing.assert_allclose(updates[k], step, rtol=1e-6)
        np.testing.assert_array_equal(new.mu[k], mu.astype(jnp.bfloat16))
