"""Expert parallelism (``expert_parallel.autoep_size``, :mod:`jzero.parallel.expert`): an MoE
toy (a pytree, 8 experts, top-2) trained at E_p in {1, 2, 4} and stages 0-3 on 8 devices equals
a single-device reference that runs every expert on every token and masks by the router
(float64, 1e-10), drops included; expert leaves rest split over ``expert`` (and ``data`` at
stage 3); the compiled step holds two all-to-alls per MoE layer over the expert groups and no
gradient-sized collective over all devices; routers that starve experts train and match; a
checkpoint moves across E_p and stages; bad input names the numbers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from moe_toy import (
    DEVICES,
    LR,
    OUT,
    D,
    E,
    F,
    K,
    batches,
    bias_all_to_expert_0,
    bias_first_device_only,
    config,
    make_loss,
    make_params,
    reference,
    reference_run,
)

import jzero
from jzero import hlo, moe

RTOL = 1e-10  # float64: the slots and the dense reference add the same products in other orders


def assert_close(got, want, rtol=RTOL):
    got, want = np.asarray(got), np.asarray(want)
    scale = max(float(np.max(np.abs(want))), 1e-300)
    err = float(np.max(np.abs(got - want))) / scale
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


pytestmark = pytest.mark.usefixtures("x64")  # conftest's float64


@pytest.fixture(scope="module")
def expected():
    with jax.enable_x64(True):
        return reference_run(make_params(), reference(), batches(2))


# E_p 1 (no expert axis: every expert on each device), 2 and 4 (the expert groups); stage 0
# (nothing sharded), 1 (optimizer state over expert x data), 3 (parameters over data too). Stage 2
# at E_p 4 is test_clipping_and_host_offload_beside_the_expert_axis, stage 3 at E_p 2
# test_a_replica_axis_outside_the_expert_axis_trains_the_same.
@pytest.mark.parametrize("ep, stage", [(1, 3), (2, 0), (4, 1), (4, 3)])
def test_moe_toy_equals_the_dense_reference(ep, stage, expected):
    want, want_params = expected
    engine = jzero.initialize(make_params(), make_loss(), optax.sgd(LR), config(stage, ep))
    mesh = dict(engine.plan.mesh.shape)
    assert mesh == ({"data": DEVICES} if ep == 1 else {"data": DEVICES // ep, "expert": ep})
    for (loss, aux), batch in zip(want, batches(2), strict=True):
        metrics = engine.train_step(batch)
        assert_close(float(metrics["loss"]), loss)
        # float32 metrics: the aux loss to its rounding, the fraction exactly (k/64 multiples)
        assert float(metrics["moe_dropped_fraction"]) == aux["moe_dropped_fraction"] == 0.0
        assert abs(float(metrics["moe_aux_loss"]) - aux["moe_aux_loss"]) <= 1e-6
        # one global norm, every element once (a float32 metric: to its rounding)
        assert abs(float(metrics["grad_norm"]) / aux["grad_norm"] - 1) <= 1e-6
    for got, want_leaf in zip(
        jax.tree.leaves(engine.params), jax.tree.leaves(want_params), strict=True
    ):
        assert_close(got, want_leaf)
    if ep > 1:
        experts = [
            leaf.path for leaf, e in zip(engine.plan.leaves, engine.plan.experts, strict=True) if e
        ]
        assert experts == ["experts.w1", "experts.w2"]
        assert "experts: 2 expert leaves split over 'expert'" in engine.describe()


def test_a_replica_axis_outside_the_expert_axis_trains_the_same(expected):
    want, want_params = expected
    cfg = config(3, 2, mesh={"replica": 2})
    engine = jzero.initialize(make_params(), make_loss(), optax.sgd(LR), cfg)
    assert dict(engine.mesh.shape) == {"replica": 2, "data": 2, "expert": 2}
    for (loss, _), batch in zip(want, batches(2), strict=True):
        assert_close(float(engine.train_step(batch)["loss"]), loss)
    for got, want_leaf in zip(
        jax.tree.leaves(engine.params), jax.tree.leaves(want_params), strict=True
    ):
        assert_close(got, want_leaf)


def test_clipping_and_host_offload_beside_the_expert_axis():
    steps = batches(2, seed=7)
    want, want_params = reference_run(make_params(), reference(), steps, clip=0.5)
    assert all(aux["grad_norm"] > 0.5 for _, aux in want)  # the clip acts on both steps
    zero = {"offload_optimizer": {"device": "cpu"}}
    cfg = config(2, 4, gradient_clipping=0.5)
    cfg["zero_optimization"].update(zero)
    engine = jzero.initialize(make_params(), make_loss(), optax.sgd(LR), cfg)
    for (value, _), batch in zip(want, steps, strict=True):
        assert_close(float(engine.train_step(batch)["loss"]), value)
    for got, want_leaf in zip(
        jax.tree.leaves(engine.params), jax.tree.leaves(want_params), strict=True
    ):
        assert_close(got, want_leaf)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(engine.state.opt_state)}
    assert kinds <= {"pinned_host"}


def test_bf16_beside_the_expert_axis_stays_near_the_float64_reference():
    value = reference_run(make_params(), reference(), batches(1))[0][0][0]
    cfg = config(3, 4, bf16={"enabled": True})
    engine = jzero.initialize(make_params(), make_loss(), optax.sgd(LR), cfg)
    got = float(engine.train_step(batches(1)[0])["loss"])
    # bf16 rounds each input and product to 2^-8 relative; the loss is a mean of squares a
    # few such operations deep from well-scaled inputs (|x| ~ 1, weights ~ 1/sqrt(fan-in)):
    # a few 2^-8 at most, whatever the machine.
    assert abs(got / value - 1) < 2e-2, (got, value)
    assert engine.state.params["experts"]["w1"].dtype == jnp.bfloat16


def _shard_elements(x):
    return math.prod(x.sharding.shard_shape(x.shape))


@pytest.mark.parametrize("stage", [1, 3])
def test_expert_leaves_rest_split_over_expert_and_at_stage_3_over_data_too(stage):
    engine = jzero.initialize(make_params(), make_loss(), optax.adam(1e-3), config(stage, 4))
    full = E * D * F
    w1 = engine.state.params["experts"]["w1"]
    # E_p = 4 of 8 devices, data = 2: a quarter at stages 0-2, an eighth at stage 3
    assert _shard_elements(w1) == (full // 8 if stage == 3 else full // 4)
    # the optimizer state of an expert leaf: sharded over expert x data at every stage >= 1
    mu = engine.state.opt_state[0].mu["experts"]["w1"]
    assert _shard_elements(mu) == full // 8
    # a dense leaf: ZeRO over all 8 devices (data x expert), whole params below stage 3
    head = engine.state.params["head"]
    assert _shard_elements(head) == (math.ceil(D / 8) * OUT if stage == 3 else D * OUT)


@pytest.fixture(scope="module")
def compiled_ep4_stage3():
    with jax.enable_x64(True):
        engine = jzero.initialize(make_params(), make_loss(), optax.sgd(LR), config(3, 4))
        batch = batches(1)[0]
        return engine, engine.lower(batch).compile()


def test_the_compiled_step_holds_two_all_to_alls_per_layer_each_way(compiled_ep4_stage3):
    engine, compiled = compiled_ep4_stage3
    by_axes = hlo.collectives_by_axes(compiled, engine.plan.mesh)
    a2a = {axes: s["all-to-all"] for axes, s in by_axes.items() if s["all-to-all"].count}
    # forward: dispatch and combine; backward: their transposes. All within expert groups.
    assert set(a2a) == {("expert",)}, a2a
    assert a2a[("expert",)].count == 4
    # No gradient-sized collective over every device: the expert leaves' gradients are
    # reduce-scattered over data only (the largest all-device collective is a dense leaf's).
    expert_grad_bytes = E * D * F * 8 // 4  # one device's w1 piece, float64
    every = by_axes.get(("data", "expert"), {})
    biggest = max((s.bytes // max(s.count, 1) for s in every.values() if s.count), default=0)
    assert biggest < expert_grad_bytes, (biggest, every)


@pytest.mark.parametrize("bias", [bias_all_to_expert_0, bias_first_device_only])
def test_starving_routers_train_and_match_the_reference(bias):
    params = make_params(bias=bias())
    # capacity 2 per expert of a device's 4 tokens: the crowded experts drop tokens
    loss, ref = make_loss(1.0, 2), reference(1.0, 2)
    steps = batches(3, seed=3)
    want, _ = reference_run(params, ref, steps)
    assert all(aux["moe_dropped_fraction"] > 0 for _, aux in want)
    engine = jzero.initialize(params, loss, optax.sgd(LR), config(3, 4))
    for (value, aux), batch in zip(want, steps, strict=True):
        metrics = engine.train_step(batch)
        assert_close(float(metrics["loss"]), value)
        assert float(metrics["moe_dropped_fraction"]) == aux["moe_dropped_fraction"]


def test_routing_counts_drops_as_the_slots_do():
    logits = jax.random.normal(jax.random.key(0), (16, E), jnp.float64)
    r = moe.route(logits, experts_per_token=K, slots=2)
    per_expert = np.asarray(jnp.sum(r.dispatch_mask, axis=(0, 2)))
    assert np.all(per_expert <= 2)
    kept = float(jnp.sum(r.dispatch_mask))
    assert float(r.stats.dropped_fraction) == pytest.approx(1 - kept / (K * 16), abs=0)
    # first choices have priority: with one slot per expert, no first choice is dropped
    # while a second choice to the same expert is kept
    one = moe.route(logits, experts_per_token=K, slots=1)
    first = jnp.argmax(logits, axis=-1)
    placed = np.asarray(jnp.sum(one.dispatch_mask, axis=-1))  # [T, E]
    for e in range(E):
        firsts = np.flatnonzero(np.asarray(first) == e)
        if len(firsts):  # the expert's one slot went to its first first-choice token
            assert placed[firsts[0], e] == 1


def test_a_checkpoint_moves_from_ep4_stage3_to_ep2_stage2_and_ep1_stage1_on_4_devices(tmp_path):
    # No load-balancing term: it is the one part of the loss that depends on how many rows
    # each device routes (8 devices route 4 rows each, 4 devices 8), and nothing drops at this
    # capacity, so the next loss is the same number on any device count.
    loss = make_loss(aux_coef=0.0)
    steps = batches(4, seed=5)
    ckpt = {"directory": str(tmp_path)}
    with jzero.initialize(make_params(), loss, optax.sgd(LR), config(3, 4, checkpoint=ckpt)) as e:
        for batch in steps[:2]:
            e.train_step(batch)
        e.save()
        e.wait_until_finished()
        saved = jax.tree.map(np.asarray, e.params)
        want = [float(e.train_step(b)["loss"]) for b in steps[2:]]
    cfg2 = config(2, 2, checkpoint=ckpt)
    with jzero.initialize(make_params(seed=9), loss, optax.sgd(LR), cfg2) as e:
        e.restore()
        for a, b in zip(jax.tree.leaves(e.params), jax.tree.leaves(saved), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)  # every bit, at E_p = 2, stage 2
        assert e.plan.expert_size == 2
        assert_close(float(e.train_step(steps[2])["loss"]), want[0])
    mesh = jzero.make_mesh(4, devices=jax.devices()[:4])
    cfg1 = config(1, 1, checkpoint=ckpt)
    options = jzero.InitOptions(mesh=mesh)
    with jzero.initialize(make_params(seed=9), loss, optax.sgd(LR), cfg1, options=options) as e:
        e.restore()
        for a, b in zip(jax.tree.leaves(e.params), jax.tree.leaves(saved), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        got = [float(e.train_step(b)["loss"]) for b in steps[2:]]
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


def test_bad_expert_settings_name_the_numbers():
    params, loss = make_params(), make_loss()
    with pytest.raises(ValueError, match=r"autoep_size: 3 .*8"):
        jzero.initialize(params, loss, optax.sgd(LR), config(0, 3))
    bad = {**params, "experts": {"w1": jnp.zeros((6, D, F)), "w2": jnp.zeros((6, F, D))}}
    with pytest.raises(ValueError, match=r"autoep_size: 4 does not divide the 6 experts"):
        jzero.initialize(bad, loss, optax.sgd(LR), config(0, 4))
    with pytest.raises(ValueError, match=r"experts_per_token=9 .* 8 experts"):
        moe.route(jnp.zeros((4, E)), experts_per_token=9)
    with pytest.raises(ValueError, match=r"no leaf is named as an expert"):
        jzero.initialize({"w": jnp.zeros((8, 4))}, lambda p, b: jnp.sum(p["w"]), optax.sgd(LR),
                         config(0, 2))  # fmt: skip
    with pytest.raises(ValueError, match=r"experts_per_token: 9 is more than the 8 experts"):
        model = {"num_experts": 8, "experts_per_token": 9}
        jzero.initialize(params, loss, optax.sgd(LR), config(0, 2, model=model))


def test_moe_layer_without_a_bound_axis_runs_every_expert_locally():
    params = make_params()
    batch = batches(1)[0]
    one, _ = make_loss()(params, batch)
    ref, _ = make_loss(4.0, 4, moe.dense_reference, groups=1)(params, batch)
    assert_close(float(one), float(ref))


def test_expert_leaves_by_name_and_by_pattern():
    tree = {
        "moe": {"experts": {"w1": 0, "w2": 0}, "gate": 0},
        "shared_expert": {"w": 0},
        "routed_experts": 0,
        "dense": 0,
    }
    flat = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    found = dict(zip(flat, moe.expert_leaves(tree), strict=True))
    assert [k for k, v in found.items() if v] == [
        "['moe']['experts']['w1']",
        "['moe']['experts']['w2']",
        "['routed_experts']",
    ]
    by_pattern = moe.expert_leaves(tree, ["dense"])
    assert [k for k, v in zip(flat, by_pattern, strict=True) if v] == ["['dense']"]
