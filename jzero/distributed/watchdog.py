"""A run of several processes never hangs in silence: each process publishes its progress (the
last step it finished, the phase it is in) and a watchdog thread ends every live process, with
one message naming who is behind, when no progress was made for ``distributed.hang_timeout``
seconds or a process is gone.

Decisions:

* **Progress goes through the runtime's key-value store** (:mod:`jzero.distributed.agreement`):
  each process sets ``jzero/progress/<run>/<process>`` (from a thread of its own, so a step
  pays no round trip) at every phase change (reading a batch,
  starting a step, the step's global batch, its compiled program, waiting for its results,
  evaluating, saving, restoring), a few hundred bytes, never a collective,
  so a process stuck in a collective (Gloo or NCCL) or in Python still has a thread that reads
  the others'.
* **The limit**: ``distributed.hang_timeout`` seconds, or ``auto``: the larger of 300 s and 10
  times the median step time so far. Until the first step has finished (its compilation, a
  restore) the limit is 4 times that. A process whose own progress is older than the limit
  reports; so does one that sees a process gone: its heartbeat (a counter its publisher
  thread sets every ``poll`` seconds, even while the process waits in a collective or in Python)
  has not moved for ``gone_after`` (30) seconds by this process's clock, and it did not stop
  its watchdog (a process ending normally says so). Liveness is read from the store, never
  with the runtime's ``get_live_nodes``: that call is a barrier among the processes it names,
  so a watchdog thread blocked in it at exit returned into a finalizing interpreter and
  aborted the process (signal 6) after a run that had succeeded.
* **Who is behind**: the processes that published the fewest phase changes; each is named with
  its host, its last finished step, its phase and for how long it has been in it. Every live
  process prints the report (stderr and the ``jzero`` logger), the lowest live process writes
  it into ``summary.json`` through the loop's callback, and each exits with status 124 (as
  ``timeout`` does): a hang ends in jzero's words, in bounded time, before any runtime abort.
* **Stragglers**: every process publishes its step time and its own time before the step's
  program (reading the batch, the loop: where a slow process shows, since in a collective the
  others wait for it); the loop writes both per process into ``metrics.jsonl`` and names a
  process whose own time is more than ``distributed.straggler_share`` (0.5) above the others'
  median, and 50 ms, for ``distributed.straggler_steps`` (5) steps in a row.
* **Every process reports**: the first to find the run stuck publishes its reason; every
  other watchdog sees it at its next look (or when its own collective fails because that
  process left) and reports the same reason. Process 0, where the runtime's service lives,
  exits last: it waits (at most 10 s) until every live process has reported; the runtime
  aborts a process whose service went away.
* A collective that fails in this process (the runtime's error: a peer's connection lost) is
  reported the same way by the loop (:meth:`Watchdog.failed`), or, in a user's own loop, when
  the error reaches the interpreter uncaught (a ``sys.excepthook`` the watchdog installs),
  before the runtime's shutdown
  would abort the process with its own stack trace.
* One process has no peers to wait for: no watchdog runs.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from jzero.distributed import agreement

__all__ = ["HANG_EXIT", "Watchdog", "hang_timeout", "stragglers"]

logger = logging.getLogger(__name__)

HANG_EXIT = 124
_RUNS = itertools.count()
_RUNNING: set[Any] = set()  # the watchdogs started and not stopped
_AT_EXIT: list[bool] = []


_HOOKED: list[Callable[..., Any]] = []  # the excepthook the watchdog's hook replaced


def _report_uncaught(kind: type[BaseException], error: BaseException, tb: Any) -> None:
    """``sys.excepthook`` while a watchdog runs: the traceback as usual; then, for the
    runtime's error (a collective failed: a peer left) reaching the interpreter uncaught in a
    user's own loop, the watchdog's report and exit, before the runtime's shutdown aborts."""
    (_HOOKED[0] if _HOOKED else sys.__excepthook__)(kind, error, tb)
    running = [w for w in _RUNNING if w.active]
    if running and isinstance(error, jax.errors.JaxRuntimeError):
        running[0].failed(error)


def _stop_running() -> None:
    """At exit, before the distributed runtime shuts down (registered after it started, so
    run before its own hook): no watchdog thread may call a runtime that is going away."""
    for watchdog in list(_RUNNING):
        watchdog.stop()


