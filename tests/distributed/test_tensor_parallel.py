"""AutoTP (``tensor_parallel.autotp_size``): Megatron-style specs from parameter names, composed
with ZeRO at every stage.

A Llama-style pytree with Hugging Face's names and no annotation trains on ``{data: 4, model:
2}`` exactly like the single-device optax loop: in float64 (each test enables x64) at 1e-10,
since a split layer sums its products in another order, which float32 rounds differently on
each CPU. The plan's specs are asserted leaf by leaf, and the compiled step's collectives by
the mesh axes their device groups span.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen
from jax.sharding import PartitionSpec as P
from numerics import EPS, max_rel_error, needs_float16

import jzero
from jzero.costs import ModelShape, ParallelDims
from jzero.hlo import collectives_by_axes, collectives_by_dtype, program_text, replica_groups
from jzero.parallel import autotp_specs
from jzero.step import logical_view

V, D, H, DH, F, L, T = 64, 32, 4, 8, 64, 2, 8
BATCH = 16
CLIP = 0.5
LR = 1e-2


pytestmark = pytest.mark.usefixtures("x64")  # conftest's float64


def make_llama(seed=0):
    """A Llama-style params tree with Hugging Face's names, layers stacked (float64)."""
    ks = iter(jax.random.split(jax.random.key(seed), 16))

    def normal(shape, std=0.1):
        return std * jax.random.normal(next(ks), shape, jnp.float64)

    ones = functools.partial(jnp.ones, dtype=jnp.float64)
    proj = {n: {"weight": normal((L, D, H * DH))} for n in ("q_proj", "k_proj", "v_proj")}
    return {
        "model": {
            "embed_tokens": {"weight": normal((V, D))},
            "layers": {
                "input_layernorm": {"weight": ones((L, D))},
                "self_attn": {**proj, "o_proj": {"weight": normal((L, H * DH, D))}},
                "post_attention_layernorm": {"weight": ones((L, D))},
                "mlp": {
                    "gate_proj": {"weight": normal((L, D, F))},
                    "up_proj": {"weight": normal((L, D, F))},
                    "down_proj": {"weight": normal((L, F, D))},
                },
            },
            "norm": {"weight": ones((D,))},
        },
        "lm_head": {"weight": normal((D, V))},
    }


def _rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w


def llama_loss(p, batch):
    """Next-token cross-entropy of the Llama-style model (causal attention, SwiGLU MLP)."""
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = jnp.take(p["model"]["embed_tokens"]["weight"], inputs, axis=0)

    def layer(x, lp):
        b, t, _ = x.shape
        a, m = lp["self_attn"], lp["mlp"]
        h = _rms(x, lp["input_layernorm"]["weight"])
        q, k, v = (
            (h @ a[n]["weight"]).reshape(b, t, H, DH) for n in ("q_proj", "k_proj", "v_proj")
        )
        s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(DH)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
        o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(b, t, H * DH)
        x = x + o @ a["o_proj"]["weight"]
        h = _rms(x, lp["post_attention_layernorm"]["weight"])
        x = (
            x
            + (jax.nn.silu(h @ m["gate_proj"]["weight"]) * (h @ m["up_proj"]["weight"]))
            @ (m["down_proj"]["weight"])
        )
        return x, None

    x, _ = jax.lax.scan(layer, x, p["model"]["layers"])
    logits = _rms(x, p["model"]["norm"]["weight"]) @ p["lm_head"]["weight"]
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)
    return -picked.mean()


def batches(n=3, seed=1):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, V, (BATCH, T + 1), dtype=np.int32)} for _ in range(n)]


@functools.cache
def reference():
    """The single-device optax loop with DeepSpeed's clipping: losses, grad norms, params."""
    tx = optax.adamw(LR)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(llama_loss)(params, batch)
        norm = optax.global_norm(grads)
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, CLIP / (norm + 1e-6)), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, norm

    params = make_llama()
    opt_state, losses, norms = tx.init(params), [], []
    for b in batches():
        params, opt_state, loss, norm = step(params, opt_state, b)
        losses.append(float(loss))
        norms.append(float(norm))
    return losses, norms, jax.device_get(params)


def config(stage, tp=2, **extra):
    return {
        "train_batch_size": BATCH,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"autotp_size": tp},
        **extra,
    }


