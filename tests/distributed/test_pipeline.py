"""Pipeline parallelism (``pipeline.stages``) composed with ZeRO stages 1-3, on the model as
written: a scanned toy and the built-in GPT.

In float64 (each test enables x64) a pipelined run equals the single-device optax loop at
1e-10 (losses, norms) and 1e-9 (parameters): the pipeline only moves where each micro-batch's
layers run, so any defect (a stage's layers skipped, a micro-batch twice, a gradient not summed
over stages) is far above float64 rounding. The compiled step's collectives are read by the
mesh axes their device groups span, and 1F1B's activation memory against GPipe's from
``memory_analysis()``.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numerics import max_rel_error, needs_float16

import jzero
from jzero.choices.schedules import BACKWARD, FORWARD, IDLE, WEIGHT
from jzero.costs import ModelShape, ParallelDims
from jzero.demo import gpt
from jzero.demo.plan import plan_report
from jzero.hlo import collectives_by_axes, permute_sends, source_target_pairs
from jzero.hlo.parse import computations
from jzero.parallel import bubble_fraction, make_schedule
from jzero.parallel.pipeline import NoLayerScan
from jzero.parallel.pipeline.layer_split import split_at_layers, stage_unit
from jzero.plan import model_state_bytes

V, D, F, L, T = 32, 16, 32, 4, 8
BATCH = 16
CLIP = 0.5
LR = 1e-2


pytestmark = pytest.mark.usefixtures("x64")  # conftest's float64


# -- the schedules -------------------------------------------------------------------------------


def _passes_in_order(s):
    """``{(virtual stage, pass, micro-batch): slot}`` of a schedule's table, after checking
    each pass runs once and after what it needs: a forward after the previous (virtual)
    stage's, a backward after its forward and the next stage's backward, a weight pass after
    its backward."""
    when = {}
    for t in range(s.num_slots):
        for stage in range(s.stages):
            if s.op[t, stage] != IDLE:
                j = int(s.chunks[t, stage]) * s.stages + stage  # the chunk's place in the model
                key = (j, int(s.op[t, stage]), int(s.micro[t, stage]))
                assert key not in when
                when[key] = t
    n = s.stages * s.virtual
    for (j, op, i), t in when.items():
        if op == FORWARD and j > 0:
            assert when[(j - 1, FORWARD, i)] < t
        if op == BACKWARD:
            assert when[(j, FORWARD, i)] < t
            if j < n - 1:
                assert when[(j + 1, BACKWARD, i)] < t
        if op == WEIGHT:
            assert when[(j, BACKWARD, i)] < t
    return when


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (3, 7)])
def test_a_schedule_runs_every_pass_once_after_its_input_and_keeps_the_micro_batches_it_says(
    kind, p, m
):
    s = make_schedule(kind, p, m)
    when = _passes_in_order(s)
    assert len(when) == 2 * p * m  # every stage: each micro-batch's forward and backward
    assert s.num_slots == 2 * (m + p - 1)
    assert s.bubble == pytest.approx(bubble_fraction(p, m)) == pytest.approx((p - 1) / (m + p - 1))
    # Micro-batches in flight on a stage (forward done, backward not): M under GPipe, P under 1F1B.
    in_flight = max(
        sum(when[(st, FORWARD, i)] <= t < when[(st, BACKWARD, i)] for i in range(m))
        for st in range(p)
        for t in range(s.num_slots)
    )
    assert in_flight == (m if kind == "gpipe" else p)
    assert s.slots == in_flight


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_zero_bubble_splits_each_backward_in_two_and_idles_less_than_1f1b(p, m):
    """ZB-H1: every stage runs each micro-batch's forward, input-gradient (B) and
    weight-gradient (W) pass once, B after the next stage's B, W after its own B; no more
    micro-batches in flight than 1F1B (forward done, W not); the same messages; fewer idle
    slots, and a shorter step where slots run in lockstep."""
    s, one = make_schedule("zero_bubble", p, m), make_schedule("1f1b", p, m)
    when = _passes_in_order(s)
    assert len(when) == 3 * p * m
    in_flight = max(
        sum(when[(st, FORWARD, i)] <= t < when[(st, WEIGHT, i)] for i in range(m))
        for st in range(p)
        for t in range(s.num_slots)
    )
    assert in_flight <= p == one.slots
    assert s.transfers.tolist() == one.transfers.tolist()
    assert s.bubble < one.bubble
    assert s.step_time < one.step_time and s.time_bubble < one.time_bubble
    # In lockstep 1F1B's steady slots hold a forward beside a backward twice as long.
    assert one.time_bubble > one.bubble == pytest.approx(bubble_fraction(p, m))


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (2, 4, 4), (4, 4, 3)])
def test_interleaved_1f1b_runs_v_chunks_per_stage_and_shrinks_the_bubble_v_times(p, m, v):
    """Megatron's interleaved 1F1B: stage s holds the model's chunks s, P + s, ...; each
    chunk's forward runs after the previous chunk's (on the previous stage, or the last
    stage's previous chunk), each backward after its forward and the next chunk's backward.
    The idle slots fall to (P - 1) / (M V + P - 1), each slot a chunk's pass; each
    micro-batch crosses each of the P V - 1 chunk boundaries once each way."""
    s, one = make_schedule("interleaved_1f1b", p, m, v), make_schedule("1f1b", p, m)
    n = p * v
    when = _passes_in_order(s)
    assert len(when) == 2 * n * m
    assert s.bubble == pytest.approx((p - 1) / (m * v + p - 1))
    assert s.bubble < one.bubble
    assert s.time_bubble < one.time_bubble and s.step_time < one.step_time
    assert s.transfers.sum() == 2 * m * (n - 1)
    # The residuals' places: the most chunks in flight on a stage (forward done, backward not).
    in_flight = max(
        sum(
            when[(j, FORWARD, i)] <= t < when[(j, BACKWARD, i)]
            for j in range(st, n, p)
            for i in range(m)
        )  # fmt: skip
        for st in range(p)
        for t in range(s.num_slots)
    )
    assert s.slots == in_flight


def test_fewer_micro_batches_than_stages_and_an_unknown_schedule_are_clear_errors():
    with pytest.raises(
        ValueError, match=r"pipeline.stages: 4 needs at least 4 micro-batches.*is 2"
    ):
        make_schedule("1f1b", 4, 2)
    with pytest.raises(ValueError, match=r"'zb' is not a schedule jzero has; use one of 1f1b"):
        make_schedule("zb", 2, 2)


# -- a scanned toy through the engine --------------------------------------------------------------


def make_toy(seed=0, layers=L):
    ks = iter(jax.random.split(jax.random.key(seed), 8))

    def normal(shape, std=0.2):
        return std * jax.random.normal(next(ks), shape, jnp.float64)

    return {
        "embed": normal((V, D)),
        "layers": {
            "norm": 1.0 + normal((layers, D), 0.05),
            "up": normal((layers, D, F)),
            "down": normal((layers, F, D)),
        },
        "head": normal((D, V)),
    }


def toy_loss(p, batch):
    """Next-token cross-entropy of a residual MLP stack under one lax.scan."""
    tokens = batch["tokens"]
    x = jnp.take(p["embed"], tokens[:, :-1], axis=0)

    def layer(x, lp):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * lp["norm"]
        return x + jnp.tanh(h @ lp["up"]) @ lp["down"], None

    x, _ = jax.lax.scan(layer, x, p["layers"])
    logp = jax.nn.log_softmax(x @ p["head"], -1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()


def batches(n=3, seed=1, vocab=V, length=T):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, vocab, (BATCH, length + 1), dtype=np.int32)}
            for _ in range(n)]  # fmt: skip


def optax_loop(loss, params, data):
    """The single-device optax loop with DeepSpeed's clipping: losses, grad norms, params."""
    tx = optax.adamw(LR)

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        norm = optax.global_norm(grads)
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, CLIP / (norm + 1e-6)), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, norm

    opt_state, losses, norms = tx.init(params), [], []
    for b in data:
        params, opt_state, value, norm = step(params, opt_state, b)
        losses.append(float(value))
        norms.append(float(norm))
    return losses, norms, jax.device_get(params)


