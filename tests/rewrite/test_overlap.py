"""``overlap_comm``: stage 3's one-layer-ahead gathers in the scan, stages 1-2's bucketed
reductions, the GPU compile options, and ``jzero.hlo``'s reports of what can overlap.

On CPU collectives run synchronously, so the tests assert structure from the compiled program:
which collectives a loop iteration's matmuls wait for (``hlo.loop_collectives``), how many
reduce-scatters a step issues, the temporaries per layer; and that the losses do not change:
those runs are in float64 (tests/support/numerics.py), compared at 1e-10 with each other and, by the
first step's grad_norm, with optax's gradient (Adam and clipping hide a gradient's scale from
the losses).
"""

import math
import sys
import warnings

import jax
import numpy as np
import optax
import pytest
import toy
from gpt_runs import batches, first_grad_norm, gpt_params, gpt_run, loss_fn
from repo import ROOT

import jzero
from jzero import hlo
from jzero.comm import overlap
from jzero.config import JzeroConfigWarning
from jzero.engine import settings
from jzero.parallel.zero import scattered_leaves
from jzero.plan import PlanOptions, make_plan
from jzero.rewrite import layer_dims

F64 = "float64"


def assert_same_training(run, ref, num_layers):
    np.testing.assert_allclose(run[0], ref[0], rtol=1e-10, atol=0)
    np.testing.assert_allclose(run[3], ref[3], rtol=1e-10, atol=0)
    assert run[3][0] == pytest.approx(first_grad_norm(num_layers), rel=1e-10, abs=0)


# -- stage 3: the gather of layer i+1 while layer i computes ------------------------------------


def loop_facts(text):
    """Per (kind, waits for a matmul of its iteration, a matmul of its iteration waits for it):
    how many collectives inside loop bodies."""
    facts = {}
    for c in hlo.loop_collectives(text):
        key = (c.kind, c.after_compute, c.feeds_compute)
        facts[key] = facts.get(key, 0) + 1
    return facts


def test_stage3_scan_gathers_one_layer_ahead_with_the_same_losses():
    # 4 layers: the forward loop runs layers 0-2 (layer 3 after it), the backward loop layers
    # 2-1 (3 before it, 0 after it); a loop of one iteration would be unrolled by XLA.
    exact = gpt_run(steps=3, num_layers=4, dtype=F64)
    ahead = gpt_run(steps=3, num_layers=4, dtype=F64, overlap_comm=True)
    (_, exact_text, _, _), (_, ahead_text, engine, _) = exact, ahead
    assert engine.plan.options.comm.overlap_comm
    assert_same_training(ahead, exact, 4)
    # The same traffic: every gather and reduce-scatter, no more.
    for kind in ("all-gather", "reduce-scatter"):
        assert hlo.collectives(ahead_text)[kind] == hlo.collectives(exact_text)[kind]
    # Without overlap a scan iteration gathers its own layer, and its matmuls wait for it; its
    # gradient's reduce-scatter waits for its backward matmuls.
    plain = loop_facts(exact_text)
    assert plain.get(("all-gather", False, True), 0) > 0
    assert plain.get(("reduce-scatter", True, False), 0) > 0
    # With it, no collective in any loop waits for a matmul of its iteration or is waited for
    # by one: the gathers fetch the next layer (forward and backward) and the reduce-scatters
    # reduce the layer before's gradient, all beside the iteration's compute.
    found = loop_facts(ahead_text)
    layers = 12  # gathered leaves per layer of the GPT's blocks
    assert set(found) == {("all-gather", False, False), ("reduce-scatter", False, False)}
    assert found[("all-gather", False, False)] >= 2 * layers - 1  # forward and backward loops
    assert found[("reduce-scatter", False, False)] == layers


