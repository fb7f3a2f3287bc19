"""``context_parallel_size`` (ring attention) through the engine, on a 2-head built-in GPT.

Context parallelism splits one sequence over as many devices as it has chunks, past the head
count Ulysses stops at: here 8 devices on a model of 2 heads. Each layout trains the built-in
GPT on packed documents (segment ids, positions restarting at each document; the NNX form's
packed loss) or plain rows, and must equal the single-device optax loop in float64: losses and
gradient norms at 1e-10 relative, parameters at 1e-9 of each leaf's scale
(``tests/support/numerics.py``; the ring adds the same products in another order and its
online softmax rescales them, far below the bound, while a lost key block, a chunk in the
wrong place or a gradient not returned around the ring is far above it).

Layouts: the ring alone on 8 devices (``context: 8``) at ZeRO 1 and 3; two-dimensional (``seq:
2`` x ``context: 4``, Ulysses within each ring member) at ZeRO 1 and 3; beside tensor
parallelism; beside a pipeline (``pipe: 2`` x ``context: 2`` x ``data: 2``, 1F1B at ZeRO 3 and
zero-bubble at ZeRO 1); the ring (plain rows) and the two-dimensional layout (packed rows) again
with rotary positions (each device rotates its zig-zag tokens' queries and keys by their places
in the row, or their documents' positions). The public functions alone
(``jzero.context_parallel_attention``, grouped-query heads, packed documents) against one
device's attention, values and gradients. From the compiled step: the ring's transfers are
collective-permutes within the ``context`` groups only (all-gathers within them inside a
pipeline stage, where every permute is the pipeline's), no buffer is ``[T, T]``, the backward
ring keeps none of the visited keys, and a long sequence's temporaries per device fall with the
ring. Sizes the layout cannot take are errors naming the numbers.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compositions import collective_axes
from flax import nnx
from jax.sharding import PartitionSpec as P
from numerics import max_rel_error

import jzero
from jzero.demo import gpt

pytestmark = pytest.mark.float64

T, BATCH, STEPS, LR, CLIP = 32, 8, 2, 1e-2, 0.5
CFG = gpt.GPTConfig(
    vocab_size=40, seq_len=T, num_layers=2, num_heads=2, d_model=16, d_ff=48, dtype="float64"
)
CONFIGS = {"learned": CFG, "rotary": dataclasses.replace(CFG, positions="rotary")}


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
def _params(positions="learned"):
    """The GPT's initial parameters in float64, made once (eagerly), as a pure dict; with
    ``positions`` "rotary" the GPT of rotary positions (no position table)."""
    with jax.ensure_compile_time_eval():  # numbers, even when first asked inside a trace
        model = gpt.GPT(CONFIGS[positions], rngs=nnx.Rngs(0))
        state = nnx.state(model, nnx.Param).to_pure_dict()
        return jax.device_get(jax.tree.map(lambda x: x.astype(jnp.float64), state))


def _model(params=None, positions="learned"):
    """The NNX GPT holding ``params`` (default :func:`_params`): the engine's model and the
    reference's, the same numbers wherever it is built."""
    graphdef, state = nnx.split(gpt.GPT(CONFIGS[positions], rngs=nnx.Rngs(0)))
    state = jax.tree.map(lambda x: x.astype(jnp.float64), state)
    nnx.replace_by_pure_dict(state, _params(positions) if params is None else params)
    return nnx.merge(graphdef, state)


def _loss(params, batch, positions="learned"):
    """The NNX GPT's loss (packed rows read their segment ids) of pure-dict ``params``."""
    return gpt.nnx_loss_fn(_model(params, positions), batch)


@functools.cache
def reference(packed, positions="learned"):
    """The single-device optax loop with DeepSpeed's clipping: losses, gradient norms, and
    the parameters after :data:`STEPS` steps."""
    tx = optax.adamw(LR)

    @jax.jit
    def step(p, state, batch):
        value, grads = jax.value_and_grad(_loss)(p, batch, positions)
        norm = optax.global_norm(grads)
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, CLIP / (norm + 1e-6)), grads)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value, norm

    p = _params(positions)
    state, out = tx.init(p), []
    for b in batches(packed):
        p, state, value, norm = step(p, state, b)
        out.append((float(value), float(norm)))
    return out, jax.device_get(p)


