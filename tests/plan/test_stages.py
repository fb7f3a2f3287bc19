"""Every stage rule derives from the one table (``jzero.choices.stages.STAGES``): which offload a
stage allows (config, plan, the measured plan's variants), its model-state bytes and traffic (the
estimate) and the formula text. Changing a row's flags changes all of them."""

import dataclasses
import warnings

import optax
import pytest
import toy

import jzero
from jzero import memory
from jzero.choices import stages
from jzero.config import JzeroConfigWarning, load_config
from jzero.costs import ModelShape, ParallelDims
from jzero.memory._measure import offload_variants
from jzero.plan import PlanOptions

PARAM_OFFLOAD = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}


def rules_of_stage_2():
    """What the rest of the library says about stage 2, read through its public entry points."""
    with warnings.catch_warnings():  # where the stage keeps parameters whole: a warning
        warnings.simplefilter("ignore", JzeroConfigWarning)
        zero = load_config(PARAM_OFFLOAD).zero_optimization
    config_allows = zero.offload_param.device == "cpu"  # else ignored, as DeepSpeed does
    try:
        params, tx = toy.make_params(), optax.sgd(0.1)
        jzero.make_plan(
            params,
            tx,
            jzero.make_mesh({"data": 8}),
            2,
            PlanOptions().replace(offload_params="pinned_host"),
        )
        plan_allows = True
    except ValueError:
        plan_allows = False
    est = memory.estimate(ModelShape(1e9, largest_layer_params=1e6), ParallelDims(8))
    row = est.row(2)
    return {
        "config allows offload_param": config_allows,
        "plan allows offload_param": plan_allows,
        "measured variants": offload_variants([2]),
        "device params": row.device.get("params"),
        "gathered layer": "gathered layer" in row.device,
        "traffic": row.comm_psi,
        "formula": stages.formula_text().split(", ")[2],
    }


def test_the_table_decides_every_stage_rule(monkeypatch):
    assert rules_of_stage_2() == {
        "config allows offload_param": False,
        "plan allows offload_param": False,
        "measured variants": [(2, "optimizer")],
        "device params": 2e9,
        "gathered layer": False,
        "traffic": 2.0,
        "formula": "stage 2 2 Psi + 14 Psi/N",
    }
    # Stage 2 made to shard its parameters too: every rule follows the flag.
    table = dict(stages.STAGES)
    table[2] = dataclasses.replace(table[2], shard_params=True)
    monkeypatch.setattr(stages, "STAGES", table)
    assert rules_of_stage_2() == {
        "config allows offload_param": True,
        "plan allows offload_param": True,
        "measured variants": [(2, "optimizer"), (2, "optimizer+params")],
        "device params": 2e9 / 8,
        "gathered layer": True,
        "traffic": 3.0,
        "formula": "stage 2 16 Psi/N",
    }


def test_offload_below_its_stage_names_the_stages_the_table_allows():
    match = r"offload_param: it offloads the parameter shards of stage 3, and stage 2 keeps"
    with pytest.warns(JzeroConfigWarning, match=match):
        load_config(PARAM_OFFLOAD)
