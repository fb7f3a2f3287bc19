"""AutoTP from the program: models whose weights carry their authors' own names are split over
``model`` by the Megatron pairs their traced loss shows (:mod:`jzero.rewrite.megatron`).

A Flax NNX transformer with einsum-style fused weights (GQA, a fused kv, a gated MLP, a tied
embedding) and an Equinox transformer of ``eqx.nn`` layers (weights ``[out, in]``) train on
``{data: 4, model: 2}`` at stages 1 and 3 exactly like the single-device optax loop (float64:
losses at 1e-10, parameters at 1e-9), every attention and MLP matmul weight split, no split
weight gathered whole over ``model`` in the compiled step, Megatron's all-reduces over
``model``, and at stage 1 no activation gathered or exchanged over ``model`` either (a
mis-split pair, e.g. ``q_einsum`` split on ``d`` or ``linear`` on its output, shows 15-17
all-gathers there; the gated MLP split gate-from-up, all-to-alls). On Hugging Face's Llama names and
the built-in GPT, whose names the rules know, the program alone gives the names' specs.
"""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import own_names as m  # tests/support
import pytest
import test_tensor_parallel as hf  # the Llama with Hugging Face's names
from flax import nnx
from jax.sharding import PartitionSpec as P
from numerics import max_rel_error

import jzero
from jzero.hlo import collectives_by_axes, replica_groups
from jzero.parallel import autotp_specs
from jzero.rewrite import program_splits

pytestmark = pytest.mark.float64

BATCH, LR, CLIP = 8, 1e-2, 0.5


def batches(n=3):
    rng = np.random.default_rng(3)
    return [{"tokens": rng.integers(0, m.V, (BATCH, m.T + 1), dtype=np.int32)} for _ in range(n)]


def config(stage, tp=2):
    return {
        "train_batch_size": BATCH,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"autotp_size": tp},
    }


def _nnx_parts():
    graph, params, rest = nnx.split(m.NNXTransformer(nnx.Rngs(0)), nnx.Param, ...)
    return params.to_pure_dict(), lambda p, b: m.nnx_loss(nnx.merge(graph, p, rest), b)


def _eqx_parts():
    params, static = eqx.partition(m.EqxTransformer(jax.random.key(0)), eqx.is_inexact_array)
    return params, lambda p, b: m.eqx_loss(eqx.combine(p, static), b)


MODELS = {
    "nnx": (lambda: m.NNXTransformer(nnx.Rngs(0)), m.nnx_loss, _nnx_parts),
    "equinox": (lambda: m.EqxTransformer(jax.random.key(0)), m.eqx_loss, _eqx_parts),
}


@functools.cache
def reference(kind):
    """The single-device optax loop with DeepSpeed's clipping: losses and final parameters."""
    params, loss_fn = MODELS[kind][2]()
    tx = optax.adamw(LR)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        norm = optax.global_norm(grads)
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, CLIP / (norm + 1e-6)), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for b in batches():
        params, opt_state, loss = step(params, opt_state, b)
        losses.append(float(loss))
    return losses, jax.device_get(params)


def _split_weight_gathers(compiled, mesh, shapes):
    """All-gathers within the model groups whose result is a weight's shape (a split weight
    gathered whole over ``model``). The sequence (12 tokens) is no weight's dimension, so an
    activation's shape never passes for a weight's."""
    names, sizes = list(mesh.shape), list(mesh.shape.values())
    found = []
    for line in compiled.as_text().splitlines():
        if " all-gather(" not in line and " all-gather-start(" not in line:
            continue
        coords = [np.array(np.unravel_index(g, sizes)).T for g in replica_groups(line, mesh.size)]
        spanned = {names[i] for c in coords for i in range(len(names)) if len(set(c[:, i])) > 1}
        result = re.search(r"= \(?f64\[([\d,]*)\]", line)
        if spanned == {"model"} and result:
            shape = tuple(int(x) for x in result.group(1).split(",") if x)
            if shape in shapes:
                found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("kind", ["nnx", "equinox"])
