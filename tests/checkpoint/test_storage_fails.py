"""A checkpoint disk that fails (full, a quota, an I/O error) is an event, not a crash: a failed
save is one line naming the cause, the directory, its free space and the last committed step;
nothing unfinished stays; a periodic save's failure lets training go on until
max_consecutive_failures in a row; too little free space fails before anything is written.
The disk is made to fail by ENOSPC raised from the file writes of a step being saved (Orbax's
JSON items, written in its background thread), so the failure surfaces where a real one does."""

import errno
import logging

import jax
import numpy as np
import pytest
from etils.epath import abstract_path

from jzero import checkpoint
from jzero.checkpoint import TMP_SUFFIX, Checkpointer, CheckpointWriteError, list_steps

SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
TARGET = {"w": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=SINGLE)}


def state(value):
    return {"w": np.full((64, 64), value, np.float32)}


@pytest.fixture
def disk(monkeypatch):
    """``disk.full_for = {2, 3}``: every file write into the saves of steps 2 and 3 fails with
    ENOSPC (by step, so a save in the background meets the disk its step was meant to)."""

    class Disk:
        full_for: set[int] = set()

    real = abstract_path.Path.write_text

    def write_text(self, *args, **kwargs):
        if any(f"/{step}{TMP_SUFFIX}/" in str(self) for step in Disk.full_for):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(abstract_path.Path, "write_text", write_text)
    return Disk


def unfinished(directory):
    return sorted(p.name for p in directory.glob(f"*{TMP_SUFFIX}"))


def errors(caplog):
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_failed_periodic_save_is_one_line_and_the_next_save_tries_again(
    ckpt_dir, disk, caplog, capfd
):
    ckpt = Checkpointer(ckpt_dir, max_to_keep=None)
    with caplog.at_level(logging.DEBUG):
        disk.full_for = {2, 3}
        ckpt.save(1, state(1.0), periodic=True)
        ckpt.save(2, state(2.0), periodic=True)  # fails in the background
        ckpt.save(3, state(3.0), periodic=True)  # finds 2 failed; fails in the background
        ckpt.save(4, state(4.0), periodic=True)  # finds 3 failed; commits
        ckpt.close()
    lines = [r.getMessage() for r in errors(caplog)]
    assert len(lines) == 2, lines
    for step, line, n in zip((2, 3), lines, (1, 2), strict=True):
        assert line.startswith(f"jzero: Checkpoint step {step} was not saved in '{ckpt_dir}': ")
        assert "No space left on device (ENOSPC); " in line and " free there, " in line
        assert "the committed steps are intact ([1], the latest 1)" in line
        assert f"Training goes on; the next save tries again ({n} failed in a row" in line
        assert "\n" not in line
    assert all(r.name.startswith("jzero") and not r.exc_info for r in errors(caplog))
    # Orbax's own reports of the failure (with their tracebacks) went to jzero's debug log.
    assert any(r.getMessage().startswith("Orbax: ") for r in caplog.records)
    assert "Traceback" not in capfd.readouterr().err
    assert list_steps(ckpt_dir) == [1, 4] and unfinished(ckpt_dir) == []
    assert ckpt.consecutive_failures == 0  # step 4 committed


def test_failures_in_a_row_stop_at_the_limit_and_a_final_failure_raises(ckpt_dir, disk):
    ckpt = Checkpointer(ckpt_dir, max_to_keep=None, max_consecutive_failures=2)
    disk.full_for = {2, 3, 4, 5}
    ckpt.save(1, state(1.0), periodic=True)
    ckpt.save(2, state(2.0), periodic=True)
    ckpt.save(3, state(3.0), periodic=True)  # 2's failure: logged
    with pytest.raises(CheckpointWriteError) as e:
        ckpt.save(4, state(4.0), periodic=True)  # 3's: the second in a row
    assert "Checkpoint step 3 was not saved" in str(e.value)
    assert "2 saves in a row failed (checkpoint.max_consecutive_failures: 2), so" in str(e.value)
    assert unfinished(ckpt_dir) == [] and list_steps(ckpt_dir) == [1]
    # A save that is not periodic (a final one) raises at its first failure, at close too ...
    ckpt.save(5, state(5.0))
    with pytest.raises(CheckpointWriteError, match=r"step 5 was not saved .*then save again"):
        ckpt.close()
    assert unfinished(ckpt_dir) == [] and list_steps(ckpt_dir) == [1]
    # ... and the checkpointer is closed all the same: its lock is free for the next writer.
    disk.full_for = set()
    with Checkpointer(ckpt_dir) as again:
        again.restore(TARGET)
        assert again.save(5, state(5.0))
    assert list_steps(ckpt_dir) == [1, 5]


