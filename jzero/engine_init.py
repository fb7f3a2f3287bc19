"""Deprecated alias of :mod:`jzero.engine`: ``initialize`` is ``jzero.initialize`` and
``jzero.engine.initialize`` (defined in :mod:`jzero.engine.build`).

Kept so that ``jzero.engine_init.initialize`` as older code and notes cite it still imports.
Importing it warns (``DeprecationWarning``) with the new import; it will be removed in a later
release.
"""

import warnings

from jzero.engine import initialize as initialize

__all__ = ["initialize"]

warnings.warn(
    "jzero.engine_init is deprecated and will be removed in a later release: "
    "import initialize from jzero (jzero.initialize) or jzero.engine.",
    DeprecationWarning,
    stacklevel=2,
)
