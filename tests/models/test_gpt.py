"""The built-in GPT: shapes, the two forms agree, init loss, the stage-3 scan contract, training."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jzero.demo.gpt import GPT, GPTConfig, apply, init_params, loss_fn, nnx_loss_fn

CFG = GPTConfig(seq_len=16, num_layers=2, num_heads=2, d_model=32, d_ff=64)
# The training and the two forms' agreement run in float64 (parameters cast from the float32
# init, every op in float64): the forms are one computation written twice, so they agree to
# float64 rounding, 1e-10 relative, and not to whatever one CPU's float32 reduction order gives.
CFG64 = dataclasses.replace(CFG, dtype="float64")


def _batch(seed: int = 0, batch_size: int = 4, cfg: GPTConfig = CFG) -> dict:
    rng = np.random.default_rng(seed)
    return {"tokens": jnp.asarray(rng.integers(0, 256, (batch_size, cfg.seq_len + 1)), jnp.int32)}


@pytest.fixture(scope="module")
def trained() -> tuple[dict, dict, list[float]]:
    """Functional init, then six float64 Adam steps on one fixed batch: (initial params as
    initialised, float32, the same in float64, losses)."""
    initial = jax.jit(init_params, static_argnums=1)(jax.random.key(0), CFG)
    with jax.enable_x64(True):
        batch = _batch()
        opt = optax.adam(1e-2)

        @jax.jit
        def step(params: dict, opt_state: optax.OptState) -> tuple[dict, optax.OptState, jax.Array]:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch, CFG64)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        initial64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), initial)
        params, opt_state, losses = initial64, opt.init(initial64), []
        for _ in range(6):
            params, opt_state, loss = step(params, opt_state)
            losses.append(float(loss))
    return initial, initial64, losses


def _nnx_with(params: dict, cfg: GPTConfig = CFG) -> GPT:
    """An NNX GPT holding ``params``, built abstractly (no init computation, no compile)."""
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(1)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def _scan_xs_sources(closed_jaxpr) -> list:
    """The top-level scans' scanned operands, each traced back through at most one dtype cast."""
    jaxpr = closed_jaxpr.jaxpr
    producer = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    scans = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    assert len(scans) == 1, [eqn.primitive.name for eqn in jaxpr.eqns]
    (scan,) = scans
    assert scan.params["num_consts"] == 0, "stacked weights must not be closure constants"
    sources = []
    for var in scan.invars[scan.params["num_consts"] + scan.params["num_carry"] :]:
        eqn = producer.get(var)
        if eqn is not None and eqn.primitive.name == "convert_element_type":
            var = eqn.invars[0]
        sources.append(var)
    return sources


def _block_inputs(closed_jaxpr, tree) -> list:
    """The jaxpr input variables that stand for the leaves under ``tree["blocks"]``."""
    leaves = jax.tree.leaves_with_path(tree)
    assert len(leaves) == len(closed_jaxpr.jaxpr.invars)
    return [
        var
        for var, (path, _) in zip(closed_jaxpr.jaxpr.invars, leaves, strict=True)
        if jax.tree_util.keystr(path).startswith("['blocks']")
    ]


def test_config_from_dict_rejects_unknown_key():
    assert GPTConfig.from_dict({"num_layers": 3}).num_layers == 3
    with pytest.raises(ValueError, match=r"\['n_layers'\].*num_layers"):
        GPTConfig.from_dict({"n_layers": 3})
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        GPTConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="dtype"):
        GPTConfig(dtype="int8")


def test_functional_init_and_adam_steps_reduce_loss(trained):
    params, _, losses = trained
    assert all(x.shape[0] == CFG.num_layers for x in jax.tree.leaves(params["blocks"]))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    # Random init: near-uniform predictions (a property of the init, not a rounding bound).
    assert abs(float(losses[0]) - math.log(256)) < 0.05
    assert float(losses[-1]) < float(losses[0]) - 0.5, losses


