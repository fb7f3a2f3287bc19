"""Every parallelism beside every other: tensor (``model``), sequence (``seq``), pipeline
(``pipe``), experts (``expert``, on the MoE GPT) and hybrid sharding (``replica``), two and three
at a time on 8 devices, each axis of 2, at ZeRO stages 1 and 3.

Each layout trains the built-in GPT (dense, or MoE where ``expert`` is one of the axes) and must
equal the single-device optax loop in float64: losses and gradient norms at 1e-10 relative,
parameters at 1e-9 of each leaf's scale (``tests/numerics.py``: the layouts add the same products
in other orders, so float64 rounding stays many orders below the bound, and a defect (a stage's
layers skipped, a gradient summed twice over an axis, an expert's tokens lost) is far above it).

An MoE layer routes the tokens of one device's micro-batch, so its capacity and its
load-balancing loss are those of that group of tokens, as in DeepSpeed: the reference computes
the loss as the mean over the same groups of rows (with capacity for every token, nothing is
dropped). Under ``seq`` a group is half of each row's tokens, which the one-device loop cannot
form, so there the load-balancing coefficient is 0 (every other path of the MoE is the same).

Beside the numbers, each run asserts from the plan that every axis splits something (a
parameter, the batch's rows or tokens), and from the compiled step that each collective stays
on its axis: ZeRO's gathers and reduce-scatters within ZeRO's axes (never a weight gathered over
``model`` first), the pipeline's transfers between neighbouring stages only, the all-to-alls
within their ``seq`` or ``expert`` groups. A checkpoint written in each layout (at stage 3,
where its state is split the most) restores into plain data parallelism bit for bit. Context
parallelism (``context``, ring attention) joins here beside experts and replicas, at stage 3.
"""

import optax
import pytest
from compositions import (
    EXPERT_TP_PLAN,
    LR,
    PAIRS,
    assert_collectives_stay_on_their_axes,
    assert_trains_like_the_single_device_loop,
    check_layout,
    config,
    gpt,
    model_config,
    params,
    trained,
)

import jzero
from jzero.plan import model_state_bytes

pytestmark = pytest.mark.float64


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("axes", PAIRS, ids="x".join)
def test_two_axes_train_like_the_single_device_loop_and_restore_anywhere(
    axes, stage, tmp_path_factory
):
    check_layout(axes, stage, tmp_path_factory)


# Context parallelism (ring attention) beside the axes tests/distributed/test_context_parallel.py
# does not pair it with (it trains the ring alone, under Ulysses, beside tensor parallelism and
# beside a pipeline): experts and hybrid sharding, at stage 3 (the most split).
@pytest.mark.parametrize("axes", [("expert", "context"), ("context", "replica")], ids="x".join)
def test_the_ring_beside_experts_and_replicas_trains_like_the_single_device_loop(
    axes, tmp_path_factory
):
    check_layout(axes, 3, tmp_path_factory)


def test_experts_split_over_model_too_train_the_same_on_less_state(tmp_path_factory):
    """Expert tensor parallelism by ``tensor_parallel.tp_plan`` beside ``expert`` at stage 3:
    the same training, each expert's MLP split over ``model``, and less state per device than
    the default (experts whole on each ``model`` device)."""
    axes = ("model", "expert")
    engine, metrics = trained(axes, 3, str(tmp_path_factory.mktemp("etp")), EXPERT_TP_PLAN)
    assert_trains_like_the_single_device_loop(engine, metrics, axes)
    assert_collectives_stay_on_their_axes(engine, axes)
    specs = engine.plan.params["blocks"]["experts"]  # [L, E, d, f] and [L, E, f, d]
    w_fc, w_proj = tuple(specs["w_fc"].spec), tuple(specs["w_proj"].spec)
    assert w_fc[1] == "expert" and w_fc[3] == "model"  # column-parallel within each expert
    assert w_proj[1] == "expert" and w_proj[2] == "model"  # row-parallel out of it
    cfg = model_config(axes)  # the default layout, planned only (nothing compiled)
    whole = jzero.initialize(
        params(cfg), lambda p, b: gpt.loss_fn(p, b, cfg), optax.adamw(LR), config(axes, 3)
    )
    split_bytes = sum(model_state_bytes(engine.plan).values())
    assert split_bytes < sum(model_state_bytes(whole.plan).values())
