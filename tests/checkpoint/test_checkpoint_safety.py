"""A checkpoint directory never loses data: foreign files, saves cut by SIGKILL, re-saves, two
runs, two writers, a failed write, NaN parameters. Each case is what a user can do by accident."""

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import toy
from procs import device_env
from repo import ROOT, SUPPORT

import jzero
from jzero import checkpoint, cli, train
from jzero.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointWriteError,
    latest_step,
    list_steps,
)

SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
TARGET = {"w": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=SINGLE)}


def state(value):
    return {"w": np.full((64, 64), value, np.float32)}


def files_of(directory):
    return sorted(str(p.relative_to(directory)) for p in Path(directory).rglob("*"))


def save_steps(directory, steps, **kwargs):
    with Checkpointer(directory, async_save=False, max_to_keep=None, **kwargs) as ckpt:
        for s in steps:
            ckpt.save(s, state(float(s)), meta={"step": s})


# -- whose directory ------------------------------------------------------------------------
def make_foreign(directory):
    for name in ("1", "2", "3", "2024", "run_5"):
        (directory / name).mkdir(parents=True)
        (directory / name / "notes.txt").write_text(f"the user's {name}")


def test_a_directory_with_foreign_numbered_folders_is_refused_and_left_intact(tmp_path, capsys):
    make_foreign(tmp_path)
    before = {p: p.read_text() for p in tmp_path.rglob("*.txt")}
    with pytest.raises(CheckpointError, match=r"holds files that are not jzero checkpoints \('1'"):
        Checkpointer(tmp_path).save(1, state(1.0))
    # jzero train refuses it before building anything, with or without --no-resume.
    for extra in ([], ["--no-resume"]):
        args = ["train", "configs/zero2.yaml", "--set", f"checkpoint.directory={tmp_path}"]
        assert cli.main([*args, *extra]) == 2
        assert "holds files that are not jzero checkpoints" in capsys.readouterr().err
    assert {p: p.read_text() for p in tmp_path.rglob("*.txt")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "2024", "3", "run_5"]


def test_rotation_and_listing_touch_only_jzero_steps(tmp_path):
    save_steps(tmp_path, [1])
    assert (tmp_path / "jzero_checkpoints.json").is_file()
    make_foreign(tmp_path / "user")  # inside a marked directory: a user's folders
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "keep.txt").write_text("mine")
    with Checkpointer(tmp_path, async_save=False, max_to_keep=2) as ckpt:
        ckpt.restore(TARGET)
        for s in (2, 3, 4):
            ckpt.save(s, state(float(s)))
        with pytest.raises(CheckpointError, match=r"'.*/7' exists and is not a jzero checkpoint"):
            ckpt.save(7, state(7.0))
    assert list_steps(tmp_path) == [3, 4] and latest_step(tmp_path) == 4
    assert (tmp_path / "7" / "keep.txt").read_text() == "mine"
    assert len(list((tmp_path / "user").rglob("notes.txt"))) == 5