@functools.cache
def trained(stage):
    engine = jzero.initialize(make_llama(), llama_loss, optax.adamw(LR), config(stage))
    metrics = [engine.train_step(b) for b in batches()]
    return engine, [float(m["loss"]) for m in metrics], [float(m["grad_norm"]) for m in metrics]


# Where each projection is split over `model` (Megatron's column / row / vocabulary split).
EXPECTED = {
    "model.embed_tokens.weight": (P("model"), "vocab"),
    "model.layers.self_attn.q_proj.weight": (P(None, None, "model"), "column"),
    "model.layers.self_attn.k_proj.weight": (P(None, None, "model"), "column"),
    "model.layers.self_attn.v_proj.weight": (P(None, None, "model"), "column"),
    "model.layers.self_attn.o_proj.weight": (P(None, "model"), "row"),
    "model.layers.mlp.gate_proj.weight": (P(None, None, "model"), "column"),
    "model.layers.mlp.up_proj.weight": (P(None, None, "model"), "column"),
    "model.layers.mlp.down_proj.weight": (P(None, "model"), "row"),
    "model.layers.input_layernorm.weight": (P(), "norm"),
    "model.layers.post_attention_layernorm.weight": (P(), "norm"),
    "model.norm.weight": (P(), "norm"),
    "lm_head.weight": (P(None, "model"), "vocab head"),
}


def _model_dims(spec):
    return [i for i, e in enumerate(tuple(spec)) if e == "model" or (
        isinstance(e, tuple) and "model" in e)]  # fmt: skip


# Stage 3 gathers the parameters (on each device's model-axis piece); stages 1 and 2 keep them
# whole and reduce-scatter the gradient (one path without accumulation). Stage 0's all-reduce
# beside a model axis: test_mesh_axes.py's stage 0.
@pytest.mark.parametrize("stage", [1, 3])
def test_autotp_llama_trains_like_the_single_device_optax_loop(stage):
    engine, losses, norms = trained(stage)
    assert dict(engine.mesh.shape) == {"data": 4, "model": 2}
    ref_losses, ref_norms, ref_params = reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-10, atol=0)
    assert max_rel_error(jax.device_get(engine.params), ref_params) < 1e-9
    # The plan splits each projection as its rule says, and ZeRO's data axis sits beside it.
    flat = jax.tree_util.tree_flatten_with_path(engine.params)[0]
    by_path = {leaf.path: i for i, leaf in enumerate(engine.plan.leaves)}
    for path, (spec, rule) in EXPECTED.items():
        i = by_path[path]
        assert engine.plan.base_specs[i] == spec, path
        tp_rule = engine.plan.options.parallel.tp_rules[i]
        assert tp_rule.startswith(rule), (path, tp_rule)
        at_rest = flat[i][1].sharding.spec
        assert _model_dims(at_rest) == _model_dims(spec), (path, at_rest)
    if stage == 3:  # ZeRO shards a dimension the model axis leaves free, never the layer dim
        q = engine.params["model"]["layers"]["self_attn"]["q_proj"]["weight"]
        assert q.sharding.spec == P(None, "data", "model")
        assert q.addressable_shards[0].data.shape == (L, D // 4, H * DH // 2)
    assert "tensor parallel (AutoTP) over {'model': 2}" in engine.describe()


@functools.cache
def trained16(stage, half):
    """The Llama on {data: 4, model: 2} computing in bf16 or fp16 from float32 masters: its
    engine and the losses of reference()'s batches."""
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), make_llama())
    # fp16 starts at a loss scale of 2**8: no overflow in the first steps, so none is skipped.
    section = {"fp16": {"enabled": True, "initial_scale_power": 8}, "bf16": {"enabled": True}}
    cfg = config(stage, **{half: section[half]})
    with jax.enable_x64(False):
        engine = jzero.initialize(params, llama_loss, optax.adamw(LR), cfg)
        metrics = [engine.train_step(b) for b in batches()]
    assert sum(int(m["skipped"]) for m in metrics) == 0
    return engine, [float(m["loss"]) for m in metrics]


