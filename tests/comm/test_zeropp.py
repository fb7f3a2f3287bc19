"""ZeRO++ in the train step: quantized weight gathers (qwZ) and quantized gradient reduce-scatters
(qgZ) from the config, on the built-in GPT at stage 3.

Bytes are read from the compiled step (after SPMD partitioning; float32, so the CPU compiler's
widening of 16-bit collectives does not enter); the 30-step losses must stay within 2% of the
exact run's while the loss really falls. Options that do not apply are listed in the no-effect
warning or refused by ``make_plan``. ``benchmarks/comm.py`` runs as a smoke test.
"""

import warnings

import jax
import numpy as np
import optax
import pytest
from gpt_runs import first_grad_norm, gpt_run
from numerics import EPS

import jzero
from jzero import hlo
from jzero.config import JzeroConfigWarning, load_config
from jzero.engine import settings
from jzero.plan import PlanOptions, describe, make_plan

# int8 rounds each gathered weight (qwZ) or each device's gradient contribution (qgZ) to within
# half its block's scale, absmax / 254: 0.4% of the block's largest element, far above float32
# rounding (so the bound holds on any CPU). Through the GPT's 4 matmul layers on the path to the
# loss, and the 30 steps' updates that follow them (Adam, normalised), the final loss moves by a
# few such fractions: 2%. A broken quantizer (a wrong scale, a lost block, a sign) moves the
# weights by whole scales and the loss by far more, or stops it falling.
QUANT_REL = 0.02


def assert_exact_run_has_optax_gradients(norms):
    """Clipping (1.0) and Adam hide a gradient's scale from the losses, and both runs of a
    quantization test share the gradient path: the exact run's first grad_norm against the
    float64 gradient's. The float32 GPT rounds each gradient's path about 32 times (embedding,
    per block 2 layer norms, 4 attention matmuls and a softmax, 2 MLP matmuls, each way; the
    final norm and the head), so within 64 EPS; a gradient x2 is 100% off."""
    assert norms[0] == pytest.approx(first_grad_norm(), rel=64 * EPS["float32"], abs=0)


def stats(text):
    return hlo.collectives(text)


def lines_of(text, op):
    return [line for line in text.splitlines() if f" {op}(" in line]


# -- qwZ ----------------------------------------------------------------------------------------


def test_qwz_gathers_int8_at_a_quarter_of_the_bytes_and_trains_the_same():
    exact, exact_text, _, exact_norms = gpt_run()
    quant, quant_text, engine, _ = gpt_run(zero_quantized_weights=True)
    assert_exact_run_has_optax_gradients(exact_norms)
    comm = engine.plan.options.comm
    assert comm.quantized_weights == 8 and comm.quantized_gradients == 0
    e, q = stats(exact_text), stats(quant_text)
    # The same gathers (forward and backward re-gathers), a quarter of the bytes and the scales.
    assert q["all-gather"].count == e["all-gather"].count > 0
    ratio = q["all-gather"].bytes / e["all-gather"].bytes
    assert ratio <= 0.3, ratio
    gathers = lines_of(quant_text, "all-gather")
    assert gathers and all("s8[" in line and "f32[" not in line for line in gathers)
    # The gradients' reduce-scatter is untouched by qwZ: exact, float32, same bytes.
    assert q["reduce-scatter"].bytes == e["reduce-scatter"].bytes
    assert q["all-to-all"].count == 0
    # Training: the loss falls far, and the quantized run stays within QUANT_REL of the exact one.
    assert exact[-1] < 0.5 * exact[0]
    assert quant[-1] == pytest.approx(exact[-1], rel=QUANT_REL)
    assert quant != exact  # really quantized


# -- qgZ ----------------------------------------------------------------------------------------


def gradient_reduction_bytes(s):
    """Bytes each gradient reduction puts on the wire: the reduce-scatter's input buffer, the
    all-to-all's (its quantized contribution), the all-reduce's buffer."""
    return s["reduce-scatter"].bytes + s["all-to-all"].bytes + s["all-reduce"].bytes


