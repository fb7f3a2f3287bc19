"""The preemption test, many times in a row, under load: does a SIGTERM ever lose the final
checkpoint?

Runs ``tests/distributed/test_launch_train.py`` (SIGTERM to ``jzero launch`` running ``jzero
train`` in 2 processes; both must stop after the same step, write their shards of the final
checkpoint and ``summary.json``, and the launcher must exit 143) ``--runs`` times. With
``--load`` the stages benchmark runs beside it the whole time (XLA compiles and 8-device steps
on every core), the condition under which CI once lost the final checkpoint. Each run's output
is kept under ``--keep`` (the test keeps every child's lines in ``launch.err`` there). Prints
one row a run and the count; exits 1 if any run failed.

    python benchmarks/launch_soak.py --runs 20 --load
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOAD = [
    sys.executable,
    str(ROOT / "benchmarks" / "stages.py"),
    "--no-bf16",
    "--layers", "4",
    "--d-model", "128",
    "--steps", "20",
    "--repeats", "3",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="consecutive runs of the test")
    ap.add_argument("--load", action="store_true", help="run the stages benchmark beside it")
    ap.add_argument("--keep", type=Path, help="where each run's files stay (default: a temp dir)")
    args = ap.parse_args(argv)
    keep = args.keep or Path(tempfile.mkdtemp(prefix="jzero-soak-"))
    keep.mkdir(parents=True, exist_ok=True)
    load = None
    failed = 0
    print(f"{'run':>4}  {'result':<7}  {'seconds':>7}  files")
    try:
        for i in range(args.runs):
            if args.load and (load is None or load.poll() is not None):
                load = subprocess.Popen(LOAD, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            run_dir = keep / f"run{i}"
            shutil.rmtree(run_dir, ignore_errors=True)
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            cmd += ["--basetemp", str(run_dir), "tests/distributed/test_launch_train.py"]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
            (run_dir / "pytest.log").parent.mkdir(parents=True, exist_ok=True)
            (run_dir / "pytest.log").write_text(proc.stdout + proc.stderr)
            ok = proc.returncode == 0
            failed += not ok
            result = "passed" if ok else "FAILED"
            print(f"{i:>4}  {result:<7}  {time.perf_counter() - t0:>7.1f}  {run_dir}", flush=True)
    finally:
        if load is not None and load.poll() is None:
            load.kill()
            load.wait()
    print(f"{args.runs - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