def config(stage, context, seq=1, tp=1, pipe=1, schedule="1f1b", positions="learned"):
    return {
        "train_batch_size": BATCH,
        "gradient_accumulation_steps": 2 if pipe > 1 else 1,  # two micro-batches a step
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "context_parallel_size": context,
        "sequence_parallel_size": seq,
        "tensor_parallel": {"autotp_size": tp},
        "pipeline": {"stages": pipe, "schedule": schedule},
        "model": {"num_heads": CFG.num_heads, "seq_len": T, "positions": positions},
    }


@functools.cache
def run(stage, context, seq=1, tp=1, packed=True, pipe=1, schedule="1f1b", positions="learned"):
    engine = jzero.initialize(
        model=functools.partial(_model, positions=positions),
        loss_fn=gpt.nnx_loss_fn,
        optimizer=optax.adamw(LR),
        config=config(stage, context, seq, tp, pipe, schedule, positions),
    )
    metrics = [engine.train_step(b) for b in batches(packed)]
    return engine, [(float(m["loss"]), float(m["grad_norm"])) for m in metrics]


def assert_trains_like_the_single_device_loop(engine, metrics, packed, positions="learned"):
    want, want_params = reference(packed, positions)
    for (loss, norm), (ref_loss, ref_norm) in zip(metrics, want, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-10, abs=0)
        assert norm == pytest.approx(ref_norm, rel=1e-10, abs=0)
    assert max_rel_error(jax.device_get(engine.params), want_params) < 1e-9


