"""Mixture of experts in the built-in GPT (``GPTConfig.num_experts``): the slot-based MoE MLP
equals a dense reference written here (every expert on every token, masked by the router:
``jzero.moe.dense_reference``), with and without capacity drops and dropless
(``drop_tokens=False``), for ``moe_every`` 1 and 2;
the functional, unrolled and NNX forms agree; under ``expert_parallel`` at ZeRO stage 3 on 8
devices the first step's loss, metrics and update equal the single-device computation, the
``blocks.experts.*`` leaves (and only they) rest split over ``expert``; ``num_experts=0`` is
the dense model's tree; bad MoE settings name their numbers.

Numerics run in float64 (random weights in the init's tree: biases non-zero, a sharp router):
the forms compute the same sums in other orders, so they agree to 1e-12 relative, not to one
CPU's float32 rounding.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jzero
from jzero.demo import gpt
from jzero.demo.gpt import GPT, GPTConfig, init_params, loss_fn, nnx_loss_fn
from jzero.plan import describe
from jzero.rewrite import gather

TINY = {"vocab_size": 32, "seq_len": 8, "num_layers": 2, "num_heads": 2, "d_model": 16, "d_ff": 32}
E, K = 4, 2
ROWS = 4  # the float64 checks route ROWS * seq_len = 32 tokens in one call
NO_DROP = E / K  # capacity_factor at which each expert has a slot for every token
DEVICES, EP, LR = 8, 4, 0.05

DENSE_BLOCK = {  # the dense model's per-layer leaves, as before MoE existed
    "attn_out", "attn_out_bias", "attn_qkv", "attn_qkv_bias", "ln1_bias", "ln1_scale",
    "ln2_bias", "ln2_scale", "mlp_in", "mlp_in_bias", "mlp_out", "mlp_out_bias",
}  # fmt: skip
EXPERT_LEAVES = ["blocks.experts.b_fc", "blocks.experts.b_proj", "blocks.experts.w_fc",
                 "blocks.experts.w_proj"]  # fmt: skip


pytestmark = pytest.mark.float64  # the module's fixtures too (conftest)


def moe_cfg(moe_every: int = 1, **more) -> GPTConfig:
    layers = 2 * moe_every  # two scan units either way
    return GPTConfig(
        **{**TINY, "num_layers": layers},
        num_experts=E,
        experts_per_token=K,
        moe_every=moe_every,
        dtype="float64",
        **more,
    )


def tokens(rows: int, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, TINY["vocab_size"], (rows, TINY["seq_len"] + 1)), jnp.int32)


@functools.cache
def params64(moe_every: int) -> dict:
    """Random float64 weights in the init's tree (numpy: nothing to compile): non-zero biases,
    LayerNorm scales off 1, and a router sharp enough that its top-k choices are clear."""
    abstract = jax.eval_shape(lambda: init_params(jax.random.key(0), moe_cfg(moe_every)))
    rng = np.random.default_rng(moe_every)

    def fill(path, x):
        name = jzero_path(path)
        if name.endswith("scale"):
            return 1.0 + 0.1 * rng.normal(size=x.shape)
        return (2.0 if name.endswith("router") else 0.2) * rng.normal(size=x.shape)

    return jax.tree_util.tree_map_with_path(fill, abstract)


def with_nnx(params: dict, cfg: GPTConfig) -> GPT:
    """An NNX GPT holding ``params`` (built abstractly: no init computation)."""
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(1)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


# ----------------------------------------------------------------------------------------------
# The reference: the GPT as a Python loop over layers, each MoE MLP dense (no slots, no scan).


def expert_mlps(e: dict, h: jax.Array) -> jax.Array:
    """Expert i's GELU MLP on row i of h [E, N, d], one vmap over the experts."""

    def one(w_fc, b_fc, w_proj, b_proj, x):
        return jax.nn.gelu(x @ w_fc + b_fc) @ w_proj + b_proj

    return jax.vmap(one)(e["w_fc"], e["b_fc"], e["w_proj"], e["b_proj"], h)


