"""Child of tests/distributed/test_launch_signals.py for ``jzero launch``'s signals (no JAX: starts
fast).

``python launch_child.py DIR``: writes its pid to ``DIR/pid<id>`` (``<id>`` is
``JZERO_PROCESS_ID``), appends the name of every SIGTERM / SIGINT / SIGHUP it receives to
``DIR/signals<id>``, waits ``LAUNCH_CHILD_DELAY`` seconds (default 0: a checkpoint being saved),
writes ``DIR/done<id>``, prints ``saved <id>`` and exits 128 + the signal number, as
``jzero train`` does. Without a signal it exits 3 after 60 s, so it never outlives a test long.
"""

import os
import signal
import sys
import time

directory = sys.argv[1]
index = os.environ["JZERO_PROCESS_ID"]
delay = float(os.environ.get("LAUNCH_CHILD_DELAY", "0"))


def path(name: str) -> str:
    return os.path.join(directory, f"{name}{index}")


def on_signal(signum: int, frame: object) -> None:
    with open(path("signals"), "a") as f:
        f.write(signal.Signals(signum).name + "\n")
    time.sleep(delay)
    open(path("done"), "w").close()
    print(f"saved {index}", flush=True)
    os._exit(128 + signum)


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, on_signal)
with open(path("pid") + ".tmp", "w") as f:  # written whole, then renamed: read whole
    f.write(str(os.getpid()))
os.replace(path("pid") + ".tmp", path("pid"))
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(3)