LAYOUTS = {
    "context8-zero1-plain": dict(stage=1, context=8, packed=False),
    "context8-zero3": dict(stage=3, context=8),
    "seq2xcontext4-zero3": dict(stage=3, context=4, seq=2),
    "seq2xcontext4-zero1": dict(stage=1, context=4, seq=2, packed=False),
    "context4xmodel2-zero3": dict(stage=3, context=4, tp=2),
    # Rotary positions (no table): each device rotates its zig-zag tokens by their own places.
    "context8-zero3-rotary-plain": dict(stage=3, context=8, packed=False, positions="rotary"),
    "seq2xcontext4-zero3-rotary": dict(stage=3, context=4, seq=2, positions="rotary"),
    # Beside a pipeline (each stage's ring gathers its keys): 1F1B at ZeRO 3, and zero-bubble
    # (the backward split in two, each stage's passes different in most slots) at ZeRO 1.
    "pipe2xcontext2-zero3": dict(stage=3, context=2, pipe=2),
    "pipe2xcontext2-zero1-zero_bubble": dict(stage=1, context=2, pipe=2, schedule="zero_bubble"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ring_attention_trains_like_the_single_device_loop(name):
    layout = LAYOUTS[name]
    engine, metrics = run(**layout)
    packed, positions = layout.get("packed", True), layout.get("positions", "learned")
    assert_trains_like_the_single_device_loop(engine, metrics, packed, positions)
    plan, context = engine.plan, layout["context"]
    assert engine.mesh.shape["context"] == context and plan.context_size == context
    assert plan.options.parallel.context_axis == "context"
    # Each ring member shares its rows: they are split over data only; ZeRO over context too.
    assert "context" in plan.zero_axes and "context" not in jax.tree.leaves(tuple(plan.batch.spec))
    split = context * layout.get("seq", 1) * layout.get("tp", 1) * layout.get("pipe", 1)
    assert plan.data_parallel_size == 8 // split
    assert "tokens: each row's split over 'context'" in engine.describe()
    assert float(engine.evaluate(batches(packed)[0])) == pytest.approx(
        float(_loss(jax.device_get(engine.params), batches(packed)[0], positions)),
        rel=1e-10,
        abs=0,
    )


def _collectives(engine, packed=True):
    compiled = engine.lower(batches(packed)[0]).compile()
    return compiled, collective_axes(compiled, engine.mesh)


@pytest.mark.parametrize(
    "name, permuted, exchanged",
    [
        ("context8-zero1-plain", {"context"}, set()),
        ("seq2xcontext4-zero3", {"context"}, {"seq"}),
        ("context4xmodel2-zero3", {"context"}, set()),
    ],
)
def test_the_ring_passes_keys_within_the_context_groups_only(name, permuted, exchanged):
    """Every collective-permute of the step is the ring's, within the ``context`` groups
    (never across ``data``, ``seq`` or ``model``); all-to-alls only Ulysses's, within ``seq``;
    and the ring runs forward and back in every layer."""
    layout = LAYOUTS[name]
    engine, _ = run(**layout)
    _, found = _collectives(engine, layout.get("packed", True))
    permutes = [spanned for kind, spanned, _ in found if kind == "collective-permute"]
    assert permutes and {frozenset(permuted)} == set(permutes), set(permutes)
    a2a = {spanned for kind, spanned, _ in found if kind == "all-to-all"}
    assert a2a == ({frozenset(exchanged)} if exchanged else set()), a2a
    # The ring's loop body forward and its transpose backward (instructions, each run C - 1
    # times a layer in its loop): at least one permute each way.
    assert len(permutes) >= 2, len(permutes)


def test_beside_a_pipeline_the_keys_are_gathered_within_the_context_groups():
    """Inside a pipeline stage the ring gathers its keys (all-gathers within the ``context``
    groups, beside ZeRO's over ``data`` x ``context``) and passes none: every
    collective-permute of the step is a pipeline transfer over ``pipe``. A permute over
    ``context`` there would be met by the devices of every stage (on the CPU all of a
    program's permutes share one rendezvous key) while the stages run different passes."""
    engine, _ = run(**LAYOUTS["pipe2xcontext2-zero3"])
    _, found = _collectives(engine)
    permutes = {spanned for kind, spanned, _ in found if kind == "collective-permute"}
    assert permutes == {frozenset({"pipe"})}, permutes
    gathers = {spanned for kind, spanned, _ in found if kind == "all-gather"}
    assert frozenset({"context"}) in gathers, gathers


def _square_buffers(text, n):
    """The HLO shapes of ``text`` with two dimensions of ``n`` side by side."""
    return sorted(set(re.findall(rf"\w+\[[\d,]*\b{n},{n}\b[\d,]*\]", text)))


def test_no_buffer_is_the_whole_sequence_squared():
    """At ``context: 8`` each device attends its 4 queries to 4 keys at a time: no ``[T, T]``
    (32 x 32) score buffer is in the compiled step, where the one-device step has one."""
    engine, _ = run(stage=1, context=8, packed=False)
    compiled, _ = _collectives(engine, packed=False)
    assert _square_buffers(compiled.as_text(), T) == []
    whole = jax.jit(jax.grad(_loss)).lower(_params(), batches(False)[0]).compile()
    assert _square_buffers(whole.as_text(), T), "the check finds the one-device step's scores"


def test_the_backward_ring_keeps_no_visited_keys():
    """The ring's gradient runs a backward ring of its own: no buffer of the compiled gradient
    stacks the ``C - 1`` visited members' keys or partials (``[7, B, T/C, H, Dh]`` at ``C``
    8, what autodiff through the forward ring keeps: ``O(T)`` bytes a device)."""
    mesh = jzero.make_mesh({"data": 1, "context": 8})
    tokens = P(None, "context")

    def loss(q, k, v):
        ring = jax.shard_map(
            jzero.context_parallel_attention, mesh=mesh, in_specs=tokens, out_specs=tokens
        )
        return jnp.sum(jnp.sin(ring(q, k, v)))

    shape = jax.ShapeDtypeStruct((1, 8 * T, 2, 8), jnp.float64)  # 32 tokens a member
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    assert re.findall(r"f64\[7,[\d,]*\]", compiled.as_text()) == []


@pytest.mark.parametrize(
    ("sizes", "block"),
    [({"data": 1, "context": 8}, None), ({"data": 1, "context": 4, "seq": 2}, None),
     ({"data": 2, "context": 4}, 2)],
    ids=["context8", "seq2xcontext4", "context4-blocks2"],
)  # fmt: skip
def test_the_public_attention_equals_one_devices_with_grouped_query_heads(sizes, block):
    """4 query heads reading 2 key/value heads, packed documents: this device's rows of
    ``context_parallel_attention`` over the ring (and Ulysses) are one device's attention's
    rows in the zig-zag order, and so are the gradients of q, k and v. With ``block`` each
    ring step is itself blockwise (a member's half chunk of 4 tokens in blocks of 2)."""
    from jzero.ops.attention import attend_block, block_mask, finish

    b, heads, kv_heads, dh = 2, 4, 2, 8
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (b, T, heads, dh), jnp.float64)
    k = jax.random.normal(keys[1], (b, T, kv_heads, dh), jnp.float64)
    v = jax.random.normal(keys[2], (b, T, kv_heads, dh), jnp.float64)
    seg = jnp.sort(jax.random.randint(keys[3], (b, T), 0, 4), axis=1)
    mesh = jzero.make_mesh(sizes)
    c = sizes["context"]
    piece = T // (2 * c)
    order = np.concatenate([np.r_[i * piece : (i + 1) * piece, (2 * c - 1 - i) * piece :
                                  (2 * c - i) * piece] for i in range(c)])  # fmt: skip

    def split(q, k, v, seg):
        local = jzero.sequence_chunk
        return jzero.context_parallel_attention(
            local(q), local(k), local(v), local(seg), block_size=block
        )

    tokens = P(None, tuple(a for a in sizes if a != "data"))
    ring = jax.shard_map(split, mesh=mesh, in_specs=P(), out_specs=tokens)

    def whole(q, k, v):
        pos = jnp.arange(T)
        return finish(attend_block(q, k, v, block_mask(pos, pos, seg, seg)), q.dtype)[:, order]

    def weighted(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

    got = jax.jit(lambda q, k, v: ring(q, k, v, seg))
    np.testing.assert_allclose(got(q, k, v), whole(q, k, v), rtol=1e-12, atol=1e-12)
    grads = jax.jit(jax.grad(weighted(got), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(weighted(whole), argnums=(0, 1, 2))(q, k, v)
    for a, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=1e-10, atol=1e-12)


def test_zig_zag_layout_and_positions():
    """Member ``c`` of ``context: 4`` holds chunks ``c`` and ``7 - c`` of 8, and within it
    device ``s`` of ``seq: 2`` the ``s``-th half; the positions are those tokens' places."""
    mesh = jzero.make_mesh({"data": 1, "context": 4, "seq": 2})
    row = jnp.arange(32)[None]

    def local(x):
        chunk = jzero.sequence_chunk(x)
        return chunk, jzero.sequence_positions(chunk.shape[1])[None]

    chunks, positions = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P(None, ("context", "seq")))
    )(row)
    want = np.concatenate([np.r_[4 * c : 4 * c + 4, 4 * (7 - c) : 4 * (7 - c) + 4]
                           for c in range(4)])  # fmt: skip
    np.testing.assert_array_equal(chunks[0], want)
    np.testing.assert_array_equal(positions[0], want)
    assert jzero.sequence_chunk(row) is row  # unbound axes: the row itself
    np.testing.assert_array_equal(jzero.sequence_positions(8), np.arange(8))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"context_parallel_size": 4, "model": {"seq_len": 12}},
         r"context_parallel_size: 4 cuts each sequence into 8 zig-zag chunks.*multiple of 8.*12"),
        ({"context_parallel_size": 4, "sequence_parallel_size": 4, "model": {"seq_len": 24}},
         r"multiple of 16, but they are 24"),
        ({"context_parallel_size": 0}, r"context_parallel_size"),
    ],
)  # fmt: skip
def test_sizes_the_layout_cannot_take_are_clear_errors(settings, message):
    with pytest.raises(ValueError, match=message):
        jzero.load_config(settings)