# bf16 with AutoTP at stage 3 aborted XLA:CPU's compiler (its bf16 all-reduce promotion on the
# reductions of a shard_map that leaves `model` to the partitioner: jzero.comm.overlap). Its
# bound is 16 unit roundoffs of a 16-bit type, beyond any instruction set's float32 rounding
# (checked under AVX2 and SSE4_2), so CI's second instruction set does not rerun it.
@pytest.mark.parametrize("half", ["bf16", pytest.param("fp16", marks=needs_float16)])
@pytest.mark.parametrize("stage", [1, 3])
def test_16bit_compute_with_autotp_runs_and_tracks_float64(stage, half):
    engine, losses = trained16(stage, half)
    ref_losses = reference()[0]
    assert losses != ref_losses  # the forward really ran in 16 bits
    # Each loss is a forward that rounds each activation to 16 bits about 12 times (embedding,
    # 2 layers x (2 norms, 3 projections, attention, 2 MLP products), the head), each within
    # EPS relative, of float32 masters that track the float64 run's: within 16 EPS (bf16 6.3%).
    bound = 16 * EPS["bfloat16" if half == "bf16" else "float16"]
    np.testing.assert_allclose(losses, ref_losses, rtol=bound, atol=0)
    if (stage, half) == (3, "bf16"):  # the case that aborted: its gradients cross the data
        with jax.enable_x64(False):  # axis in bf16 (jzero does not widen them), as on a GPU
            moved = collectives_by_dtype(program_text(engine.lower(batches(1)[0])))
        assert moved["reduce-scatter"]["bf16"].count > 0


def _zero_gathers_over_model(compiled, mesh):
    """All-gathers within the model groups that XLA made out of ZeRO's own collectives (a
    weight or gradient gathered whole over `model` before its data-axis collective)."""
    names, sizes = list(mesh.shape), list(mesh.shape.values())
    found = []
    for line in compiled.as_text().splitlines():
        if " all-gather(" not in line and " all-gather-start(" not in line:
            continue
        groups = replica_groups(line, mesh.size)
        coords = [np.array(np.unravel_index(g, sizes)).T for g in groups]
        spanned = {names[i] for c in coords for i in range(len(names)) if len(set(c[:, i])) > 1}
        origin = re.search(r'op_name="([^"]*)"', line)
        if (
            spanned == {"model"}
            and origin
            and origin.group(1).endswith(("reduce_scatter", "all_gather", "psum_scatter"))
        ):
            found.append(line.strip()[:160])
    return found


def test_model_axis_collectives_stay_within_model_groups_and_zero_within_data():
    for stage in (1, 3):
        engine, _, _ = trained(stage)
        compiled = engine.lower(batches()[0]).compile()
        # ZeRO's collectives run on each device's model-axis piece: no gradient or parameter
        # is gathered whole over `model` first (jzero.comm.manual).
        assert _zero_gathers_over_model(compiled, engine.mesh) == [], stage
        by_axes = collectives_by_axes(compiled, engine.mesh)
        # Megatron's activation all-reduces (after the row-parallel layers) run within the
        # model groups ...
        assert by_axes[("model",)]["all-reduce"].count >= 2 * L, by_axes.keys()
        # ... and ZeRO's gradient reduce-scatter and parameter all-gather within data groups.
        data = by_axes[("data",)]
        assert data["reduce-scatter"].count > 0 and data["all-gather"].count > 0
        grad_bytes = sum(math.prod(x.shape) * 8 for x in jax.tree.leaves(make_llama()))
        assert data["reduce-scatter"].bytes >= grad_bytes // 2 // 2  # a model shard's grads
        # Nothing gradient-sized spans both axes: only scalars (loss, norms) do.
        both = by_axes.get(("data", "model"), {})
        for kind, stats in both.items():
            assert stats.bytes <= 64 * max(stats.count, 1), (stage, kind, stats)


