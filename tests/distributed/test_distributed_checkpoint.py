"""A checkpoint written by two processes (4 devices each) restores in one process with 8
devices, and the reverse, and training goes on as if nothing had changed.

Both two-process halves are tasks of the suite's shared two-process run (dist_session.py): it
saves into one folder and, from another, restores what this process saved before the launch.
In float64 (dist_ckpt.py): losses and grad norms at 1e-10 against dist_train.STEPS uninterrupted
steps in this process, whose first grad norm is the optax gradient's (clipping hides a
gradient's scale from the losses).
"""

import dist_ckpt
import dist_session
import dist_train
import jax
import numpy as np
import pytest
from procs import LOSS_RTOL


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted steps in this process (8 devices): (losses, grad norms)."""
    ref = dist_train.reference(dist_ckpt.STAGE)  # dist_ckpt's engine without the checkpoint
    return ref["losses"], ref["norms"]


def assert_steps(losses, norms, reference, steps):
    assert reference[1][0] == pytest.approx(dist_train.first_grad_norm(), rel=LOSS_RTOL, abs=0)
    np.testing.assert_allclose(losses, reference[0][steps], rtol=LOSS_RTOL, atol=0)
    np.testing.assert_allclose(norms, reference[1][steps], rtol=LOSS_RTOL, atol=0)


def test_saved_by_two_processes_restored_in_one(reference):
    session = dist_session.run()
    saved = session["records"]["ckpt_save"]
    assert saved["processes"] == 2
    assert_steps(saved["losses"], saved["norms"], reference, slice(None, dist_ckpt.SAVED_AT))
    with jax.enable_x64(True), dist_ckpt.make_engine(str(session["dir"] / "ckpt_two")) as engine:
        engine.restore()
        assert engine.global_step == dist_ckpt.SAVED_AT
        losses, norms = dist_ckpt.train(engine, dist_ckpt.batches()[dist_ckpt.SAVED_AT :])
    assert_steps(losses, norms, reference, slice(dist_ckpt.SAVED_AT, None))


def test_saved_by_one_process_restored_in_two(reference):
    # dist_session.run saved ckpt_one here (SAVED_AT steps of dist_ckpt.make_engine) before
    # the launch; the two processes restored it and trained on.
    resumed = dist_session.run()["records"]["ckpt_resume"]
    assert resumed["processes"] == 2
    assert_steps(resumed["losses"], resumed["norms"], reference, slice(dist_ckpt.SAVED_AT, None))