def stragglers(section: Any) -> tuple[float, int]:
    """``(distributed.straggler_share, distributed.straggler_steps)``, defaults 0.5 and 5.

    Raises:
      ValueError: a share that is not a positive number, or steps that are not a positive int.
    """
    section = section or {}
    share, steps = section.get("straggler_share", 0.5), section.get("straggler_steps", 5)
    if not (isinstance(share, int | float) and not isinstance(share, bool) and share > 0):
        raise ValueError(
            f"distributed.straggler_share: {share!r} is not allowed; it is how much slower than "
            "the others' median a process's own time a step may be (a positive number, e.g. "
            "0.5 for 50%). Set e.g. distributed.straggler_share: 0.5."
        )
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps > 0):
        raise ValueError(
            f"distributed.straggler_steps: {steps!r} is not allowed; it is how many steps in a "
            "row a process must be slow to be named (a positive integer, e.g. 5)."
        )
    return float(share), steps


def hang_timeout(section: Any) -> float | None:
    """``distributed.hang_timeout`` of a config's ``distributed`` section: seconds, or ``None``
    for ``auto`` (the default).

    Raises:
      ValueError: not a positive number nor ``auto``.
    """
    value = (section or {}).get("hang_timeout", "auto")
    if value in ("auto", None):
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise ValueError(
        f"distributed.hang_timeout: {value!r} is not allowed; it is the seconds without "
        "progress after which a run of several processes ends (a positive number), or auto "
        "(the larger of 300 s and 10 median steps). Set e.g. distributed.hang_timeout: 600."
    )


