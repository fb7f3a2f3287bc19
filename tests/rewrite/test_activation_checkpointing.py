"""``activation_checkpointing`` rematerialises each stacked layer (every scan body of the loss)
at every stage, with no model change, and never changes the numbers.

The model: 8 stacked layers, each a residual MLP with a wide hidden activation (x @ w1 -> tanh
-> @ w2), a big batch and small weights, so activations dominate the step's temporaries.

Every test runs in float64 (the module's ``x64`` fixture): "never changes the numbers" is
checked at 1e-10 against the single-device optax loop (losses and gradient norms, so that a
gradient scaled by a constant, which Adam's update ignores, fails too); in float32 a
recomputation may round in another order on another CPU. The memory figures are float64's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from numerics import max_rel_error

import jzero
from jzero.config import ConfigError, load_config
from jzero.engine import settings
from jzero.hlo import collectives
from jzero.rewrite import gather, remat, trace
from jzero.step import StepOptions

L, D, F, B = 8, 32, 512, 2048  # per device: 256 rows, a 256 x 512 hidden activation per layer
ITEM = 8  # bytes of a float64 activation
CLIP = 1.0  # DeepSpeed's default gradient_clipping, which the engines here keep


pytestmark = pytest.mark.usefixtures("x64")  # conftest's float64


def params():
    rng = np.random.default_rng(0)
    return {
        "w1": rng.normal(size=(L, D, F)) / np.sqrt(D),
        "w2": rng.normal(size=(L, F, D)) / np.sqrt(F),
    }


def batches(n=2):
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(B, D))} for _ in range(n)]


def scan_loss(p, b, tag=None):
    def layer(x, w):
        h = jnp.tanh(x @ w["w1"])
        if tag:
            h = jax.ad_checkpoint.checkpoint_name(h, tag)
        return x + h @ w["w2"], None

    x, _ = jax.lax.scan(layer, b["x"], p)
    return jnp.mean(x**2)


def engine(stage, section=None, loss=scan_loss):
    cfg = {
        "train_batch_size": B,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if section is not None:
        cfg["activation_checkpointing"] = section
    return jzero.initialize(params(), loss, optax.adam(1e-3), cfg)


def temp(e):
    return e.lower(batches(1)[0]).compile().memory_analysis().temp_size_in_bytes


def losses(e):
    """[(loss, grad_norm)] of the engine's steps on ``batches()``."""
    metrics = [e.train_step(b) for b in batches()]
    return [(float(m["loss"]), float(m["grad_norm"])) for m in metrics]


@functools.cache
def reference():
    """[(loss, gradient global norm)] of the single-device optax loop on ``batches()``."""
    tx = optax.adam(1e-3)

    @jax.jit
    def step(p, opt_state, b):
        loss, grads = jax.value_and_grad(scan_loss)(p, b)
        norm = optax.global_norm(grads)
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, CLIP / (norm + 1e-6)), grads)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss, norm

    p = params()
    opt_state, out = tx.init(p), []
    for b in batches():
        p, opt_state, loss, norm = step(p, opt_state, b)
        out.append((float(loss), float(norm)))
    return out


def assert_reference(got):
    """The engine's (loss, grad_norm) steps are the single-device loop's, in float64."""
    np.testing.assert_allclose(got, reference(), rtol=1e-10, atol=0)


@functools.cache
def run(stage, policy=None):
    """(temp bytes, [(loss, grad_norm)]) of a fresh engine; ``policy`` None: no section."""
    e = engine(stage, None if policy is None else {"policy": policy})
    return temp(e), losses(e)


@pytest.mark.parametrize("stage", [0, 3])
def test_full_policy_cuts_temporaries_and_keeps_the_losses(stage):
    base_temp, base_losses = run(stage)
    full_temp, full_losses = run(stage, "full")
    # Measured (float64): stage 0 20.0 -> 4.9 MiB, stage 3 11.1 -> 3.1 MiB.
    assert full_temp <= 0.6 * base_temp, (full_temp, base_temp)
    assert_reference(base_losses)
    assert_reference(full_losses)


