"""``context_parallel_size`` (ring attention) through the engine, on a 2-head built-in GPT.

Context parallelism splits one sequence over as many devices as it has chunks, past the head
count Ulysses stops at: here 8 devices on a model of 2 heads. Each layout trains the built-in
GPT on packed documents (segment ids, positions restarting at each document; the NNX form's
packed loss) or plain rows, and must equal the single-device optax loop in float64: losses and
gradient norms at 1e-10 relative, parameters at 1e-9 of each leaf's scale
(``tests/support/numerics.py``; the ring adds the same products in another order and its
online softmax rescales them, far below the bound, while a lost key block, a chunk in the
wrong place or a gradient not returned around the ring is far above it).

Layouts: the ring alone on 8 devices (``context: 8``) at ZeRO 1 and 3; two-dimensional
(``seq: 2`` x ``context: 4``, Ulysses within each ring member) at ZeRO 3; beside tensor
parallelism and beside a pipeline. From the compiled step: the ring's transfers are
collective-permutes within the ``context`` groups only, and no buffer is ``[T, T]``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compositions import collective_axes
from flax import nnx
from numerics import max_rel_error

import jzero
from jzero.demo import gpt

pytestmark = pytest.mark.float64

T, BATCH, STEPS, LR, CLIP = 32, 8, 2, 1e-2, 0.5
CFG = gpt.GPTConfig(
    vocab_size=40, seq_len=T, num_layers=2, num_heads=2, d_model=16, d_ff=48, dtype="float64"
)


def _packed_rows(rng):
    """``BATCH`` rows of ``T + 1`` tokens, each packed with documents of 3 to 13 tokens and
    padding (segment 0) after the last whole one."""
    tokens = rng.integers(1, CFG.vocab_size, (BATCH, T + 1), dtype=np.int32)
    seg = np.zeros((BATCH, T + 1), np.int32)
    pos = np.zeros((BATCH, T + 1), np.int32)
    for r in range(BATCH):
        at, doc = 0, 1
        while True:
            n = int(rng.integers(3, 14))
            if at + n > T + 1 - 2:
                break
            seg[r, at : at + n], pos[r, at : at + n] = doc, np.arange(n)
            at, doc = at + n, doc + 1
        tokens[r, at:] = 0
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


def batches(packed):
    rng = np.random.default_rng(3)
    if packed:
        return [_packed_rows(rng) for _ in range(STEPS)]
    return [{"tokens": rng.integers(0, CFG.vocab_size, (BATCH, T + 1), dtype=np.int32)}
            for _ in range(STEPS)]  # fmt: skip


@functools.cache
def _params():
    """The GPT's initial parameters in float64, made once (eagerly), as a pure dict."""
    with jax.ensure_compile_time_eval():  # numbers, even when first asked inside a trace
        state = nnx.state(gpt.GPT(CFG, rngs=nnx.Rngs(0)), nnx.Param).to_pure_dict()
        return jax.device_get(jax.tree.map(lambda x: x.astype(jnp.float64), state))


def _model(params=None):
    """The NNX GPT holding ``params`` (default :func:`_params`): the engine's model and the
    reference's, the same numbers wherever it is built."""
    graphdef, state = nnx.split(gpt.GPT(CFG, rngs=nnx.Rngs(0)))
    state = jax.tree.map(lambda x: x.astype(jnp.float64), state)
    nnx.replace_by_pure_dict(state, _params() if params is None else params)
    return nnx.merge(graphdef, state)


def _loss(params, batch):
    """The NNX GPT's loss (packed rows read their segment ids) of pure-dict ``params``."""
    return gpt.nnx_loss_fn(_model(params), batch)


@functools.cache
def reference(packed):
    """The single-device optax loop with DeepSpeed's clipping: losses, gradient norms, and
    the parameters after :data:`STEPS` steps."""
    tx = optax.adamw(LR)

    @jax.jit
    def step(p, state, batch):
        value, grads = jax.value_and_grad(_loss)(p, batch)
        norm = optax.global_norm(grads)
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, CLIP / (norm + 1e-6)), grads)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value, norm

    p = _params()
    state, out = tx.init(p), []
    for b in batches(packed):
        p, state, value, norm = step(p, state, b)
        out.append((float(value), float(norm)))
    return out, jax.device_get(p)


def config(stage, context, seq=1, tp=1, pipe=1):
    return {
        "train_batch_size": BATCH,
        "gradient_accumulation_steps": 2 if pipe > 1 else 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "context_parallel_size": context,
        "sequence_parallel_size": seq,
        "tensor_parallel": {"autotp_size": tp},
        "pipeline": {"stages": pipe},
    }


@functools.cache
def run(stage, context, seq=1, tp=1, pipe=1, packed=True):
    engine = jzero.initialize(
        model=_model,
        loss_fn=gpt.nnx_loss_fn,
        optimizer=optax.adamw(LR),
        config=config(stage, context, seq, tp, pipe),
    )
    metrics = [engine.train_step(b) for b in batches(packed)]
    return engine, [(float(m["loss"]), float(m["grad_norm"])) for m in metrics]


def assert_trains_like_the_single_device_loop(engine, metrics, packed):
    want, want_params = reference(packed)
    for (loss, norm), (ref_loss, ref_norm) in zip(metrics, want, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-10, abs=0)
        assert norm == pytest.approx(ref_norm, rel=1e-10, abs=0)
    assert max_rel_error(jax.device_get(engine.params), want_params) < 1e-9


LAYOUTS = {
    "context8-zero1-plain": dict(stage=1, context=8, packed=False),
    "context8-zero3": dict(stage=3, context=8),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ring_attention_trains_like_the_single_device_loop(name):
    layout = LAYOUTS[name]
    engine, metrics = run(**layout)
    assert_trains_like_the_single_device_loop(engine, metrics, layout.get("packed", True))
    plan = engine.plan
    assert engine.mesh.shape["context"] == layout["context"]
    assert plan.options.parallel.context_axis == "context" and plan.context_size == layout["context"]
    assert "context" in plan.zero_axes and "context" not in jax.tree.leaves(tuple(plan.batch.spec))