@functools.cache
def toy_reference():
    return optax_loop(toy_loss, make_toy(), batches())


def config(stage, stages, micro, schedule="1f1b", **extra):
    return {
        "train_batch_size": BATCH,
        "gradient_accumulation_steps": micro,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "pipeline": {"stages": stages, "schedule": schedule},
        **extra,
    }


EXTRA = {
    "": {},
    "remat": {"activation_checkpointing": {"policy": "full"}},
    "offload": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                      "offload_optimizer": {"device": "cpu"}}},
}  # fmt: skip


def full_config(stage, stages, micro, schedule="1f1b", extra="", **more):
    return {**config(stage, stages, micro, schedule), **EXTRA[extra], **more}


@functools.cache
def trained(stage, stages, micro, schedule, extra=""):
    cfg = full_config(stage, stages, micro, schedule, extra)
    engine = jzero.initialize(make_toy(), toy_loss, optax.adamw(LR), cfg)
    metrics = [engine.train_step(b) for b in batches()]
    return engine, [float(m["loss"]) for m in metrics], [float(m["grad_norm"]) for m in metrics]


# One run per code path: ZeRO stage 3 (parameters gathered within each stage's data group)
# and stage 1/2 (one path under the pipeline: the pipelined gradients are reduce-scattered
# once either way; the built-in GPT's test runs stage 1), every schedule, two stages and four
# (interior stages, which both receive and send), M = P and M > P; activation checkpointing
# (each stage's layer scan rematerialised) and the optimizer state in host memory ride along.
# The checkpoint test below restarts from the same configurations (the same programs).
RUNS = [
    (3, 2, 4, "1f1b", "remat"),
    (3, 4, 4, "gpipe", "offload"),
    (2, 4, 8, "1f1b", ""),
    (3, 2, 4, "zero_bubble", "remat"),  # beside RUNS[0]: the split backward's program
    (1, 4, 4, "zero_bubble", ""),  # a slot where a stage receives both ways: two permutes
    (1, 2, 4, "interleaved_1f1b", ""),  # each stage 2 chunks of one layer: the model's 0, 2
    (3, 2, 4, "interleaved_1f1b", "offload"),  # and 1, 3
]