def toy_temp(num_layers, **zero):
    """Temporaries of a compiled stage-3 step of the toy model (layers of 256 x 256 fp32)."""
    params = toy.make_params(num_layers=num_layers, d=256)
    cfg = {
        "train_batch_size": 32,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    engine = jzero.initialize(params, toy.loss_fn, optax.sgd(1e-2), cfg)
    compiled = engine.lower(toy.make_batches(1, 32)[0]).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_stage3_overlap_memory_does_not_grow_with_the_layer_count():
    layer = 256 * 256 * 4  # one layer's gathered weight
    plain_small, plain_big = toy_temp(4), toy_temp(8)
    ahead_small, ahead_big = toy_temp(4, overlap_comm=True), toy_temp(8, overlap_comm=True)
    # Four more layers cost what they cost without overlap (their activations and gradient
    # shards), not four more gathered weights: measured, exactly the same 160 KiB.
    assert ahead_big - ahead_small <= plain_big - plain_small + layer // 8
    assert ahead_big - ahead_small < layer
    # The price is a constant few layers: the one fetched ahead and the gradient being reduced
    # (measured: two layers more than without overlap).
    assert ahead_small - plain_small <= 3 * layer


# -- stages 1-2: buckets ------------------------------------------------------------------------


def test_stage2_buckets_reduce_in_about_four_collectives_with_the_same_bytes_and_losses():
    exact = gpt_run(stage=2, steps=3, dtype=F64)
    _, exact_text, plain_engine, _ = exact
    numel = sum(math.prod(leaf.shape) for leaf in plain_engine.plan.leaves)
    quarter = numel // 4
    zero = dict(overlap_comm=True, reduce_bucket_size=quarter, allgather_bucket_size=quarter)
    bucketed = gpt_run(stage=2, steps=3, dtype=F64, **zero)
    _, text, engine, _ = bucketed
    assert engine.plan.options.comm.reduce_bucket_size == quarter
    e, b = hlo.collectives(exact_text), hlo.collectives(text)
    leaves = len(plain_engine.plan.leaves)
    sizes = [math.prod(leaf.shape) for leaf in engine.plan.leaves]
    expected = len(overlap.bucket_groups(sizes, [0] * leaves, quarter))
    # The layer scan's leaves are reduce-scattered in its backward loop, once a layer (stage
    # 2's scatter at the use); the buckets hold the others, reduced after the backward pass.
    cfg, params = gpt_params(2, F64)  # the runs' own parameters (made once): read, not run
    with jax.enable_x64(True):
        dims = layer_dims(lambda p, x: loss_fn(p, x, cfg), params, batches(1)[0])
    in_loop = scattered_leaves(engine.plan, dims)
    assert sum(in_loop) >= 4
    rest = [s for s, scattered in zip(sizes, in_loop, strict=True) if not scattered]
    buckets = len(overlap.bucket_groups(rest, [0] * len(rest), quarter))
    layers = 2 * sum(in_loop)
    assert e["reduce-scatter"].count == len(rest) + layers  # one per leaf without buckets
    assert b["reduce-scatter"].count == buckets + layers and buckets < len(rest)
    assert b["reduce-scatter"].bytes == e["reduce-scatter"].bytes  # the same totals
    assert b["all-gather"].count == expected and 4 <= expected <= 6
    assert b["all-gather"].bytes == e["all-gather"].bytes
    assert_same_training(bucketed, exact, 2)


def test_bucket_groups_and_rows():
    assert overlap.bucket_groups([3, 3, 5, 1, 9, 1], ["a"] * 6, 6) == [[0, 1], [2, 3], [4], [5]]
    assert overlap.bucket_groups([1, 1, 1], ["a", "b", "a"], 2) == [[0, 2], [1]]
    assert overlap.bucket_groups([1, 1], ["a", "a"], None) == [[0], [1]]
    x = np.arange(2 * 8 * 3).reshape(2, 8, 3)
    rows = overlap.to_rows(x, 1, 4)  # device i keeps x[:, 2i:2i+2, :]
    assert rows.shape == (4, 12)
    np.testing.assert_array_equal(rows[1], x[:, 2:4, :].reshape(-1))
    np.testing.assert_array_equal(overlap.from_rows(rows, x.shape, 1), x)


# -- GPU compile options ------------------------------------------------------------------------


def plan_for(stage, **kw):
    params = {"w": jax.ShapeDtypeStruct((64, 64), np.float32)}
    options = PlanOptions().replace(**kw)
    return make_plan(params, optax.adam(1e-3), jzero.make_mesh({"data": 8}), stage, options)


def test_gpu_compile_options_follow_the_config_and_cpu_gets_none():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JzeroConfigWarning)
        cfg = jzero.config.load_config(
            {
                "bf16": {"enabled": True},
                "zero_optimization": {
                    "stage": 2,
                    "overlap_comm": True,
                    "reduce_bucket_size": 1000,
                    "allgather_bucket_size": 3000,
                },
            }
        )
    plan = plan_for(2, precision=settings.precision(cfg),
                    **vars(settings.comm_options(cfg.zero_optimization)))  # fmt: skip
    opts = overlap.compiler_options(plan, platform="gpu")
    assert opts["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert opts["xla_gpu_enable_pipelined_all_gather"] is True
    assert opts["xla_gpu_enable_pipelined_reduce_scatter"] is True
    assert opts["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 2000  # bf16 bytes
    assert opts["xla_gpu_all_reduce_combine_threshold_bytes"] == 2000
    assert opts["xla_gpu_all_gather_combine_threshold_bytes"] == 6000
    # Every option is one this XLA knows (an unknown one fails the compile).
    jax.jit(lambda x: x + 1).lower(np.ones(3)).compile(compiler_options=opts)
    assert overlap.compiler_options(plan) == {}  # these devices are CPUs
    assert overlap.compiler_options(plan_for(2), platform="gpu") == {}  # overlap_comm off
    stage3 = overlap.compiler_options(plan_for(3, overlap_comm=True), platform="gpu")
    assert stage3 == overlap.GPU_ASYNC_OPTIONS  # no buckets at stage 3


def test_make_plan_refuses_bad_bucket_sizes():
    with pytest.raises(ValueError, match="reduce_bucket_size=0 is not a bucket size"):
        plan_for(2, overlap_comm=True, reduce_bucket_size=0)
    unbucketed = plan_for(2, reduce_bucket_size=10).options.comm  # needs overlap_comm
    assert unbucketed.reduce_bucket_size is None
    at_stage3 = plan_for(3, overlap_comm=True, reduce_bucket_size=10).options.comm
    assert at_stage3.reduce_bucket_size is None


# -- the asynchronous-collective report ---------------------------------------------------------

ASYNC_HLO = """\
HloModule jit_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_dot (p0: f32[8,16], p1: f32[16,16]) -> f32[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,16]{1,0} parameter(1)
  ROOT %dot = f32[8,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%rs_computation (p: f32[16,16]) -> f32[2,16] {
  %p = f32[16,16]{1,0} parameter(0)
  ROOT %rs = f32[2,16]{1,0} reduce-scatter(%p), replica_groups={}, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[8,16], w: f32[2,16], v: f32[16,16]) -> (f32[8,16], f32[2,16], f32[]) {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[2,16]{1,0} parameter(1)
  %v = f32[16,16]{1,0} parameter(2)
  %all-gather-start = (f32[2,16], f32[16,16]) all-gather-start(%w), dimensions={0}
  %fusion = f32[8,16]{1,0} fusion(%x, %v), kind=kOutput, calls=%fused_dot
  %all-gather-done = f32[16,16]{1,0} all-gather-done(%all-gather-start)
  %async-start = ((f32[16,16]{1,0}), f32[2,16]{1,0}, s32[]) async-start(%v), calls=%rs_computation
  %fusion.1 = f32[8,16]{1,0} fusion(%fusion, %all-gather-done), kind=kOutput, calls=%fused_dot
  %fusion.2 = f32[8,16]{1,0} fusion(%fusion.1, %v), kind=kOutput, calls=%fused_dot
  %async-done = f32[2,16]{1,0} async-done(%async-start)
  %s = f32[] constant(1)
  %all-reduce-start = f32[] all-reduce-start(%s), replica_groups={}, to_apply=%add
  %all-reduce-done = f32[] all-reduce-done(%all-reduce-start)
  ROOT %t = (f32[8,16]{1,0}, f32[2,16]{1,0}, f32[]) tuple(%fusion.2, %async-done, %all-reduce-done)
}
"""


def test_async_report_reads_starts_dones_and_the_compute_between():
    found = {c.kind: c for c in hlo.async_collectives(ASYNC_HLO)}
    assert set(found) == {"all-gather", "reduce-scatter", "all-reduce"}
    assert found["all-gather"].between == ("fusion",) and found["all-gather"].compute == 1
    assert found["all-gather"].done == "all-gather-done"
    assert found["reduce-scatter"].compute == 2 and found["reduce-scatter"].start == "async-start"
    assert found["all-reduce"].compute == 0  # asynchronous in form only
    # The collectives are counted as usual, the async reduce-scatter through its computation.
    stats = hlo.collectives(ASYNC_HLO)
    assert stats["all-gather"].count == 1 and stats["all-gather"].bytes == 16 * 16 * 4
    assert stats["reduce-scatter"].count == 1


def test_cpu_programs_run_no_collective_asynchronously():
    _, text, _, _ = gpt_run(steps=3, num_layers=4, dtype=F64, overlap_comm=True)
    assert hlo.collectives(text)["all-gather"].count > 0
    assert hlo.async_collectives(text) == []


# -- the GPU check's script, on CPU -------------------------------------------------------------


def test_overlap_comm_prefetches_one_layer_in_a_python_loop():
    """Unrolled layers (a Python loop) at stage 3: ``overlap_comm`` lets each forward gather
    start one layer ahead of its use, the program of ``stage3_prefetch_bucket_size`` of one
    layer's elements; the losses do not change."""
    sys.path.insert(0, str(ROOT / "tests" / "step"))  # also when this file runs alone
    import test_stage3_any_model as loop

    texts, runs = {}, {}
    with jax.enable_x64(True):  # float64: each trains like the optax loop (loop_sgd_reference)
        data = loop.batches(2, np.float64)
        for name, keys in (
            ("plain", {}),
            ("overlap", {"overlap_comm": True}),
            ("one layer", {"stage3_prefetch_bucket_size": loop.D * loop.D}),
        ):
            cfg = loop.zero3(**keys)
            e = jzero.initialize(loop.loop_params(), loop.loop_loss, optax.sgd(0.1), cfg)
            texts[name] = e.lower(data[0]).as_text()
            if name != "one layer":  # its program is overlap's (asserted below): not run again
                runs[name] = loop.train(e, data)
    assert texts["overlap"] == texts["one layer"] != texts["plain"]
    assert runs["overlap"] == runs["plain"]  # the same arithmetic, bit for bit
    loop.assert_matches(runs["overlap"], loop.loop_sgd_reference())
