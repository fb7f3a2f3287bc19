"""Deprecated alias of :mod:`jzero.demo.train`: the ``jzero train`` loop moved into the demo
package, beside its model and its data.

Kept so that ``jzero.train.run`` as older code and notes cite it still imports; new code imports
from :mod:`jzero.demo.train` (or :mod:`jzero.demo`). Importing it warns
(``DeprecationWarning``) with the new import; it will be removed in a later release.
"""

import warnings

from jzero.demo.train import METRICS as METRICS
from jzero.demo.train import SUMMARY as SUMMARY
from jzero.demo.train import ending as ending
from jzero.demo.train import exit_code as exit_code
from jzero.demo.train import format_summary as format_summary
from jzero.demo.train import run as run
from jzero.demo.train import strict_json as strict_json

__all__ = ["ending", "exit_code", "format_summary", "run", "strict_json"]

warnings.warn(
    "jzero.train is deprecated and will be removed in a later release: "
    "import from jzero.demo.train (or jzero.demo).",
    DeprecationWarning,
    stacklevel=2,
)
