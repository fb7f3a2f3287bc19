"""Child of tests/distributed/test_distributed.py for ``jzero launch`` itself (no JAX).

Prints ``out <id> pid <pid>`` to stdout and ``err <id>`` to stderr, then two lines as Gloo
prints them (from C++, on stdout) when it connects a communicator: one as expected (the
launcher drops it) and one with a peer missing (kept). Process 0 starts a
grandchild (``sleep``), prints ``grandchild <pid>``, ignores SIGTERM, creates the file
``$ECHO_DIR/ready`` and waits; the others wait for that file, then exit with code ``ECHO_EXIT``
(default 5), or wait too when it is ``wait``.
"""

import os
import signal
import subprocess
import sys
import time

index = int(os.environ["JZERO_PROCESS_ID"])
print(f"out {index} pid {os.getpid()} of {os.environ['JZERO_NUM_PROCESSES']}", flush=True)
print(f"err {index}", file=sys.stderr, flush=True)
for connected in (1, 0):
    print(
        f"[Gloo] Rank {index} is connected to {connected} peer ranks. Expected number of "
        "connected peer ranks is : 1",
        flush=True,
    )
code = os.environ.get("ECHO_EXIT", "5")
if index == 0:
    child = subprocess.Popen(["sleep", "600"])
    print(f"grandchild {child.pid}", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
    open(os.path.join(os.environ["ECHO_DIR"], "ready"), "w").close()
else:
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(os.environ["ECHO_DIR"], "ready")):
        if time.monotonic() > deadline:
            sys.exit("process 0 never got ready")
        time.sleep(0.05)
    if code != "wait":
        sys.exit(int(code))
print(f"ready {index}", flush=True)
time.sleep(600)
