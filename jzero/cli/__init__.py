"""The ``jzero`` command: ``train``, ``estimate``, ``plan``, ``checkpoint``, ``launch``.

Decisions:

* Each subcommand lives beside what it drives: ``train`` here (the loop is
  :func:`jzero.train.run`), ``estimate`` and ``plan`` in :mod:`jzero.cli.memory`,
  ``checkpoint inspect | export`` in :mod:`jzero.cli.checkpoint`, ``launch`` in
  :mod:`jzero.distributed.launch`; each is ``func(args) -> int``, the exit status.
* With no accelerator, ``train`` and ``plan`` ask JAX for 8 virtual CPU devices before anything
  touches a backend, so every stage shards for real on a laptop (``--cpu-devices`` changes the
  count; :mod:`jzero.cli.devices`).
* A user's mistake (a bad config, a missing file) exits with status 2 and one message, never a
  traceback; a checkpoint that could not be written exits with 1. ``train`` exits 130 or 143
  after Ctrl-C or SIGTERM (it stops after the current step, saves and prints the summary), and
  1 when inf/NaN gradients stopped it or its checkpoints failed (its final save, or
  ``checkpoint.max_consecutive_failures`` saves in a row).
* The log on stderr is jzero's, a line per event, and the other libraries' warnings and
  errors; their INFO (JAX's backend and cache reports, Orbax's progress, matplotlib's font
  cache) is left out, and Orbax's reports of a failed write go to jzero's debug log (jzero
  reports the failure in one line). ``--verbose`` shows jzero's debug log, every library's
  INFO and the traceback behind an error (:mod:`jzero.cli.logs`).
* ``train``'s progress goes to a tqdm bar on stderr when stderr is a terminal, with the log
  lines written above it; piped into a file there is no bar (no carriage returns), and the
  ``steps_per_print`` log lines are the progress. Every step is a JSON line in
  ``<train.log_dir>/metrics.jsonl``. At the end a few lines on stdout
  (:func:`jzero.train.format_summary`): ``done:``, ``interrupted:``, ``stopped:`` or
  ``failed:`` (its checkpoints) with the steps and time, then the losses, tokens/s, peak
  memory and where the logs and the checkpoint are; the full summary is ``summary.json``.
* The modules behind the commands (the training loop, the model, the planner) are imported
  when a command runs, after the device count is set; nothing imported before touches a JAX
  backend, or imports JAX at all: ``jzero --help``, ``jzero estimate`` and ``jzero launch``'s
  own process load no JAX, Flax, Optax or Orbax (``import jzero`` loads its names on first
  use; tests/cli/test_imports.py checks it).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import traceback
from collections.abc import Sequence

from jzero.cli import checkpoint, devices, logs, memory

__all__ = ["build_parser", "main"]


class _LateSigterm:
    """SIGTERM outside :func:`jzero.train.run`'s own handling: before the run takes over it
    ends the process at once (exit 143, as the default would); once the run has returned (its
    final checkpoint committed, ``summary.json`` written) it is logged and ignored, so a
    second SIGTERM a moment after the first (SLURM's beside the launcher's) cannot turn the
    run's exit status into a kill."""

    def __init__(self) -> None:
        self.run_returned = False

    def __call__(self, signum: int, frame: object) -> None:
        if not self.run_returned:
            raise SystemExit(128 + signum)
        print("jzero: SIGTERM received after the run ended; exiting as planned", file=sys.stderr)


def _train(args: argparse.Namespace) -> int:
    devices.use_cpu_devices(args.cpu_devices)
    from jzero import distributed, train

    late = _LateSigterm()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, late) if main_thread else None
    try:
        cache = []  # --compile-cache / --no-compile-cache, as train.compile_cache
        if args.no_compile_cache:
            cache = ["train.compile_cache=null"]
        elif args.compile_cache is not None:
            cache = [f"train.compile_cache={json.dumps(args.compile_cache)}"]
        summary = train.run(  # its own handlers replace `late` for the run, then restore it
            args.config,
            overrides=[*(args.set or ()), *cache],
            steps=args.steps,
            resume=not args.no_resume,
            overwrite=args.overwrite,
            progress=not args.quiet,
            model=args.model,
        )
        late.run_returned = True
        status = _report(summary, train, distributed)
        if _PROCESS_ENTRY and main_thread:  # the process only shuts down from here (entry)
            # SIG_IGN, not a Python handler: the interpreter's finalization resets those to
            # the default (a kill) and can take a second (XLA's and Orbax's teardown).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            previous = None
        return status
    finally:
        if main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _verify(args: argparse.Namespace) -> int:
    devices.use_cpu_devices(args.cpu_devices)
    from jzero import distributed, train

    verdict = train.verify(
        args.config,
        against=args.against,
        model=args.model,
        steps=args.steps,
        overrides=args.set or (),
    )
    if distributed.is_main_process():
        print(verdict.table())
    return 0 if verdict.passed else 1


def _report(summary: dict, train: object, distributed: object) -> int:
    """Prints the run's summary (process 0) and returns the exit status."""
    if distributed.is_main_process():  # only process 0 prints
        print(train.format_summary(summary))
    return train.exit_code(summary)