def test_ring_attention_past_the_head_count_where_ulysses_stops():
    """Ulysses over 8 devices cannot split 2 heads; the ring over 8 devices of the same model
    trains (above), and the config names the two sizes."""
    with pytest.raises(ValueError, match=r"sequence_parallel_size: 8 does not divide the 2"):
        jzero.load_config({"sequence_parallel_size": 8, "model": {"num_heads": 2, "seq_len": T}})
    cfg = jzero.load_config({"context_parallel_size": 8, "model": {"num_heads": 2, "seq_len": T}})
    assert cfg.mesh_sizes()["context"] == 8


def test_the_auto_layout_lays_out_a_ring_where_heads_and_rows_run_out():
    """One row on 8 devices of a 2-head model: data cannot split it and Ulysses stops at 2,
    so every candidate spreads the sequence with ``context`` (alone or beside ``seq: 2``);
    none beside a pipeline."""
    from jzero import costs
    from jzero.engine import auto_layout

    cfg = jzero.load_config(
        {
            "train_batch_size": 1,
            "context_parallel_size": "auto",
            "sequence_parallel_size": "auto",
            "pipeline": {"stages": "auto"},
            "model": {"num_heads": 2, "seq_len": T, "num_layers": 2},
        }
    )
    shape = costs.ModelShape(params=1e4, hidden=16, seq_len=T, heads=2, layers=2)
    found = auto_layout.layouts(cfg, shape, costs.ParallelDims(8, 8))
    sizes = {(lay.context, lay.seq, lay.pipe, lay.data) for lay in found}
    assert (8, 1, 1, 1) in sizes and (4, 2, 1, 1) in sizes, sizes
    assert all(c * s * p == 8 and p == 1 for c, s, p, _ in sizes), sizes