def test_the_section_without_a_policy_means_full():
    e = engine(0, {})
    assert e.config.activation_checkpointing.policy == "full"
    assert temp(e) == run(0, "full")[0]
    # No section: jzero's default (no checkpointing at stages 0-2), kept through to_dict.
    cfg = load_config({})
    assert cfg.activation_checkpointing.policy is None and settings.remat_policy(cfg) is None
    assert load_config(cfg.to_dict()) == cfg
    present = load_config({"activation_checkpointing": {"cpu_checkpointing": False}})
    assert load_config(present.to_dict()) == present


def test_dots_and_none_policies():
    base_temp, base_losses = run(0)
    # none is no checkpointing; dots keeps the matmul outputs: between none and full.
    assert run(0, "none")[0] == base_temp
    dots_temp, dots_losses = run(0, "dots")
    assert run(0, "full")[0] < dots_temp < base_temp
    assert_reference(base_losses)
    assert_reference(dots_losses)
    # At stage 3, none keeps every activation (more than stage 3's default, dots_no_batch),
    # and still gathers each layer again in the backward pass (see the test below).
    none3_temp, none3_losses = run(3, "none")
    assert none3_temp > run(3)[0] + L * (B // 8) * F * ITEM // 2
    assert_reference(none3_losses)


def test_names_policy_saves_the_tagged_values():
    tagged = functools.partial(scan_loss, tag="hidden")
    kept = engine(0, {"policy": "names:hidden"}, tagged)
    other = engine(0, {"policy": "names:elsewhere"}, tagged)
    # Keeping the tagged hidden activation costs memory; a name the model never tags keeps
    # nothing, as full.
    assert temp(kept) > temp(other) + L * (B // 8) * F * ITEM // 2
    assert temp(other) == pytest.approx(run(0, "full")[0], rel=0.05)  # bytes, not rounding
    assert_reference(losses(kept))


def test_cpu_checkpointing_trains_with_unchanged_losses():
    """cpu_checkpointing: true offloads each layer's saved input to ``pinned_host``.

    What CPU cannot show: host and device memory are the same memory on CPU devices, and
    ``memory_analysis()`` reports no host bytes, so the device-memory saving is visible only
    on a GPU/TPU. Here: the offload is in the traced step (a ``device_put`` to host memory
    inside the layer scan), it compiles, and it trains exactly as without it."""
    e = engine(0, {"policy": "full", "cpu_checkpointing": True})
    policy = settings.remat_policy(e.config)
    step = jzero.make_train_step(e.plan, scan_loss, e.optimizer, StepOptions(remat_policy=policy))
    text = str(jax.make_jaxpr(step)(e.state, batches(1)[0]))
    assert "<host>" in text and remat.LAYER_INPUT in text
    assert_reference(losses(e))
    # At stage 3, policy none keeps every activation of a gathered layer, in host memory.
    e3 = engine(3, {"policy": "none", "cpu_checkpointing": True})
    assert_reference(losses(e3))
    # A Python loop's layers offload their inputs the same way, at stage 3 too.
    cfg = {
        "train_batch_size": B,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "activation_checkpointing": {"policy": "full", "cpu_checkpointing": True},
    }
    loop = jzero.initialize(layered(params()), layered_loss, optax.adam(1e-3), cfg)
    text = str(jax.make_jaxpr(loop._step_fn(batches(1)[0]))(loop.state, batches(1)[0]))
    assert "<host>" in text and remat.LAYER_INPUT in text
    assert_reference(losses(loop))


def test_cpu_checkpointing_offloads_the_built_in_gpts_layer_inputs():
    """The built-in GPT (the long-context model: its layers are a scan whose body may hold the
    model's own remat, blockwise attention or a tiled MLP) keeps each layer's input in host
    memory under cpu_checkpointing: the traced step moves the tagged input to ``<host>``."""
    from jzero.demo import gpt

    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=2, d_model=16, d_ff=32, num_heads=2)
    params = jax.jit(gpt.init_params, static_argnums=1)(jax.random.key(0), cfg)
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "activation_checkpointing": {"policy": "full", "cpu_checkpointing": True},
    }

    def loss(p, b):
        return gpt.loss_fn(p, b, cfg)

    e = jzero.initialize(params, loss, config=config)
    policy = settings.remat_policy(e.config)
    assert policy.offload and policy.kind == "full"
    step = jzero.make_train_step(e.plan, loss, e.optimizer, StepOptions(remat_policy=policy))
    text = str(jax.make_jaxpr(step)(e.state, {"tokens": jnp.zeros((8, 17), jnp.int32)}))
    assert "<host>" in text and remat.LAYER_INPUT in text