def test_checkpoints_move_between_tensor_parallel_sizes(tmp_path):
    """T=2 x D=4 at stage 3 (the engine :func:`trained` shares) saves; T=1 x D=8 and T=4 x D=2
    restore every parameter and optimizer state bit for bit, and their next step's loss is
    the saving engine's loss on the same parameters."""
    first, _, _ = trained(3)
    first.save_checkpoint(tmp_path / "ckpt")
    first.wait_until_finished()
    written = jax.device_get(logical_view(first.plan, first.state))
    b = batches()
    expected = float(first.evaluate(b[1]))
    cfg = {"checkpoint": {"directory": str(tmp_path / "ckpt")}}
    for tp, stage in ((1, 1), (4, 2)):
        other = jzero.initialize(
            make_llama(seed=7), llama_loss, optax.adamw(LR), {**cfg, **config(stage, tp)},
        )  # fmt: skip
        assert dict(other.mesh.shape).get("model", 1) == tp
        other.restore()
        restored = jax.device_get(logical_view(other.plan, other.state))
        for field in ("params", "opt_state"):
            got, want = getattr(restored, field), getattr(written, field)
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(x, y)  # a checkpoint holds the logical values
        assert float(other.train_step(b[1])["loss"]) == pytest.approx(expected, rel=1e-10)


def test_fused_qkv_splits_per_head_group():
    """4 heads on T=2: each model device holds the q, k and v columns of its two heads."""
    d = 16
    params = {
        "h": {"attn": {
            "c_attn": {"weight": jnp.arange(d * 3 * d, dtype=jnp.float64).reshape(d, 3, d),
                       "bias": jnp.zeros((3, d), jnp.float64)},
            "c_proj": {"weight": jnp.ones((d, d), jnp.float64), "bias": jnp.zeros((d,))},
        }},
        "wte": {"weight": jnp.ones((V, d))},
        "wpe": {"weight": jnp.ones((T, d))},
        "ln_f": {"weight": jnp.ones((d,))},
        "flat": {"c_attn": {"weight": jnp.ones((d, 3 * d))}},
    }  # fmt: skip
    specs, choices = autotp_specs(params, 2, num_heads=4)
    rules = {c.path: c.rule for c in choices}
    assert specs["h"]["attn"]["c_attn"]["weight"] == P(None, None, "model")
    assert specs["h"]["attn"]["c_attn"]["bias"] == P(None, "model")
    assert rules["h.attn.c_attn.weight"] == "fused qkv per head group (c_attn)"
    assert specs["h"]["attn"]["c_proj"]["weight"] == P("model")
    assert specs["h"]["attn"]["c_proj"]["bias"] == P()
    assert specs["wte"]["weight"] == P("model") and specs["wpe"]["weight"] == P()
    # A flat (d, 3d) fused leaf can't rest per head: replicated, with the fix named.
    assert specs["flat"]["c_attn"]["weight"] == P()
    assert "store it as (d, 3, n)" in rules["flat.c_attn.weight"]
    # On the mesh: device j of `model` holds heads 2j, 2j+1 of q, k and v alike.
    mesh = jzero.make_mesh({"data": 4, "model": 2})
    w = params["h"]["attn"]["c_attn"]["weight"]
    placed = jax.device_put(
        w, jax.sharding.NamedSharding(mesh, specs["h"]["attn"]["c_attn"]["weight"])
    )
    head = d // 4
    for shard in placed.addressable_shards:
        j = mesh.devices.flatten().tolist().index(shard.device) % 2  # the model index
        cols = np.arange(2 * j * head, (2 * j + 2) * head)
        np.testing.assert_array_equal(shard.data, np.asarray(w)[:, :, cols])


def test_user_annotations_and_tp_plan_win_over_the_rules():
    params = make_llama()
    user = jax.tree.map(lambda _: P(), params)
    user["lm_head"]["weight"] = P("model", None)
    plan = {"*.mlp.down_proj.*": "replicate", "model.norm.*": [None]}
    specs, choices = autotp_specs(params, 2, tp_plan=plan, param_specs=user)
    rules = {c.path: c.rule for c in choices}
    assert specs["lm_head"]["weight"] == P("model", None) and rules["lm_head.weight"] == (
        "your annotation"
    )
    assert specs["model"]["layers"]["mlp"]["down_proj"]["weight"] == P()
    assert rules["model.layers.mlp.down_proj.weight"] == "tp_plan '*.mlp.down_proj.*'"
    assert specs["model"]["layers"]["mlp"]["up_proj"]["weight"] == P(None, None, "model")


