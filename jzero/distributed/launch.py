"""``jzero launch``: several local processes of one jzero program, started and stopped together.

Decisions:

* Each child gets ``JZERO_COORDINATOR=127.0.0.1:PORT``, ``JZERO_NUM_PROCESSES`` and
  ``JZERO_PROCESS_ID`` (read by :func:`jzero.distributed.init_distributed`), and with
  ``--devices-per-process D`` the flag ``--xla_force_host_platform_device_count=D`` in
  ``XLA_FLAGS`` (D virtual CPU devices each, for development and tests). ``PYTHONUNBUFFERED=1``
  makes Python children flush every line. With no ``--port`` a free port is picked.
* A command that starts with ``jzero`` runs this interpreter's jzero (``python -m jzero.cli``),
  so the children use the same installation even where the console script is not on PATH.
* Output: every line of a child's stdout (stderr) goes to the launcher's stdout (stderr),
  prefixed ``[p<id>] ``, one reader thread per stream, whole lines only. One kind is left
  out: Gloo (JAX's CPU collectives) prints ``[Gloo] Rank 0 is connected to 1 peer ranks.
  Expected number of connected peer ranks is : 1`` from C++ on stdout for every communicator
  it connects (a dozen lines per run, with no setting that silences it); such a line is
  dropped when the two counts agree, and kept when they differ (a peer is missing) or when
  the command has ``--verbose`` (``jzero train --verbose`` shows every library's log).
* Shutdown: every child runs in its own session (its own process group), so a signal reaches
  its whole tree and the terminal's Ctrl-C reaches only the launcher. The launcher forwards the
  signal it gets to every child's group: SIGINT as SIGINT, SIGTERM as SIGTERM, and SIGHUP (a
  dropped ssh session) as SIGTERM. It then waits up to a grace period (``--grace-period``, 30 s
  by default; make it cover a checkpoint save: ``jzero train`` finishes its step, saves and
  exits 143 on SIGTERM, 130 on SIGINT) and SIGKILLs every group still alive. A second signal
  while it waits SIGKILLs them at once. When a child fails, the others get SIGTERM and the same
  grace period; groups of children that exited are cleared the same way, so nothing a child
  started outlives the launcher. The exit status is the first failing child's (128 + signal
  number for a child killed by a signal), or 130 after SIGINT, 143 after SIGTERM and 129 after
  SIGHUP; a message names the failed process and its code. SIGTERM, SIGINT and SIGHUP are
  graceful: the children can save a final checkpoint.
* Children die with the launcher, even on ``kill -9`` of the launcher (which no program can
  catch): then there is no grace period and no final checkpoint. Each child starts through a
  small stdlib-only Python wrapper (``_WRAPPER``) that asks Linux for SIGKILL when its parent
  dies (``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``), exits at once if the launcher is
  already gone, then ``exec``s the command in place (same pid). ``subprocess``'s
  ``preexec_fn`` is not used: it is unsafe with the reader threads running. Only the child
  itself is covered, not processes it starts (those are stopped through its group when the
  launcher lives to do so). On other systems the wrapper skips ``prctl``. A launcher output
  that goes away (a closed terminal) does not block the children: their lines are then dropped.
* ``--replicas R`` (hybrid sharding) sets ``JZERO_REPLICAS=R`` in every child;
  ``jzero.initialize`` then builds ``mesh: {replica: R, data: -1}`` where the config names no
  replica axis, so ZeRO shards within each group of processes and replicates across them.
* The launcher runs no JAX computation: it only starts and stops processes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from jzero.distributed.processes import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_REPLICAS,
)

__all__ = [
    "LaunchOutput",
    "add_commands",
    "child_env",
    "free_port",
    "is_gloo_chatter",
    "launch",
    "main",
]

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
DEFAULT_GRACE_PERIOD = 30.0
_POLL_S = 0.05


# The signals the launcher handles, what it forwards to the children, and its exit code.
_FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM}
_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
if hasattr(signal, "SIGHUP"):
    _FORWARDED[signal.SIGHUP] = signal.SIGTERM
    _EXIT_CODES[signal.SIGHUP] = 129

# Run as ``python -c _WRAPPER LAUNCHER_PID COMMAND...``: stdlib only (no jzero, hence no JAX).
# PR_SET_PDEATHSIG is 1 on Linux; the death signal survives execvp.
_WRAPPER = """\
import os, sys
parent = int(sys.argv[1])
if sys.platform.startswith("linux"):
    try:
        import ctypes, signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
if os.getppid() != parent:
    sys.exit(f"jzero launch: the launcher (pid {parent}) is gone; not starting {sys.argv[2]}")
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    sys.stderr.write(f"jzero launch: could not start {sys.argv[2]}: {e}\\n")
    sys.exit(127)
