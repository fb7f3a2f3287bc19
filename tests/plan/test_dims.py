"""The plan's layout is one value, :class:`jzero.costs.ParallelDims`: the one the estimate, the
cost model and the auto layout take. Read from a built plan's mesh and options, it names each
parallelism's size, and the plan's own sizes are its fields (``tests/engine/test_auto_layout.py``:
the layout the auto layout chose is the plan's)."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from compositions import batches, config, model_config

import jzero
from jzero import costs
from jzero.demo import gpt

pytestmark = pytest.mark.float64  # the compositions' float64 GPT

# Each parallelism alone, and three together, on the 8 devices (each named axis of 2).
LAYOUTS = [(), ("model",), ("seq",), ("context",), ("pipe",), ("expert",), ("replica",),
           ("model", "pipe", "replica"), ("seq", "expert", "replica")]  # fmt: skip


def plan_of(axes):
    cfg = model_config(axes)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches()[0])
    # The float64 parameters' shapes, traced, never made (compositions.params caches arrays).
    made = jax.eval_shape(lambda: gpt.init_params(jax.random.key(0), cfg))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float64), made)
    engine = jzero.initialize(
        abstract, lambda p, b: gpt.loss_fn(p, b, cfg), optax.adamw(1e-3),
        config(axes, 3), batch=shapes, abstract=True,
    )  # fmt: skip
    return engine.plan


@pytest.mark.parametrize("axes", LAYOUTS, ids=lambda a: "x".join(a) or "data")
def test_the_plans_layout_is_the_cost_models_value(axes):
    plan = plan_of(axes)
    sizes = {a: 2 if a in axes else 1 for a in ("replica", "model", "seq", "context", "pipe",
                                                  "expert")}  # fmt: skip
    want = costs.ParallelDims(8, **sizes)
    assert dataclasses.replace(plan.dims, schedule="1f1b", virtual=None) == want
    assert plan.dims.data == int(plan.mesh.shape["data"])
    # The plan's sizes are the value's fields, and the data-parallel degree its batch split.
    got = (plan.num_replicas, plan.seq_size, plan.context_size, plan.pipe_size, plan.expert_size)
    assert got == (want.replica, want.seq, want.context, want.pipe, want.expert)
    assert plan.data_parallel_size == want.batch_split
