"""Every three of tensor, sequence, pipeline, expert and replica parallelism (each axis of 2, so
``data`` is 1) at ZeRO stages 1 and 3: the checks of ``test_compose_two.py``.

One triple runs at stage 3 only: under model x pipe x replica ZeRO's only axis is ``data``, of
size 1 here (``plan.state_axes == ("data",)``), so stages 1 and 3 shard nothing and train the
same; stage 3 is the run that also checks the restore."""

import pytest
from compositions import TRIPLES, check_layout

pytestmark = pytest.mark.float64

ZERO_OVER_DATA_ONLY = ("model", "pipe", "replica")  # ZeRO's axes: data (1) alone
LAYOUTS = [
    pytest.param(axes, stage, id=f"{'x'.join(axes)}-{stage}")
    for stage in (1, 3)
    for axes in TRIPLES
    if not (stage == 1 and axes == ZERO_OVER_DATA_ONLY)
]


@pytest.mark.parametrize(("axes", "stage"), LAYOUTS)
def test_three_axes_train_like_the_single_device_loop_and_restore_anywhere(
    axes, stage, tmp_path_factory
):
    check_layout(axes, stage, tmp_path_factory)