def test_forms_agree_on_the_same_weights(trained):
    _, params, losses = trained
    with jax.enable_x64(True):
        batch = _batch()
        inputs = batch["tokens"][:, :-1]

        @jax.jit
        def both_forms(params: dict) -> tuple[jax.Array, ...]:
            model = _nnx_with(params, CFG64)
            return (
                apply(params, inputs, CFG64),
                loss_fn(params, batch, CFG64),
                model(inputs),
                nnx_loss_fn(model, batch),
            )

        logits, loss, nnx_logits, nnx_loss = jax.device_get(both_forms(params))
    for out in (logits, nnx_logits):
        assert out.shape == (4, CFG.seq_len, 256) and out.dtype == np.float64
        assert bool(np.isfinite(out).all())
    assert np.max(np.abs(nnx_logits - logits)) < 1e-10 * np.max(np.abs(logits))
    assert float(loss) == pytest.approx(losses[0], rel=1e-10, abs=0)  # the training's first
    assert float(nnx_loss) == pytest.approx(float(loss), rel=1e-10, abs=0)


def test_nnx_init_builds_the_functional_tree():
    model = nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(0)))  # traces init, computes nothing
    nnx_params = nnx.state(model, nnx.Param).to_pure_dict()
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), CFG))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), nnx_params) == jax.tree.map(
        lambda x: (x.shape, x.dtype), params
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scan_xs_are_the_stacked_params(dtype):
    cfg = GPTConfig(seq_len=8, num_layers=2, num_heads=2, d_model=16, d_ff=32, dtype=dtype)
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    batch = _batch(cfg=cfg)

    # Functional form: the jaxpr's inputs are the flattened params, in tree order.
    jaxpr = jax.make_jaxpr(lambda p: loss_fn(p, batch, cfg))(params)
    assert _scan_xs_sources(jaxpr) == _block_inputs(jaxpr, params)

    # NNX form: the same contract for the module's state.
    graphdef, state = nnx.split(_nnx_with(params, cfg))
    jaxpr = jax.make_jaxpr(lambda s: nnx_loss_fn(nnx.merge(graphdef, s), batch))(state)
    assert _scan_xs_sources(jaxpr) == _block_inputs(jaxpr, state)


def _packed(docs, width):
    """One packed row of ``docs`` (token lists), padded to ``width``: tokens, segment ids
    (1, 2, ... per document; 0 on padding) and positions (restarting at each document)."""
    tokens, seg, pos = [], [], []
    for i, doc in enumerate(docs, 1):
        tokens += doc
        seg += [i] * len(doc)
        pos += list(range(len(doc)))
    pad = width - len(tokens)
    return [np.array([x + [0] * pad], np.int32) for x in (tokens, seg, pos)]


def _token_losses(model, docs, width=17):
    """Per target: the next-token loss of the packed row, where the target continues its
    input's document (else NaN)."""
    tokens, seg, pos = _packed(docs, width)
    logits, _ = model.forward(jnp.asarray(tokens[:, :-1]), jnp.asarray(seg[:, :-1]),
                              jnp.asarray(pos[:, :-1]))  # fmt: skip
    nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), tokens[:, 1:, None], -1)
    keep = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    return np.where(keep, nll[..., 0], np.nan)[0], seg[0, 1:]


def test_packed_documents_never_see_each_other(x64):
    """In a packed row each document attends to itself only and restarts its positions: its
    per-token losses do not change when another document in the row changes (here its tokens
    and its length, which moves the third document along the row); float64, so the only
    difference left is the summation order of zeros' neighbours (far below 1e-10)."""
    cfg = GPTConfig(vocab_size=32, seq_len=16, num_layers=2, num_heads=2, d_model=16, d_ff=32,
                    dtype="float64")  # fmt: skip
    model = GPT(cfg, rngs=nnx.Rngs(0))
    first, third = [1, 5, 9, 2], [7, 7, 3, 4, 8]
    a, seg_a = _token_losses(model, [first, [3, 1, 4, 1, 5], third])
    b, seg_b = _token_losses(model, [first, [30, 2, 6], third])
    for doc, tokens in ((1, first), (3, third)):
        la, lb = a[seg_a == doc], b[seg_b == doc]
        la, lb = la[~np.isnan(la)], lb[~np.isnan(lb)]
        assert len(la) == len(tokens) - 1  # every target but the document's first token
        np.testing.assert_allclose(la, lb, rtol=1e-10, atol=0)
    # The second document's own losses did change, and the loss reads only kept targets.
    assert not np.allclose(a[seg_a == 2][:2], b[seg_b == 2][:2])
    tokens, seg, pos = _packed([first, [3, 1, 4, 1, 5], third], 17)
    batch = {"tokens": tokens, "segment_ids": seg, "positions": pos}
    loss = float(nnx_loss_fn(model, {k: jnp.asarray(v) for k, v in batch.items()}))
    assert loss == pytest.approx(np.nansum(a) / 16, rel=1e-12)
