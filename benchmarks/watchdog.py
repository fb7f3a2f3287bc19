"""What the watchdog and the processes' agreement cost a run of several processes.

Run: ``python benchmarks/watchdog.py`` (the demo model of ``configs/zero2.yaml``, 12 steps as 2
processes x 4 virtual CPU devices under ``jzero launch``), or ``--smoke`` (a 1-layer GPT, 2
steps, the least with a step after the compiling one: it checks that the script runs). Prints
one table, process 0's figures:

* **watchdog a step**: the seconds a step spends publishing its phases and reading the others'
  times (:class:`jzero.distributed.Watchdog`'s ``phase`` and ``compare``, wrapped and timed),
  against the step's median time (the steps after the first, which compiles).
* **agreement**: the seconds of the two agreements before the first step (the run's
  fingerprint, and the lowered step's hash), once per run.

Decisions:

* The child wraps the methods it times and calls :func:`jzero.train.run`, what ``jzero train``
  runs; the figures are its own clock's, in the run that trains.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FULL = {"steps": 12, "model": None}
SMOKE = {
    "steps": 2,
    "model": "{vocab_size: 256, seq_len: 16, num_layers: 1, num_heads: 2, d_model: 32, d_ff: 64}",
}


def child(out: str, steps: int, model: str | None) -> None:
    """One process of the launch: trains, timing the watchdog and the agreement."""
    import jax

    from jzero import distributed, train

    spent = {"watchdog": 0.0, "agreement": 0.0}

    def timed(fn, what):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[what] += time.perf_counter() - t

        return wrapper

    distributed.Watchdog.phase = timed(distributed.Watchdog.phase, "watchdog")
    distributed.Watchdog.compare = timed(distributed.Watchdog.compare, "watchdog")
    distributed.agree = timed(distributed.agree, "agreement")
    folder = Path(out).parent
    overrides = [
        *([f"model={model}"] if model else []),
        "data={source: stdlib, max_bytes: 200000}",
        "train.eval_interval=0",
        "checkpoint.directory=null",
        f"train.log_dir={folder / 'run'}",
        f"train.compile_cache={folder / 'cache'}",
    ]
    train.run("configs/zero2.yaml", overrides=overrides, steps=steps, progress=False)
    if jax.process_index() == 0:
        lines = (folder / "run" / "metrics.jsonl").read_text().splitlines()
        times = [json.loads(line)["time"] for line in lines]
        step_s = statistics.median(b - a for a, b in zip(times, times[1:], strict=False))
        Path(out).write_text(
            json.dumps(
                {
                    "steps": len(times),
                    "step_s": step_s,
                    "watchdog_s": spent["watchdog"],
                    "agreement_s": spent["agreement"],
                }
            )  # fmt: skip
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a 1-layer GPT, 2 steps")
    ap.add_argument("--child", nargs=3, metavar=("OUT", "STEPS", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        out, steps, model = args.child
        child(out, int(steps), None if model == "-" else model)
        return
    size = SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [sys.executable, "-m", "jzero.distributed.launch", "-n", "2",
               "--devices-per-process", "4", "--", sys.executable, __file__, "--child",
               str(out), str(size["steps"]), size["model"] or "-"]  # fmt: skip
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode:
            sys.exit(f"the launch failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        f = json.loads(out.read_text())
    per_step = f["watchdog_s"] / f["steps"]
    print(f"jzero train, configs/zero2.yaml's model, {f['steps']} steps, 2 processes x 4 devices")
    print(f"{'':28}{'seconds':>10}  {'share of a step':>16}")
    print(f"{'median step':28}{f['step_s']:>10.4f}")
    print(f"{'watchdog a step':28}{per_step:>10.5f}  {100 * per_step / f['step_s']:>15.2f}%")
    print(f"{'agreement, once':28}{f['agreement_s']:>10.4f}")


if __name__ == "__main__":
    main()
