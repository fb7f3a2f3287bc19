"""Weights in and out: safetensors and Hugging Face's sharded layout, into and out of shards.

Import direction: imports :mod:`jzero.checkpoint` (to export one) and :mod:`jzero.distributed`;
imported by :mod:`jzero.engine`, the CLI and ``jzero train``. ``export`` always means weights
out; checkpoints are :mod:`jzero.checkpoint`'s.

* :mod:`~jzero.weights.format`: the file format: names, dtype tables, headers, reading back.
* :mod:`~jzero.weights.export`: leaves written to one file or to Hugging Face's shards.
* :mod:`~jzero.weights.sharded`: weights read straight into a plan's shards; an engine's
  sharded arrays written out.
* :mod:`~jzero.weights.from_checkpoint`: a checkpoint's parameters exported, leaf by leaf.
"""

from jzero.weights.export import ExportEntry as ExportEntry
from jzero.weights.export import leaf_entries as leaf_entries
from jzero.weights.export import parse_size as parse_size
from jzero.weights.export import path_parts as path_parts
from jzero.weights.export import shard_groups as shard_groups
from jzero.weights.export import write_leaves as write_leaves
from jzero.weights.export import write_sharded as write_sharded
from jzero.weights.format import INDEX_NAME as INDEX_NAME
from jzero.weights.format import PATHS_KEY as PATHS_KEY
from jzero.weights.format import PathEntry as PathEntry
from jzero.weights.format import load_exported as load_exported
from jzero.weights.format import read_index as read_index
from jzero.weights.format import read_safetensors_header as read_safetensors_header
from jzero.weights.from_checkpoint import export_checkpoint as export_checkpoint
from jzero.weights.from_checkpoint import parameter_leaves as parameter_leaves
from jzero.weights.sharded import MARKER as MARKER
from jzero.weights.sharded import Tensor as Tensor
from jzero.weights.sharded import check_step_weights_dir as check_step_weights_dir
from jzero.weights.sharded import check_weights as check_weights
from jzero.weights.sharded import load_weights as load_weights
from jzero.weights.sharded import open_weights as open_weights
from jzero.weights.sharded import save_step_weights as save_step_weights
from jzero.weights.sharded import save_weights as save_weights

__all__ = [
    "check_step_weights_dir",
    "export_checkpoint",
    "ExportEntry",
    "INDEX_NAME",
    "leaf_entries",
    "load_exported",
    "check_weights",
    "load_weights",
    "MARKER",
    "open_weights",
    "parameter_leaves",
    "parse_size",
    "path_parts",
    "PathEntry",
    "PATHS_KEY",
    "read_index",
    "read_safetensors_header",
    "save_step_weights",
    "save_weights",
    "shard_groups",
    "Tensor",
    "write_leaves",
    "write_sharded",
]
