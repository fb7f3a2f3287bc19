"""Stop signals during a run: the first SIGINT or SIGTERM stops the loop after the current
step, which then writes its final checkpoint.

Decisions:

* One watcher at a time: :func:`watching` installs one unless one is installed already (the
  ``jzero train`` command installs it before set-up, :func:`jzero.fit` then uses that one), and
  puts the previous handlers back when the one that installed it ends.
* Only from the main thread (Python's rule for signal handlers); elsewhere nothing is installed
  and no signal is seen.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["StopOnSignal", "watching"]

logger = logging.getLogger(__name__)

_ACTIVE: list[StopOnSignal] = []


class StopOnSignal:
    """Stop signals while the run is going, until its final checkpoint is committed.

    The first SIGINT (Ctrl-C) or SIGTERM (what SLURM and Kubernetes send before they kill a
    job) asks the loop to stop after the current step and save. A further SIGTERM is logged
    and otherwise ignored: SLURM signals every process of a job at its time limit, and under
    ``jzero launch`` each child gets it again from the launcher, so a second SIGTERM is normal
    and must not cost the final checkpoint (the launcher's grace period and SIGKILL are the
    hard stop). A second Ctrl-C means "quit now": it raises ``KeyboardInterrupt``, in the loop
    (the step in flight is abandoned, the final checkpoint is still written) and in the save
    (which is then abandoned; Orbax never commits a half-written step, so the checkpoints
    already on disk stay)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            return
        if signum == signal.SIGINT:  # a second Ctrl-C: quit now
            raise KeyboardInterrupt
        logger.warning(
            "jzero: %s received again; the run still stops after the current step and writes "
            "its final checkpoint (SIGKILL, or a second Ctrl-C, ends it at once)",
            signal.Signals(signum).name,
        )

    @property
    def requested(self) -> bool:
        return self.received is not None

    def name(self) -> str:
        """The signal's name; ``SIGINT`` for a KeyboardInterrupt the handler did not see."""
        return signal.Signals(self.received or signal.SIGINT).name

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


@contextlib.contextmanager
def watching() -> Iterator[StopOnSignal]:
    """The stop watcher installed now, or a new one installed for the ``with`` block."""
    if _ACTIVE:
        yield _ACTIVE[-1]
        return
    stop = StopOnSignal()
    _ACTIVE.append(stop)
    try:
        yield stop
    finally:
        _ACTIVE.remove(stop)
        stop.restore()
