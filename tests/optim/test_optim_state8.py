"""``optimizer: {type: AdamW, params: {state_bits: 8}}``: Adam's moments rest as int8/uint8 codes
with blockwise float32 scales (jzero.optim.quantized): within the code's stated error, about a
quarter of the fp32 state's bytes per device, training the GPT like the fp32 state, and
checkpoints that restore bit-identically, also onto another device count."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy

import jzero
from jzero import hlo
from jzero.config import ConfigError, load_config, resolve_optimizer
from jzero.demo import gpt
from jzero.optim import quantized_adam_state
from jzero.optim.quantized import (
    MU_TOP,
    NU_TOP,
    PER_OCTAVE,
    QuantizedAdamState,
    dequantize,
    quantize,
)
from jzero.plan import model_state_bytes

HALF_STEP = 2 ** (1 / (2 * PER_OCTAVE))  # a level is within this factor of what it stands for
# The encoder computes log2 in float32: its result is within a few ulp of the true log2, so a
# value within ~1e-6 of a rounding edge (the geometric midpoint of two levels) may take the
# other neighbour. Either neighbour is within HALF_STEP * (1 + 1e-6) of it; 1e-5 covers that
# with room, and is 400x below the 4.4% bound being tested.
SLACK = 1e-5


# The GPT's init compiled once (op by op its random draws are one compilation per shape).
init_gpt = jax.jit(gpt.init_params, static_argnums=1)


def adamw(bits, **extra):
    params = {"lr": 1e-2, "weight_decay": 0.01}
    if bits is not None:
        params["state_bits"] = bits
    return {"optimizer": {"type": "AdamW", "params": params}, **extra}


def toy_engine(stage, bits, directory=None, mesh=None, **extra):
    cfg = {
        "train_batch_size": 16,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **adamw(bits),
        **extra,
    }
    if directory is not None:
        cfg["checkpoint"] = {"directory": str(directory)}
    params = toy.make_params(num_layers=2, d=64)
    return jzero.initialize(params, toy.loss_fn, config=cfg, options=jzero.InitOptions(mesh=mesh))


def of_type(tree, kind):
    found = [s for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kind))]
    return [s for s in found if isinstance(s, kind)]


def shard_bytes(tree):
    """Bytes on device 0 of the arrays of ``tree``, from their shard shapes."""
    leaves = jax.tree.leaves(tree)
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in leaves)


def reference_codes(x, signed, block):
    """The documented code in float64 numpy, and its distance from a rounding tie."""
    top = MU_TOP if signed else NU_TOP
    rows, n = x.shape
    pad = -n % block
    blocks = np.pad(x, [(0, 0), (0, pad)]).reshape(rows, -1, block)
    scale = np.abs(blocks).max(-1)
    safe = np.where(scale > 0, scale, 1.0)[..., None]  # an all-zero block: codes 0
    with np.errstate(divide="ignore"):
        t = top + PER_OCTAVE * np.log2(np.abs(blocks) / safe)
    k = np.clip(np.round(t), 0, top)
    if not signed:
        k = np.where(blocks > 0, np.maximum(k, 1), 0)
    t = np.maximum(t, -1.0)  # log2(0) = -inf: far from any tie
    tie = np.abs(t - np.floor(t) - 0.5)
    unpad = lambda a: a.reshape(rows, -1)[:, :n]  # noqa: E731
    return unpad(np.sign(blocks) * k), unpad(tie), scale


def test_codes_round_trip_within_the_stated_bound():
    block = 256
    rng = np.random.default_rng(0)
    # Rows of 600 = 256 + 256 + 88: two whole blocks and a short one; magnitudes spread over
    # 12 decades (so every code and the below-range zero appear), signs mixed, some zeros.
    x = np.sign(rng.normal(size=(6, 600))) * 10.0 ** rng.uniform(-12, 0, size=(6, 600))
    x[:, ::37] = 0.0
    x[5, 256:512] = 0.0  # an all-zero block: scale 0, all codes 0
    x32 = x.astype(np.float32)
    roundtrip = jax.jit(
        lambda v, signed: dequantize(*quantize(v, signed, block), block), static_argnums=1
    )
    for signed, moment in ((True, x32), (False, np.abs(x32))):
        top = MU_TOP if signed else NU_TOP
        codes, scale = jax.jit(lambda v, s=signed: quantize(v, s, block))(moment)
        assert codes.dtype == (jnp.int8 if signed else jnp.uint8) and codes.shape == (6, 600)
        assert scale.dtype == jnp.float32 and scale.shape == (6, 3)
        ref_k, tie, ref_scale = reference_codes(moment.astype(np.float64), signed, block)
        # The scale is each block's absmax, exactly; the codes are the float64 formula's away
        # from ties (see SLACK), and at a tie one of its two neighbours.
        np.testing.assert_array_equal(np.asarray(scale, np.float64), ref_scale)
        k = np.asarray(codes, np.int64)
        assert np.all((k == ref_k) | ((tie < 1e-4) & (np.abs(k - ref_k) == 1)))
        assert np.mean(k == ref_k) > 0.999
        back = np.asarray(roundtrip(moment, signed), np.float64)
        # Decoding is exact: scale * 2**((|k| - K) / 8), two float32 roundings (2 * 2**-24).
        s = np.repeat(ref_scale, block, axis=1)[:, :600]
        exact = np.sign(k) * s * np.exp2((np.abs(k) - top) / PER_OCTAVE) * (k != 0)
        np.testing.assert_allclose(back, exact, rtol=2**-23, atol=0)
        a = np.abs(moment.astype(np.float64))
        # Zero stays zero, the sign is kept, the block's absmax comes back exactly.
        assert np.all(back[a == 0] == 0) and np.all(back * moment >= 0)
        assert np.all(back[a == s] == moment[a == s])
        edge = s * HALF_STEP ** (2 * (1 - top) - 1)  # the lower rounding edge of code 1
        inside = (a >= edge) & (a > 0)
        err = np.abs(back - moment)
        assert np.all(err[inside] <= (HALF_STEP - 1) * (1 + SLACK) * a[inside])
        assert np.max(err[inside] / a[inside]) > 0.9 * (HALF_STEP - 1)  # the bound is tight
        if signed:  # below the edge mu rounds to zero (so a decaying moment reaches zero)
            assert np.all(back[~inside] == 0) and np.any(~inside & (a > 0))
        else:  # a positive nu is never zero, and never below nu / HALF_STEP
            assert np.all(back[a > 0] > 0) and np.any(~inside & (a > 0))
            assert np.all(back[a > 0] >= a[a > 0] / (HALF_STEP * (1 + SLACK)))
        # Relative to the block's scale, the error is at most half a step of the top level.
        assert np.all(err <= (HALF_STEP - 1) * (1 + SLACK) * s)


def test_leaves_of_every_rank_get_codes_of_their_shape():
    rng = np.random.default_rng(1)
    encode = jax.jit(quantize, static_argnums=(1, 2))  # one program a shape, not one an op
    decode = jax.jit(dequantize, static_argnums=2)
    for shape, scale_shape in [((), ()), ((5,), (1,)), ((3, 300), (3, 2)), ((2, 0), (2, 0))]:
        x = jnp.asarray(rng.normal(size=shape), jnp.float32)
        codes, scale = encode(x, True, 256)
        assert codes.shape == shape and scale.shape == scale_shape
        back = decode(codes, scale, 256)
        assert back.shape == shape and back.dtype == jnp.float32
        if shape == ():  # one block of one element: stored exactly
            assert int(codes) == MU_TOP * np.sign(float(x)) and float(back) == float(x)


def test_the_wrapper_is_the_inner_update_on_the_decoded_state():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 300)), jnp.float32), "s": jnp.ones(())}
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    inner = optax.adam(1e-3)
    tx = quantized_adam_state(inner)
    state = jax.jit(tx.init)(params)  # compiled: one program, where op by op each op is one
    q = state[0]
    assert isinstance(q, QuantizedAdamState)
    assert (q.mu_codes["w"].dtype, q.nu_codes["w"].dtype) == (jnp.int8, jnp.uint8)
    assert q.mu_codes["w"].shape == (4, 300) and q.mu_scale["w"].shape == (4, 2)
    assert q.mu_codes["s"].shape == q.mu_scale["s"].shape == ()
    # The plan's view: tree_map_params finds four copies of the params' tree in the state.
    shapes = optax.tree_map_params(tx, lambda x: x.shape, state, transform_non_params=lambda _: 0)
    assert shapes[0].mu_codes == {"w": (4, 300), "s": ()} and shapes[0].count == 0

    update = jax.jit(tx.update)
    for _ in range(3):  # moments that are not zeros
        _, state = update(grads, state, params)
        grads = jax.tree.map(lambda g: g * 0.7 + 0.1, grads)

    @jax.jit
    def step_and_reference(grads, state, params):
        """The wrapper's step, and the reference: optax's own Adam, in float32, from the state
        decoded by hand, with its new moments encoded by hand."""
        updates, new = tx.update(grads, state, params)
        q = state[0]
        decoded = optax.ScaleByAdamState(
            count=q.count,
            mu=jax.tree.map(dequantize, q.mu_codes, q.mu_scale),
            nu=jax.tree.map(dequantize, q.nu_codes, q.nu_scale),
        )
        ref_updates, (ref, _) = inner.update(grads, (decoded, state[1]), params)
        encoded = {k: (quantize(ref.mu[k], True), quantize(ref.nu[k], False)) for k in params}
        return updates, new, ref_updates, encoded

    # Exactly equal.
    updates, new, ref_updates, encoded = step_and_reference(grads, state, params)
    assert int(new[0].count) == int(state[0].count) + 1 == 4
    for k in params:
        assert updates[k].dtype == jnp.float32
        np.testing.assert_array_equal(updates[k], ref_updates[k])
        for got, scale, (want, want_scale) in (
            (new[0].mu_codes[k], new[0].mu_scale[k], encoded[k][0]),
            (new[0].nu_codes[k], new[0].nu_scale[k], encoded[k][1]),
        ):
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(scale, want_scale)

    with pytest.raises(ValueError, match="no optax.ScaleByAdamState"):
        quantized_adam_state(optax.sgd(0.1)).init(params)


@pytest.mark.parametrize("stage", [1, 3])
def test_8bit_state_is_under_a_third_of_the_fp32_state_per_device(stage):
    with toy_engine(stage, None) as wide, toy_engine(stage, 8) as narrow:
        w, n = wide.state.opt_state, narrow.state.opt_state
        (q,) = of_type(n, QuantizedAdamState)
        (f,) = of_type(w, optax.ScaleByAdamState)
        for codes, dtype in ((q.mu_codes, jnp.int8), (q.nu_codes, jnp.uint8)):
            assert {x.dtype for x in jax.tree.leaves(codes)} == {jnp.dtype(dtype)}
            # The codes rest exactly like the fp32 moments: same (padded) shapes, same layout.
            assert jax.tree.map(lambda x: (x.shape, x.sharding), codes) == jax.tree.map(
                lambda x: (x.shape, x.sharding), f.mu
            )
        planned = {
            k: model_state_bytes(e.plan)["opt_state"] for k, e in (("f32", wide), ("8", narrow))
        }
        assert planned["f32"] == shard_bytes(w) and planned["8"] == shard_bytes(n)
        ratio = shard_bytes(n) / shard_bytes(w)
        print(f"stage {stage} opt_state B/device: fp32 {shard_bytes(w)}, 8-bit {shard_bytes(n)}")
        print(f"stage {stage} ratio {ratio:.3f}")
        assert ratio <= 0.3


# Training the GPT like the fp32 state: test_optim_state16.py's
# test_bf16_and_8bit_states_train_the_gpt_like_the_fp32_state (one fp32-state run for both).


def test_8bit_state_adds_no_collective_unordered_against_the_stage3_layer_loops():
    """Two layers over 8 devices are split unevenly, and the qkv rows (3 x 128 = 384) are a block
    and a half, so decoding that leaf's state reshards it; those collectives wait for the
    backward pass like the fp32 step's. Unordered beside the layer loops' gathers, XLA:CPU ran
    them in different orders on different devices and the demo's GPT aborted at stage 3 (a
    rendezvous timeout)."""
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=2, d_model=128, d_ff=128, num_heads=2)
    batch = {"tokens": jax.ShapeDtypeStruct((16, cfg.seq_len + 1), jnp.int32)}
    unordered, resharded = {}, {}
    for bits in (32, 8):
        config = {
            "train_batch_size": 16,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "state_bits": bits}},
        }
        params = init_gpt(jax.random.key(0), cfg)
        with jzero.initialize(params, lambda p, b: gpt.loss_fn(p, b, cfg), config=config) as e:
            text = e.lower(batch).compile().as_text()
        unordered[bits] = sorted(c.kind for c in hlo.unordered_collectives(text))
        resharded[bits] = hlo.collectives(text)["collective-permute"].count
    assert resharded[8] and not resharded[32]  # the 8-bit decode does reshard here ...
    assert unordered[8] == unordered[32]  # ... and adds nothing unordered against the loops


def bits_of(tree):
    return [np.asarray(x).ravel().view(np.uint8) for x in jax.tree.leaves(tree)]


def test_a_checkpoint_of_the_8bit_state_restores_bit_identically_on_any_device_count(tmp_path):
    batches = toy.make_batches(2, 16)
    with toy_engine(3, 8, tmp_path) as engine:
        engine.train_step(batches[0])  # codes and scales that are not zeros
        saved = bits_of(engine.opt_state)  # logical shapes, as checkpoints hold them
        saved_stored = bits_of(engine.state.opt_state)
        assert engine.save()
        expected = float(engine.train_step(batches[1])["loss"])
    with toy_engine(3, 8, tmp_path) as fresh:
        fresh.restore()
        restored = bits_of(fresh.state.opt_state)
        assert {x.dtype for x in jax.tree.leaves(fresh.state.opt_state)} >= {
            jnp.dtype("int8"),
            jnp.dtype("uint8"),
        }
        assert len(restored) == len(saved_stored)
        for a, b in zip(restored, saved_stored, strict=True):
            np.testing.assert_array_equal(a, b)
        assert float(fresh.train_step(batches[1])["loss"]) == expected
    four = jzero.make_mesh({"data": 4}, devices=jax.devices()[:4])
    with toy_engine(1, 8, tmp_path, mesh=four) as other:
        other.restore()
        for a, b in zip(bits_of(other.opt_state), saved, strict=True):
            np.testing.assert_array_equal(a, b)
        # Same state, another reduction order: the next loss agrees to float32 rounding.
        assert float(other.train_step(batches[1])["loss"]) == pytest.approx(expected, rel=1e-5)


def test_8bit_state_under_bf16_and_optimizer_offload():
    offload = {"offload_optimizer": {"device": "cpu"}}
    batches = toy.make_batches(1, 16) * 3  # one batch thrice: its loss falls as it trains
    runs = {}
    for name, zero in (("device", {}), ("offload", offload)):
        cfg = {
            "train_batch_size": 16,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2, **zero},
            **adamw(8),
        }
        params = toy.make_params(num_layers=2, d=64, dtype=jnp.bfloat16)
        with jzero.initialize(params, toy.loss_fn, config=cfg) as e:
            losses = [float(e.train_step(b)["loss"]) for b in batches]
            (q,) = of_type(e.state.opt_state, QuantizedAdamState)
            kinds = {x.sharding.memory_kind for x in jax.tree.leaves(e.state.opt_state)}
            assert kinds == ({"pinned_host"} if zero else {"device"})
            assert {x.dtype for x in jax.tree.leaves(q.mu_codes)} == {jnp.dtype("int8")}
            assert {x.dtype for x in jax.tree.leaves(e.state.master)} == {jnp.dtype("float32")}
            runs[name] = losses, bits_of(e.state)
    assert runs["device"][0][-1] < runs["device"][0][0]  # it trains
    assert runs["offload"][0] == runs["device"][0]  # where the state rests changes no bit
    for a, b in zip(*(runs[k][1] for k in runs), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("bits", "message"),
    [
        (4, r"optimizer.params.state_bits: 4 is not allowed; it must be 32 .* or 8 .*"
            r"Set state_bits: 8 or 32, or remove it."),
        (16, r"optimizer.params.state_bits: 16 is not allowed; it must be 32 .* or 8 .*"
             r"For 16-bit moments remove state_bits and set bf16: \{enabled: true, "
             r"bf16_optimizer_states: true\}."),
        ("8", r"optimizer.params.state_bits: '8' is not allowed; it must be 32 .* or 8"),
        (True, r"optimizer.params.state_bits: true is not allowed"),
    ],
)  # fmt: skip
def test_state_bits_other_than_8_or_32_says_the_fix(bits, message):
    with pytest.raises(ConfigError, match=message):
        load_config(adamw(bits))


def test_state_bits_defaults_to_32_and_refuses_bf16_optimizer_states():
    assert resolve_optimizer(load_config(adamw(None)).optimizer)[1]["state_bits"] == 32
    assert resolve_optimizer(load_config(adamw(8.0)).optimizer)[1]["state_bits"] == 8
    cfg = load_config({**adamw(8), "bf16": {"enabled": True, "bf16_optimizer_states": True}})
    with pytest.raises(ConfigError, match=r"state_bits: 8 and bf16.bf16_optimizer_states: true"):
        jzero.optim.build_optimizer(cfg)
