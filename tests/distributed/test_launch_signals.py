"""``jzero launch`` never strands or cuts short its children: signals are forwarded and the
children get a grace period, a ``kill -9`` of the launcher takes the children with it, and a
local coordinator listens on loopback only.

The launcher runs as ``python -m jzero.distributed.launch`` in its own process group; its children
are
tests/support/launch_child.py (no JAX), which record their pid and the signals they get in files.
Every
wait is bounded, and every process a test started is killed when it ends, however it ends.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from procs import gone
from repo import ROOT, SUPPORT

from jzero.distributed import launch
from jzero.distributed import runtime as distributed

CHILD = SUPPORT / "launch_child.py"
START_TIMEOUT = 90  # the launcher imports jzero (hence JAX) on a busy 2-core machine


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


class Launches:
    """Launchers started by a test, with their children; all killed when the test ends."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.procs: list[subprocess.Popen] = []

    def start(self, grace_period: float, delay: float = 0.0) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("JZERO_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.update(JAX_PLATFORMS="cpu", LAUNCH_CHILD_DELAY=str(delay))
        cmd = [sys.executable, "-m", "jzero.distributed.launch", "-n", "2", "--grace-period"]
        cmd += [str(grace_period), "--", sys.executable, str(CHILD), str(self.directory)]
        p = subprocess.Popen(
            cmd,
            env=env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def child_pids(self) -> list[int]:
        """The children's pids, once both wrote them (their signal handlers are set then)."""
        files = [self.directory / f"pid{i}" for i in range(2)]
        wait_until(lambda: all(f.exists() for f in files), START_TIMEOUT, "children started")
        return [int(f.read_text()) for f in files]

    def signals(self, index: int) -> list[str]:
        f = self.directory / f"signals{index}"
        return f.read_text().split() if f.exists() else []

    def finish(self, p: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
        """The launcher's exit code, stdout and stderr; fails if it runs past ``timeout``."""
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launcher still runs after {timeout} s") from None
        return p.returncode, out, err

    def kill_all(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
        for f in self.directory.glob("pid?"):
            pid = int(f.read_text())
            with contextlib.suppress(OSError):  # only a child of this test, still running
                if str(CHILD) in Path(f"/proc/{pid}/cmdline").read_text() and not gone(pid):
                    os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def launches(tmp_path):
    runs = Launches(tmp_path)
    try:
        yield runs
    finally:
        runs.kill_all()


def test_kill_9_of_the_launcher_kills_its_children(launches):
    p = launches.start(grace_period=30)
    pids = launches.child_pids()
    os.kill(p.pid, signal.SIGKILL)
    assert launches.finish(p, timeout=10)[0] == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if not gone(pid)] == []  # none outlives the launcher
    assert launches.signals(0) == launches.signals(1) == []  # killed: no handler ran


def test_sighup_stops_the_children_with_sigterm_and_exits_129(launches):
    p = launches.start(grace_period=30)
    pids = launches.child_pids()
    os.kill(p.pid, signal.SIGHUP)
    code, out, err = launches.finish(p, timeout=60)
    assert code == 129, err
    assert launches.signals(0) == launches.signals(1) == ["SIGTERM"]
    assert "jzero launch: interrupted; stopped all 2 process(es)." in err
    assert all(map(gone, pids))


def test_sigterm_is_forwarded_and_the_children_get_their_grace_period(launches):
    p = launches.start(grace_period=60, delay=1.0)  # each child takes 1 s to "save"
    pids = launches.child_pids()
    os.kill(p.pid, signal.SIGTERM)
    code, out, err = launches.finish(p, timeout=60)
    assert code == 143, err
    assert launches.signals(0) == launches.signals(1) == ["SIGTERM"]
    # Both finished saving (not SIGKILLed early), and their last lines were still forwarded.
    assert all((launches.directory / f"done{i}").exists() for i in range(2))
    assert "[p0] saved 0" in out and "[p1] saved 1" in out
    assert all(map(gone, pids))


def test_sigint_is_forwarded_as_sigint_and_exits_130(launches):
    p = launches.start(grace_period=30)
    pids = launches.child_pids()
    os.kill(p.pid, signal.SIGINT)
    code, out, err = launches.finish(p, timeout=60)
    assert code == 130, err
    assert launches.signals(0) == launches.signals(1) == ["SIGINT"]
    assert "jzero launch: interrupted; stopped all 2 process(es)." in err
    assert all(map(gone, pids))


def test_a_second_signal_kills_the_children_at_once(launches):
    p = launches.start(grace_period=120, delay=100)  # saving would outlast the test's timeout
    pids = launches.child_pids()
    os.kill(p.pid, signal.SIGTERM)
    wait_until(lambda: launches.signals(0) and launches.signals(1), 30, "SIGTERM forwarded")
    os.kill(p.pid, signal.SIGTERM)
    code, out, err = launches.finish(p, timeout=30)
    assert code == 143, err
    assert not any((launches.directory / f"done{i}").exists() for i in range(2))
    assert all(map(gone, pids))


# -- the wrapper each child starts through -------------------------------------------------------
def run_wrapped(argv: list[str], parent: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        launch._wrapped(argv, parent), capture_output=True, text=True, timeout=30, check=False
    )


def test_the_wrapper_exits_at_once_when_the_launcher_is_gone(tmp_path):
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    wrong = run_wrapped(command, parent=os.getppid())  # the wrapper's parent is this process
    assert wrong.returncode != 0
    assert f"the launcher (pid {os.getppid()}) is gone" in wrong.stderr
    assert not marker.exists()
    assert run_wrapped(command, parent=os.getpid()).returncode == 0
    assert marker.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_wrapper_sets_the_parent_death_signal_and_execs_in_place():
    code = (
        "import ctypes, os; v = ctypes.c_int(); "
        "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); "  # PR_GET_PDEATHSIG
        "print(v.value, os.getppid())"
    )
    result = run_wrapped([sys.executable, "-c", code], parent=os.getpid())
    assert result.returncode == 0, result.stderr
    # SIGKILL survived the exec, and the command runs in the wrapper's place (same parent).
    assert result.stdout.split() == [str(int(signal.SIGKILL)), str(os.getpid())]


# -- the coordinator's bind address --------------------------------------------------------------
@pytest.mark.parametrize(
    ("coordinator", "bind"),
    [
        ("127.0.0.1:1234", "127.0.0.1:1234"),
        ("127.0.1.1:99", "127.0.1.1:99"),
        ("localhost:1234", "127.0.0.1:1234"),
        ("LocalHost:7", "127.0.0.1:7"),
        ("[::1]:1234", "[::1]:1234"),
        ("::1:1234", "[::1]:1234"),
        ("10.0.0.1:1234", None),
        ("0.0.0.0:1234", None),
        ("[::]:1234", None),
        ("node-3.cluster:1234", None),
        ("192.168.1.5:80", None),
        (None, None),
    ],
)
def test_bind_address_is_loopback_only_for_a_loopback_coordinator(coordinator, bind):
    assert distributed._bind_address(coordinator) == bind


def test_start_passes_the_bind_address_when_jax_takes_it(monkeypatch):
    calls = []

    def new_jax(coordinator_address=None, coordinator_bind_address=None, **kwargs):
        calls.append(coordinator_bind_address)

    def jax_without_it(coordinator_address=None, num_processes=None, process_id=None, **kwargs):
        calls.append(kwargs.get("coordinator_bind_address", "absent"))

    monkeypatch.setattr(distributed, "backends_initialized", lambda: False)
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    local = distributed.DistributedSpec("localhost:5555", 2, 0, "env")
    remote = distributed.DistributedSpec("10.1.2.3:5555", 2, 0, "env")
    for initialize in (new_jax, jax_without_it):
        monkeypatch.setattr(jax.distributed, "initialize", initialize)
        distributed._start(local, "test")
        distributed._start(remote, "test")
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "[::]:5555")  # the user's choice wins
    monkeypatch.setattr(jax.distributed, "initialize", new_jax)
    distributed._start(local, "test")
    assert calls == ["127.0.0.1:5555", None, "absent", "absent", None]


def test_the_installed_jax_takes_a_bind_address():
    # If a JAX release drops the parameter, a local coordinator listens on all interfaces again.
    assert distributed._accepts(jax.distributed.initialize, "coordinator_bind_address")
