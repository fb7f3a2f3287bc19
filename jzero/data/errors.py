"""The data layer's one error type.

Decisions:

* :class:`DataError` subclasses ``ValueError``: a bad corpus is a bad argument, and callers
  that caught the former ``ValueError`` of :mod:`jzero.demo.data` still catch it.
* Every message names the file (and the line or record where there is one) and the fix.
"""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """A corpus, tokenizer or data setting that cannot be used, named with where and why."""
