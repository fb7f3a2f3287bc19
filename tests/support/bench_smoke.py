"""Runs several ``benchmarks/`` scripts in this one process (``tests/benchmarks/``'s smoke runs).

Reads a JSON list of ``[name, script, [args...]]`` from the file named first on the command line
and runs each as ``python benchmarks/<script>.py ARGS`` would (``runpy`` as ``__main__``, with
``sys.argv`` set and ``benchmarks/`` first on ``sys.path``), one after the other, so that JAX and
jzero are imported once for all of them. Writes ``<name>.out`` and ``<name>.err`` (file
descriptors 1 and 2 while it ran, so a child process the script starts writes there too) and
``<name>.json`` (``{"rc": exit status, "cpu_s": CPU seconds, its children's included}``) into
the folder named second.

Decisions:

* A script leaves no state for the next: the environment, ``sys.argv``, the working folder, the
  warning filters and every JAX config value (``jax_enable_x64`` among them) are put back after
  each; JAX's in-memory caches are cleared (the persistent compilation cache, the run's, stays).
* A script's failure is its own: ``SystemExit`` is its exit status (a message to its ``.err``),
  any other exception its traceback and status 1; the next script runs.

The tests' side is here too: :func:`smoke_env`, :func:`launch` (the child, run to its end) and
:func:`result` (what one run printed).
"""

import gc
import json
import os
import resource
import runpy
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import collector
import jax
from procs import device_env
from repo import ROOT

BENCHMARKS = ROOT / "benchmarks"


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _exit_status(exit: SystemExit) -> int:
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=sys.stderr)  # sys.exit("message"), as the interpreter prints it
    return 1


def _run_script(script: str, args: list[str]) -> int:
    """``benchmarks/<script>.py ARGS`` in this process; its exit status."""
    sys.argv = [str(BENCHMARKS / f"{script}.py"), *args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit:
        return _exit_status(exit)
    except BaseException:  # noqa: BLE001 - the script's failure is reported, the next one runs
        traceback.print_exc()
        return 1
    return 0


def run(name: str, script: str, args: list[str], out: Path) -> None:
    """Runs one script, its output and status into ``out``, and puts back what it changed."""
    env, argv, cwd = dict(os.environ), list(sys.argv), os.getcwd()
    config = dict(jax.config.values)
    saved = os.dup(1), os.dup(2)
    start = _cpu_seconds()
    with open(out / f"{name}.out", "wb") as stdout, open(out / f"{name}.err", "wb") as stderr:
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        try:
            with warnings.catch_warnings():
                rc = _run_script(script, args)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    cpu_s = _cpu_seconds() - start
    os.environ.clear()
    os.environ.update(env)
    sys.argv = argv
    os.chdir(cwd)
    for key, value in config.items():
        if jax.config.values.get(key) != value:
            jax.config.update(key, value)
    jax.clear_caches()
    gc.collect()
    (out / f"{name}.json").write_text(json.dumps({"rc": rc, "cpu_s": cpu_s}))


def smoke_env(**extra: str) -> dict[str, str]:
    """The child's environment: 8 virtual CPU devices and the run's caches
    (``procs.device_env``), the code generator at the level the scripts' ``--smoke`` sets
    (``gpu_check.SMOKE_XLA_FLAGS``), and ``extra``."""
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_check import SMOKE_XLA_FLAGS

    env = device_env(8, **extra)
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {SMOKE_XLA_FLAGS}"
    return env


def launch(runs: list, out: Path, env: dict[str, str], timeout: float) -> None:
    """Runs ``runs`` (``[name, script, [args...]]`` each) in one child process of this script,
    their output and status into ``out``; the child itself must exit 0."""
    (out / "runs.json").write_text(json.dumps(runs))
    cmd = [sys.executable, str(Path(__file__).resolve()), str(out / "runs.json"), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def result(out: Path, name: str) -> tuple[str, str]:
    """What run ``name`` of :func:`launch` printed, ``(stdout, stderr)``; it must have exited 0."""
    text, err = ((out / f"{name}.{kind}").read_text() for kind in ("out", "err"))
    status = json.loads((out / f"{name}.json").read_text())
    assert status["rc"] == 0, text[-3000:] + err[-3000:]
    return text, err


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    sys.path.insert(0, str(BENCHMARKS))
    collector.space_out()
    collector.freeze_imports()
    for name, script, args in runs:
        run(name, script, args, out)


if __name__ == "__main__":
    main()