@pytest.mark.parametrize("stage, stages, micro, schedule, extra", RUNS)
def test_a_pipelined_toy_trains_like_the_single_device_optax_loop(
    stage, stages, micro, schedule, extra
):
    """Also under activation checkpointing and with the optimizer state in host memory."""
    engine, losses, norms = trained(stage, stages, micro, schedule, extra)
    assert dict(engine.mesh.shape) == {"pipe": stages, "data": 8 // stages}
    ref_losses, ref_norms, ref_params = toy_reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-10, atol=0)
    assert max_rel_error(jax.device_get(engine.params), ref_params) < 1e-9
    # A stacked leaf rests as 1/P of the layers on each device (times ZeRO's shard at stage 3);
    # the embedding and head are whole on every stage.
    data = 8 // stages
    up = engine.state.params["layers"]["up"]
    expected = (L // stages, D // data, F) if stage == 3 else (L // stages, D, F)
    assert {s.data.shape for s in up.addressable_shards} == {expected}
    assert up.sharding.spec[0] == "pipe"
    assert engine.state.params["head"].sharding.spec[:1] != ("pipe",)
    assert f"pipeline: {stages} stages over 'pipe', schedule {schedule}" in engine.describe()
    if stages == 4 and stage == 3:  # evaluate runs the stages forward only, as a pipeline
        held_out = batches(1, seed=7)[0]
        expected = float(jax.jit(toy_loss)(ref_params, held_out))
        assert float(engine.evaluate(held_out)) == pytest.approx(expected, rel=1e-9)
        # Each stage runs its own layers: nothing is gathered over `pipe`; each of the 4
        # micro-batches (8 rows a device) goes forward once across each boundary.
        rows = jzero.distributed.global_batch(held_out, engine.plan.batch, BATCH)
        program = engine._eval.lower(engine._resting_params(), engine.state.extra, rows)
        compiled = program.compile()
        carry = BATCH // data // 4 * T * D * 8
        assert permute_sends(compiled) == {d: 4 * carry for d in range(8 - data)}
        by_axes = collectives_by_axes(compiled, engine.mesh)
        assert {k for k, st in by_axes[("pipe",)].items() if st.count} == {
            "collective-permute",
            "all-reduce",  # the loss, from the last stage
        }
        assert by_axes[("pipe",)]["all-reduce"].bytes == 8
        assert set(by_axes) == {("pipe",), ("data",)}


def test_the_compiled_step_moves_activations_between_neighbouring_stages_only():
    engine, *_ = trained(*RUNS[0])  # activation checkpointing moves no extra activations
    compiled = engine.lower(batches()[0]).compile()
    by_axes = collectives_by_axes(compiled, engine.mesh)
    permutes = {axes: s["collective-permute"] for axes, s in by_axes.items()
                if s["collective-permute"].count}  # fmt: skip
    assert list(permutes) == [("pipe",)]
    # Each permute moves one micro-batch's activations (the layer scan's carry): rows per
    # device per micro-batch x tokens x width, in float64; from stage s to s + 1 or back.
    rows = BATCH // 4 // 4  # data-parallel 4, 4 micro-batches
    carry = rows * T * D * 8
    text = compiled.as_text()
    lines = [ln for ln in text.splitlines() if " collective-permute(" in ln
             or " collective-permute-start(" in ln]  # fmt: skip
    assert lines
    for line in lines:
        assert f"f64[{rows},{T},{D}]" in line.split("collective-permute")[0], line
        for src, dst in source_target_pairs(line):
            assert abs(src - dst) == 4  # the same data position on the neighbouring stage
    # Each micro-batch's activations forward once, its gradient back once: M = 4 messages
    # from each device of either stage, one permute a slot with that slot's pairs.
    assert permute_sends(compiled) == {d: 4 * carry for d in range(8)}
    # A permute runs in each slot where a stage sends (both stages at once in the steady
    # state's slots): 6 of the 2 (M + P - 1) = 10 slots.
    assert permutes[("pipe",)].count == (make_schedule("1f1b", 2, 4).pattern > 0).sum() == 6
    assert permutes[("pipe",)].bytes == permutes[("pipe",)].count * carry
    # ZeRO's gathers and reduce-scatters stay within each stage's data group.
    for axes, stats in by_axes.items():
        if stats["all-gather"].count or stats["reduce-scatter"].count:
            assert axes == ("data",), axes
    # Stage 3 gathers the embedding only on the first stage and the head only on the last:
    # every all-gather outside the layer scan runs inside the pass's switch and inside the
    # first or last stage's conditional (the layers' inside the pass and the layer loop).
    places = _all_gather_callers(text)
    assert sorted(set(places)) == [
        ("conditional", "conditional", "while"),
        ("while", "conditional", "while"),
    ], places
    assert places.count(("conditional", "conditional", "while")) >= 2  # embedding, head


def _pass_branches(text):
    """Per branch of the compiled step's pass switch (idle, forward, backward[, weight]): the
    dots and reduce-scatters it runs, nested computations included (counted once each)."""
    comps, _ = computations(text)

    def reach(name, seen):
        if name in comps and name not in seen:
            seen.add(name)
            for line in comps[name]:
                for group in re.findall(
                    r"(?:body|condition|calls|to_apply|"
                    r"branch_computations)=(\{[^}]*\}|%?[\w.\-]+)",
                    line,
                ):
                    for callee in re.findall(r"%?([\w.\-]+)", group):
                        reach(callee, seen)
        return seen

    def count(name, op):
        return sum(bool(re.search(rf"\s{op}(-start)?\(", line))
                   for c in reach(name, set()) for line in comps[c])  # fmt: skip

    for lines in comps.values():
        for line in lines:
            m = re.search(r"branch_computations=\{([^}]*)\}", line)
            names = [x.strip().lstrip("%") for x in m.group(1).split(",")] if m else []
            if len(names) >= 3 and count(names[1], "dot"):  # the passes, not the permutes'
                return [(count(b, "dot"), count(b, "reduce-scatter")) for b in names]
    raise AssertionError("no pass switch in the compiled step")


def test_zero_bubble_computes_the_weight_gradients_in_the_weight_pass_only():
    """Stage 3, beside the same run under 1F1B: the input-gradient pass reduce-scatters
    nothing (no weight gradient is computed there: the compiler removed none, the split left
    none), the weight pass every leaf's; and the two passes do the one-pass backward's
    matmuls plus at most one (the last stage's head recomputed in both, where the stage-3
    conditional is checkpointed). A weight pass that re-ran the input gradients' chain would
    add the layers' input-gradient matmuls again."""
    split, *_ = trained(*RUNS[3])
    joint, *_ = trained(*RUNS[0])
    (_, _), (_, _), (b_dots, b_scatters), (w_dots, w_scatters) = _pass_branches(
        split.lower(batches()[0]).compile().as_text()
    )
    (_, _), (_, _), (dots, scatters) = _pass_branches(joint.lower(batches()[0]).compile().as_text())
    assert b_scatters == 0 and w_scatters == scatters == 5  # 3 layer leaves, embed, head
    assert b_dots >= 2 and w_dots >= 2  # the layer's two input-, two weight-gradient matmuls
    assert b_dots + w_dots <= dots + 1


def test_the_embedding_runs_on_the_first_stage_and_the_loss_on_the_last_only():
    """The stage unit's program: what the layers read besides their carry runs on every
    stage; the embedding lookup (a gather) only under the first stage's conditional, the
    head, softmax and the labels' lookup only under the last stage's."""
    half = jax.tree.map(lambda x: x, make_toy())
    half["layers"] = jax.tree.map(lambda x: x[: L // 2], half["layers"])
    batch = batches(1)[0]
    split = split_at_layers(toy_loss, half, batch, stages=2)
    unit = stage_unit(split)
    carry = [jnp.zeros(c.shape, c.dtype) for c in split.carry]
    flat = jax.tree.leaves(half)
    closed = jax.make_jaxpr(
        lambda ps, c, f, la: unit(
            jax.tree.unflatten(jax.tree.structure(half), ps), c, f, la, batch
        )  # fmt: skip
    )(flat, carry, True, False)
    top = [e.primitive.name for e in closed.jaxpr.eqns]
    assert "gather" not in top and "dot_general" in (
        e.primitive.name for e in closed.jaxpr.eqns[top.index("scan")].params["jaxpr"].eqns
    )
    conds = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 2
    inside = [{q.primitive.name for b in c.params["branches"] for q in b.jaxpr.eqns} for c in conds]
    assert "gather" in inside[0] and "dot_general" not in inside[0]  # the embedding lookup
    assert "dot_general" in inside[1] and "gather" in inside[1]  # the head, the labels


def _all_gather_callers(text):
    """Per all-gather in the HLO text, the ops that call its computation, innermost first."""
    comps, _ = computations(text)
    caller = {}
    for name, lines in comps.items():
        for line in lines:
            op = re.search(r"\s([a-z][a-z0-9\-]*)\(", line)
            for group in re.findall(
                r"(?:body|calls|to_apply|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)", line
            ):
                for callee in re.findall(r"%?([\w.\-]+)", group):
                    caller.setdefault(callee, (name, op.group(1)))
    places = []
    for name, lines in comps.items():
        for line in lines:
            if " all-gather(" in line or " all-gather-start(" in line:
                chain, at = [], name
                while at in caller and len(chain) < 16:
                    at, op = caller[at]
                    if op in ("while", "conditional"):
                        chain.append(op)
                places.append(tuple(chain))
    return places


ROWS = 2  # rows of one micro-batch on each device


@functools.cache
@functools.cache  # GPipe at M = 8 is read twice
def temp_bytes(schedule, micro, stage=1):
    """The compiled step's temporaries at P = 2 (data-parallel 4), ROWS rows a micro-batch."""
    rows = 4 * ROWS * micro
    engine = jzero.initialize(
        make_toy(), toy_loss, optax.sgd(LR), config(stage, 2, micro, schedule,
                                                    train_batch_size=rows)
    )  # fmt: skip
    batch = {"tokens": np.zeros((rows, T + 1), np.int32)}
    return engine.lower(batch).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_keeps_p_micro_batches_of_activations_where_gpipe_keeps_m():
    """P = 2, micro-batches of the same size, M = 4P = 8 against M = 2P = 4: GPipe's
    temporaries grow by one micro-batch's saved activations per micro-batch, and at M = 8 1F1B
    holds M - P = 6 micro-batches' fewer than GPipe: P of them, as GPipe at M = P would (so
    1F1B's do not grow with M; at rel 0.1 one micro-batch more or fewer is 1/6 off)."""
    per_micro = (temp_bytes("gpipe", 8) - temp_bytes("gpipe", 4)) / 4
    # A micro-batch's saved activations: at least its 2 layers' inputs.
    assert per_micro >= 2 * ROWS * T * D * 8
    saved = temp_bytes("gpipe", 8) - temp_bytes("1f1b", 8)
    assert saved == pytest.approx((8 - 2) * per_micro, rel=0.1)


def test_stage_2_under_a_pipeline_reduce_scatters_each_micro_batch_and_sums_a_shard():
    """Each backward pass's gradients are reduce-scattered over the stage's data group (4)
    before they are added up, so the step's gradient sums hold a quarter of the stage's
    gradients: the temporaries fall by at least the other three quarters against stage 1
    (which sums whole gradients and reduces once after the micro-batches)."""
    toy = make_toy()
    stacked = sum(x.size for x in jax.tree.leaves(toy["layers"]))
    stage_grads = (sum(x.size for x in jax.tree.leaves(toy)) - stacked // 2) * 8  # float64
    saved = temp_bytes("1f1b", 4, 1) - temp_bytes("1f1b", 4, 2)
    assert saved >= 3 / 4 * stage_grads


def test_a_checkpoint_saved_at_two_stages_stage_3_restores_at_one_stage_stage_1(tmp_path):
    """The pipelined engines are RUNS[0]'s and RUNS[2]'s configurations: their programs."""
    ckpt = {"checkpoint": {"directory": str(tmp_path / "ckpt")}}
    data = batches()
    piped = jzero.initialize(make_toy(), toy_loss, optax.adamw(LR), full_config(*RUNS[0], **ckpt))
    piped.train_step(data[0])
    piped.save()
    piped.wait_until_finished()
    expected = float(piped.train_step(data[1])["loss"])
    piped.close()  # one writer per checkpoint directory
    four = jzero.make_mesh({"data": 4}, devices=jax.devices()[:4])
    whole = jzero.initialize(
        make_toy(),
        toy_loss,
        optax.adamw(LR),
        {**config(1, 1, 1), **ckpt},
        options=jzero.InitOptions(mesh=four),
    )
    whole.restore()
    assert float(whole.train_step(data[1])["loss"]) == pytest.approx(expected, rel=1e-10, abs=0)
    # ... and back onto four stages.
    whole.save(2)
    whole.wait_until_finished()
    expected = float(whole.train_step(data[2])["loss"])
    whole.close()
    cfg = full_config(*RUNS[2], **ckpt)
    four_stages = jzero.initialize(make_toy(), toy_loss, optax.adamw(LR), cfg)
    four_stages.restore(2)
    got = float(four_stages.train_step(data[2])["loss"])
    assert got == pytest.approx(expected, rel=1e-10, abs=0)


def test_layers_the_stages_do_not_divide_are_a_clear_error():
    engine = jzero.initialize(make_toy(layers=6), toy_loss, optax.sgd(LR), config(1, 4, 4))
    with pytest.raises(ValueError, match=r"pipeline.stages: 4 does not divide the 6 layers of "
                       r"layers.down.*divisors of 6 \(1, 2, 3, 6\)"):  # fmt: skip
        engine.train_step(batches(1)[0])


def test_a_python_loop_over_layers_is_refused_with_what_to_change():
    def loop_loss(p, batch):
        x = jnp.take(p["embed"], batch["tokens"][:, :-1], axis=0)
        for i in range(L):
            x = x + jnp.tanh(x @ p["layers"]["up"][i]) @ p["layers"]["down"][i]
        logp = jax.nn.log_softmax(x @ p["head"], -1)
        return -jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], -1).mean()

    engine = jzero.initialize(make_toy(), loop_loss, optax.sgd(LR), config(1, 2, 2))
    with pytest.raises(NoLayerScan, match=r"layers stacked under one lax.scan.*Python loop"):
        engine.train_step(batches(1)[0])


def test_stages_that_do_not_divide_the_devices_are_a_clear_error():
    with pytest.raises(
        ValueError, match=r"pipeline.stages: 3 does not divide the 8 devices.*1, 2, 4, 8"
    ):
        jzero.initialize(make_toy(), toy_loss, optax.sgd(LR), config(1, 3, 3))


def test_a_users_mesh_without_the_pipe_axis_is_refused_with_the_fix():
    options = jzero.InitOptions(mesh=jax.make_mesh((8,), ("data",)))
    with pytest.raises(ValueError, match=r"pipeline.stages: 2 needs a mesh axis 'pipe' of 2 "
                       r"devices, but the mesh is \{'data': 8\}.*give it pipe: 2"):  # fmt: skip
        jzero.initialize(make_toy(), toy_loss, optax.sgd(LR), config(1, 2, 2), options=options)


def test_interleaving_settings_that_do_not_fit_are_clear_errors():
    wrong = r"virtual_stages: 2 chunks of layers per stage need pipeline.schedule: interleaved"
    with pytest.raises(jzero.ConfigError, match=wrong + r"_1f1b, but the schedule is '1f1b'"):
        jzero.load_config({**config(1, 2, 4), "pipeline": {"stages": 2, "virtual_stages": 2}})
    with pytest.raises(jzero.ConfigError, match=r"groups of pipeline.stages \(4\), but "
                       r"gradient_accumulation_steps is 6; set it to a multiple of 4"):  # fmt: skip
        jzero.load_config(config(1, 4, 6, "interleaved_1f1b"))
    engine = jzero.initialize(make_toy(), toy_loss, optax.sgd(LR),
                              config(1, 4, 4, "interleaved_1f1b"))  # fmt: skip
    with pytest.raises(ValueError, match=r"virtual_stages: 4 stages of 2 chunks each do not "
                       r"divide the 4 layers of layers.down"):  # fmt: skip
        engine.train_step(batches(1)[0])


def test_too_few_micro_batches_are_refused_when_the_config_is_read():
    with pytest.raises(ValueError, match=r"pipeline.stages: 4 needs at least 4 micro-batches"):
        jzero.initialize(make_toy(), toy_loss, optax.sgd(LR), config(1, 4, 2))


# -- the built-in GPT ------------------------------------------------------------------------------

GPT = gpt.GPTConfig(
    vocab_size=64, seq_len=16, num_layers=4, num_heads=4, d_model=32, d_ff=64, dtype="float64"
)


def gpt_params():
    return jax.tree.map(lambda x: x.astype(np.float64), gpt.init_params(jax.random.key(0), GPT))


def gpt_loss(p, b):
    return gpt.loss_fn(p, b, GPT)


@functools.cache
def gpt_reference():
    return optax_loop(gpt_loss, gpt_params(), batches(vocab=64, length=GPT.seq_len))


@functools.cache
def gpt_pipelined():
    """The GPT at stage 1 on four stages of eight micro-batches (a row a device each) after
    gpt_reference()'s steps: its engine and metrics."""
    engine = jzero.initialize(gpt_params(), gpt_loss, optax.adamw(LR), config(1, 4, 8))
    return engine, [engine.train_step(b) for b in batches(vocab=64, length=GPT.seq_len)]


def test_the_built_in_gpt_pipelined_trains_like_the_single_device_optax_loop():
    """Stage 1 on four stages: what the GPT's layers read besides their carry (positions, the
    mask) made on every stage; stage 3's gathers under the pipeline are the toy's RUNS."""
    engine, metrics = gpt_pipelined()
    ref_losses, ref_norms, ref_params = gpt_reference()
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], ref_losses, rtol=1e-10)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-10)
    assert max_rel_error(jax.device_get(engine.params), ref_params) < 1e-9
    assert sum(engine.plan.pipelined) == sum(1 for x in jax.tree.leaves(gpt_params()["blocks"]))


