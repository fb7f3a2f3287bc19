"""Deprecated alias of :mod:`jzero.demo.data`: the byte-level data moved into the demo package,
beside the model and the loop that use it.

Kept so that ``jzero.data.<name>`` as older code and notes cite it still imports; new code
imports from :mod:`jzero.demo.data`. Importing it warns (``DeprecationWarning``) with the new
import; it will be removed in a later release.
"""

import warnings

from jzero.demo.data import DEFAULT_MAX_BYTES as DEFAULT_MAX_BYTES
from jzero.demo.data import BatchIterator as BatchIterator
from jzero.demo.data import eval_batches as eval_batches
from jzero.demo.data import load_tokens as load_tokens
from jzero.demo.data import split_train_eval as split_train_eval
from jzero.demo.data import stdlib_corpus_bytes as stdlib_corpus_bytes

__all__ = [
    "BatchIterator",
    "eval_batches",
    "load_tokens",
    "split_train_eval",
    "stdlib_corpus_bytes",
]

warnings.warn(
    "jzero.data is deprecated and will be removed in a later release: import from jzero.demo.data.",
    DeprecationWarning,
    stacklevel=2,
)