def test_unmatched_leaves_are_listed_once_in_the_plan():
    params = {**make_llama(), "adapter": {"gain": jnp.ones((L, D))}}

    def loss(p, b):
        return llama_loss(p, b) + 0.0 * jnp.sum(p["adapter"]["gain"])

    engine = jzero.initialize(params, loss, optax.sgd(LR), config(1))
    text = engine.describe()
    assert "leaves no tensor-parallel rule matched, replicated over model (1; " in text
    assert text.count("adapter.gain") == 2  # its table row, and the one list


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"tensor_parallel": {"autotp_size": 3}, "model": {"num_heads": 4, "d_model": 32}},
         r"autotp_size: 3 does not divide the 4 attention heads.*divisors of 4 \(1, 2, 4\)"),
        ({"tensor_parallel": {"autotp_size": 2, "tp_size": 4}}, r"autotp_size 2 and tp_size 4"),
        ({"tensor_parallel": {"autotp_size": 2}, "mesh": {"data": -1, "model": 4}},
         r"mesh.model is 4; remove mesh.model or set it to 2"),
        ({"tensor_parallel": {"autotp_size": -2}}, r"autotp_size: -2 is not allowed"),
    ],
)  # fmt: skip
def test_bad_tensor_parallel_settings_are_clear_errors(cfg, message):
    with pytest.raises(ValueError, match=message):
        jzero.load_config(cfg).mesh_sizes()


def test_a_size_that_does_not_divide_a_split_dimension_names_the_leaf():
    params = make_llama()
    with pytest.raises(ValueError, match=r"autotp_size: 3 does not divide dimension 1 \(64\) of "
                       r"lm_head.weight \(32, 64\), which the rule vocab head"):  # fmt: skip
        autotp_specs(params, 3)


def test_the_estimate_divides_the_model_by_t_and_shards_the_rest_over_the_data_group():
    psi, n, t = 7.5e9, 64, 4
    e = jzero.estimate(ModelShape(psi), ParallelDims(n, model=t))
    d = n // t  # ZeRO's group: the data axis beside the model axis
    assert e.row(3).device_bytes == pytest.approx(16 * psi / (d * t))
    assert e.row(1).device_bytes == pytest.approx(4 * psi / t + 12 * psi / t / d)
    assert e.row(0).device_bytes == pytest.approx(16 * psi / t)
    # Megatron's activation split, and its traffic: 4 all-reduces of s b h a layer.
    model = ModelShape(psi, seq_len=2048, hidden=4096, layers=32, heads=32)
    split = jzero.estimate(model, ParallelDims(n, micro_batch=1, model=t)).row(3)
    whole = jzero.estimate(model, ParallelDims(n, micro_batch=1)).row(3)
    s, h, a, L = 2048, 4096, 32, 32
    per_layer = s * h * (10 + 24 / t) + 5 * a * s * s / t  # Korthikanti et al., bf16
    assert split.activations == pytest.approx(L * per_layer)
    assert split.activations < whole.activations
    assert split.model_axis_bytes == pytest.approx(4 * 2 * (t - 1) / t * s * h * 2 * L)
    assert whole.model_axis_bytes == 0
    seq = jzero.estimate(model, ParallelDims(n, micro_batch=1, seq=4)).row(3)
    assert seq.activations == pytest.approx(whole.activations / 4)
    assert seq.device_bytes == pytest.approx(whole.device_bytes)  # ZeRO over data x seq


def test_jzero_plan_reports_per_device_bytes_and_the_model_axis_traffic():
    from jzero.demo.plan import plan_report

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "model": {"vocab_size": 64, "seq_len": 16, "num_layers": 2, "num_heads": 4,
                  "d_model": 32, "d_ff": 64},
    }  # fmt: skip
    with jax.enable_x64(False):
        plain = plan_report(cfg, stages=(1,), compare_checkpointing=False)
        split = plan_report(
            cfg,
            stages=(1,),
            compare_checkpointing=False,
            overrides=["tensor_parallel.autotp_size=2"],
        )
    one, two = plain.row(1), split.row(1)
    assert one.model_axis_bytes is None and two.model_axis_bytes > 0
    assert two.device["params"] < one.device["params"]  # each device holds half the matrices
    assert "model/step" in split.table() and "mesh {'data': 4, 'model': 2}" in split.table()