def reference_loss(params: dict, batch: dict, cfg: GPTConfig) -> tuple[jax.Array, dict]:
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    emb = params["embed"]
    x = emb["tokens"][inputs] + emb["positions"][: inputs.shape[1]]
    aux, dropped = [], []
    for u in range(cfg.num_layers // cfg.moe_every):
        unit = jax.tree.map(lambda w, u=u: w[u], params["blocks"])
        for j in range(cfg.moe_every - 1):
            x = gpt._block(jax.tree.map(lambda w, j=j: w[j], unit["dense"]), x, cfg)
        x = x + gpt._attention(unit, gpt._layer_norm(x, unit["ln1_scale"], unit["ln1_bias"]), cfg)
        h = gpt._layer_norm(x, unit["ln2_scale"], unit["ln2_bias"])
        y, stats = jzero.moe.dense_reference(
            h @ unit["router"],
            functools.partial(expert_mlps, unit["experts"]),
            h,
            experts_per_token=cfg.experts_per_token,
            capacity_factor=cfg.capacity_factor,
            min_capacity=4,
            drop_tokens=cfg.drop_tokens,
        )
        x = x + y
        aux.append(stats.aux_loss)
        dropped.append(stats.dropped_fraction)
    logits = gpt._head(params["ln_f"], emb["tokens"], x)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))
    total = sum(aux)
    info = {"moe_aux_loss": total, "moe_dropped_fraction": sum(dropped) / len(dropped)}
    return ce + cfg.moe_aux_loss_coef * total, info


@pytest.fixture(scope="module", params=[1, 2], ids=["moe_every=1", "moe_every=2"])
def forms(request) -> tuple[int, dict]:
    """Every form's ``(loss, aux)`` on the same weights and batch, at a capacity with no drop,
    at the default one (1.25, which drops) and dropless, in one compiled program per
    ``moe_every``."""
    moe_every = request.param
    params = params64(moe_every)
    batch = {"tokens": tokens(ROWS)}
    configs = {
        "no_drop": moe_cfg(moe_every, capacity_factor=NO_DROP),
        "default": moe_cfg(moe_every),
        "dropless": moe_cfg(moe_every, drop_tokens=False),
    }

    @jax.jit
    def run(params: dict) -> dict:
        out = {}
        for name, cfg in configs.items():
            out[name] = {
                "functional": loss_fn(params, batch, cfg),
                "reference": reference_loss(params, batch, cfg),
                "unrolled": gpt.unrolled_loss_fn(gpt.unstack_blocks(params), batch, cfg),
                "nnx": nnx_loss_fn(with_nnx(params, cfg), batch),
            }
        return out

    return moe_every, jax.device_get(run(params))


def rel(a, b) -> float:
    return abs(float(a) - float(b)) / abs(float(b))


def test_moe_gpt_equals_the_dense_reference_without_drops(forms):
    _, out = forms
    (loss, aux), (want, want_aux) = out["no_drop"]["functional"], out["no_drop"]["reference"]
    assert loss.dtype == np.float64
    assert float(aux["moe_dropped_fraction"]) == float(want_aux["moe_dropped_fraction"]) == 0.0
    assert rel(loss, want) <= 1e-12, (loss, want)
    assert rel(aux["moe_aux_loss"], want_aux["moe_aux_loss"]) <= 1e-12
    assert float(aux["moe_aux_loss"]) > 2.0  # two layers, each >= 1 (uniform routing gives 1)


def test_moe_gpt_drops_as_the_dense_reference(forms):
    # At capacity_factor 1.25 (capacity 20 of 32 tokens' 64 choices) this router overfills
    # some expert: the dropped choices must be the same ones.
    _, out = forms
    (loss, aux), (want, want_aux) = out["default"]["functional"], out["default"]["reference"]
    assert float(aux["moe_dropped_fraction"]) == float(want_aux["moe_dropped_fraction"]) > 0.0
    assert rel(loss, want) <= 1e-12, (loss, want)
    assert rel(loss, out["no_drop"]["functional"][0]) > 1e-6  # the drops change the loss


def test_dropless_moe_gpt_equals_the_reference_and_a_capacity_that_drops_nothing(forms):
    _, out = forms
    (loss, aux), (want, want_aux) = out["dropless"]["functional"], out["dropless"]["reference"]
    assert float(aux["moe_dropped_fraction"]) == float(want_aux["moe_dropped_fraction"]) == 0.0
    assert rel(loss, want) <= 1e-12, (loss, want)
    # a slot for every token at capacity_factor E / k: the same model, the same numbers
    assert rel(loss, out["no_drop"]["functional"][0]) <= 1e-12


def test_functional_unrolled_and_nnx_forms_agree(forms):
    _, out = forms
    for case in out.values():
        loss, aux = case["functional"]
        for form in ("unrolled", "nnx"):
            other, other_aux = case[form]
            assert rel(other, loss) <= 1e-12, (form, other, loss)
            assert rel(other_aux["moe_aux_loss"], aux["moe_aux_loss"]) <= 1e-12
            assert other_aux["moe_dropped_fraction"] == aux["moe_dropped_fraction"]