def build_parser() -> argparse.ArgumentParser:
    """The ``jzero`` argument parser."""
    ap = argparse.ArgumentParser(prog="jzero", description="DeepSpeed's ZeRO for JAX.")
    sub = ap.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train a model (yours with --model, else the built-in GPT) from a config"
    )
    train.add_argument("config", help="a YAML or JSON config (DeepSpeed keys plus jzero's)")
    train.add_argument(
        "--model",
        metavar="ENTRY",
        help="your model: package.module:function or path/to/file.py:function, called with "
        "the config's model keys and returning jzero.initialize's arguments "
        "({'model': ..., 'loss_fn': ...}); overrides model.entry (default: the built-in GPT)",
    )
    train.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set zero_optimization.stage=3 (repeatable)",
    )
    train.add_argument("--steps", type=int, help="override train.steps")
    devices.add_cpu_devices_flag(train)
    train.add_argument(
        "--quiet", action="store_true", help="no progress bar (there is none unless on a terminal)"
    )
    logs.add_verbose_flag(train)
    train.add_argument(
        "--no-resume",
        action="store_true",
        help="start fresh; refused when checkpoint.directory holds an earlier run's checkpoints "
        "unless --overwrite is given too",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start fresh and replace an earlier run's checkpoints in checkpoint.directory "
        "(deleted once this run's first checkpoint is committed) and its metrics.jsonl and "
        "summary.json in train.log_dir; implies --no-resume",
    )
    cache = train.add_mutually_exclusive_group()
    cache.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="keep compiled programs in DIR, so a restart loads them instead of compiling "
        "(overrides train.compile_cache; default: ~/.cache/jzero/compile_cache, or "
        "$XDG_CACHE_HOME/jzero/compile_cache, or $JAX_COMPILATION_CACHE_DIR when set)",
    )
    cache.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="compile every program at every start (train.compile_cache=null)",
    )
    train.set_defaults(func=_train)
    verify = sub.add_parser(
        "verify",
        help="does my layout change my training? the config's model a few steps at its layout "
        "and at plain data parallelism, in float64, compared step by step (exit 1 if not)",
    )
    verify.add_argument("config", help="a YAML or JSON config (DeepSpeed keys plus jzero's)")
    verify.add_argument("--model", metavar="ENTRY", help="your model's entry point, as for train")
    verify.add_argument(
        "--against", metavar="CONFIG", help="compare with this config instead of plain data "
        "parallelism (stage 0, every device on data)"
    )  # fmt: skip
    verify.add_argument("--steps", type=int, default=5, help="steps each side trains (5)")
    verify.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config value (both sides)"
    )
    devices.add_cpu_devices_flag(verify)
    verify.set_defaults(func=_verify)
    from jzero.distributed import launch

    checkpoint.add_commands(sub)
    memory.add_commands(sub)
    launch.add_commands(sub)
    return ap


def entry() -> None:
    """The ``jzero`` process (the console script and ``python -m jzero.cli``): :func:`main`,
    then exit with its status. Once ``jzero train``'s run has returned, its state is on disk
    (the final checkpoint committed, ``summary.json`` written), so a SIGTERM from then on,
    while the interpreter shuts down (Orbax's and JAX's threads joining: a second of it on a
    slow CPU), is ignored: the process ends with the run's own status rather than as a kill,
    so SLURM's SIGTERM a moment after the launcher's cannot turn a clean stop into exit -15."""
    global _PROCESS_ENTRY
    _PROCESS_ENTRY = True
    sys.exit(main())


# Set by :func:`entry`: this interpreter is the ``jzero`` process and ends when main returns.
_PROCESS_ENTRY = False


def main(argv: Sequence[str] | None = None) -> int:
    """The ``jzero`` command line, as a function: the exit status (the process is
    :func:`entry`)."""
    args = build_parser().parse_args(argv)
    verbose = bool(getattr(args, "verbose", False))
    logs.configure_logging(verbose)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        status = _exit_status(e)
        if status is None:
            raise
        _error(e, verbose)
        return status


def _exit_status(e: BaseException) -> int | None:
    """The exit status of an error that ends a command: 1 for a checkpoint that could not be
    written (the disk, not the config: no usage error), 2 for a user's mistake (a bad value,
    ``ConfigError`` is a ``ValueError``; a missing file), None for anything else (raised on).
    The checkpoint package is looked up where a command loaded it: a command that never
    imported it (``estimate``, ``--help``) raised none of its errors, and need not load JAX
    and Orbax to say so."""
    dirs = sys.modules.get("jzero.checkpoint.dirs")
    if dirs is not None and isinstance(e, dirs.CheckpointWriteError):
        return 1
    return 2 if isinstance(e, (ValueError, FileNotFoundError)) else None


def _error(e: BaseException, verbose: bool) -> None:
    """One line for an error that ends a command; its traceback first with ``--verbose``."""
    if verbose:
        traceback.print_exception(e, file=sys.stderr)
    print(f"jzero: error: {e}", file=sys.stderr)
