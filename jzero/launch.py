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
  prefixed ``[p<id>] ``, one reader thread per stream, whole lines only.
* Shutdown: every child runs in its own session (its own process group), so a signal reaches
  its whole tree and the terminal's Ctrl-C reaches only the launcher. When a child fails, on
  Ctrl-C or on SIGTERM, every group still alive gets SIGTERM, then SIGKILL after a grace period
  (10 s by default); groups of children that exited are cleared the same way, so nothing a child
  started outlives the launcher. The exit status is the first failing child's (128 + signal
  number for a child killed by a signal), 130 on Ctrl-C, 143 on SIGTERM; a message names the
  failed process and its code.
* The launcher runs no JAX computation: it only starts and stops processes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from jzero.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

__all__ = ["add_commands", "child_env", "free_port", "launch", "main"]

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
DEFAULT_GRACE_PERIOD = 10.0
_POLL_S = 0.05


class _Terminated(Exception):
    """The launcher itself got SIGTERM."""


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


def _forward(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _signal_groups(procs: Sequence[subprocess.Popen], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _stop_all(procs: Sequence[subprocess.Popen], grace_period: float) -> None:
    """SIGTERM to every child's group, SIGKILL to what is left after ``grace_period``."""
    _signal_groups(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    while time.monotonic() < deadline:
        for p in procs:
            p.poll()
        if all(p.returncode is not None and not _group_alive(p.pid) for p in procs):
            return
        time.sleep(_POLL_S)
    _signal_groups(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Runs ``command`` as ``num_processes`` local processes of one distributed program.

    Args:
      command: the program and its arguments (a leading ``--`` is dropped; ``jzero ...`` runs
        ``python -m jzero.cli ...`` with this interpreter).
      num_processes: how many processes to start.
      devices_per_process: virtual CPU devices per process (``XLA_FLAGS``); ``None`` keeps
        the environment's.
      port: the coordinator port; a free one when ``None``.
      grace_period: seconds between SIGTERM and SIGKILL when stopping the children.
      env: the base environment; ``os.environ`` by default.
      stdout / stderr: where the prefixed lines go; ``sys.stdout`` / ``sys.stderr`` by default.

    Returns:
      0 when every process succeeded, else the first failing process's exit code (128 +
      signal for a signal), 130 after Ctrl-C or 143 after SIGTERM.
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
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"--port is {port}; it must be in 1..65535. Leave it out for a free one.")
    argv = _resolve_command(command)
    out, err = stdout or sys.stdout, stderr or sys.stderr
    port = free_port() if port is None else port
    base = os.environ if env is None else env
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        raise _Terminated

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    code, failed = 0, None
    try:
        for pid in range(num_processes):
            try:
                p = subprocess.Popen(
                    argv,
                    env=child_env(base, pid, num_processes, port, devices_per_process),
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
            for stream, sink in ((p.stdout, out), (p.stderr, err)):
                t = threading.Thread(
                    target=_forward, args=(stream, sink, f"[p{pid}] ", lock), daemon=True
                )
                t.start()
                threads.append(t)
        while failed is None and any(p.poll() is None for p in procs):
            failed = next((i for i, p in enumerate(procs) if p.poll()), None)
            time.sleep(_POLL_S)
        failed = next((i for i, p in enumerate(procs) if p.poll()), None)
        if failed is not None:
            code = _exit_code(procs[failed].returncode)
    except KeyboardInterrupt:
        code = 130
    except _Terminated:
        code = 143
    finally:
        _stop_all(procs, grace_period)
        for t in threads:
            t.join(timeout=5)
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    if failed is not None:
        rc = procs[failed].returncode
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        err.write(
            f"jzero launch: process {failed} (pid {procs[failed].pid}) {how}; stopped the "
            f"other {num_processes - 1} process(es). Its output above is prefixed [p{failed}]. "
            f"Command: {shlex.join(argv)}\n"
        )
    elif code:
        err.write(f"jzero launch: interrupted; stopped all {len(procs)} process(es).\n")
    err.flush()
    return code


def _run(args: argparse.Namespace) -> int:
    return launch(
        args.command,
        args.num_processes,
        devices_per_process=args.devices_per_process,
        port=args.port,
        grace_period=args.grace_period,
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
    p.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    p.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD,
        help="seconds between SIGTERM and SIGKILL when stopping (default 10)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    p.set_defaults(func=_run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jzero.launch ...``: the same as ``jzero launch ...``."""
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