@pytest.mark.parametrize("stages, micro", [(2, 8), (4, 4), (4, 8)])  # (2, 4): the toy's above
def test_the_built_in_gpt_sends_each_micro_batch_once_forward_and_once_back(stages, micro):
    """Read from the compiled step: per device, the bytes its collective-permutes send, the
    schedule table's permute counted as often as the table runs each of its branches. 1F1B
    needs each micro-batch's activations forward and its gradient back across each stage
    boundary, nothing in idle slots: M carries from an end stage, 2 M from an interior one."""
    batch = {"tokens": np.zeros((8 // stages * micro, GPT.seq_len + 1), np.int32)}
    if (stages, micro) == (4, 8):  # the layout the GPT trains in above: its step, compiled
        sends = permute_sends(gpt_pipelined()[0].lower(batch).compile())
    else:
        cfg = {**config(1, stages, micro), "train_batch_size": 8 // stages * micro}
        engine = jzero.initialize(
            lambda k: gpt.init_params(k, GPT), gpt_loss, optax.sgd(LR), cfg, abstract=True,
        )  # fmt: skip
        fast = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
        sends = permute_sends(engine.lower(batch).compile(fast))  # the HLO passes all run
    carry = 1 * GPT.seq_len * GPT.d_model * 8  # one row a device per micro-batch, float64
    data = 8 // stages
    for device in range(8):
        stage = device // data
        need = micro * (1 if stage in (0, stages - 1) else 2) * carry
        assert sends[device] == need <= 1.15 * 2 * micro * carry, (device, sends)
    schedule = make_schedule("1f1b", stages, micro)
    assert [sends[s * data] // carry for s in range(stages)] == schedule.transfers.tolist()


def test_the_estimate_splits_the_model_state_over_stages_and_keeps_p_or_m_micro_batches():
    model = ModelShape(7e9, seq_len=2048, hidden=4096, layers=32, heads=32)

    def layout(**sizes):
        return ParallelDims(64, micro_batch=1, **sizes)

    whole = jzero.memory.estimate(model, layout())
    piped = jzero.memory.estimate(model, layout(pipe=4, micro_batches=16))
    gpipe = jzero.memory.estimate(model, layout(pipe=4, micro_batches=16, schedule="gpipe"))
    assert piped.row(0).device_bytes == pytest.approx(16 * 7e9 / 4)  # Psi / P a stage
    assert piped.row(3).device_bytes == pytest.approx(16 * 7e9 / 64)  # over all N devices
    # 1F1B: P micro-batches of L / P layers, the activations of one micro-batch of L layers;
    # GPipe: M of them.
    assert piped.row(0).activations == pytest.approx(whole.row(0).activations)
    assert gpipe.row(0).activations == pytest.approx(16 / 4 * piped.row(0).activations)
    # Each micro-batch's s b h activations forward, their gradient back (bf16).
    assert piped.row(0).pipe_axis_bytes == 2 * 16 * 2048 * 4096 * 2
    assert "pipeline P = 4 stages (1f1b, M = 16 micro-batches, bubble" in piped.table()
    # Zero-bubble keeps 1F1B's P in flight; interleaving's first stage 2 (P - 1) + (V - 1) P + 1
    # = 11 chunks of L / (P V) layers, and each micro-batch crosses V times the boundaries.
    zb, inter = (jzero.memory.estimate(model, layout(pipe=4, micro_batches=16, schedule=k,
                                                     virtual=v))
                 for k, v in (("zero_bubble", 1), ("interleaved_1f1b", 2)))  # fmt: skip
    assert zb.row(0).activations == pytest.approx(piped.row(0).activations)
    assert inter.row(0).activations == pytest.approx(11 / 2 / 4 * piped.row(0).activations)
    assert inter.row(0).pipe_axis_bytes == 2 * piped.row(0).pipe_axis_bytes
    with pytest.raises(ValueError, match=r"micro_batches: 2 is fewer than the 4 pipeline"):
        jzero.memory.estimate(ModelShape(7e9), ParallelDims(64, pipe=4, micro_batches=2))


def test_jzero_train_runs_the_built_in_gpt_on_two_stages(tmp_path, tiny_gpt):
    """`jzero train --set pipeline.stages=2` on 8 devices: the mesh {pipe: 2, data: 4}, the
    loss falls, and each device holds less model state than on {data: 8} at stage 1 (half the
    layers, the optimizer state sharded over 4 instead of 8)."""
    import json

    from jzero import train

    steps = 3
    model = ", ".join(f"{k}: {v}" for k, v in tiny_gpt.items())
    tiny = [
        f"model={{{model}}}",
        "data={source: stdlib, max_bytes: 200000}",
        "train.eval_interval=0",
        "zero_optimization.stage=1",
        "checkpoint.directory=null",
        "train.compile_cache=null",  # the test run's cache, not a fresh one beside the logs
    ]
    piped = train.run(
        "configs/zero2.yaml",
        overrides=[*tiny, "pipeline.stages=2", "gradient_accumulation_steps=2",
                   "train_micro_batch_size_per_gpu=2", f"train.log_dir={tmp_path / 'p'}"],
        steps=steps,
        progress=False,
    )  # fmt: skip
    # The same run on {data: 8}: its plan from the state's shapes (nothing to train or compile).
    cfg = jzero.load_config(
        "configs/zero2.yaml", overrides=[*tiny, "train_micro_batch_size_per_gpu=2"]
    )
    model = gpt.GPTConfig(**tiny_gpt)
    whole = jzero.initialize(
        lambda key: gpt.init_params(key, model),
        lambda p, b: gpt.loss_fn(p, b, model),
        config=cfg,
        abstract=True,
    )
    whole_bytes = sum(model_state_bytes(whole.plan).values())
    assert piped["mesh"] == {"pipe": 2, "data": 4} and dict(whole.mesh.shape) == {"data": 8}
    lines = (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(x)["loss"] for x in lines]
    assert len(losses) == steps and losses[-1] < losses[0]
    assert piped["model_state_bytes_per_device"] < whole_bytes


@needs_float16
def test_fp16_loss_scaling_seeds_the_pipeline_with_the_scale():
    """fp16 with dynamic loss scaling (initial scale 2^8): the pipeline seeds each micro-batch's
    backward pass with the scale and unscales after, so the first step's loss and gradient norm
    are P = 1's. Bound: both runs compute each micro-batch's layers with the same fp16 ops,
    only summing the micro-batches and stages in another order; 4 L roundings of fp16's unit
    roundoff (2^-11) bound what reordering moves (8e-3). A seed without the scale would be off
    by 2^8, a stage's gradients left out by its share of the norm."""
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}
    toy = jax.tree.map(lambda x: x.astype(jnp.float32), make_toy())
    first = batches(1)[0]
    runs = []
    for stages in (1, 2):
        engine = jzero.initialize(toy, toy_loss, optax.adamw(LR), {**config(2, stages, 2), **fp16})
        m = engine.train_step(first)
        assert float(m["skipped"]) == 0 and float(m["loss_scale"]) == 2.0**8
        runs.append((float(m["loss"]), float(m["grad_norm"])))
    (loss1, norm1), (loss2, norm2) = runs
    bound = 4 * L * 2.0**-11
    assert loss2 == pytest.approx(loss1, rel=bound)
    assert norm2 == pytest.approx(norm1, rel=bound)


def test_jzero_plan_for_another_device_count_refuses_a_pipelined_mesh_with_the_fix():
    with pytest.raises(ValueError, match=r"--devices 16.*mesh also has \{'pipe': 2\}.*drop "):
        plan_report(
            "configs/zero2.yaml",
            devices=16,
            overrides=["pipeline.stages=2", "gradient_accumulation_steps=2"],
        )