def test_bad_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="one of none, full, dots, dots_no_batch, or names:a,b"):
        load_config({"activation_checkpointing": {"policy": "selective"}})
    with pytest.raises(ConfigError, match="did you mean 'full'"):
        load_config({"activation_checkpointing": {"policy": "ful"}})
    with pytest.raises(ConfigError, match="names:"):
        load_config({"activation_checkpointing": {"policy": "names:"}})
    with pytest.raises(ConfigError, match="checkpoints nothing at stage 0"):
        load_config({"activation_checkpointing": {"policy": "none", "cpu_checkpointing": True}})
    with pytest.raises(ValueError, match="not a policy"):
        remat.parse_policy("everything")


def test_stage3_never_saves_a_gathered_weight_whatever_the_policy():
    # 8 layers of 256x256: the weights (2 MiB) dominate; policy none keeps every activation
    # but must gather each layer again in the backward pass, as stage 3's default does.
    rng = np.random.default_rng(0)
    w = {"w": rng.normal(size=(8, 256, 256)) / 16}
    x = {"x": rng.normal(size=(64, 256))}

    def loss(p, b):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.T), None), b["x"], p["w"])
        return jnp.mean(h**2)

    cfg = {"train_batch_size": 64, "zero_optimization": {"stage": 3}}
    out = {}
    for policy in (None, "none"):
        section = {} if policy is None else {"activation_checkpointing": {"policy": policy}}
        e = jzero.initialize(w, loss, optax.adam(1e-3), {**cfg, **section})
        exe = e.lower(x).compile()
        out[policy] = exe.memory_analysis().temp_size_in_bytes, collectives(exe)["all-gather"]
    full_bytes = w["w"].nbytes
    for policy, (tmp, gathers) in out.items():
        assert gathers.bytes == pytest.approx(2 * full_bytes, rel=0.05), policy  # fwd + bwd
        assert tmp < out[None][0] + full_bytes // 4, policy  # no layer kept gathered


def stacked_loop_loss(p, b):
    """The scan's layers as a Python loop over slices of the stacked leaves."""
    x = b["x"]
    for i in range(L):
        x = x + jnp.tanh(x @ p["w1"][i]) @ p["w2"][i]
    return jnp.mean(x**2)


def layered(p):
    """The stacked leaves as one subtree per layer, ``layers_0`` ... (as Linen names them)."""
    return {f"layers_{i}": {"w1": p["w1"][i], "w2": p["w2"][i]} for i in range(L)}