"""


def _wrapped(argv: Sequence[str], launcher_pid: int) -> list[str]:
    """``argv`` started through :data:`_WRAPPER`: killed when ``launcher_pid`` dies (Linux)."""
    return [sys.executable, "-I", "-S", "-c", _WRAPPER, str(launcher_pid), *argv]


class _Signals:
    """A signal handler that only records what it got (checked by the launcher's loops)."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def __call__(self, signum: int, frame: Any) -> None:
        self.received.append(signum)


def free_port() -> int:
    """A TCP port that is free on this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(
    base: Mapping[str, str],
    process_id: int,
    num_processes: int,
    port: int,
    devices_per_process: int | None = None,
    replicas: int | None = None,
) -> dict[str, str]:
    """The environment of child ``process_id``: ``base`` plus the ``JZERO_*`` layout."""
    env = dict(base)
    env.update(
        {
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(process_id),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if replicas is not None:
        env[ENV_REPLICAS] = str(replicas)
    if devices_per_process is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
        env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={devices_per_process}"])
    return env


def _resolve_command(command: Sequence[str]) -> list[str]:
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError(
            "jzero launch needs a command to run, e.g. "
            "`jzero launch --num-processes 2 -- jzero train configs/zero2.yaml`."
        )
    if command[0] == "jzero":
        return [sys.executable, "-m", "jzero.cli", *command[1:]]
    return command


# Gloo's report of a communicator it connected (printed from C++; see the module's decisions).
_GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    r"Expected number of connected peer ranks is : (\d+)"
)


def is_gloo_chatter(line: str) -> bool:
    """Whether ``line`` is Gloo's report of a communicator connected as expected."""
    m = _GLOO_CONNECTED.fullmatch(line.strip())
    return m is not None and m.group(1) == m.group(2)


def _forward(
    stream: IO[bytes],
    out: IO[str],
    prefix: str,
    lock: threading.Lock,
    drop: Callable[[str], bool] | None = None,
) -> None:
    broken = False
    for raw in iter(stream.readline, b""):
        if broken:  # keep reading, so that a child never blocks on a full pipe
            continue
        line = raw.decode(errors="replace").rstrip("\r\n")
        if drop is not None and drop(line):
            continue
        with lock:
            try:
                out.write(f"{prefix}{line}\n")
                out.flush()
            except (OSError, ValueError):  # the terminal or the pipe is gone (e.g. SIGHUP)
                broken = True
    stream.close()


def _signal_process_groups(procs: Sequence[subprocess.Popen], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)


def _process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _stop_all(procs: Sequence[subprocess.Popen], grace_period: float, signals: _Signals) -> None:
    """Stops every child's group: the launcher's signal forwarded (SIGTERM when it got none),
    SIGKILL to what is left after ``grace_period`` or at once on a further signal."""
    received = signals.received
    handled = min(len(received), 1)  # a signal already received beyond the first escalates
    _signal_process_groups(procs, _FORWARDED[received[0]] if received else signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    while time.monotonic() < deadline:
        if len(received) > handled:
            if handled:
                break  # a second signal: SIGKILL now
            handled = 1  # the first signal while stopping after a failure: forwarded as well
            _signal_process_groups(procs, _FORWARDED[received[0]])
            continue
        for p in procs:
            p.poll()
        if all(p.returncode is not None and not _process_group_alive(p.pid) for p in procs):
            return
        time.sleep(_POLL_S)
    _signal_process_groups(procs, signal.SIGKILL)


def _check_runnable(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Raises ``ValueError`` when ``argv[0]`` cannot be run (the wrapper would exit 127)."""
    program = argv[0]
    if os.sep in program:
        found = program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    else:
        found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise ValueError(
            f"could not start {shlex.join(argv)}: {program!r} is not an executable file. Check "
            "the command's spelling and that it is on PATH (or give its full path)."
        )


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


@dataclasses.dataclass(frozen=True)
class LaunchOutput:
    """Where :func:`launch` passes its children's output, each line prefixed ``[pN] ``."""

    stdout: IO[str] | None = None
    """Where the children's standard output goes; ``None``: ``sys.stdout``."""
    stderr: IO[str] | None = None
    """Where their standard error and the launcher's messages go; ``None``: ``sys.stderr``."""
    keep_gloo_lines: bool = False
    """Also pass on Gloo's reports of the communicators it connected (see the module's
    decisions); ``jzero launch`` keeps them when the command has ``--verbose``."""


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    replicas: int | None = None,
    env: Mapping[str, str] | None = None,
    output: LaunchOutput | None = None,
) -> int:
    """Runs ``command`` as ``num_processes`` local processes of one distributed program.

    Args:
      command: the program and its arguments (a leading ``--`` is dropped; ``jzero ...`` runs
        ``python -m jzero.cli ...`` with this interpreter).
      num_processes: how many processes to start.
      devices_per_process: virtual CPU devices per process (``XLA_FLAGS``); ``None`` keeps
        the environment's.
      port: the coordinator port; a free one when ``None``.
      grace_period: seconds between the forwarded signal (SIGTERM on a failure) and SIGKILL
        when stopping the children.
      replicas: hybrid sharding's replica groups (``JZERO_REPLICAS`` in every child; see the
        module docstring); ``None``: the config's mesh as written.
      env: the base environment; ``os.environ`` by default.
      output: where the children's prefixed lines go and which are dropped
        (:class:`LaunchOutput`); ``None``: its defaults.

    Returns:
      0 when every process succeeded, else the first failing process's exit code (128 +
      signal for a signal), 130 after SIGINT (Ctrl-C), 143 after SIGTERM, 129 after SIGHUP.
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(
            f"--num-processes is {num_processes!r}; it must be a positive integer. "
            "Pass e.g. --num-processes 2."
        )
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(
            f"--devices-per-process is {devices_per_process}; it must be a positive integer "
            "(virtual CPU devices per process). Pass e.g. --devices-per-process 4, or leave it out."
        )
    if replicas is not None and (
        isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1
    ):
        raise ValueError(
            f"--replicas is {replicas!r}; it must be a positive integer (replica groups, e.g. "
            "one per host). Pass e.g. --replicas 2, or leave it out."
        )
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"--port is {port}; it must be in 1..65535. Leave it out for a free one.")
    argv = _resolve_command(command)
    base = os.environ if env is None else env
    _check_runnable(argv, base)
    output = output if output is not None else LaunchOutput()
    out, err = output.stdout or sys.stdout, output.stderr or sys.stderr
    port = free_port() if port is None else port
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []

    signals = _Signals()
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, signals) for sig in _FORWARDED} if in_main else {}
    launcher_pid = os.getpid()
    code, failed = 0, None
    try:
        for pid in range(num_processes):
            if signals.received:
                break
            try:
                p = subprocess.Popen(
                    _wrapped(argv, launcher_pid),
                    env=child_env(base, pid, num_processes, port, devices_per_process, replicas),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as e:
                raise ValueError(
                    f"could not start {shlex.join(argv)}: {e}. Check the "
                    "command's spelling and that it is on PATH (or give its full path)."
                ) from e
            procs.append(p)
            drop = None if output.keep_gloo_lines else is_gloo_chatter
            for stream, sink in ((p.stdout, out), (p.stderr, err)):
                t = threading.Thread(
                    target=_forward, args=(stream, sink, f"[p{pid}] ", lock, drop), daemon=True
                )
                t.start()
                threads.append(t)
        while not signals.received and failed is None and any(p.poll() is None for p in procs):
            failed = next((i for i, p in enumerate(procs) if p.poll()), None)
            time.sleep(_POLL_S)
        if signals.received:
            code, failed = _EXIT_CODES[signals.received[0]], None
        else:
            failed = next((i for i, p in enumerate(procs) if p.poll()), None)
            if failed is not None:
                code = _exit_code(procs[failed].returncode)
    finally:
        try:
            _stop_all(procs, grace_period, signals)
        finally:
            for p in procs:
                if p.poll() is None:  # _stop_all was cut short
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            for t in threads:
                t.join(timeout=5)
            for sig, handler in previous.items():
                if handler is not None:  # None: a handler set outside Python, not restorable
                    signal.signal(sig, handler)
    message = ""
    if failed is not None:
        rc = procs[failed].returncode
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        message = (
            f"jzero launch: process {failed} (pid {procs[failed].pid}) {how}; stopped the "
            f"other {num_processes - 1} process(es). Its output above is prefixed [p{failed}]. "
            f"Command: {shlex.join(argv)}\n"
        )
    elif code:
        message = f"jzero launch: interrupted; stopped all {len(procs)} process(es).\n"
    with contextlib.suppress(OSError, ValueError):  # the terminal may be gone (SIGHUP)
        err.write(message)
        err.flush()
    return code


def _run(args: argparse.Namespace) -> int:
    return launch(
        args.command,
        args.num_processes,
        devices_per_process=args.devices_per_process,
        port=args.port,
        grace_period=args.grace_period,
        replicas=args.replicas,
        output=LaunchOutput(keep_gloo_lines="--verbose" in args.command),
    )


def add_commands(subparsers: Any) -> None:
    """Adds ``jzero launch`` to the ``jzero`` command's subparsers (``func(args) -> int``)."""
    p = subparsers.add_parser(
        "launch",
        help="run a command as several local jzero processes",
        description="Start P local processes of one distributed jzero program, e.g. "
        "`jzero launch --num-processes 2 --devices-per-process 4 -- jzero train CONFIG`.",
    )
    p.add_argument("--num-processes", "-n", type=int, required=True, help="processes to start")
    p.add_argument(
        "--devices-per-process",
        type=int,
        help="virtual CPU devices per process (sets XLA_FLAGS; for development and tests)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        help="hybrid sharding: replica groups R (e.g. one per host); the mesh becomes "
        "{replica: R, data: -1} where the config names no replica axis",
    )
    p.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    p.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD,
        help="seconds between the forwarded signal (or SIGTERM) and SIGKILL when stopping; "
        "leave time for a final checkpoint (default 30)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    p.set_defaults(func=_run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jzero.distributed.launch ...``: the same as ``jzero launch ...``."""
    ap = argparse.ArgumentParser(prog="jzero")
    add_commands(ap.add_subparsers(dest="command_name", required=True))
    args = ap.parse_args(["launch", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"jzero launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