def test_a_model_with_its_own_names_is_split_from_its_program_and_trains_exactly(kind, stage):
    make, loss_fn, _ = MODELS[kind]
    b = batches()
    engine = jzero.initialize(
        model=make, loss_fn=loss_fn, optimizer=optax.adamw(LR), config=config(stage), batch=b[0]
    )
    assert dict(engine.mesh.shape) == {"data": 4, "model": 2}
    losses = [float(engine.train_step(x)["loss"]) for x in b]
    ref_losses, ref_params = reference(kind)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    got = jax.device_get(engine.params)
    assert max_rel_error(jax.tree.leaves(got), jax.tree.leaves(ref_params)) < 1e-9
    # Every matmul weight of attention and the MLP is split, by the program.
    rules = dict(zip([x.path for x in engine.plan.leaves], engine.plan.options.parallel.tp_rules,
                     strict=True))  # fmt: skip
    specs = dict(zip([x.path for x in engine.plan.leaves], engine.plan.base_specs, strict=True))
    layers = re.compile(r"attn|attention|mlp|feedforward")
    matmuls = [x.path for x in engine.plan.leaves if len(x.shape) >= 2 and layers.search(x.path)]
    assert len(matmuls) == (5 if kind == "nnx" else 6) * m.L
    for path in matmuls:
        assert "model" in tuple(specs[path]), (path, specs[path], rules[path])
        assert rules[path].endswith("(from the program)"), (path, rules[path])
    if kind == "nnx":  # the heads dimension of the fused weights, never Dh or the kv/gate pair
        assert specs["layers.0.attn.q_einsum"] == P(None, "model")
        assert specs["layers.0.attn.kv_einsum"] == P(None, None, "model")
        assert specs["layers.0.attn.attn_vec_einsum"] == P("model")
        assert specs["layers.0.mlp.gating_einsum"] == P(None, None, "model")
        assert specs["layers.0.mlp.linear"] == P("model")
        assert specs["embedder.input_embedding"] == P("model")  # the tied table's vocabulary
    else:  # [out, in]: column-split weights on their first dimension
        assert specs["body.0.attention.query_proj.weight"] == P("model")
        assert specs["body.0.attention.output_proj.weight"] == P(None, "model")
        assert specs["body.0.feedforward.layers.0.bias"] == P("model")
        assert specs["body.0.feedforward.layers.1.bias"] == P()
        assert specs["tok.weight"] == P("model") and specs["readout.weight"] == P("model")
    assert "split from the program (" in engine.describe()
    # No split weight is gathered whole over `model` in the compiled step.
    data = engine.mesh.shape["data"]
    shapes = set()
    for x in engine.plan.leaves:  # whole, or still split over data (stage 3 at rest)
        if "model" in str(specs[x.path]):
            shapes.add(x.shape)
            if x.param_dim is not None:
                shapes.add(tuple(n // data if i == x.param_dim else n
                                 for i, n in enumerate(x.shape)))  # fmt: skip
    compiled = engine.lower(b[0]).compile()
    assert _split_weight_gathers(compiled, engine.mesh, shapes) == []
    model = collectives_by_axes(compiled, engine.mesh)[("model",)]
    assert model["all-reduce"].count >= 2 * m.L  # Megatron's, after each row-parallel matmul
    if stage == 1:  # whole activations where a pair is mis-split: none here
        assert model["all-gather"].count == 0 and model["all-to-all"].count == 0


def _same_specs(params, loss_fn, batch, tp=2):
    """The specs the program alone gives (names off) and the names' specs, leaf by leaf."""
    program = program_splits(loss_fn, params, batch)
    by_program = autotp_specs(params, tp, program=program, by_name=False)
    by_name = autotp_specs(params, tp)
    return [
        (a.path, a.spec, b.spec)
        for a, b in zip(by_program[1], by_name[1], strict=True)
        if a.spec != b.spec
    ]


