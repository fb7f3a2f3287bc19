"""MoE dispatch by sorting and dropless MoE (:func:`jzero.moe.route_sorted`,
``moe_layer(..., drop_tokens=False)``): the sorted rows hold exactly the choices the dense
one-hot masks of :func:`jzero.moe.route` keep, in the same slots; the MoE toy trained through
them at E_p 1 and 2, ZeRO stages 1 and 3 on 8 devices equals the dense reference (float64,
1e-10) with capacity drops and dropless; dropless drops nothing under a router that sends every
token to expert 0 and trains as the reference with unlimited capacity; the compiled step's
temporaries grow linearly with the tokens a device routes in both modes (the dense masks grew
with their square)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from moe_toy import (
    DEVICES,
    LR,
    E,
    K,
    batches,
    bias_all_to_expert_0,
    config,
    make_loss,
    make_params,
    reference,
    reference_run,
)

import jzero
from jzero import moe
from jzero.demo import gpt

RTOL = 1e-10

pytestmark = pytest.mark.float64  # the module's fixtures too (conftest)


def assert_close(got, want, rtol=RTOL):
    got, want = np.asarray(got), np.asarray(want)
    scale = max(float(np.max(np.abs(want))), 1e-300)
    err = float(np.max(np.abs(got - want))) / scale
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def dense_mask(sorted_routing: moe.SortedRouting, tokens: int) -> np.ndarray:
    """The ``[T, E, N]`` one-hot mask the sorted rows stand for (1 where row ``(e, c)`` holds
    token ``t``)."""
    source = np.asarray(sorted_routing.source)
    return (source[None] == np.arange(tokens)[:, None, None]).astype(np.float64)


@pytest.mark.parametrize("k, slots", [(1, 2), (2, 2), (2, 3), (3, 5)])
def test_sorted_rows_hold_the_choices_the_dense_masks_keep(k, slots):
    tokens = 24
    logits = jax.random.normal(jax.random.key(k), (tokens, E), jnp.float64)
    logits = logits.at[:, 1].add(1.5)  # a crowded expert: drops beyond the slots
    dense = moe.route(logits, experts_per_token=k, slots=slots)
    got = moe.route_sorted(logits, experts_per_token=k, slots=slots)
    assert got.source.shape == (E, slots) and got.row.shape == got.gates.shape == (k, tokens)
    # the same choice in the same slot: the same tokens dropped, by position
    np.testing.assert_array_equal(dense_mask(got, tokens), np.asarray(dense.dispatch_mask))
    # each kept choice's gate, read back through its row
    weights = np.zeros((tokens, E * slots))
    for j in range(k):
        kept = np.asarray(got.row[j]) < E * slots
        t = np.flatnonzero(kept)
        weights[t, np.asarray(got.row[j])[kept]] += np.asarray(got.gates[j])[kept]
    want = np.asarray(dense.combine_weights).reshape(tokens, E * slots)
    np.testing.assert_allclose(weights, want, rtol=1e-15, atol=0)
    assert float(got.stats.dropped_fraction) == float(dense.stats.dropped_fraction) > 0
    assert float(got.stats.aux_loss) == pytest.approx(float(dense.stats.aux_loss), rel=1e-15)


def test_dropless_rows_hold_every_choice():
    tokens = 16
    logits = jnp.zeros((tokens, E), jnp.float64).at[:, 0].set(50.0)  # all to expert 0
    got = moe.route_sorted(logits, experts_per_token=K, drop_tokens=False)
    assert got.source.shape == (E, tokens)  # an expert gets each token at most once
    np.testing.assert_array_equal(np.asarray(got.source[0]), np.arange(tokens))
    assert bool(jnp.all(got.row < E * tokens)) and float(got.stats.dropped_fraction) == 0.0
    capped = moe.route_sorted(logits, experts_per_token=K, capacity_factor=1.25)
    assert float(capped.stats.dropped_fraction) > 0.3  # the capacity would drop most of them


# Capacity factor 1.0 and 2 slots per expert of a device's 4 tokens: the toy's router overfills
# some experts on some devices, so the capacity drops choices; dropless keeps them all.
MODES = {"drops": dict(capacity_factor=1.0, min_capacity=2), "dropless": dict(drop_tokens=False)}


@pytest.fixture(scope="module")
def references():
    steps = batches(2, seed=11)
    out = {}
    for name, mode in MODES.items():
        ref = make_loss(layer=moe.dense_reference, groups=DEVICES, **mode)
        out[name] = reference_run(make_params(), ref, steps)
    return steps, out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("ep, stage", [(1, 1), (1, 3), (2, 1), (2, 3)])
def test_sorted_dispatch_equals_the_dense_reference(ep, stage, mode, references):
    steps, out = references
    want, want_params = out[mode]
    if mode == "drops":
        assert all(aux["moe_dropped_fraction"] > 0 for _, aux in want)
    engine = jzero.initialize(
        make_params(), make_loss(**MODES[mode]), optax.sgd(LR), config(stage, ep)
    )
    for (loss, aux), batch in zip(want, steps, strict=True):
        metrics = engine.train_step(batch)
        assert_close(float(metrics["loss"]), loss)
        assert float(metrics["moe_dropped_fraction"]) == aux["moe_dropped_fraction"]
    for got, want_leaf in zip(
        jax.tree.leaves(engine.params), jax.tree.leaves(want_params), strict=True
    ):
        assert_close(got, want_leaf)


def test_dropless_drops_nothing_under_a_router_that_picks_one_expert_and_trains():
    params = make_params(bias=bias_all_to_expert_0())
    steps = batches(3, seed=3)
    want, _ = reference_run(params, reference(E / K, 1), steps)  # a slot for every token
    capped, _ = reference_run(params, reference(1.0, 2), steps)
    # 2 slots for a device's 4 first choices at expert 0: a quarter of the choices dropped
    assert all(aux["moe_dropped_fraction"] >= 0.25 for _, aux in capped)
    engine = jzero.initialize(params, make_loss(drop_tokens=False), optax.sgd(LR), config(3, 2))
    losses = []
    for (value, aux), batch in zip(want, steps, strict=True):
        assert aux["moe_dropped_fraction"] == 0.0
        metrics = engine.train_step(batch)
        assert float(metrics["moe_dropped_fraction"]) == 0.0
        assert_close(float(metrics["loss"]), value)
        losses.append(float(metrics["loss"]))
    # it trains: the same batch's loss falls after the three steps
    before = float(make_loss(drop_tokens=False)(params, steps[0])[0])
    after = float(make_loss(drop_tokens=False)(engine.params, steps[0])[0])
    assert after < before, (before, after)


# The shape: 8 experts, top-2, capacity factor 1.25, E_p = 2, ZeRO stage 1, on the
# toy (a d=16 residual stream: the dispatch is most of the step). 64 and 256 tokens a device.
ROWS_1X = 64 * DEVICES


def _temp_bytes(rows: int, **mode) -> int:
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(rows, 12)), "y": rng.normal(size=(rows, 5))}
    loss = make_loss(capacity_factor=1.25, **mode)
    engine = jzero.initialize(
        make_params(), loss, optax.sgd(LR), config(1, 2, train_batch_size=rows)
    )
    return engine.lower(batch).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("mode", [{}, {"drop_tokens": False}], ids=["capacity", "dropless"])
def test_step_temporaries_grow_linearly_with_the_tokens(mode):
    one, four = _temp_bytes(ROWS_1X, **mode), _temp_bytes(4 * ROWS_1X, **mode)
    # the dense [T, E, C] masks made this 14x (C grows with T); linear is 4x plus a margin
    assert four <= 4.6 * one, (four / one, one, four)


def test_gpt_config_passes_drop_tokens():
    cfg = jzero.load_config(
        {"train_batch_size": 8, "model": {"num_experts": 4, "drop_tokens": False}}
    )
    assert gpt.config_for(cfg).drop_tokens is False
    assert gpt.GPTConfig(num_experts=4).drop_tokens is True
    with pytest.raises(ValueError, match=r"drop_tokens must be true or false, got 'no'"):
        gpt.GPTConfig(num_experts=4, drop_tokens="no")
