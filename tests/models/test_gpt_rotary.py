"""The built-in GPT with rotary positions (``positions: rotary``): no position table, and its
loss equals a NumPy GPT whose attention rotates queries and keys as complex numbers (float64,
1e-12); packed documents rotate by positions restarting at 0; the keys are validated in
``GPTConfig`` and in the ``model`` section. Under ring attention and Ulysses it is tested in
``tests/distributed/test_context_parallel.py``."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jzero
from jzero.demo import gpt
from jzero.demo.gpt import GPT, GPTConfig, init_params, loss_fn

pytestmark = pytest.mark.float64
T = 16
CFG = GPTConfig(vocab_size=32, seq_len=T, num_layers=2, num_heads=2, d_model=16, d_ff=32,
                dtype="float64", positions="rotary", rope_theta=500.0)  # fmt: skip


def _layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * scale + bias


def _gelu(x):  # jax.nn.gelu's tanh form
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _rope(x, theta):
    """RoPE as the paper writes it: channels ``i`` and ``i + Dh/2`` are one complex number,
    multiplied by ``exp(i * t * theta ** (-2i / Dh))`` at position ``t``."""
    t, half = x.shape[1], x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    angle = np.arange(t)[:, None] * theta ** (-2 * np.arange(half) / (2 * half))
    z = z * np.exp(1j * angle)[None, :, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def numpy_loss(params, tokens, cfg):
    """The GPT's next-token loss written out in NumPy, rotary attention included."""
    p = jax.tree.map(np.asarray, params)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    d, h = cfg.d_model, cfg.num_heads
    x = p["embed"]["tokens"][inputs]
    for layer in range(cfg.num_layers):
        w = {name: leaf[layer] for name, leaf in p["blocks"].items()}
        y = _layer_norm(x, w["ln1_scale"], w["ln1_bias"])
        qkv = np.einsum("btd,dcn->btcn", y, w["attn_qkv"]) + w["attn_qkv_bias"].reshape(3, d)
        q, k, v = (qkv[:, :, i].reshape(b, t, h, d // h) for i in range(3))
        q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
        scores = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // h)
        scores = np.where(np.tri(t, dtype=bool), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, d)
        x = x + out @ w["attn_out"] + w["attn_out_bias"]
        y = _layer_norm(x, w["ln2_scale"], w["ln2_bias"])
        x = x + _gelu(y @ w["mlp_in"] + w["mlp_in_bias"]) @ w["mlp_out"] + w["mlp_out_bias"]
    logits = _layer_norm(x, p["ln_f"]["scale"], p["ln_f"]["bias"]) @ p["embed"]["tokens"].T
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, targets[..., None], -1).mean()


def test_rotary_gpt_equals_a_numpy_reference_and_has_no_position_table():
    params = jax.tree.map(lambda x: x.astype(jnp.float64), init_params(jax.random.key(0), CFG))
    assert set(params["embed"]) == {"tokens"}
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (3, T + 1)).astype(np.int32)
    got = float(jax.jit(loss_fn, static_argnums=2)(params, {"tokens": tokens}, CFG))
    assert got == pytest.approx(numpy_loss(params, tokens, CFG), rel=1e-12, abs=0)
    # The NNX form holds the same tree: no embed.positions.
    model = GPT(CFG, rngs=nnx.Rngs(0))
    assert set(nnx.state(model, nnx.Param).to_pure_dict()["embed"]) == {"tokens"}


def test_rotary_scores_depend_on_the_distance_only():
    """A query at ``m`` and a key at ``n`` score ``q . k`` rotated by ``m - n``: shifting both
    positions by 100 keeps the score, moving one changes it."""
    q, k = jax.random.normal(jax.random.key(1), (2, 1, 1, 1, 8), jnp.float64)

    def score(m, n):
        rq = jzero.ops.rotary(q, jnp.array([m]))
        rk = jzero.ops.rotary(k, jnp.array([n]))
        return float(jnp.sum(rq * rk))

    assert score(103, 100) == pytest.approx(score(3, 0), rel=1e-12)
    assert score(4, 0) != pytest.approx(score(3, 0), rel=1e-3)


def _logits(model, rows):
    tokens, seg, pos = (jnp.asarray(np.array(a, np.int32)) for a in zip(*rows, strict=True))
    return np.asarray(jax.jit(lambda m, *a: m(*a))(model, tokens, seg, pos))


def test_a_packed_document_rotates_by_positions_restarting_at_0(monkeypatch):
    """A document packed after another gives the logits it gives alone at the row's start.
    RoPE's scores depend on distances only, so the check runs twice: with the real rotation,
    and with it replaced by an absolute one (scaling by ``1 + position``), which gives the
    same logits only when each document's positions restart at 0."""
    model = GPT(CFG, rngs=nnx.Rngs(0))
    first, doc = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8]
    pad = T - len(first) - len(doc)

    def packed(*docs):
        tokens = [tok for d in docs for tok in d]
        seg = [i + 1 for i, d in enumerate(docs) for _ in d]
        pos = [p for d in docs for p in range(len(d))]
        n = T - len(tokens)
        return tokens + [0] * n, seg + [0] * n, pos + [0] * n

    rows = [packed(first, doc), packed(doc, [7] * len(first))]
    for absolute in (False, True):
        if absolute:
            monkeypatch.setattr(gpt, "rotary", lambda x, at, theta: x * (1.0 + at[..., None, None]))
        got = _logits(model, rows)
        np.testing.assert_allclose(got[0, len(first) : T - pad], got[1, : len(doc)], rtol=1e-12)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"positions": "alibi"}, "GPTConfig.positions='alibi' is not supported. It must be one "
         "of ('learned', 'rotary'): 'learned' for a position table, 'rotary' for rotary "
         "position embeddings of queries and keys."),
        ({"positions": "rotary", "d_model": 6, "num_heads": 2}, "GPTConfig.positions='rotary' "
         "needs an even head dimension, but d_model=6 / num_heads=2 is 3. Choose d_model and "
         "num_heads with an even quotient, or positions='learned'."),
        ({"rope_theta": 0}, "GPTConfig.rope_theta=0 must be a number > 0 (the base of the "
         "rotary frequencies; 10000 is the usual)."),
    ],
)  # fmt: skip
def test_bad_position_settings_are_clear_errors(fields, message):
    with pytest.raises(ValueError) as err:
        GPTConfig(**fields)
    assert str(err.value) == message


def test_the_model_section_checks_positions():
    with pytest.raises(jzero.config.ConfigError) as err:
        jzero.load_config({"model": {"positions": "absolute"}})
    assert str(err.value) == (
        "model.positions: 'absolute' is not allowed; it must be one of ['learned', 'rotary']: "
        "'learned' (a position table, the default) or 'rotary' (rotary position embeddings of "
        "queries and keys, no table). Set one of them."
    )
    with pytest.raises(jzero.config.ConfigError, match=r"^model.rope_theta: -1 is not allowed"):
        jzero.load_config({"model": {"positions": "rotary", "rope_theta": -1}})
    assert jzero.load_config({"model": {"positions": "rotary"}}).model["positions"] == "rotary"