def layered_loss(p, b):
    x = b["x"]
    for i in range(L):
        w = p[f"layers_{i}"]
        x = x + jnp.tanh(x @ w["w1"]) @ w["w2"]
    return jnp.mean(x**2)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_python_loop_is_checkpointed_layer_by_layer(stage):
    """No scan, no model change: each layer of the loop (found from the parameters' paths)
    keeps only its input under ``full``; at stage 3 its weights are gathered in the forward
    pass and once more in the recomputation, which also serves the backward pass (2x)."""

    def make(section):
        cfg = {
            "train_batch_size": B,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        if section:
            cfg["activation_checkpointing"] = section
        return jzero.initialize(layered(params()), layered_loss, optax.adam(1e-3), cfg)

    base, full = make(None), make({"policy": "full"})
    base_exe, full_exe = (e.lower(batches(1)[0]).compile() for e in (base, full))
    base_temp = base_exe.memory_analysis().temp_size_in_bytes
    full_temp = full_exe.memory_analysis().temp_size_in_bytes
    assert full_temp <= 0.6 * base_temp, (full_temp, base_temp)
    assert_reference(losses(base))  # the loop's layers are the scan's, one by one
    assert_reference(losses(full))
    if stage == 3:
        weights = sum(x.nbytes for x in jax.tree.leaves(params()))
        assert collectives(full_exe)["all-gather"].bytes == pytest.approx(2 * weights, rel=0.01)
        assert collectives(full_exe)["reduce-scatter"].bytes == pytest.approx(weights, rel=0.01)


def test_slices_of_a_stacked_leaf_in_a_loop_are_layers_too():
    plain = temp(engine(0, None, stacked_loop_loss))
    assert temp(engine(0, {"policy": "full"}, stacked_loop_loss)) <= 0.6 * plain


def test_layer_keys_of_pytrees_linen_and_nnx_paths():
    tree = {"embed": 0, "layers": [{"w": 0}, {"w": 0}], "Dense_3": {"kernel": 0}}
    assert trace.layer_keys(tree) == ["Dense_3", None, "layers/0", "layers/1"]


def test_checkpoint_scans_on_its_own_changes_what_is_saved_not_the_gradient():
    p, b = params(), {"x": batches(1)[0]["x"][:64]}
    f = gather.remat_scans(scan_loss, "full")
    assert "remat" in str(jax.make_jaxpr(jax.grad(f))(p, b))
    assert "remat" not in str(jax.make_jaxpr(jax.grad(scan_loss))(p, b))
    got, want = jax.jit(jax.grad(f))(p, b), jax.jit(jax.grad(scan_loss))(p, b)
    # float64: a recomputation rounds at most in another order, far below 1e-10 of a leaf.
    assert max_rel_error(got, want) < 1e-10


def _value_and_norm(loss, p, b):
    value, grads = jax.value_and_grad(loss)(p, b)
    return value, optax.global_norm(grads)


def test_partition_activations_splits_each_saved_layer_input_over_the_model_axis():
    """DeepSpeed's ``partition_activations`` on a data=4 x model=2 mesh: each layer's saved
    input (256 rows x 512 per device, 1 MiB) is kept as a half on each device of a model
    pair and gathered back before the recomputation; the same losses. Layers whose inputs
    dominate (a wide residual stream, a narrow hidden layer), their hidden layer split over
    the model axis (Megatron's column- then row-parallel pair), so the residual stream each
    layer saves is whole on both devices of a pair."""
    n, d, f, b = 8, 512, 128, 1024
    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(n, d, f)) / np.sqrt(d)
    w2 = rng.normal(size=(n, f, d)) / np.sqrt(f)
    batch = {"x": rng.normal(size=(b, d))}

    def wide_scan(p, b):
        def layer(x, w):
            return x + jnp.tanh(x @ w["w1"]) @ w["w2"], None

        return jnp.mean(jax.lax.scan(layer, b["x"], p)[0] ** 2)

    def wide_loop(p, b):
        x = b["x"]
        for i in range(n):
            x = x + jnp.tanh(x @ p[f"layers_{i}"]["w1"]) @ p[f"layers_{i}"]["w2"]
        return jnp.mean(x**2)

    half_input = (b // 4) * d * ITEM // 2
    stacked = {"w1": w1, "w2": w2}
    per_layer = {f"layers_{i}": {"w1": w1[i], "w2": w2[i]} for i in range(n)}
    specs = {
        0: {"w1": P(None, None, "model"), "w2": P(None, "model", None)},
        3: {f"layers_{i}": {"w1": P(None, "model"), "w2": P("model", None)} for i in range(n)},
    }
    # The single-device loss and gradient global norm of the first step.
    value, norm = jax.jit(lambda p, b: _value_and_norm(wide_scan, p, b))(stacked, batch)
    want = (float(value), float(norm))
    for stage, p, loss in ((0, stacked, wide_scan), (3, per_layer, wide_loop)):
        out = {}
        for part in (False, True):
            cfg = {
                "train_batch_size": b,
                "mesh": {"data": 4, "model": 2},
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                "activation_checkpointing": {"policy": "full", "partition_activations": part},
            }
            options = jzero.InitOptions(param_specs=specs[stage])
            e = jzero.initialize(p, loss, optax.sgd(1e-3), cfg, options=options)
            tmp = e.lower(batch).compile().memory_analysis().temp_size_in_bytes
            m = e.train_step(batch)
            out[part] = tmp, (float(m["loss"]), float(m["grad_norm"]))
        # At the peak, at least 4 of the 8 layers' saved inputs are halved in the scan, and at
        # least 2 in the loop (measured 6.75 and 2.87: the row-parallel layers' all-reduce
        # buffers share the loop's peak).
        assert out[True][0] <= out[False][0] - {0: 4, 3: 2}[stage] * half_input, (stage, out)
        np.testing.assert_allclose(out[True][1], want, rtol=1e-10, atol=0)
        np.testing.assert_allclose(out[False][1], want, rtol=1e-10, atol=0)