@pytest.mark.parametrize("moe_every", [1, 2])
def test_one_scan_consumes_every_stacked_leaf(moe_every):
    """Stage 3's contract (traced only, nothing compiled): one top-level scan, whose scanned
    operands are exactly the ``blocks`` leaves (through at most the cast), in both forms."""
    cfg = dataclasses.replace(moe_cfg(moe_every), dtype="bfloat16")
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    batch = {"tokens": jax.ShapeDtypeStruct((2, TINY["seq_len"] + 1), jnp.int32)}
    want = [
        0 if jax.tree_util.keystr(p).startswith("['blocks']") else None
        for p, _ in jax.tree.leaves_with_path(params)
    ]
    assert gather.layer_dims(lambda p, b: loss_fn(p, b, cfg), params, batch) == want
    jaxpr = jax.make_jaxpr(lambda p, b: loss_fn(p, b, cfg))(params, batch)
    assert [e.primitive.name for e in jaxpr.jaxpr.eqns].count("scan") == 1
    assert sum(x.shape[0] == 2 for x in jax.tree.leaves(params["blocks"])) == len(
        jax.tree.leaves(params["blocks"])
    )

    graphdef, state = nnx.split(with_nnx(params, cfg))
    nnx_want = [
        0 if jax.tree_util.keystr(p).startswith("['blocks']") else None
        for p, _ in jax.tree.leaves_with_path(state)
    ]
    got = gather.layer_dims(lambda s, b: nnx_loss_fn(nnx.merge(graphdef, s), b), state, batch)
    assert got == nnx_want


def test_parameter_layout():
    for moe_every, extra in ((1, set()), (2, {f"dense.{n}" for n in DENSE_BLOCK})):
        cfg = moe_cfg(moe_every)
        params = jax.eval_shape(lambda cfg=cfg: init_params(jax.random.key(0), cfg))
        shapes = {jzero_path(p)[len("blocks.") :]: x.shape for p, x in _blocks(params)}
        attn = DENSE_BLOCK - {"mlp_in", "mlp_in_bias", "mlp_out", "mlp_out_bias"}
        assert set(shapes) == attn | {"router"} | {e[7:] for e in EXPERT_LEAVES} | extra
        d, f = TINY["d_model"], TINY["d_ff"]
        assert shapes["router"] == (2, d, E)
        assert shapes["experts.w_fc"] == (2, E, d, f)
        assert shapes["experts.b_fc"] == (2, E, f)
        assert shapes["experts.w_proj"] == (2, E, f, d)
        assert shapes["experts.b_proj"] == (2, E, d)
        if moe_every == 2:
            assert shapes["dense.mlp_in"] == (2, 1, d, f)
            assert shapes["dense.attn_qkv"] == (2, 1, d, 3, d)
        names = [jzero_path(p) for p, _ in jax.tree.leaves_with_path(params)]
        assert [n for n, e in zip(names, jzero.moe.expert_leaves(params), strict=True) if e] == (
            EXPERT_LEAVES
        )
        # the NNX module's parameter tree is the functional one
        model = nnx.eval_shape(lambda cfg=cfg: GPT(cfg, rngs=nnx.Rngs(0)))
        nnx_params = nnx.state(model, nnx.Param).to_pure_dict()
        assert jax.tree.map(lambda x: (x.shape, x.dtype), nnx_params) == jax.tree.map(
            lambda x: (x.shape, x.dtype), params
        )


def jzero_path(path) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def _blocks(params):
    return [(p, x) for p, x in jax.tree.leaves_with_path(params) if jzero_path(p).startswith("b")]


def test_num_experts_zero_is_the_dense_model():
    dense = GPTConfig(**TINY)
    also_dense = GPTConfig(**TINY, num_experts=0, experts_per_token=5, moe_every=3)
    for cfg in (dense, also_dense):
        assert not cfg.moe and cfg.num_units == TINY["num_layers"]
        params = jax.eval_shape(lambda cfg=cfg: init_params(jax.random.key(0), cfg))
        assert {jzero_path(p)[len("blocks.") :] for p, _ in _blocks(params)} == DENSE_BLOCK
        assert all(x.shape[0] == TINY["num_layers"] for _, x in _blocks(params))
        batch = {"tokens": jax.ShapeDtypeStruct((2, TINY["seq_len"] + 1), jnp.int32)}
        out = jax.eval_shape(lambda p, b, cfg=cfg: loss_fn(p, b, cfg), params, batch)
        assert isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()  # no aux
        model = nnx.eval_shape(lambda cfg=cfg: GPT(cfg, rngs=nnx.Rngs(0)))
        nnx_params = nnx.state(model, nnx.Param).to_pure_dict()
        assert jax.tree.structure(nnx_params) == jax.tree.structure(params)


