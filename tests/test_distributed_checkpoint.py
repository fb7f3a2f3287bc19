"""A checkpoint written by two processes (4 devices each) restores in one process with 8
devices, and the reverse, and training goes on as if nothing had changed."""

import dist_ckpt
import dist_train
import numpy as np
import pytest
import toy
from test_distributed import LOSS_RTOL, run_two


@pytest.fixture(scope="module")
def reference():
    """10 uninterrupted steps in this process (8 devices)."""
    engine = dist_ckpt.make_engine("unused")
    return dist_ckpt.train(engine, toy.make_batches(dist_train.STEPS, dist_train.GLOBAL_BATCH))


def launch_two(mode: str, directory) -> dict:
    return run_two("dist_ckpt.py", mode, str(directory))


def test_saved_by_two_processes_restored_in_one(tmp_path, reference):
    saved = launch_two("save", tmp_path)
    assert saved["processes"] == 2
    np.testing.assert_allclose(saved["losses"], reference[:5], rtol=LOSS_RTOL)
    with dist_ckpt.make_engine(str(tmp_path)) as engine:
        engine.restore()
        assert engine.global_step == dist_ckpt.SAVED_AT
        batches = toy.make_batches(dist_train.STEPS, dist_train.GLOBAL_BATCH)
        losses = dist_ckpt.train(engine, batches[dist_ckpt.SAVED_AT :])
    np.testing.assert_allclose(losses, reference[5:], rtol=LOSS_RTOL)


def test_saved_by_one_process_restored_in_two(tmp_path, reference):
    with dist_ckpt.make_engine(str(tmp_path)) as engine:
        batches = toy.make_batches(dist_train.STEPS, dist_train.GLOBAL_BATCH)
        dist_ckpt.train(engine, batches[: dist_ckpt.SAVED_AT])
        engine.save()
    resumed = launch_two("resume", tmp_path)
    assert resumed["processes"] == 2
    np.testing.assert_allclose(resumed["losses"], reference[5:], rtol=LOSS_RTOL)
