"""What the ``jzero`` command prints on stderr: jzero's log, and only the warnings of the rest.

Decisions:

* **jzero's INFO, everyone's WARNING.** JAX, Orbax (through absl), matplotlib and the
  distributed runtime log their progress at INFO (``Unable to initialize backend 'tpu'``,
  ``Resetting cache at ...``, Orbax's options and metadata-store reports, its read and write
  throughput, ``generated new fontManager``). By default the command's one handler, on the root
  logger, passes the ``jzero`` loggers' records from INFO up and every other logger's from
  WARNING up; the root logger is at WARNING, so the other libraries' INFO records are not
  even made. The decision is the handler's filter, not the libraries' logger levels, so a
  library that sets its own logger's level (absl does, from its ``--verbosity`` flag or
  ``set_verbosity``) changes nothing.
* **``--verbose`` shows the rest:** the filter goes, the root logger is at INFO (every
  library's INFO) and the ``jzero`` logger at DEBUG (jzero's debug log); the traceback behind
  an error is printed too (:mod:`jzero.cli`). The other libraries' DEBUG stays out: JAX alone
  writes some 80 lines at DEBUG to start and compile one small function, a debugger's view,
  not a user's (``JAX_LOGGING_LEVEL=DEBUG`` gives it).
* **A caller's logging wins.** When the process has set up logging before ``jzero.cli.main``
  runs (a root handler exists: a test runner, a notebook), no handler is added and the root
  logger's level is left alone: only ``--verbose``'s DEBUG for ``jzero`` and, without it,
  absl's level at WARNING (Orbax's progress reports) apply.
"""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["JzeroOrWarning", "add_verbose_flag", "configure_logging"]

OWN = "jzero"


class JzeroOrWarning(logging.Filter):
    """Passes the ``jzero`` loggers' records and every other logger's warnings and errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        own = name == OWN or name.startswith(OWN + ".")
        return own or record.levelno >= logging.WARNING


def configure_logging(verbose: bool) -> logging.Handler | None:
    """Sets up the command's log on stderr, as the module's decisions say.

    Args:
      verbose: show every library's INFO and jzero's DEBUG (``--verbose``).

    Returns:
      The handler added to the root logger, or ``None`` when the caller's logging was kept.
    """
    own = logging.getLogger(OWN)
    # Orbax reports its progress through absl: kept from a caller's handlers too. absl is
    # imported first, so that its logger is absl's own (which names the caller, Orbax, as the
    # record's source: jzero.checkpoint.orbax_io's filters read it), not a plain one made here.
    import absl.logging  # noqa: F401

    logging.getLogger("absl").setLevel(logging.NOTSET if verbose else logging.WARNING)
    root = logging.getLogger()
    if root.handlers:  # the caller set up logging: keep it
        if verbose:
            own.setLevel(logging.DEBUG)
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    if not verbose:
        handler.addFilter(JzeroOrWarning())
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    own.setLevel(logging.DEBUG if verbose else logging.INFO)
    return handler


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    """Adds ``--verbose`` (``args.verbose``) to a subcommand's parser."""
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show jzero's debug log, the other libraries' INFO log (JAX, Orbax, ...) "
        "and the traceback behind an error",
    )