class Watchdog:
    """Publishes this process's progress and ends the run when the processes stop making it.

    Args:
      timeout: seconds without progress (``distributed.hang_timeout``); ``None``: ``auto``.
      on_hang: called with the report (a JSON mapping) on the lowest live process before it
        exits, e.g. to write ``summary.json``.
      poll: seconds between the watchdog's looks at the others.
      stragglers: ``(distributed.straggler_share, distributed.straggler_steps)``: a process
        whose own time a step is more than the share above the others' median that many steps
        in a row is named in a warning (:meth:`compare`).
    """

    def __init__(
        self,
        timeout: float | None = None,
        on_hang: Callable[[dict[str, Any]], None] | None = None,
        poll: float = 1.0,
        stragglers: tuple[float, int] = (0.5, 5),
    ):
        straggler_share, straggler_steps = stragglers
        self.timeout, self.on_hang, self.poll = timeout, on_hang, poll
        self.active = jax.process_count() > 1
        self.gone_after = max(30.0, 10 * poll)
        self._beat = 0
        self._seen: dict[int, tuple[int, float]] = {}  # process -> (beat, when it last moved)
        self._ending = threading.Event()  # this process is reporting and will exit
        self.prefix = f"jzero/progress/{next(_RUNS)}"
        self._seq = 0
        self._last_step: int | None = None
        self._phase = ("setup", None)
        self._since = time.time()
        self._step_times: list[float] = []
        self._times: list[tuple[int, float, float | None]] = []
        self._slow: dict[int, int] = {}
        self.straggler_share, self.straggler_steps = straggler_share, straggler_steps
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._dirty = threading.Event()
        self._host = socket.gethostname()

    # -- this process's progress -------------------------------------------------------------
    def phase(self, name: str, step: int | None = None) -> None:
        """This process enters phase ``name`` (of step ``step``, which ``{step}`` in the name
        shows)."""
        text = name.format(step=step) if "{step}" in name else name
        self._phase, self._since = (text, step), time.time()
        self._seq += 1
        if self.active:
            self._dirty.set()  # the publisher thread sends it: no round trip on this thread

    def finished(self, step: int, seconds: float, own_seconds: float | None = None) -> None:
        """This process finished step ``step`` in ``seconds``, ``own_seconds`` of them its own
        work before the step's program (reading the batch, the loop)."""
        self._last_step = step
        self._step_times.append(seconds)
        self._times = [*self._times[-2:], (step, seconds, own_seconds)]  # the last 3 steps
        self.phase("finished step {step}", step)

    def compare(self, step: int) -> tuple[list[float | None], list[float | None], list[str]]:
        """Every process's step time and own time of ``step`` (``None`` where one has not
        published it yet), and a warning for each process whose own time was more than
        ``straggler_share`` above the others' median (and 50 ms) for ``straggler_steps``
        steps in a row."""
        if not self.active:
            return [], [], []
        records = self._records()
        steps_s, own_s = [], []
        for p in range(jax.process_count()):
            times = {t[0]: t for t in records.get(p, {}).get("times", [])}
            steps_s.append(times[step][1] if step in times else None)
            own_s.append(times[step][2] if step in times else None)
        warnings = []
        for p, own in enumerate(own_s):
            others = [o for q, o in enumerate(own_s) if q != p and o is not None]
            slow = (
                own is not None
                and others
                and own > (1 + self.straggler_share) * statistics.median(others)
                and own - statistics.median(others) > 0.05
            )
            self._slow[p] = self._slow.get(p, 0) + 1 if slow else 0
            if self._slow[p] == self.straggler_steps:
                warnings.append(
                    f"jzero: process {p} ({records.get(p, {}).get('host', 'unknown host')}) is "
                    f"a straggler: {own:.3f} s of its own work a step (reading its batch, the "
                    f"loop) against a median of {statistics.median(others):.3f} s on the others, "
                    f"for {self.straggler_steps} steps in a row (distributed.straggler_share "
                    f"{self.straggler_share:g}); the others wait for it in every collective."
                )
        return steps_s, own_s, warnings

    def _records(self) -> dict[int, dict[str, Any]]:
        return self._progress(agreement.read_all(self.prefix))

    def _progress(self, every: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Each process's progress record among the store's keys under the prefix."""
        return {
            int(k.rsplit("/", 1)[1]): v
            for k, v in every.items()
            if k.rsplit("/", 1)[1].isdigit() and "/reported/" not in k
        }

    def _reported(self, every: dict[str, Any]) -> dict[int, str]:
        """The other processes that reported the run stuck, with their reasons."""
        me = jax.process_index()
        return {
            int(k.rsplit("/", 1)[1]): str(v)
            for k, v in every.items()
            if "/reported/" in k and int(k.rsplit("/", 1)[1]) != me
        }

    def _publisher(self) -> None:
        """Sends this process's latest progress whenever it changed (a phase change sets
        ``_dirty``), and at least every ``poll`` seconds as the heartbeat; several changes
        between two sends go as one, the latest, with its count. Stopping sends a last record
        saying so, so that the others do not take this process for gone."""
        while not self._stop.is_set():
            self._dirty.wait(self.poll)
            self._dirty.clear()
            self._publish()
        self._publish(stopped=True)

    def _publish(self, stopped: bool = False) -> None:
        self._beat += 1
        record = {
            "beat": self._beat,
            "stopped": stopped,
            "times": self._times,
            "seq": self._seq,
            "step": self._last_step,
            "phase": self._phase[0],
            "phase_step": self._phase[1],
            "since": self._since,
            "host": self._host,
            "pid": os.getpid(),
        }
        try:
            agreement.publish(f"{self.prefix}/{jax.process_index()}", record)
        except Exception as e:  # the store is gone with the runtime: the watchdog will see it
            logger.debug("jzero: progress not published: %s", e)

    # -- the watchdog thread -----------------------------------------------------------------
    def limit(self) -> float:
        """Seconds without progress that count as a hang now."""
        base = self.timeout
        if base is None:
            median = statistics.median(self._step_times) if self._step_times else 0.0
            base = max(300.0, 10 * median)
        return base if self._step_times else 4 * base

    def start(self) -> Watchdog:
        if self.active and self._thread is None:
            self.phase("setting up")
            self._thread = threading.Thread(target=self._run, name="jzero-watchdog", daemon=True)
            self._sender = threading.Thread(
                target=self._publisher, name="jzero-progress", daemon=True
            )
            self._sender.start()
            self._thread.start()
            _RUNNING.add(self)
            if sys.excepthook is not _report_uncaught:
                _HOOKED.append(sys.excepthook)
                sys.excepthook = _report_uncaught
            if not _AT_EXIT:  # the runtime is up: this hook runs before its shutdown
                atexit.register(_stop_running)
                _AT_EXIT.append(True)
        return self

    def stop(self) -> None:
        _RUNNING.discard(self)
        self._stop.set()
        self._dirty.set()
        for thread in (self._thread, self._sender):
            if thread is not None:
                thread.join(timeout=5)
        self._thread = self._sender = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                every = agreement.read_all(self.prefix)
                gone = self._gone(self._progress(every))
                stale = time.time() - self._since > self.limit()
                found = self._reported(every)
            except Exception as e:  # the runtime itself failed: say so, then end
                if self._stop.is_set():  # stopping (the process exits): nothing to report
                    return
                self._end(self._report(gone=[], why=f"the distributed runtime failed: {e}"))
                return
            if self._stop.is_set():
                return
            if found and not (gone or stale):  # another process found the run stuck
                self._end(self._report(gone, next(iter(found.values()))))
                return
            if gone or stale:
                why = (
                    f"process{'es' if len(gone) > 1 else ''} {', '.join(map(str, gone))} "
                    f"left the run (no heartbeat for {self.gone_after:.0f} s)"
                    if gone
                    else f"no progress for {self.limit():.0f} s (distributed.hang_timeout)"
                )
                self._end(self._report(gone, why))
                return

    def failed(self, error: BaseException) -> None:
        """This process's step failed in the runtime (a peer's connection lost in a
        collective): the report, naming the processes behind, then exit; nothing for one
        process."""
        if not self.active:
            return
        if self._ending.is_set():  # the watchdog thread is reporting: it ends the process
            time.sleep(60)
            return
        try:  # a killed peer's heartbeat has stopped; a live one moves within a poll or two
            found = self._reported(agreement.read_all(self.prefix))
            if found:  # a peer reported the run stuck and exits: this is why the step failed
                self._stop.set()
                self._end(self._report([], next(iter(found.values()))))
            before = self._records()
            time.sleep(2 * self.poll + 0.5)
            after = self._records()
            gone = [
                p
                for p, r in after.items()
                if p != jax.process_index()
                and not r.get("stopped")
                and r.get("beat") == before.get(p, {}).get("beat")
            ]
        except Exception:  # the runtime is failing too
            gone = []
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        why = f"process {jax.process_index()}'s collective failed ({type(error).__name__}: {first})"
        self._stop.set()
        self._end(self._report(gone, why))

    def _gone(self, records: dict[int, dict[str, Any]]) -> list[int]:
        """The processes whose heartbeat in ``records`` has not moved for ``gone_after``
        seconds by this process's clock (a process not yet publishing, or one that stopped its
        watchdog, is not gone)."""
        now, gone = time.monotonic(), []
        for p, r in records.items():
            if p == jax.process_index() or r.get("stopped") or "beat" not in r:
                continue
            beat, moved = self._seen.get(p, (None, now))
            if beat != r["beat"]:
                self._seen[p] = (r["beat"], now)
            elif now - moved > self.gone_after:
                gone.append(p)
        return gone

    def _report(self, gone: list[int], why: str) -> dict[str, Any]:
        now = time.time()
        try:
            records = self._records()
        except Exception:  # the store is unreachable: what this process knows
            records = {}
        records.setdefault(
            jax.process_index(),
            {"seq": self._seq, "step": self._last_step, "phase": self._phase[0],
             "phase_step": self._phase[1], "since": self._since, "host": self._host},
        )  # fmt: skip
        for p in range(jax.process_count()):
            records.setdefault(p, {"seq": -1, "step": None, "phase": "unknown", "since": now})
        fewest = min(r["seq"] for r in records.values())
        behind = sorted(set(gone) | {p for p, r in records.items() if r["seq"] == fewest})
        if len(behind) == len(records) and not gone:
            behind = []  # all alike: every process waits in the same place
        processes = {
            str(p): {
                "host": r.get("host"),
                "last_step": r.get("step"),
                "phase": r.get("phase"),
                "phase_step": r.get("phase_step"),
                "seconds_in_phase": round(now - r.get("since", now), 1),
                "gone": p in gone,
            }
            for p, r in sorted(records.items())
        }
        return {
            "why": why,
            "behind": behind,
            "processes": processes,
            "reporter": jax.process_index(),
        }

    def _end(self, report: dict[str, Any]) -> None:
        if self._ending.is_set():  # the other thread is reporting: it ends the process
            time.sleep(60)
            return
        self._ending.set()
        lines = [f"jzero: the run is stuck: {report['why']}."]
        if report["behind"]:
            names = ", ".join(f"process {p}" for p in report["behind"])
            lines.append(f"  behind: {names}")
        for p, r in report["processes"].items():
            state = (
                f"gone (last seen {r['phase']!r})"
                if r["gone"]
                else f"in {r['phase']!r} for {r['seconds_in_phase']:.0f} s"
            )
            lines.append(
                f"  process {p} ({r['host'] or 'unknown host'}): last finished step "
                f"{r['last_step'] if r['last_step'] is not None else 'none'}, {state}"
            )
        lines.append(f"  every live process exits with status {HANG_EXIT}.")
        message = "\n".join(lines)
        print(message, file=sys.stderr, flush=True)
        logger.error("%s", message)
        live = [int(p) for p, r in report["processes"].items() if not r["gone"]]
        me = jax.process_index()
        if self.on_hang is not None and live and me == min(live):
            try:
                self.on_hang({**report, "message": message})
            except Exception as e:  # the report is printed already
                print(f"jzero: the hang report was not written: {e}", file=sys.stderr)
        try:
            agreement.publish(f"{self.prefix}/reported/{me}", report["why"])
            if me == 0:  # the runtime's service lives here: the others report and exit first
                self._wait_reported([p for p in live if p != 0])
        except Exception:  # the runtime is gone already
            pass
        logging.shutdown()
        os._exit(HANG_EXIT)

    def _wait_reported(self, others: list[int], seconds: float = 10.0) -> None:
        """Waits (at most ``seconds``) until ``others`` have printed their reports."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            done = agreement.read_all(f"{self.prefix}/reported")
            if all(f"{self.prefix}/reported/{p}" in done for p in others):
                return
            time.sleep(0.2)
