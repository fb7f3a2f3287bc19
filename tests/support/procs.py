"""Processes a test starts: each in its own process group, every wait bounded, and every group
killed when the test ends however it ends (conftest's ``children`` fixture); two-process runs under
``jzero launch``."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from repo import ROOT

# 2 processes x 4 devices match 1 process x 8 devices (losses and grad norms): in float64 (the
# children enable x64), where gloo's other summation order stays far below 1e-10, and a wrong
# reduction (a process's rows left out, a gradient x2) is far above it.
LOSS_RTOL = 1e-10


def device_env(devices: int = 8, **extra: str) -> dict[str, str]:
    """A copy of this process's environment for a child with ``devices`` virtual CPU devices:
    XLA_FLAGS keeps its other flags (an ISA limit) and the
    compilation cache the run shares (conftest)."""
    count = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
    return {**os.environ, "XLA_FLAGS": " ".join([*kept, f"{count}={devices}"]), **extra}


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JZERO_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


class Children:
    """Started processes, each in its own group; all groups are killed on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        p = subprocess.Popen(
            cmd,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.procs.append(p)
        p.out, p.err = [], []
        for stream, sink in ((p.stdout, p.out), (p.stderr, p.err)):
            t = threading.Thread(target=self._read, args=(stream, sink), daemon=True)
            t.start()
            self.readers.append(t)
        return p

    @staticmethod
    def _read(stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)

    def wait_for_line(self, p: subprocess.Popen, pattern: str, timeout: float) -> str:
        """The first line of output matching ``pattern``, waiting at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in p.out + p.err if re.search(pattern, line)]
            if found:
                return found[0]
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s: {p.out + p.err}")

    def finish(self, p: subprocess.Popen, timeout: float) -> int:
        """The exit code; fails the test if ``p`` runs longer than ``timeout`` seconds."""
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s: {p.out + p.err}") from None
        time.sleep(0.2)  # let the reader threads drain the pipes
        return code

    def kill_all(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for t in self.readers:
            t.join(timeout=10)
        for p in self.procs:
            p.stdout.close()
            p.stderr.close()


def gone(pid: int) -> bool:
    """Whether ``pid`` runs no more: no such process, or a zombie awaiting its reaper."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # orphans are reaped by PID 1, which does not reap in some containers
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "jzero.distributed.launch", *args]


def signal_at_step(monkeypatch, signum: int, step: int) -> None:
    """This process raises ``signum`` as ``Engine.train_step`` begins its ``step``-th call (the
    run's own handler catches it, as in a process of its own); ``monkeypatch`` undoes it."""
    from jzero.engine import Engine

    train_step, calls = Engine.train_step, []

    def patched(self, batch):
        calls.append(1)
        if len(calls) == step:
            signal.raise_signal(signum)
        return train_step(self, batch)

    monkeypatch.setattr(Engine, "train_step", patched)