def test_a_sequences_temporaries_per_device_fall_with_the_ring():
    """One 2048-token sequence per data group on a 2-head model: at ``context: 8`` each device
    holds 256 of its tokens and attends them block by block, so its temporaries are under a
    fifth of one device attending the whole sequence at once (measured: 15.1 MB against
    140.6 MB, float32)."""
    cfg = gpt.GPTConfig(vocab_size=256, seq_len=2048, num_layers=1, num_heads=2, d_model=64,
                        d_ff=128, attention_block=4096, loss_chunk=0)  # fmt: skip
    with jax.enable_x64(False):
        temps = {}
        for context in (1, 8):
            rows = 8 // context  # one sequence per data group
            engine = jzero.initialize(
                gpt.init_params(jax.random.key(0), cfg),
                lambda p, b: gpt.loss_fn(p, b, cfg),
                optax.sgd(1e-3),
                {"train_batch_size": rows, "context_parallel_size": context},
            )
            batch = {"tokens": np.zeros((rows, cfg.seq_len + 1), np.int32)}
            temps[context] = engine.lower(batch).compile().memory_analysis().temp_size_in_bytes
    assert temps[8] <= 0.2 * temps[1], temps


def test_an_auto_layout_with_one_row_trains_on_a_ring():
    """``context_parallel_size: auto`` beside ``sequence_parallel_size: auto`` with one row on
    8 devices: the engine chooses a layout whose ``context`` x ``seq`` is 8, and its first step's
    loss is the one-device loss of that row."""
    row = {k: v[:1] for k, v in batches(True)[0].items()}
    settings = {
        **config(1, "auto", "auto"),
        "train_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "device_memory": "1GB",
    }
    engine = jzero.initialize(
        model=_model, loss_fn=gpt.nnx_loss_fn, optimizer=optax.adamw(LR), config=settings
    )
    loss = float(engine.train_step(row)["loss"])
    cfg = engine.config
    assert cfg.context_parallel_size > 1, dict(engine.mesh.shape)
    assert cfg.context_parallel_size * cfg.sequence_parallel_size == 8
    assert loss == pytest.approx(float(_loss(_params(), row)), rel=1e-10, abs=0)
