"""Training data for ``jzero train``: sources, tokenizers, packing, a resumable Grain iterator.

Only this package imports Grain (in ``iterator``), ``tokenizers`` and ``sentencepiece`` (in
``tokenizer``), pyarrow and array_record (in ``sources``, lazily). The modules, each importing
only those listed before it: ``errors``, ``sources``, ``tokenizer``, ``packing``, ``order``,
``iterator``, ``mixture``, ``build`` (:func:`from_config`).

The ``data`` section's keys (:data:`SECTION_KEYS`):

* ``source``: ``stdlib`` (default), ``text``, ``jsonl``, ``parquet``, ``arrayrecord``, ``tokens``;
  ``path`` (a file, directory or glob) or ``paths`` (a list of them).
* ``field`` (jsonl, parquet, arrayrecord JSON records; default ``text``), ``separator`` (text:
  split each file on it; default one document per file), ``dtype`` (``.bin`` tokens; default
  ``uint16``), ``max_bytes`` (cap on bytes, or tokens for ``tokens``, read per source).
* ``tokenizer``: ``bytes`` (default), a ``tokenizer.json`` or a SentencePiece ``.model`` path;
  ``eos_id``: appended after each text document, and where ``tokens`` documents end.
* ``mixture``: a list of sources (the keys above) each with a ``weight``.
* ``eval``: an eval source of its own; else ``eval_fraction`` (0.05) of each source's rows are
  held out. ``eval_batches`` (4) fixed eval batches of ``eval_batch_size`` (32) rows each,
  whatever the training batch and the device count, so every layout evaluates the same rows.
* ``skip_bad_records`` (false), ``num_threads`` (2), ``prefetch`` (4 batches).

A batch is ``{"tokens", "segment_ids", "positions"}``, int32 ``[B / P, seq_len + 1]``.
"""

from jzero.data.build import EVAL_BATCH as EVAL_BATCH
from jzero.data.build import SECTION_KEYS as SECTION_KEYS
from jzero.data.build import SOURCE_KEYS as SOURCE_KEYS
from jzero.data.build import Loaders as Loaders
from jzero.data.build import SourceStats as SourceStats
from jzero.data.build import from_config as from_config
from jzero.data.errors import DataError as DataError
from jzero.data.iterator import DataIterator as DataIterator
from jzero.data.order import BatchSpec as BatchSpec
from jzero.data.order import sample_ids as sample_ids
from jzero.data.packing import PackedRows as PackedRows
from jzero.data.packing import pack as pack
from jzero.data.sources import SOURCES as SOURCES
from jzero.data.sources import SourceSpec as SourceSpec
from jzero.data.sources import read_source as read_source
from jzero.data.sources import stdlib_files as stdlib_files
from jzero.data.tokenizer import Tokenizer as Tokenizer
from jzero.data.tokenizer import load_tokenizer as load_tokenizer

__all__ = [
    "EVAL_BATCH",
    "SECTION_KEYS",
    "SOURCES",
    "SOURCE_KEYS",
    "BatchSpec",
    "DataError",
    "DataIterator",
    "Loaders",
    "PackedRows",
    "SourceSpec",
    "SourceStats",
    "Tokenizer",
    "from_config",
    "load_tokenizer",
    "pack",
    "read_source",
    "sample_ids",
    "stdlib_files",
]