def test_on_hugging_face_llama_names_the_program_gives_the_names_specs():
    """The Llama of test_tensor_parallel.py (names known, layers stacked under a scan): that
    module trains it on these specs exactly like the optax loop at stages 1 and 3."""
    with jax.enable_x64(True):
        params = hf.make_llama()
        assert _same_specs(params, hf.llama_loss, hf.batches(1)[0]) == []
        program = program_splits(hf.llama_loss, params, hf.batches(1)[0])
        _, choices = autotp_specs(params, 2, program=program, by_name=False)
    rules = {c.path: c.rule for c in choices}
    assert rules["model.layers.self_attn.q_proj.weight"] == "column (from the program)"
    assert rules["model.layers.self_attn.o_proj.weight"] == "row (from the program)"
    assert rules["model.embed_tokens.weight"] == "vocab (from the program)"
    assert rules["lm_head.weight"] == "vocab head (from the program)"


def test_on_the_built_in_gpt_the_program_gives_the_names_specs():
    """Fused qkv ``[L, d, 3, n]`` split per head group, its flat bias whole, a tied head."""
    from jzero.demo import gpt

    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=4, d_model=32,
                        d_ff=64)  # fmt: skip
    params = gpt.init_params(jax.random.key(0), cfg)
    batch = {"tokens": np.zeros((8, 17), np.int32)}
    assert _same_specs(params, lambda p, b: gpt.loss_fn(p, b, cfg), batch) == []
    program = program_splits(lambda p, b: gpt.loss_fn(p, b, cfg), params, batch)
    specs, _ = autotp_specs(params, 2, program=program, by_name=False)
    assert specs["blocks"]["attn_qkv"] == P(None, None, None, "model")
    assert specs["blocks"]["attn_out"] == P(None, "model")


def test_a_pair_the_model_axis_does_not_divide_stays_whole_and_is_listed():
    """4 model devices: the 2 kv heads do not split, so attention's pair (q, kv, out) stays
    replicated, listed as unmatched; the MLP's pair (f = 64) splits."""
    params, loss_fn = _nnx_parts()
    program = program_splits(loss_fn, params, batches(1)[0])
    specs, choices = autotp_specs(params, 4, program=program)
    rules = {c.path: c.rule for c in choices}
    layer = specs["layers"][0]
    assert layer["attn"]["q_einsum"] == P() and layer["attn"]["kv_einsum"] == P()
    assert rules["layers.0.attn.attn_vec_einsum"].startswith("no rule: replicated (row from the")
    assert "dimension 2 (2) of layers.0.attn.kv_einsum" in rules["layers.0.attn.q_einsum"]
    assert layer["mlp"]["linear"] == P("model")


def test_without_a_batch_the_program_is_read_at_the_first_one():
    """No batch to initialize: the plan splits nothing until the first batch's shapes, which
    give the program's specs (the state is made then, in that layout)."""
    engine = jzero.initialize(
        model=MODELS["nnx"][0], loss_fn=m.nnx_loss, optimizer=optax.adamw(LR), config=config(1)
    )
    assert engine.setup.read_program is not None
    engine.resolve(jax.eval_shape(lambda: batches(1)[0]))
    spec = dict(zip([x.path for x in engine.plan.leaves], engine.plan.base_specs, strict=True))
    assert spec["layers.0.attn.q_einsum"] == P(None, "model")
    assert engine.params["layers"][0]["attn"]["q_einsum"].sharding.spec == P(None, "model")


def test_a_stage_search_needs_the_batch_at_once():
    cfg = {**config(1), "zero_optimization": {"stage": "auto"}, "device_memory": "1GB"}
    with pytest.raises(ValueError, match=r"Pass jzero.initialize\(\.\.\., batch=batch\)"):
        jzero.initialize(
            model=MODELS["nnx"][0], loss_fn=m.nnx_loss, optimizer=optax.adamw(LR), config=cfg
        )
