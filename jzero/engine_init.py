"""Deprecated alias of :mod:`jzero.engine`: ``initialize`` is ``jzero.initialize`` and
``jzero.engine.initialize`` (defined in :mod:`jzero.engine.build`).

Kept so that ``jzero.engine_init.initialize`` as older code and notes cite it still imports.
This alias will be removed in a later release.
"""

from jzero.engine import initialize as initialize

__all__ = ["initialize"]
