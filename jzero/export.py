"""Deprecated alias of :mod:`jzero.weights`: exported weights are written and read there.

Kept so that ``jzero.export.<name>`` as older code and notes cite it still imports; new code
imports from :mod:`jzero.weights`. Importing it warns (``DeprecationWarning``) with the new
import; it will be removed in a later release.
"""

import warnings

from jzero.weights import INDEX_NAME as INDEX_NAME
from jzero.weights import ExportEntry as ExportEntry
from jzero.weights import leaf_entries as leaf_entries
from jzero.weights import load_exported as load_exported
from jzero.weights import parse_size as parse_size
from jzero.weights import path_parts as path_parts
from jzero.weights import read_index as read_index
from jzero.weights import read_safetensors_header as read_safetensors_header
from jzero.weights import shard_groups as shard_groups
from jzero.weights import write_leaves as write_leaves
from jzero.weights import write_sharded as write_sharded

__all__ = [
    "INDEX_NAME",
    "ExportEntry",
    "leaf_entries",
    "load_exported",
    "parse_size",
    "path_parts",
    "read_index",
    "read_safetensors_header",
    "shard_groups",
    "write_leaves",
    "write_sharded",
]

warnings.warn(
    "jzero.export is deprecated and will be removed in a later release: import from jzero.weights.",
    DeprecationWarning,
    stacklevel=2,
)
