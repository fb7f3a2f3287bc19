"""Nothing silent on two processes: a process that stops in Python at step 3, or is killed
there, ends the run in bounded time with jzero's report naming it, its last step and its
phase (and summary.json holding it); processes started with different configs stop before
their first step, naming the field."""

import json
import socket
import sys
import time

from procs import Children, child_env, device_env
from repo import ROOT

from jzero.distributed import HANG_EXIT

CHILD = ROOT / "tests" / "support" / "hang_child.py"
HANG_TIMEOUT = 5


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, mode, timeout=240):
    """Both processes of ``mode``: (their exit codes, their output, the seconds they took)."""
    port = _free_port()
    c = Children()
    try:
        procs = []
        for p in range(2):
            env = child_env(
                XLA_FLAGS=device_env(2)["XLA_FLAGS"],
                JZERO_COORDINATOR=f"127.0.0.1:{port}",
                JZERO_NUM_PROCESSES="2",
                JZERO_PROCESS_ID=str(p),
            )
            cmd = [sys.executable, str(CHILD), mode, str(tmp_path / "ckpt"), str(tmp_path / "log")]
            procs.append(c.start(cmd, env))
        start = time.monotonic()
        codes = [c.finish(p, timeout=timeout) for p in procs]
        return codes, ["".join(p.out + p.err) for p in procs], time.monotonic() - start
    finally:
        c.kill_all()


def test_a_process_stopped_in_python_is_named_in_bounded_time(tmp_path):
    codes, out, seconds = _run(tmp_path, "sleep")
    assert codes == [HANG_EXIT, HANG_EXIT], out
    for text in out:
        assert "jzero: the run is stuck: no progress for 5 s" in text, text
        assert "behind: process 1" in text
        assert "process 1 (" in text
        assert "last finished step 2, in 'starting step 3' for" in text  # process 1
        # Process 0 went on into step 3 (dispatched asynchronously) and waits in its save.
        assert "process 0 (" in text and "in 'saving checkpoint 3' for" in text
    summary = json.loads((tmp_path / "log" / "summary.json").read_text())
    assert summary["hang"]["behind"] == [1]
    assert summary["hang"]["processes"]["1"]["last_step"] == 2
    assert summary["hang"]["processes"]["1"]["phase"] == "starting step 3"
    assert seconds < HANG_TIMEOUT + 60
    assert summary["steps"] == 2 and "stuck" in summary["stopped"]


def test_a_killed_process_is_named(tmp_path):
    """Process 1 is killed at step 3: process 0's collective fails, and instead of the
    runtime's abort (a C++ stack trace) it reports, naming process 1 behind at step 2."""
    codes, out, seconds = _run(tmp_path, "kill")
    assert codes == [HANG_EXIT, -9], out
    text = out[0]
    assert "jzero: the run is stuck: process 0's collective failed (JaxRuntimeError" in text
    assert "behind: process 1" in text
    # Its heartbeat stopped with it: gone, with its last finished step and phase.
    assert "process 1 (" in text and "last finished step 2, gone (last seen '" in text
    assert "process 0 (" in text and "gone" not in text.split("process 0 (")[1].split("\n")[0]
    assert "Check failure stack trace" not in text  # ended by jzero, not by the runtime
    summary = json.loads((tmp_path / "log" / "summary.json").read_text())
    assert summary["hang"]["behind"] == [1] and summary["steps"] == 2
    assert summary["hang"]["processes"]["1"]["gone"] is True
    assert summary["hang"]["processes"]["0"]["gone"] is False
    assert seconds < HANG_TIMEOUT + 60


def test_a_users_own_loop_is_watched_too(tmp_path):
    """No jzero.fit: the engine's own watchdog, started at the first train_step."""
    codes, out, seconds = _run(tmp_path, "loop")
    assert codes == [HANG_EXIT, HANG_EXIT], out
    for text in out:
        assert "jzero: the run is stuck: no progress for 5 s" in text, text
        assert "behind: process 1" in text
        assert "in 'step 4: running the compiled step' for" in text  # process 0 went on
    assert seconds < HANG_TIMEOUT + 60


def test_processes_with_different_configs_stop_before_the_first_step(tmp_path):
    codes, out, _ = _run(tmp_path, "config")
    assert codes == [1, 1], out  # the error raised by every process (jzero train: exit 2)
    for text in out:
        assert "the processes would not train the same run: config gradient_clipping" in text
        assert "1.0 on process 0, 0.5 on process 1" in text, text
    assert (
        not (tmp_path / "log" / "metrics.jsonl").exists()
        or not (tmp_path / "log" / "metrics.jsonl").read_text()
    )


def test_a_process_is_gone_when_its_heartbeat_stops_moving():
    """Liveness comes from the heartbeats in the store (the runtime's get_live_nodes is a
    barrier: a watchdog thread blocked in it at exit aborted finished runs): a heartbeat that
    has not moved for gone_after seconds is gone; one that moves, one that stopped its
    watchdog, or one not yet publishing never is."""
    from jzero.distributed import Watchdog

    dog = Watchdog(poll=0.01)
    dog.gone_after = 0.2
    records = {1: {"beat": 5}, 2: {"beat": 3, "stopped": True}, 3: {"phase": "setup"}}
    assert dog._gone(records) == []  # first seen now
    time.sleep(0.3)
    assert dog._gone({**records, 1: {"beat": 6}}) == []  # it moved
    assert dog._gone({**records, 1: {"beat": 6}}) == []  # not for long enough yet
    time.sleep(0.3)
    assert dog._gone({**records, 1: {"beat": 6}}) == [1]
    assert dog._gone({**records, 1: {"beat": 6, "stopped": True}}) == []
