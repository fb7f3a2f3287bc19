"""``python -m jzero.cli ARGS``: the ``jzero`` command with this interpreter."""

import sys

from jzero.cli import main

sys.exit(main())
