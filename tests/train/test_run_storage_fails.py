"""Storage that fails under `jzero train`: a checkpoint disk that fills up mid-run (a small
tmpfs, as a user meets it) and saves whose writes fail (ENOSPC injected) end the run cleanly,
with one line per failure, summary.json, no unfinished folder, and a resume from the last
committed step; a compile cache that can't be written is one warning, never an error."""

import errno
import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from cli_runs import TINY
from etils.epath import abstract_path

from jzero import train
from jzero.checkpoint import TMP_SUFFIX, list_steps
from jzero.distributed import enable_compile_cache

# The CLI flags of cli_runs.TINY as overrides of train.run (the same programs: one cache).
OVERRIDES = [TINY[i + 1] for i in range(0, len(TINY), 2)]


def unfinished(directory):
    return sorted(p.name for p in directory.glob(f"*{TMP_SUFFIX}"))


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs of its own, as a checkpoint volume; skipped where mounting is not allowed."""
    vol = tmp_path / "vol"
    vol.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(vol)]
    done = subprocess.run(mount, capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"mounting a tmpfs is not allowed here: {done.stderr.strip()}")
    try:
        yield vol
    finally:
        subprocess.run(["umount", "-l", str(vol)], check=False)


def fill(volume, leave):
    """Fills ``volume`` with a file of zeros, leaving ``leave`` bytes free."""
    size = shutil.disk_usage(volume).free - leave
    with open(volume / "filler", "wb") as f:
        for _ in range(size // 4096):
            f.write(bytes(4096))
    assert abs(shutil.disk_usage(volume).free - leave) <= 8192


def test_a_checkpoint_disk_that_fills_up_ends_the_run_cleanly(tmp_path, small_disk):
    """A run saves step 2 on the volume; then the volume fills up, leaving 400 KiB: more than
    a step's arrays (306 KiB), so a save starts, but less than Orbax's files of a step take
    there (480-820 KiB). `jzero train` resumes from step 2 and saves every 2 steps: 4 and 6
    run out of space mid-write (each one line, training goes on), and the final save at 8 too:
    exit 1 with that line, and nothing else to read (no traceback, no Orbax report)."""
    ckpt = small_disk / "ckpt"
    overrides = [*OVERRIDES, f"checkpoint.directory={ckpt}", "checkpoint.save_interval_steps=2"]
    train.run(
        "configs/zero2.yaml",
        overrides=[*overrides, f"train.log_dir={tmp_path / 'first'}"],
        steps=2,
        progress=False,
    )
    assert list_steps(ckpt) == [2]
    fill(small_disk, 400 * 1024)
    logs = tmp_path / "run"
    args = ["train", "configs/zero2.yaml", "--quiet", "--steps", "8"]
    args += [arg for override in overrides for arg in ("--set", override)]
    args += ["--set", f"train.log_dir={logs}"]
    proc = subprocess.run(
        [sys.executable, "-m", "jzero.cli", *args], capture_output=True, text=True, timeout=300
    )
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    for noise in ("Traceback", "Event loop is closed", "_SignalingThread", "RESOURCE_EXHAUSTED"):
        assert noise not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "was not saved in" in line]
    assert [line.split(" was not saved")[0] for line in lines] == [
        f"jzero: Checkpoint step {n}" for n in (4, 6, 8)
    ], err[-3000:]
    for line in lines:
        assert f"in '{ckpt}': No space left on device (ENOSPC); " in line
        assert " KiB free there, the step's arrays hold 306." in line
        assert "the committed steps are intact ([2], the latest 2)." in line
    assert "Training goes on" in lines[0] and "Training goes on" in lines[1]
    assert lines[2].endswith("then save again.")
    summary = json.loads((logs / "summary.json").read_text())
    assert proc.stdout.startswith("failed: trained steps 3-8 ")  # the summary, on stdout
    assert f"  why:        {summary['checkpoint_error']}\n" in proc.stdout
    assert f"  checkpoint: step 2 in {ckpt}\n" in proc.stdout
    assert summary["resumed_from"] == 2 and summary["steps"] == 8
    assert summary["last_checkpoint"] == 2
    assert summary["checkpoint_error"] == lines[2].removeprefix("jzero: ")
    assert list_steps(ckpt) == [2] and unfinished(ckpt) == []


def test_saves_that_keep_failing_stop_the_run_and_it_resumes_from_the_last_step(
    tmp_path, monkeypatch, caplog
):
    """The writes of steps 4, 6 and 8 fail (ENOSPC from Orbax's writes in its background
    thread); with checkpoint.max_consecutive_failures 2 the run stops at step 8, where the
    second failure (step 6's) is found, without a final save. A rerun resumes from step 2."""
    real = abstract_path.Path.write_text

    def write_text(self, *args, **kwargs):
        if any(f"/{step}{TMP_SUFFIX}/" in str(self) for step in (4, 6, 8)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(abstract_path.Path, "write_text", write_text)
    ckpt, logs = tmp_path / "ckpt", tmp_path / "run"
    overrides = [*OVERRIDES, f"train.log_dir={logs}", f"checkpoint.directory={ckpt}"]
    overrides += ["checkpoint.save_interval_steps=2", "checkpoint.max_consecutive_failures=2"]
    with caplog.at_level(logging.ERROR, logger="jzero"):
        summary = train.run("configs/zero2.yaml", overrides=overrides, steps=20, progress=False)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "step 4 was not saved" in lines[0], lines
    assert "Training goes on" in lines[0]
    assert lines[1] == f"jzero: {summary['checkpoint_error']}"
    assert "step 6 was not saved" in lines[1] and "2 saves in a row failed" in lines[1]
    assert summary["steps"] == 8 and summary["last_checkpoint"] == 2
    assert train.exit_code(summary) == 1
    assert json.loads((logs / "summary.json").read_text()) == summary
    assert list_steps(ckpt) == [2] and unfinished(ckpt) == []  # 8 never saved, nothing left
    monkeypatch.undo()
    again = train.run("configs/zero2.yaml", overrides=overrides, steps=9, progress=False)
    assert again["resumed_from"] == 2 and again["steps"] == 9
    assert again["checkpoint_error"] is None and train.exit_code(again) == 0
    assert again["last_checkpoint"] == 9


def test_a_compile_cache_that_cannot_be_written_is_one_warning(tmp_path, caplog):
    """pytest turns warnings into errors here (pyproject), as `-W error` does: JAX's warning for
    each entry it can't write or read would be an exception inside the compilation."""
    cache = tmp_path / "cache"
    restore = enable_compile_cache(cache)
    try:
        jax.jit(lambda x: x - 1)(jnp.ones(2)).block_until_ready()  # the cache is in use
        for entry in cache.iterdir():
            entry.unlink()
        cache.rmdir()
        cache.write_text("")  # a file where the folder was: every entry fails
        with caplog.at_level(logging.DEBUG, logger="jzero"):
            for n in (3, 5):  # two programs: each fails to be read, then to be written
                jax.jit(lambda x: x * 2 + 1)(jnp.ones(n)).block_until_ready()
    finally:
        restore()
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert f"the compile cache in {cache} can't be used (" in warned[0].getMessage()
    assert any("compile cache: Error" in r.getMessage() for r in caplog.records)  # the others
    # A cache folder that can't be made leaves the cache off for the run, with one warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jzero"):
        enable_compile_cache(cache / "inside-a-file")()
    assert [r.getMessage()[:40] for r in caplog.records] == [
        f"jzero: the compile cache folder {cache}"[:40]
    ]
