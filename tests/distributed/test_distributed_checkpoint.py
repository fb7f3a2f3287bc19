"""A checkpoint written by two processes (4 devices each) restores in one process with 8
devices, and the reverse, and training goes on as if nothing had changed.

In float64 (dist_ckpt.py): losses and grad norms at 1e-10 against 10 uninterrupted steps in this
process, whose first grad norm is the optax gradient's (clipping hides a gradient's scale from
the losses).
"""

import dist_ckpt
import dist_train
import jax
import numpy as np
import pytest
from procs import LOSS_RTOL, run_two


@pytest.fixture(scope="module")
def reference():
    """10 uninterrupted steps in this process (8 devices): (losses, grad norms)."""
    with jax.enable_x64(True):
        engine = dist_ckpt.make_engine("unused")
        return dist_ckpt.train(engine, dist_ckpt.batches())


def launch_two(mode: str, directory) -> dict:
    return run_two("dist_ckpt.py", mode, str(directory))


def assert_steps(losses, norms, reference, steps):
    assert reference[1][0] == pytest.approx(dist_train.first_grad_norm(), rel=LOSS_RTOL, abs=0)
    np.testing.assert_allclose(losses, reference[0][steps], rtol=LOSS_RTOL, atol=0)
    np.testing.assert_allclose(norms, reference[1][steps], rtol=LOSS_RTOL, atol=0)


def test_saved_by_two_processes_restored_in_one(tmp_path, reference):
    saved = launch_two("save", tmp_path)
    assert saved["processes"] == 2
    assert_steps(saved["losses"], saved["norms"], reference, slice(None, dist_ckpt.SAVED_AT))
    with jax.enable_x64(True), dist_ckpt.make_engine(str(tmp_path)) as engine:
        engine.restore()
        assert engine.global_step == dist_ckpt.SAVED_AT
        losses, norms = dist_ckpt.train(engine, dist_ckpt.batches()[dist_ckpt.SAVED_AT :])
    assert_steps(losses, norms, reference, slice(dist_ckpt.SAVED_AT, None))


def test_saved_by_one_process_restored_in_two(tmp_path, reference):
    with jax.enable_x64(True), dist_ckpt.make_engine(str(tmp_path)) as engine:
        dist_ckpt.train(engine, dist_ckpt.batches()[: dist_ckpt.SAVED_AT])
        engine.save()
    resumed = launch_two("resume", tmp_path)
    assert resumed["processes"] == 2
    assert_steps(resumed["losses"], resumed["norms"], reference, slice(dist_ckpt.SAVED_AT, None))