def test_too_little_free_space_fails_before_anything_is_written(ckpt_dir, monkeypatch, caplog):
    ckpt = Checkpointer(ckpt_dir, max_to_keep=None)
    ckpt.save(1, state(1.0))
    ckpt.wait_until_finished()
    writes = []
    monkeypatch.setattr(checkpoint.orbax_io.StepWriter, "save", lambda *a: writes.append(a))
    monkeypatch.setattr(checkpoint.checkpointer, "free_bytes", lambda _: 1000)
    with caplog.at_level(logging.ERROR):
        assert ckpt.save(2, state(2.0), periodic=True) is False
    (line,) = [r.getMessage() for r in errors(caplog)]
    assert "step 2 was not saved" in line and "too little free space for it (nothing was" in line
    assert "1000 B free there, the step's arrays hold 16.0 KiB;" in line
    with pytest.raises(CheckpointWriteError, match="too little free space .* then save again"):
        ckpt.save(3, state(3.0))
    assert writes == [] and unfinished(ckpt_dir) == [] and list_steps(ckpt_dir) == [1]
    ckpt.close()


def test_unfinished_saves_are_removed_at_start_never_a_committed_step(ckpt_dir, caplog):
    with Checkpointer(ckpt_dir, async_save=False) as ckpt:
        ckpt.save(1, state(1.0))
    for name in (f"2{TMP_SUFFIX}", f"10{TMP_SUFFIX}"):  # two saves a killed run left
        (ckpt_dir / name / "state").mkdir(parents=True)
    (ckpt_dir / f"1{TMP_SUFFIX}.notes").write_text("not a folder of ours")
    # While another writer holds the directory, its unfinished save is left alone.
    holder = Checkpointer(ckpt_dir)
    holder.restore(TARGET)
    holder.save(3, state(3.0))  # opens the directory: removes the leftovers, with a line each
    holder.wait_until_finished()
    (ckpt_dir / f"4{TMP_SUFFIX}").mkdir()  # as if it were that writer's save in flight
    assert checkpoint.dirs.clean_unfinished(ckpt_dir) == []
    assert unfinished(ckpt_dir) == [f"4{TMP_SUFFIX}"]
    holder.close()
    with caplog.at_level(logging.INFO, logger="jzero"):
        assert checkpoint.dirs.clean_unfinished(ckpt_dir) == [f"4{TMP_SUFFIX}"]
    assert f"removed 4{TMP_SUFFIX} from {ckpt_dir}: a checkpoint save that never" in caplog.text
    assert unfinished(ckpt_dir) == [] and list_steps(ckpt_dir) == [1, 3]
    assert (ckpt_dir / f"1{TMP_SUFFIX}.notes").is_file()


def test_a_write_that_lands_after_its_event_loop_closed_is_not_reported(ckpt_dir, caplog):
    """When one shard's write fails, Orbax's event loop closes while TensorStore finishes the
    others; each then wakes the closed loop (``RuntimeError: Event loop is closed``, reported
    as unraisable: a traceback on stderr per shard, and here a pytest error). Once a writer is
    open, those go to jzero's debug log."""
    import asyncio

    import tensorstore as ts

    with Checkpointer(ckpt_dir) as ckpt:
        ckpt.save(1, state(1.0))
    promise, write = ts.Promise.new()  # a write still running in TensorStore

    async def shard():
        await write

    async def failing_shard():
        raise OSError(errno.ENOSPC, "No space left on device")

    async def save():
        await asyncio.gather(shard(), failing_shard())

    loop = asyncio.new_event_loop()
    with pytest.raises(OSError):
        loop.run_until_complete(save())
    loop.close()
    with caplog.at_level(logging.DEBUG, logger="jzero"):
        promise.set_result(None)  # the write lands: TensorStore wakes the closed loop
    assert "a write finished after its event loop closed" in caplog.text
