"""``python -m jzero.cli ARGS``: the ``jzero`` command with this interpreter."""

from jzero.cli import entry

entry()
