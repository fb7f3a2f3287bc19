"""Byte-level text data that ships with every Python, and a resumable batch iterator.

Decisions:

* The default corpus is the Python standard library's own ``.py`` sources (tests and
  ``site-packages`` skipped), read in sorted path order, so every machine with the same Python
  version builds the same bytes without a download. Bytes are tokens: vocabulary 256.
* Token files: ``.npy`` holds a 1-D array of non-negative integers (its dtype is kept);
  ``.bin`` is raw little-endian **uint16** (the usual dump format for tokenizer ids). A plain
  text file is read as bytes (uint8).
* Batches are random windows of ``seq_len + 1`` tokens. The window starts of step ``s`` come
  from ``numpy.random.default_rng([seed, s])``, so a batch depends only on ``(seed, step)``:
  resuming needs only the step counter, and the global batch does not depend on how many
  processes share it. Process ``p`` of ``P`` takes rows ``p*B/P : (p+1)*B/P`` of the global
  batch, so the processes together yield exactly the one-process batch, and a checkpoint
  taken with one process count resumes with the same data under another.
* NumPy only: batches are host arrays; placing them on devices is the engine's job.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np

from jzero.data.sources import DEFAULT_MAX_BYTES, stdlib_files

__all__ = [
    "BatchIterator",
    "eval_batches",
    "load_tokens",
    "split_train_eval",
    "stdlib_corpus_bytes",
]

_SOURCES = ("stdlib", "text", "tokens")
_TOKEN_SUFFIXES = (".npy", ".bin")


@functools.lru_cache(maxsize=4)
def stdlib_corpus_bytes(max_bytes: int | None = None) -> bytes:
    """The Python standard library's ``.py`` sources, concatenated, as one byte string.

    Files are read in sorted order of their path relative to the stdlib root, skipping test
    directories and ``site-packages``, and joined with a newline. The result is deterministic
    for a given Python version.

    Args:
        max_bytes: cap on the returned length; ``None`` means 8 MiB.

    Returns:
        The corpus bytes.
    """
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}.")
    chunks, total = [], 0
    for path in stdlib_files():
        chunks.append(path.read_bytes() + b"\n")
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def load_tokens(
    source: Literal["stdlib", "text", "tokens"] = "stdlib",
    path: str | os.PathLike | None = None,
    max_bytes: int | None = None,
) -> np.ndarray:
    """Loads a 1-D token array.

    Args:
        source: ``"stdlib"`` for the standard-library corpus (``path`` unused), ``"text"`` for
            the bytes of the file at ``path``, ``"tokens"`` for a token file at ``path``:
            ``.npy`` (1-D non-negative integers, dtype kept) or ``.bin`` (raw little-endian
            uint16).
        path: the file for ``"text"`` and ``"tokens"``.
        max_bytes: keep at most this many tokens (bytes for byte sources); ``None`` keeps the
            whole file, or 8 MiB of the stdlib corpus.

    Returns:
        The tokens: uint8 for ``"stdlib"`` and ``"text"``.

    Raises:
        ValueError: for an unknown source, a missing ``path``, or a malformed token file.
        FileNotFoundError: if ``path`` does not exist.
    """
    if source not in _SOURCES:
        raise ValueError(f"Unknown data source {source!r}. It must be one of {_SOURCES}.")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}.")
    if source == "stdlib":
        data = stdlib_corpus_bytes(max_bytes)
        return np.frombuffer(data, np.uint8).copy()
    if path is None:
        raise ValueError(f"Data source {source!r} reads a file: pass path=..., the file to read.")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Data file {str(path)!r} does not exist. Fix the path, or use source='stdlib' for "
            "the built-in standard-library corpus, which needs no file."
        )
    if source == "text":
        with path.open("rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes)
        return np.frombuffer(data, np.uint8).copy()
    if path.suffix == ".bin":
        tokens = np.memmap(path, dtype="<u2", mode="r")
    elif path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"Token file {str(path)!r} holds a {tokens.ndim}-D {tokens.dtype} array; a "
                "1-D array of integer token ids is needed. Save one with np.save."
            )
    else:
        raise ValueError(
            f"Token file {str(path)!r} has suffix {path.suffix!r}; it must be one of "
            f"{_TOKEN_SUFFIXES}. Use source='text' to read a text file as bytes."
        )
    tokens = np.array(tokens[:max_bytes])
    if tokens.size and tokens.min() < 0:
        raise ValueError(f"Token file {str(path)!r} holds negative token ids.")
    return tokens


def split_train_eval(
    tokens: np.ndarray, eval_fraction: float = 0.05
) -> tuple[np.ndarray, np.ndarray]:
    """Splits tokens into a training head and a held-out evaluation tail.

    Args:
        tokens: 1-D token array.
        eval_fraction: share of tokens for evaluation, in (0, 1); at least one token.

    Returns:
        ``(train, eval)`` views of ``tokens``.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must lie strictly between 0 and 1, got {eval_fraction}.")
    if len(tokens) < 2:
        raise ValueError(f"Cannot split {len(tokens)} token(s); at least 2 are needed.")
    num_eval = min(max(1, round(len(tokens) * eval_fraction)), len(tokens) - 1)
    cut = len(tokens) - num_eval
    return tokens[:cut], tokens[cut:]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    idx = starts[:, None] + np.arange(seq_len + 1)
    return {"tokens": np.asarray(tokens[idx], dtype=np.int32)}


