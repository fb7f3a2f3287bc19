"""Every three of tensor, sequence, pipeline, expert and replica parallelism (each axis of 2, so
``data`` is 1) at ZeRO stages 1 and 3: the checks of ``test_compose_two.py``."""

import pytest
from compositions import TRIPLES, check_layout

pytestmark = pytest.mark.float64


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("axes", TRIPLES, ids="x".join)
def test_three_axes_train_like_the_single_device_loop_and_restore_anywhere(
    axes, stage, tmp_path_factory
):
    check_layout(axes, stage, tmp_path_factory)
