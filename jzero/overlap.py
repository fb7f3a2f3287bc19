"""Deprecated alias: ``overlap_comm``'s buckets and compiler options now live in :mod:`jzero.comm`,
the scan that gathers one layer ahead in :mod:`jzero.replay`.

Kept so that ``jzero.overlap.<name>`` as older code and notes cite it still imports; new code
imports from :mod:`jzero.comm` or :mod:`jzero.replay`. Importing it warns
(``DeprecationWarning``) with the new import; it will be removed in a later release.
"""

import warnings

from jzero.comm import GPU_ASYNC_OPTIONS as GPU_ASYNC_OPTIONS
from jzero.comm import bucket_groups as bucket_groups
from jzero.comm import compiler_options as compiler_options
from jzero.comm import from_rows as from_rows
from jzero.comm import gather_buckets as gather_buckets
from jzero.comm import reduce_buckets as reduce_buckets
from jzero.comm import to_rows as to_rows
from jzero.replay import can_overlap as can_overlap
from jzero.replay import overlapped_scan as overlapped_scan

__all__ = [
    "GPU_ASYNC_OPTIONS",
    "bucket_groups",
    "can_overlap",
    "compiler_options",
    "from_rows",
    "gather_buckets",
    "overlapped_scan",
    "reduce_buckets",
    "to_rows",
]

warnings.warn(
    "jzero.overlap is deprecated and will be removed in a later release: "
    "import from jzero.comm (buckets, compiler options) or jzero.replay "
    "(can_overlap, overlapped_scan).",
    DeprecationWarning,
    stacklevel=2,
)