def _check_geometry(
    tokens: np.ndarray, batch_size: int, seq_len: int, process_index: int, process_count: int
) -> None:
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}.")
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index={process_index} is not in [0, process_count={process_count})."
        )
    if batch_size % process_count:
        raise ValueError(
            f"The global batch_size={batch_size} is not divisible by process_count="
            f"{process_count}. Choose a batch size that is a multiple of the process count."
        )
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"A window needs seq_len + 1 = {seq_len + 1} tokens but only {len(tokens)} are "
            "available. Use more data or a shorter seq_len."
        )


class BatchIterator:
    """Deterministic, resumable random windows, sliced by process.

    Args:
        tokens: 1-D token array.
        batch_size: the global batch size, over all processes.
        seq_len: tokens per input; each row holds ``seq_len + 1`` tokens (inputs and targets).
        seed: data seed.
        process_index: this process's index.
        process_count: number of processes sharing each global batch.

    Example:
        >>> it = BatchIterator(np.arange(100, dtype=np.uint8), 4, 8, seed=0)
        >>> it.next()["tokens"].shape
        (4, 9)
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        _check_geometry(tokens, batch_size, seq_len, process_index, process_count)
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.process_index = process_index
        self.process_count = process_count
        self.step = 0

    @property
    def local_batch_size(self) -> int:
        """Rows this process gets per batch."""
        return self.batch_size // self.process_count

    def next(self) -> dict[str, np.ndarray]:
        """Returns this process's rows of the next global batch: ``{"tokens": int32 [b, T+1]}``."""
        rng = np.random.default_rng([self.seed, self.step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        lo = self.process_index * self.local_batch_size
        self.step += 1
        return _windows(self.tokens, starts[lo : lo + self.local_batch_size], self.seq_len)

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self.next()

    def state(self) -> dict[str, int]:
        """The position to checkpoint: ``{"step": ..., "seed": ...}``."""
        return {"step": self.step, "seed": self.seed}

    def restore(self, state: dict[str, Any]) -> None:
        """Continues from a :meth:`state`, so the next batch is the one that followed it.

        Raises:
            ValueError: if the state was saved with another seed.
        """
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"The data state was saved with seed={int(state['seed'])} but this iterator has "
                f"seed={self.seed}; resuming would give different data. Build the iterator with "
                "the saved seed."
            )
        self.step = int(state["step"])


def eval_batches(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    num_batches: int,
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
    """Fixed evaluation batches: evenly spaced windows over ``tokens``, the same every call.

    Args:
        tokens: 1-D (held-out) token array.
        batch_size: the global batch size.
        seq_len: tokens per input; rows hold ``seq_len + 1`` tokens.
        num_batches: number of batches.
        process_index: this process's index; it gets its slice of every global batch.
        process_count: number of processes.

    Returns:
        ``num_batches`` dicts ``{"tokens": int32 [batch_size / process_count, seq_len + 1]}``.
    """
    _check_geometry(tokens, batch_size, seq_len, process_index, process_count)
    if num_batches < 1:
        raise ValueError(f"num_batches must be positive, got {num_batches}.")
    starts = np.linspace(0, len(tokens) - seq_len - 1, batch_size * num_batches).astype(np.int64)
    starts = starts.reshape(num_batches, process_count, -1)[:, process_index]
    return [_windows(tokens, s, seq_len) for s in starts]
