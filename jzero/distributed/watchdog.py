"""A run of several processes never hangs in silence: each process publishes its progress (the
last step it finished, the phase it is in) and a watchdog thread ends every live process, with
one message naming who is behind, when no progress was made for ``distributed.hang_timeout``
seconds or a process is gone.

Decisions:

* **Progress goes through the runtime's key-value store** (:mod:`jzero.distributed.agreement`):
  each process sets ``jzero/progress/<run>/<process>`` at every phase change (reading a batch,
  starting a step, the step's global batch, its compiled program, waiting for its results,
  evaluating, saving, restoring), a few hundred bytes, never a collective,
  so a process stuck in a collective (Gloo or NCCL) or in Python still has a thread that reads
  the others'.
* **The limit**: ``distributed.hang_timeout`` seconds, or ``auto``: the larger of 300 s and 10
  times the median step time so far. Until the first step has finished (its compilation, a
  restore) the limit is 4 times that. A process whose own progress is older than the limit
  reports; so does one that sees a process gone from the runtime (its connection closed).
* **Who is behind**: the processes that published the fewest phase changes; each is named with
  its host, its last finished step, its phase and for how long it has been in it. Every live
  process prints the report (stderr and the ``jzero`` logger), the lowest live process writes
  it into ``summary.json`` through the loop's callback, and each exits with status 124 (as
  ``timeout`` does): a hang ends in jzero's words, in bounded time, before any runtime abort.
* A collective that fails in this process (the runtime's error: a peer's connection lost) is
  reported the same way by the loop (:meth:`Watchdog.failed`), before the runtime's shutdown
  would abort the process with its own stack trace.
* One process has no peers to wait for: no watchdog runs.
"""

from __future__ import annotations

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

__all__ = ["HANG_EXIT", "Watchdog", "hang_timeout"]

logger = logging.getLogger(__name__)

HANG_EXIT = 124
_RUNS = itertools.count()


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
    """

    def __init__(
        self,
        timeout: float | None = None,
        on_hang: Callable[[dict[str, Any]], None] | None = None,
        poll: float = 1.0,
    ):
        self.timeout, self.on_hang, self.poll = timeout, on_hang, poll
        self.active = jax.process_count() > 1
        self.prefix = f"jzero/progress/{next(_RUNS)}"
        self._seq = 0
        self._last_step: int | None = None
        self._phase = ("setup", None)
        self._since = time.time()
        self._step_times: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._host = socket.gethostname()

    # -- this process's progress -------------------------------------------------------------
    def phase(self, name: str, step: int | None = None) -> None:
        """This process enters phase ``name`` (of step ``step``, which ``{step}`` in the name
        shows)."""
        text = name.format(step=step) if "{step}" in name else name
        self._phase, self._since = (text, step), time.time()
        self._seq += 1
        self._publish()

    def finished(self, step: int, seconds: float) -> None:
        """This process finished step ``step`` in ``seconds``."""
        self._last_step = step
        self._step_times.append(seconds)
        self.phase("finished step {step}", step)

    def _publish(self) -> None:
        if not self.active:
            return
        record = {
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
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                gone = self._gone()
                stale = time.time() - self._since > self.limit()
            except Exception as e:  # the runtime itself failed: say so, then end
                self._end(self._report(gone=[], why=f"the distributed runtime failed: {e}"))
                return
            if gone or stale:
                why = (
                    f"process{'es' if len(gone) > 1 else ''} {', '.join(map(str, gone))} "
                    "left the run (the runtime lost its connection)"
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
        try:
            gone = self._gone()
        except Exception:  # the runtime is failing too
            gone = []
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        why = f"process {jax.process_index()}'s collective failed ({type(error).__name__}: {first})"
        self._stop.set()
        self._end(self._report(gone, why))

    def _gone(self, wait: float = 2.0) -> list[int]:
        """The processes the runtime no longer counts live; ``[]`` when it does not answer
        within ``wait`` seconds (with a peer just lost it may wait for its heartbeat)."""
        client = agreement.store()
        ids = list(range(jax.process_count()))
        found: list[dict[int, int]] = []
        asked = threading.Thread(
            target=lambda: found.append(client.get_live_nodes(ids)), daemon=True
        )
        asked.start()
        asked.join(wait)
        return [p for p in ids if p not in found[0]] if found else []

    def _report(self, gone: list[int], why: str) -> dict[str, Any]:
        now = time.time()
        try:
            records = {
                int(k.rsplit("/", 1)[1]): v
                for k, v in agreement.read_all(self.prefix).items()
                if k.rsplit("/", 1)[1].isdigit() and "/reported/" not in k
            }
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
            agreement.publish(f"{self.prefix}/reported/{me}", True)
            if me == 0:  # the runtime's service lives here: the others report first
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