def test_bad_moe_settings_name_their_numbers():
    with pytest.raises(ValueError, match=r"experts_per_token=5 exceeds num_experts=4.*<= 4"):
        GPTConfig(**TINY, num_experts=4, experts_per_token=5)
    with pytest.raises(ValueError, match=r"num_layers=2 is not divisible by moe_every=3.*\[1, 2\]"):
        GPTConfig(**TINY, num_experts=4, moe_every=3)
    with pytest.raises(ValueError, match=r"num_experts=1 .*0 for the dense model.*>= 2"):
        GPTConfig(**TINY, num_experts=1)
    with pytest.raises(ValueError, match=r"num_experts=-2"):
        GPTConfig(**TINY, num_experts=-2)
    with pytest.raises(ValueError, match=r"capacity_factor=0.0 must be > 0"):
        GPTConfig(**TINY, num_experts=4, capacity_factor=0)
    with pytest.raises(ValueError, match=r"moe_every must be a positive integer, got 0"):
        GPTConfig(**TINY, num_experts=4, moe_every=0)
    with pytest.raises(ValueError, match=r"moe_aux_loss_coef=-1.0 must be >= 0"):
        GPTConfig(**TINY, num_experts=4, moe_aux_loss_coef=-1)
    cfg = GPTConfig.from_dict({**TINY, "num_experts": 8, "capacity_factor": 2})
    assert cfg.capacity_factor == 2.0 and isinstance(cfg.capacity_factor, float)


# ----------------------------------------------------------------------------------------------
# Expert parallelism at ZeRO stage 3 on the 8 devices.


def test_expert_parallel_stage3_step_equals_one_device():
    """Each of the 8 devices routes its own row (its 8 tokens, capacity 5: some drops), as
    DeepSpeed routes per rank, and the step's loss is the devices' mean: so the single-device
    computation is the mean over rows of the functional loss of each row, and its gradient."""
    cfg = moe_cfg(1)
    params = params64(1)
    batch = {"tokens": tokens(DEVICES, seed=3)}

    @jax.jit
    def reference(params: dict):
        def mean_loss(params):
            per_row = jax.vmap(lambda row: loss_fn(params, {"tokens": row[None]}, cfg))
            losses, aux = per_row(batch["tokens"])
            return jnp.mean(losses), jax.tree.map(jnp.mean, aux)

        (loss, aux), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
        return loss, aux, jax.tree.map(lambda p, g: p - LR * g, params, grads)

    want, want_aux, want_params = jax.device_get(reference(params))
    engine = jzero.initialize(
        params,
        lambda p, b: loss_fn(p, b, cfg),
        optax.sgd(LR),
        {
            "train_batch_size": DEVICES,
            "gradient_clipping": 0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "expert_parallel": {"autoep_size": EP},
            "model": {"num_experts": E},
        },
    )
    assert dict(engine.plan.mesh.shape) == {"data": DEVICES // EP, "expert": EP}
    experts = [
        leaf.path for leaf, e in zip(engine.plan.leaves, engine.plan.experts, strict=True) if e
    ]
    assert experts == EXPERT_LEAVES
    described = describe(engine.plan)
    assert f"experts: {len(EXPERT_LEAVES)} expert leaves split over 'expert'" in described

    metrics = engine.train_step(batch)
    assert rel(metrics["loss"], want) <= 1e-10, (float(metrics["loss"]), float(want))
    # float32 metrics: the aux loss to its rounding, the fraction exactly (multiples of 1/16)
    assert float(metrics["moe_dropped_fraction"]) == float(want_aux["moe_dropped_fraction"])
    assert float(want_aux["moe_dropped_fraction"]) > 0.0
    assert rel(metrics["moe_aux_loss"], want_aux["moe_aux_loss"]) <= 1e-6
    got_params = jax.device_get(engine.params)
    for path, got in jax.tree.leaves_with_path(got_params):
        want_leaf = functools.reduce(lambda t, k: t[k.key], path, want_params)
        scale = float(np.max(np.abs(want_leaf)))
        assert float(np.max(np.abs(got - want_leaf))) <= 1e-10 * scale, jzero_path(path)