def test_qgz_reduces_int8_at_a_quarter_of_the_bytes_and_trains_the_same():
    exact, exact_text, _, exact_norms = gpt_run()
    quant, quant_text, engine, _ = gpt_run(zero_quantized_gradients=True)
    assert_exact_run_has_optax_gradients(exact_norms)
    comm = engine.plan.options.comm
    assert comm.quantized_gradients == 8 and comm.quantized_weights == 0
    e, q = stats(exact_text), stats(quant_text)
    # Every float reduce-scatter became one int8 all-to-all of about a quarter of its bytes.
    assert q["reduce-scatter"].count == 0
    assert q["all-to-all"].count == e["reduce-scatter"].count > 0
    ratio = gradient_reduction_bytes(q) / gradient_reduction_bytes(e)
    assert ratio <= 0.3, ratio
    exchanges = lines_of(quant_text, "all-to-all")
    assert exchanges and all("s8[" in line and "f32[" not in line for line in exchanges)
    assert q["all-gather"].bytes == e["all-gather"].bytes  # the weights are gathered exactly
    assert quant[-1] == pytest.approx(exact[-1], rel=QUANT_REL)
    assert quant != exact


# -- what applies where -------------------------------------------------------------------------


def load(raw):
    """(the config, the keys its no-effect warning lists, the warnings' texts)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = load_config(raw)
    ours = [str(w.message) for w in record if issubclass(w.category, JzeroConfigWarning)]
    keys = {line.split(":")[0].strip("- ") for m in ours for line in m.splitlines()[1:-1]}
    return cfg, keys, ours


def test_options_that_do_not_apply_are_listed_and_the_rest_reach_the_plan():
    zero = {
        "zero_quantized_weights": True,
        "zero_quantized_nontrainable_weights": True,
        "zero_quantized_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 1000,
        "allgather_bucket_size": 2000,
    }
    listed = {}
    options = {}
    for stage in (0, 1, 2, 3):
        cfg, keys, messages = load({"zero_optimization": {"stage": stage, **zero}})
        listed[stage] = {k.removeprefix("zero_optimization.") for k in keys}
        options[stage] = vars(settings.comm_options(cfg.zero_optimization))
        if stage < 3:
            assert any("ZeRO++ qwZ acts at stage 3" in m for m in messages)
    frozen = "zero_quantized_nontrainable_weights"
    assert listed[0] == {"zero_quantized_weights", frozen, "zero_quantized_gradients",
                         "allgather_bucket_size"}  # fmt: skip
    assert listed[1] == listed[2] == {"zero_quantized_weights", frozen}
    assert listed[3] == {frozen, "reduce_bucket_size", "allgather_bucket_size"}
    assert options[0] == dict(
        overlap_comm=True,
        reduce_bucket_size=1000,
        allgather_bucket_size=2000,
        quantized_weights=0,
        quantized_gradients=0,
    )
    assert options[2]["quantized_gradients"] == 8 and options[2]["quantized_weights"] == 0
    assert options[3] == dict(
        overlap_comm=True,
        reduce_bucket_size=None,
        allgather_bucket_size=None,
        quantized_weights=8,
        quantized_gradients=8,
    )
    # int4 gradients; without overlap_comm the bucket sizes are listed (and not used).
    raw = {"stage": 2, "zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4}
    cfg, keys, _ = load({"zero_optimization": raw})
    assert (
        vars(settings.comm_options(cfg.zero_optimization))["quantized_gradients"] == 4 and not keys
    )
    _, keys, _ = load({"zero_optimization": {"stage": 2, "reduce_bucket_size": 10}})
    assert keys == {"zero_optimization.reduce_bucket_size"}
    # Written as false (the default), nothing is listed.
    _, keys, _ = load({"zero_optimization": {"stage": 2, "zero_quantized_weights": False}})
    assert keys == set()


def test_make_plan_refuses_quantization_where_the_stage_has_no_such_collective():
    params = {"w": jax.ShapeDtypeStruct((64, 64), np.float32)}
    mesh = jzero.make_mesh({"data": 8})
    with pytest.raises(ValueError, match="quantized_weights .* stage 2 keeps parameters whole"):
        make_plan(params, optax.adam(1e-3), mesh, 2, PlanOptions().replace(quantized_weights=8))
    with pytest.raises(ValueError, match="stage 0 all-reduces its gradients"):
        make_plan(params, optax.adam(1e-3), mesh, 0, PlanOptions().replace(quantized_gradients=8))
    with pytest.raises(ValueError, match="pass 8 or 4 bits"):
        make_plan(params, optax.adam(1e-3), mesh, 3, PlanOptions().replace(quantized_weights=6))
    plan = make_plan(
        params,
        optax.adam(1e-3),
        mesh,
        3,
        PlanOptions().replace(quantized_weights=8, quantized_gradients=4),
    )
    assert "ZeRO++ qwZ: int8 parameter gathers" in describe(plan)
    assert "ZeRO++ qgZ: int4 gradient reduce-scatters" in describe(plan)


# -- the side-by-side benchmark -----------------------------------------------------------------
