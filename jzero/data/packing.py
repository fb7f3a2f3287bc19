"""Packing: documents cut into chunks, chunks packed greedily into rows of ``seq_len + 1``.

Decisions:

* A document (its tokens, then ``eos_id`` if set) is cut into chunks of ``seq_len + 1``
  tokens, the last one shorter. What a chunk holds depends on its document alone, so changing
  one document moves the others' chunks (which row, which offset) but never changes them.
* Chunks are packed greedily in document order: a chunk that does not fit the row's space left
  starts the next row; no chunk spans two rows; the rest of a row is padding (token 0).
* Each row has ``segment_ids`` (1, 2, ... per chunk in the row; 0 on padding) and
  ``positions`` (0, 1, ... within each chunk, restarting at each chunk). A target is a real
  next token where ``segment_ids[1:] == segment_ids[:-1] != 0``.
* Rows are random access (:meth:`PackedRows.get`), built from offsets into the token arrays:
  only the chunk table lives in memory beside them (memory-mapped token files stay on disk).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PackedRows", "pack"]


@dataclass(frozen=True)
class PackedRows:
    """Packed rows ``lo .. hi`` of chunks over ``arrays`` (see :func:`pack`).

    Chunk ``c`` is ``arrays[chunk_array[c]][chunk_start[c] : chunk_start[c] + chunk_len[c]]``;
    row ``r`` holds chunks ``row_first[r] .. row_first[r + 1]``.
    """

    arrays: Sequence[np.ndarray]
    chunk_array: np.ndarray
    chunk_start: np.ndarray
    chunk_len: np.ndarray
    row_first: np.ndarray
    width: int
    lo: int = 0
    hi: int | None = None

    def __len__(self) -> int:
        return (len(self.row_first) - 1 if self.hi is None else self.hi) - self.lo

    def get(self, index: int, epoch: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row ``index`` (of this view) as int32 ``(tokens, segment_ids, positions)``."""
        del epoch  # a packed row is the same every epoch
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        r = self.lo + index
        tokens = np.zeros(self.width, np.int32)
        segments = np.zeros(self.width, np.int32)
        positions = np.zeros(self.width, np.int32)
        offset = 0
        for k, c in enumerate(range(self.row_first[r], self.row_first[r + 1])):
            n, start = int(self.chunk_len[c]), int(self.chunk_start[c])
            tokens[offset : offset + n] = self.arrays[self.chunk_array[c]][start : start + n]
            segments[offset : offset + n] = k + 1
            positions[offset : offset + n] = np.arange(n)
            offset += n
        return tokens, segments, positions

    def view(self, lo: int, hi: int) -> PackedRows:
        """Rows ``lo .. hi`` of this view."""
        base = self.lo
        return PackedRows(
            self.arrays, self.chunk_array, self.chunk_start, self.chunk_len, self.row_first,
            self.width, base + lo, base + hi,
        )  # fmt: skip

    def tokens(self) -> int:
        """Real (non-padding) tokens in this view's rows."""
        first, last = self.row_first[self.lo], self.row_first[self.lo + len(self)]
        return int(self.chunk_len[first:last].sum())

    def fingerprint(self) -> str:
        """A digest of the rows' chunk layout (lengths and places), 16 hex digits."""
        digest = hashlib.sha256()
        first, last = self.row_first[self.lo], self.row_first[self.lo + len(self)]
        for part in (self.chunk_len, self.chunk_start, self.chunk_array):
            digest.update(np.ascontiguousarray(part[first:last]).tobytes())
        digest.update(np.asarray(self.row_first[self.lo : self.lo + len(self) + 1]).tobytes())
        return digest.hexdigest()[:16]


def pack(
    arrays: Sequence[np.ndarray],
    doc_array: np.ndarray,
    doc_start: np.ndarray,
    doc_end: np.ndarray,
    seq_len: int,
) -> PackedRows:
    """Packs documents into rows of ``seq_len + 1`` tokens.

    Args:
        arrays: the token arrays the documents lie in.
        doc_array: for each document, the index of its array.
        doc_start: where each document starts in its array.
        doc_end: where each ends (exclusive); empty documents are dropped.
        seq_len: tokens per input; rows hold ``seq_len + 1``.

    Returns:
        The packed rows.
    """
    width = seq_len + 1
    doc_array, doc_start = np.asarray(doc_array), np.asarray(doc_start, np.int64)
    lengths = np.asarray(doc_end, np.int64) - doc_start
    chunks = -(-lengths // width)  # ceil; 0 for an empty document
    doc_of = np.repeat(np.arange(len(lengths)), chunks)
    first_chunk = np.cumsum(chunks) - chunks
    k = np.arange(len(doc_of)) - first_chunk[doc_of]  # chunk number within its document
    chunk_start = doc_start[doc_of] + k * width
    chunk_len = np.minimum(width, lengths[doc_of] - k * width).astype(np.int32)
    row_first, fill = [], width
    for c, n in enumerate(chunk_len.tolist()):
        if fill + n > width:
            row_first.append(c)
            fill = 0
        fill += n
    row_first.append(len(chunk_len))
    return PackedRows(
        list(arrays), doc_array[doc_of].astype(np.int32), chunk_start, chunk_len,
        np.asarray(row_first, np.int64), width,
    )  # fmt: skip
