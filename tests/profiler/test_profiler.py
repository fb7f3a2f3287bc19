"""``flops_profiler``: the compiled step's FLOPs (XLA's count) and the model's (3x the forward
matmuls, per module) for a plain MLP are 6 x params x tokens; the printout, MFU against a
given peak, and the per-module counts of a scanned GPT."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzero
from jzero import profiler
from jzero.config import ConfigError, load_config
from jzero.demo import gpt

LAYERS, D, TOKENS = 12, 128, 256


def mlp_params():
    rng = np.random.default_rng(0)
    return {
        f"layer_{i}": {
            "w": jnp.asarray(rng.normal(size=(D, D)) / np.sqrt(D), jnp.float32),
            "b": jnp.zeros(D, jnp.float32),
        }
        for i in range(LAYERS)
    }


def mlp_loss(params, batch):
    h = batch["x"]
    for i in range(LAYERS):
        h = jnp.tanh(h @ params[f"layer_{i}"]["w"] + params[f"layer_{i}"]["b"])
    return jnp.mean((h - batch["y"]) ** 2)


def test_the_profile_of_a_plain_mlp_is_six_flops_per_parameter_per_token(tmp_path):
    rng = np.random.default_rng(1)
    batch = {
        "x": rng.normal(size=(TOKENS, D)).astype(np.float32),
        "y": rng.normal(size=(TOKENS, D)).astype(np.float32),
    }
    out = tmp_path / "profile.txt"
    cfg = {
        "train_batch_size": TOKENS,
        "zero_optimization": {"stage": 1},
        "flops_profiler": {
            "enabled": True,
            "profile_step": 2,
            "top_modules": 3,
            "output_file": str(out),
        },
    }
    engine = jzero.initialize(mlp_params(), mlp_loss, optax.adamw(1e-3), cfg)
    engine.train_step(batch)
    assert engine.flops_profile is None  # step 1 is not the one profiled
    engine.train_step(batch)
    p = engine.flops_profile
    params = sum(x.size for x in jax.tree.leaves(mlp_params()))
    six_nt = 6 * params * TOKENS
    # XLA's count of the compiled step over all 8 devices: the matmuls (the first layer needs no
    # input gradient: 1/36 fewer), plus the elementwise work and the sharded AdamW update.
    assert p.cost.devices == 8
    assert abs(p.cost.total_flops - six_nt) <= 0.05 * six_nt, (p.cost.total_flops, six_nt)
    # The model's count: 3x the forward matmuls, 6 x (the weights) x tokens exactly; the
    # biases are the 1% of the parameters no matmul multiplies.
    weights = LAYERS * D * D
    assert p.model_flops == 6 * weights * TOKENS
    assert abs(p.model_flops - six_nt) <= 0.05 * six_nt
    assert p.forward == {f"layer_{i}.w": 2 * D * D * TOKENS for i in range(LAYERS)}
    text = out.read_text()
    assert "unknown on this device" in text and "MFU (" not in text  # no peak on CPU
    assert text.count("layer_") == 3  # top_modules rows
    assert p.mfu is None


def test_mfu_is_the_model_flops_over_the_peak_times_the_step_time():
    p = profiler.FlopsProfile(
        step=1,
        cost=profiler.StepCost(flops=5e11, bytes_accessed=1e9, devices=8),
        seconds=0.5,
        forward={"blocks.w": 10**12},
        peak=1e12,
    )
    assert p.model_flops == 3e12
    assert p.mfu == pytest.approx(3e12 / (0.5 * 8 * 1e12))
    assert "MFU (model FLOPs / peak x time):      75.00%" in p.format()


def test_known_accelerators_have_a_peak_and_the_config_overrides_it():
    class Device:
        platform, device_kind = "gpu", "NVIDIA H200"

    assert profiler.peak_flops(Device()) == profiler.PEAK_FLOPS["H200"]
    assert profiler.peak_flops(jax.devices()[0]) is None  # CPU: unknown
    assert profiler.peak_flops(jax.devices()[0], 2.0e12) == 2.0e12


def test_module_flops_count_each_scanned_layer_and_group_by_depth():
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=3, d_model=32, d_ff=128, num_heads=2)
    params = jax.eval_shape(lambda: gpt.init_params(jax.random.key(0), cfg))
    batch = {"tokens": jax.ShapeDtypeStruct((4, cfg.seq_len + 1), jnp.int32)}
    tokens = 4 * cfg.seq_len

    def loss(p, b):
        return gpt.loss_fn(p, b, cfg)

    flops = profiler.module_flops(loss, params, batch)
    # One scan over 3 layers: each layer's matmul counted 3 times.
    assert flops["blocks.mlp_in"] == 3 * 2 * tokens * cfg.d_model * cfg.d_ff
    assert flops["blocks.attn_qkv"] == 3 * 2 * tokens * cfg.d_model * 3 * cfg.d_model
    assert flops["embed.tokens"] == 2 * tokens * cfg.d_model * cfg.vocab_size  # tied head
    # Attention's q k^T and p v multiply two activations: their own rows.
    assert any(k.startswith("(activations") for k in flops)
    grouped = profiler.module_flops(loss, params, batch, depth=1)
    blocks = sum(v for k, v in flops.items() if k.startswith("blocks."))
    assert grouped["blocks"] == blocks


@pytest.mark.parametrize(
    ("section", "message"),
    [({"profile_step": 0}, "profile_step"), ({"recompute_fwd_factor": 2}, "recompute_fwd_factor")],
)
def test_bad_profiler_settings_say_what_is_allowed(section, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"flops_profiler": section})