# -- saves killed by SIGKILL ------------------------------------------------------------------
@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Two saves cut by one SIGKILL of one child (tests/support/ckpt_kill_child.py): a large
    step 2 mid-write into a folder holding step 1, and a re-save of step 2 over steps 1 and 2
    after the old copy was set aside. Returns the two folders (midwrite, resave)."""
    root = tmp_path_factory.mktemp("killed")
    midwrite, resave = root / "midwrite", root / "resave"
    save_steps(resave, [1, 2])
    env = device_env(1, PYTHONPATH=os.pathsep.join([str(ROOT), str(SUPPORT)]))
    cmd = [sys.executable, str(SUPPORT / "ckpt_kill_child.py"), str(midwrite), str(resave)]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=120)
        assert line == ["saving\n"], "the child never started the two saves"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    return midwrite, resave


def test_a_save_killed_mid_write_is_ignored(killed):
    directory = killed[0]
    ckpt = Checkpointer(directory)
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    assert ckpt.partial_steps() == [2]  # step 2 was really cut short
    assert (directory / "2.orbax-checkpoint-tmp").is_dir() and not (directory / "2").exists()
    target = {
        "step": jax.ShapeDtypeStruct((), np.int32, sharding=SINGLE),
        "params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SINGLE), toy.make_params()
        ),
    }
    restored, meta = ckpt.restore(target)
    assert meta == {"step": 1} and int(restored["step"]) == 1
    expected = jax.tree.leaves(toy.make_params())
    for a, b in zip(jax.tree.leaves(restored["params"]), expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(CheckpointError, match=r"Step 2 is not a complete checkpoint .* \[1\] "):
        ckpt.restore(target, step=2)
    assert "unfinished saves (ignored): [2]" in checkpoint.inspect(directory)
    # A new writer clears the unfinished save and saves step 2 for real.
    ckpt.save(2, {"step": np.int32(2), "params": toy.make_params()}, meta={"step": 2})
    ckpt.close()
    assert ckpt.all_steps() == [1, 2] and ckpt.partial_steps() == []


# -- re-saving a step -----------------------------------------------------------------------
def test_a_resave_killed_before_commit_keeps_the_step_restorable(killed):
    tmp_path = killed[1]
    # The old copy was set aside, the new one never committed: step 2 is still there.
    assert (tmp_path / "2.jzero-replaced").is_dir() and not (tmp_path / "2").exists()
    assert list_steps(tmp_path) == [1, 2] and latest_step(tmp_path) == 2
    restored, meta = Checkpointer(tmp_path).restore(TARGET)
    assert meta == {"step": 2} and float(restored["w"][0, 0]) == 2.0
    # The next writer puts the old copy back under its name.
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.restore(TARGET)
        ckpt.save(3, state(3.0))
    assert (tmp_path / "2").is_dir() and not (tmp_path / "2.jzero-replaced").exists()
    assert list_steps(tmp_path) == [1, 2, 3]


def test_a_committed_resave_replaces_the_step(tmp_path):
    save_steps(tmp_path, [1, 2])
    with Checkpointer(tmp_path) as ckpt:  # async: the old copy waits aside until the commit
        ckpt.restore(TARGET, step=2)
        assert ckpt.save(2, state(-2.0), meta={"step": 2}, overwrite=True)
        assert list_steps(tmp_path) == [1, 2]  # during the write too
    assert not (tmp_path / "2.jzero-replaced").exists()
    restored, _ = Checkpointer(tmp_path).restore(TARGET, step=2)
    assert float(restored["w"][0, 0]) == -2.0


# -- two runs in one directory --------------------------------------------------------------
def test_a_new_run_into_an_old_runs_directory_is_refused_unless_overwrite(tmp_path):
    save_steps(tmp_path, [10, 20, 30])
    before = files_of(tmp_path)
    with pytest.raises(CheckpointError, match=r"earlier run \(steps \[10, 20, 30\], the latest 30"):
        with Checkpointer(tmp_path) as ckpt:
            ckpt.save(1, state(1.0))
    assert files_of(tmp_path) == before
    with Checkpointer(tmp_path, overwrite=True) as ckpt:
        ckpt.save(1, state(1.0))
        ckpt.wait_until_finished()
        assert ckpt.latest_step() == 1
    assert list_steps(tmp_path) == [1]  # the earlier run's steps went once step 1 committed


def test_the_latest_step_is_the_one_written_last(tmp_path):
    save_steps(tmp_path, [1, 2, 3])
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.restore(TARGET, step=1)  # go back to step 1 and train a new branch
        ckpt.save(2, state(20.0), overwrite=True)
    assert list_steps(tmp_path) == [1, 2, 3] and latest_step(tmp_path) == 2
    restored, _ = Checkpointer(tmp_path).restore(TARGET)  # resumes the new branch, not step 3
    assert float(restored["w"][0, 0]) == 20.0


# -- writers --------------------------------------------------------------------------------
def test_a_second_writer_is_refused_and_a_stale_lock_is_taken_over(tmp_path, caplog):
    first = Checkpointer(tmp_path, async_save=False)
    first.save(1, state(1.0))
    second = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=rf"Another writer .*\(pid {os.getpid()} on host "):
        second.save(2, state(2.0))
    first.close()
    second.close()
    # A writer that was killed leaves its text in the lock file but no lock.
    (tmp_path / "jzero.lock").write_text("pid 999999 on host elsewhere\n")
    with caplog.at_level(logging.WARNING, logger="jzero"):
        with Checkpointer(tmp_path, async_save=False) as third:
            third.restore(TARGET)
            third.save(2, state(2.0))
    assert "taking over the checkpoint directory" in caplog.text
    assert "pid 999999 on host elsewhere" in caplog.text
    assert list_steps(tmp_path) == [1, 2]


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    save_steps("~/ckpt", [1])
    assert list_steps(tmp_path / "ckpt") == [1] and not Path("~").exists()


def test_a_failed_write_is_a_write_error_and_keeps_the_earlier_steps(tmp_path, monkeypatch):
    save_steps(tmp_path, [1, 2])

    def disk_full(step_dir):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.checkpointer, "seal", disk_full)
    ckpt = Checkpointer(tmp_path)
    ckpt.restore(TARGET)
    ckpt.save(2, state(-1.0), overwrite=True)  # async: the failure comes later
    with pytest.raises(CheckpointWriteError, match=r"step 2 .* No space left .* intact \(\[1, 2\]"):
        ckpt.wait_until_finished()
    ckpt.close()
    restored, _ = Checkpointer(tmp_path).restore(TARGET, step=2)
    assert float(restored["w"][0, 0]) == 2.0
    # The command line reports it as a failure of the run (1), not a usage error (2).

    def fail(args):
        raise CheckpointWriteError("Writing checkpoint step 3 failed: disk full")

    monkeypatch.setattr(cli, "_train", fail)
    assert cli.main(["train", "configs/zero2.yaml"]) == 1


# -- non-finite parameters ------------------------------------------------------------------
def test_nan_params_are_never_checkpointed_and_the_good_ones_are_kept(tmp_path, caplog):
    cfg = {
        "train_batch_size": 16,
        "zero_optimization": {"stage": 2},
        "checkpoint": {"directory": str(tmp_path), "save_interval_steps": 1, "max_to_keep": 2},
    }
    batches = toy.make_batches(4, 16)
    batches[2] = {"x": batches[2]["x"] * np.nan, "y": batches[2]["y"]}
    with jzero.initialize(toy.make_params(), toy.loss_fn, optax.sgd(0.1), cfg) as engine:
        with caplog.at_level(logging.WARNING, logger="jzero"):
            nonfinite = [float(engine.train_step(b)["nonfinite"]) for b in batches]
        engine.wait_until_finished()
    assert nonfinite == [0.0, 0.0, 1.0, 1.0]  # the NaN batch, then NaN params
    assert list_steps(tmp_path) == [1, 2]  # steps 3 and 4 were refused, 1 and 2 kept
    assert "NOT saving checkpoint step 3" in caplog.text
    with jzero.initialize(toy.make_params(), toy.loss_fn, optax.sgd(0.1), cfg) as fresh:
        assert fresh.restore()["iteration"] == 2
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(fresh.params))


def test_json_output_has_no_bare_nan():
    text = train.strict_json({"loss": float("nan"), "x": [float("inf"), 1.5]})
    assert json.loads(text) == {"loss": None, "x": [None, 1.5]}


def test_the_unfinished_save_suffix_is_orbaxs():
    """jzero.checkpoint.dirs names Orbax's temporary step folders without importing Orbax."""
    import orbax.checkpoint as ocp

    assert checkpoint.dirs.TMP_SUFFIX == ocp.path.step.TMP_DIR_SUFFIX