def test_jzero_train_runs_the_gpt_split_over_model_and_seq(tmp_path, tiny_gpt):
    """`jzero train --set tensor_parallel.autotp_size=2 --set sequence_parallel_size=2` on 8
    devices, 4 heads: 2 a model device, split again over seq. Its checkpoint restores at
    other tensor-parallel sizes: test_checkpoints_move_between_tensor_parallel_sizes."""
    from jzero import train

    model = ", ".join(f"{k}: {v}" for k, v in {**tiny_gpt, "num_heads": 4}.items())
    tiny = [
        f"model={{{model}}}",
        "data={source: stdlib, max_bytes: 200000}",
        "train_micro_batch_size_per_gpu=2",
        "train.eval_interval=0",
        f"train.log_dir={tmp_path / 'run'}",
        f"checkpoint.directory={tmp_path / 'ckpt'}",
        "tensor_parallel.autotp_size=2",
        "sequence_parallel_size=2",
    ]
    with jax.enable_x64(False):
        run = train.run("configs/zero3.yaml", overrides=tiny, steps=1, progress=False)
    assert run["steps"] == 1 and run["devices"] == 2  # data-parallel: 8 / (T x S)
    assert run["mesh"] == {"data": 2, "seq": 2, "model": 2}
    assert math.isfinite(run["final_loss"]) and (tmp_path / "ckpt").is_dir()


def test_the_built_in_gpt_splits_its_attention_heads_over_model():
    """4 heads on T=2: each device's attention scores hold 2 heads, and the fused qkv rests
    split per head group."""
    from jzero.demo import gpt

    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=4, d_model=32,
                        d_ff=64)  # fmt: skip
    with jax.enable_x64(False):
        engine = jzero.initialize(
            gpt.init_params(jax.random.key(0), cfg),
            lambda p, b: gpt.loss_fn(p, b, cfg),
            optax.adamw(1e-3),
            {"train_batch_size": 8, "tensor_parallel": {"autotp_size": 2}},
        )
        hlo = engine.lower({"tokens": np.zeros((8, 17), np.int32)}).compile().as_text()
    qkv = engine.params["blocks"]["attn_qkv"]
    assert qkv.sharding.spec == P(None, None, None, "model")
    assert qkv.addressable_shards[0].data.shape == (2, 32, 3, 16)
    # Scores [rows, heads, t, t]: 2 rows a data group (8 rows over data=4), 2 of the 4 heads.
    assert re.search(r"f32\[2,2,16,16\]", hlo) and not re.search(r"f32\[2,4,16,16\]", hlo)


class FlaxAttentionBlock(linen.Module):
    """Flax's own multi-head attention (DenseGeneral q/k/v of (d, H, Dh), out of (H, Dh, d))."""

    @linen.compact
    def __call__(self, x):
        f64 = {"dtype": jnp.float64, "param_dtype": jnp.float64}
        y = linen.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * DH, **f64)(x)
        return linen.Dense(V, **f64)(x + y)


def test_flax_multi_head_attention_splits_on_its_heads_dimension():
    block = FlaxAttentionBlock()
    rng = np.random.default_rng(2)
    b = [{"x": rng.normal(size=(BATCH, T, D)), "y": rng.integers(0, V, (BATCH, T))}
         for _ in range(2)]  # fmt: skip

    def loss(p, batch):
        logits = block.apply({"params": p}, batch["x"])
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)
        return -picked.mean()

    params = block.init(jax.random.key(0), b[0]["x"][:2])["params"]
    split = jzero.initialize(params, loss, optax.adamw(LR), config(1))
    whole = jzero.initialize(params, loss, optax.adamw(LR), config(1, tp=1))
    tp_rules = split.plan.options.parallel.tp_rules
    rules = dict(zip([leaf.path for leaf in split.plan.leaves], tp_rules, strict=True))
    attn = "MultiHeadDotProductAttention_0"
    assert rules[f"{attn}.query.kernel"] == "column per head (query)"
    assert rules[f"{attn}.out.kernel"] == "row per head (out)"
    q = split.params[attn]["query"]["kernel"]  # (d, H, Dh): the heads split, never Dh
    assert _model_dims(q.sharding.spec) == [1]
    assert _model_dims(split.params[attn]["out"]["kernel"].sharding.spec) == [0]
    for batch in b:
        np.testing.assert_allclose(
            float(split.train_step(batch)["loss"]), float(whole.train_step(batch)["loss"]),
            rtol=1e-10,
        )  # fmt: skip
