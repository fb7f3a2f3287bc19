"""The training loop for any model: :func:`fit` in a script, :func:`run` as ``jzero train``.

* :mod:`~jzero.train.loop`: :func:`fit`, the loop (steps, evaluation, logs, monitors,
  checkpoints with the data position, a clean stop on SIGTERM, resume).
* :mod:`~jzero.train.command`: :func:`run`, ``jzero train CONFIG``: the model (the built-in GPT
  or an entry point), the data and the engine from a config, then :func:`fit`.
* :mod:`~jzero.train.verify`: :func:`verify`, ``jzero verify``: the config's layout against plain
  data parallelism, step by step in float64.
* :mod:`~jzero.train.entry`: a user's model named by ``package.module:function`` or
  ``file.py:function``.
* :mod:`~jzero.train.summary`, :mod:`~jzero.train.run_dirs`, :mod:`~jzero.train.signals`: the
  run's record and exit status, its folders' checks, and its stop signals.

Import direction: imports the engine, :mod:`jzero.data`, :mod:`jzero.monitor`, the config and
the distributed runtime; the built-in GPT (:mod:`jzero.demo`) only when a config trains it;
only :mod:`jzero.cli` and jzero's root import it.
"""

from jzero.train.command import elastic_split as elastic_split
from jzero.train.command import run as run
from jzero.train.entry import EntryPointError as EntryPointError
from jzero.train.entry import load_entry as load_entry
from jzero.train.loop import fit as fit
from jzero.train.summary import ending as ending
from jzero.train.summary import exit_code as exit_code
from jzero.train.summary import format_summary as format_summary
from jzero.train.summary import strict_json as strict_json
from jzero.train.verify import Verdict as Verdict
from jzero.train.verify import verify as verify

__all__ = [
    "EntryPointError",
    "elastic_split",
    "ending",
    "exit_code",
    "fit",
    "format_summary",
    "load_entry",
    "run",
    "strict_json",
    "Verdict",
    "verify",
]
