"""The data section of a config, built into a training iterator and fixed eval batches.

Decisions:

* Every source is read, tokenized and checked when it is built (each record once), so a bad
  record or an id past the vocabulary is an error before the first step; with
  ``skip_bad_records`` bad records are skipped and counted (``Loaders.train.skipped_records``).
* Eval data is an ``eval`` source of its own, or (default) the last ``eval_fraction`` (0.05) of
  each training source's packed rows, held out of training; ``eval_fraction: 0`` and no
  ``eval`` means no eval batches. A document cut by that boundary has its head in training
  and its tail in eval (rows, not documents, are held out: one long document splits too).
  Eval batches are rows ``0, 1, ...`` of the eval rows (wrapping round), the same every call;
  a process gets its rows of each global batch.
* The ``tokens`` source's ids are checked against the model's ``vocab_size`` (when given);
  tokenized text against ``vocab_size``, or the tokenizer's vocabulary when it is ``None``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jzero.data.errors import DataError
from jzero.data.iterator import DataIterator, Rows
from jzero.data.mixture import ConcatRows, MixedRows, mixture_counts
from jzero.data.order import BatchSpec
from jzero.data.packing import PackedRows, pack
from jzero.data.sources import SourceSpec, TextDocs, read_source
from jzero.data.tokenizer import Tokenizer, check_ids, load_tokenizer

__all__ = ["EVAL_BATCH", "SOURCE_KEYS", "SECTION_KEYS", "Loaders", "SourceStats", "from_config"]

EVAL_BATCH = 32  # rows of an eval batch unless data.eval_batch_size says

SOURCE_KEYS = ("source", "path", "paths", "field", "separator", "dtype", "max_bytes")
SECTION_KEYS = (
    *SOURCE_KEYS,
    "tokenizer",
    "eos_id",
    "mixture",
    "eval",
    "eval_fraction",
    "eval_batches",
    "eval_batch_size",
    "skip_bad_records",
    "num_threads",
    "prefetch",
)


@dataclass(frozen=True)
class SourceStats:
    """What one source held once packed."""

    name: str
    documents: int
    tokens: int
    rows: int
    weight: float = 1.0
    eval_rows: int = 0


@dataclass
class Loaders:
    """The built data: ``train`` (resumable), ``eval`` (this process's fixed batches)."""

    train: DataIterator
    eval: list[dict[str, np.ndarray]]
    sources: list[SourceStats]
    eval_note: str
    tokenizer: str
    vocab_size: int
    seq_len: int

    def describe(self) -> str:
        """One log line: the sources, their sizes, and the train/eval split."""
        parts = [
            f"{s.name}: {s.documents:,} docs, {s.tokens:,} tokens, {s.rows:,} rows"
            + (f", weight {s.weight:g}" if len(self.sources) > 1 else "")
            for s in self.sources
        ]
        return (
            f"data: {'; '.join(parts)} | tokenizer {self.tokenizer} (vocab {self.vocab_size}), "
            f"rows of {self.seq_len + 1} | train {self.train.num_rows:,} rows an epoch | "
            f"eval {self.eval_note}"
        )


def _spec(entry: Mapping[str, Any], where: str, eos_id: int | None) -> SourceSpec:
    if "path" in entry and "paths" in entry:
        raise DataError(f"{where}: set path or paths, not both.")
    paths = entry.get("paths", entry.get("path"))
    paths = () if paths is None else (paths,) if isinstance(paths, str) else tuple(paths)
    return SourceSpec(
        kind=entry.get("source", "stdlib"),
        paths=tuple(str(p) for p in paths),
        field=entry.get("field", "text"),
        separator=entry.get("separator"),
        dtype=entry.get("dtype", "uint16"),
        eos_id=eos_id,
        max_bytes=entry.get("max_bytes"),
    )


def _check_keys(entry: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(entry) - set(allowed))
    if unknown:
        raise DataError(f"{where}: unknown key(s) {unknown}; the keys are {sorted(allowed)}.")


def _text_rows(docs: TextDocs, tok: Tokenizer, eos_id, limit: int, threads: int):
    encoded = tok.encode(docs.texts, threads)
    if eos_id is not None:
        encoded = [np.append(t, np.int32(eos_id)) for t in encoded]
    lengths = np.array([len(t) for t in encoded], np.int64)
    flat = np.concatenate(encoded) if encoded else np.zeros(0, np.int32)
    if len(flat) and int(flat.max()) >= limit:
        for tokens, where in zip(encoded, docs.where, strict=True):
            check_ids(tokens, limit, f"{where} (tokenized by {tok.name})")
    if limit <= 65536:
        flat = flat.astype(np.uint16)
    ends = np.cumsum(lengths)
    return [flat], np.zeros(len(lengths), np.int32), ends - lengths, ends


def _token_rows(docs, limit: int | None):
    arrays, doc_array, doc_start, doc_end = [], [], [], []
    files = zip(docs.arrays, docs.starts, docs.files, strict=True)
    for f, (array, starts, path) in enumerate(files):
        ends = np.append(starts[1:], len(array))
        if limit is not None and len(array) and int(array.max()) >= limit:
            at = int(np.argmax(np.asarray(array) >= limit))
            doc = int(np.searchsorted(starts, at, side="right")) - 1
            check_ids(array[at : at + 1], limit, f"{path} document {doc} (token {at})")
        arrays.append(array)
        doc_array.append(np.full(len(starts), f, np.int32))
        doc_start.append(starts)
        doc_end.append(ends)
    return arrays, np.concatenate(doc_array), np.concatenate(doc_start), np.concatenate(doc_end)


def _build_source(spec: SourceSpec, tok: Tokenizer, opts: dict[str, Any]):
    docs = read_source(spec, skip_bad_records=opts["skip"])
    if isinstance(docs, TextDocs):
        limit = tok.vocab_size if opts["vocab_size"] is None else opts["vocab_size"]
        if spec.eos_id is not None and not 0 <= spec.eos_id < limit:
            raise DataError(f"data.eos_id={spec.eos_id} is not a token id below {limit}.")
        parts = _text_rows(docs, tok, spec.eos_id, limit, opts["threads"])
    else:
        parts = _token_rows(docs, opts["vocab_size"])
    rows = pack(*parts, opts["seq_len"])
    documents = len(parts[1])
    return rows, docs.skipped, documents


def _fingerprint(items: list[Any]) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


def _eval_batches(rows: Rows, count: int, spec: BatchSpec) -> list[dict[str, np.ndarray]]:
    out = []
    for k in range(count):
        first = k * spec.global_batch + spec.process_index * spec.local
        got = [rows.get(i % len(rows)) for i in range(first, first + spec.local)]
        out.append(
            {
                name: np.stack([g[n] for g in got]).astype(np.int32)
                for n, name in enumerate(("tokens", "segment_ids", "positions"))
            }
        )
    return out


def from_config(
    section: Mapping[str, Any],
    *,
    seq_len: int,
    vocab_size: int | None,
    seed: int,
    global_batch: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Loaders:
    """Builds the config's ``data`` section (keys: :mod:`jzero.data`).

    Args:
        section: the ``data`` mapping (empty: the stdlib corpus, bytes).
        seq_len: tokens per input; rows hold ``seq_len + 1``.
        vocab_size: the model's vocabulary; ids at or past it are errors. ``None``: the
            tokenizer's.
        seed: the data seed (epoch orders, mixture draws).
        global_batch: rows per global batch, over all processes.
        process_index: this process's index.
        process_count: processes sharing each global batch.

    Raises:
        DataError: for any bad setting or input, naming it.
    """
    section = dict(section)
    _check_keys(section, SECTION_KEYS, "data")
    if seq_len < 1:
        raise DataError(f"seq_len must be positive, got {seq_len}.")
    spec = BatchSpec(global_batch, process_index, process_count)
    tok = load_tokenizer(str(section.get("tokenizer", "bytes")))
    eos_id = section.get("eos_id")
    opts = {
        "skip": bool(section.get("skip_bad_records", False)),
        "vocab_size": vocab_size,
        "threads": int(section.get("num_threads", 2)),
        "seq_len": seq_len,
    }
    if "mixture" in section:
        entries = section["mixture"]
        if not entries or set(section) & set(SOURCE_KEYS):
            raise DataError(
                "data.mixture must be a non-empty list of sources, each with its own source, "
                "path and weight, and the section's own source/path keys unset."
            )
        for j, e in enumerate(entries):
            _check_keys(e, (*SOURCE_KEYS, "weight"), f"data.mixture[{j}]")
        weights = [float(e.get("weight", 1.0)) for e in entries]
    else:
        entries, weights = [section], [1.0]
    specs = [_spec(e, f"data.mixture[{j}]", eos_id) for j, e in enumerate(entries)]
    if len(specs) > 1:
        mixture_counts([1] * len(specs), weights)  # checks the weights before reading
    built = [_build_source(s, tok, opts) for s in specs]
    skipped = sum(b[1] for b in built)
    train_parts: list[PackedRows] = []
    eval_parts: list[PackedRows] = []
    fraction = float(section.get("eval_fraction", 0.05))
    if "eval" in section:
        _check_keys(section["eval"], SOURCE_KEYS, "data.eval")
        eval_rows, eval_skipped, _ = _build_source(
            _spec(section["eval"], "data.eval", eos_id), tok, opts
        )
        skipped += eval_skipped
        eval_parts.append(eval_rows)
        train_parts = [b[0] for b in built]
        eval_note = f"{len(eval_rows):,} rows of {_spec(section['eval'], '', None).describe()}"
    else:
        if not 0.0 <= fraction < 1.0:
            raise DataError(f"data.eval_fraction must be in [0, 1), got {fraction}.")
        for (rows, _, _), s in zip(built, specs, strict=True):
            held = min(max(1, round(len(rows) * fraction)), len(rows) - 1) if fraction else 0
            if fraction and len(rows) < 2:
                raise DataError(
                    f"Data source {s.describe()} packs into {len(rows)} row(s): too few to hold "
                    "out eval rows. Use more data, a shorter seq_len, or data.eval_fraction: 0."
                )
            train_parts.append(rows.view(0, len(rows) - held))
            eval_parts.append(rows.view(len(rows) - held, len(rows)))
        held_rows = sum(len(p) for p in eval_parts)
        eval_note = f"{held_rows:,} rows held out (eval_fraction {fraction:g})"
    stats = [
        SourceStats(s.describe(), b[2], p.tokens(), len(p), w, len(e))
        for s, b, p, w, e in zip(
            specs, built, train_parts, weights, eval_parts or [[]] * len(specs), strict=False
        )
    ]
    train: Rows = train_parts[0] if len(train_parts) == 1 else MixedRows(train_parts, weights, seed)
    fingerprint = _fingerprint(
        [tok.name, eos_id, seq_len, weights, [s.describe() for s in specs]]
        + [p.fingerprint() for p in train_parts]
    )
    iterator = DataIterator(
        train,
        seed,
        spec,
        fingerprint=fingerprint,
        num_threads=opts["threads"],
        prefetch=int(section.get("prefetch", 4)),
        skipped_records=skipped,
    )
    eval_rows_all = ConcatRows([p for p in eval_parts if len(p)])
    count = int(section.get("eval_batches", 4))
    # The eval set is the config's: its batches' rows never depend on the training batch
    # (nor so on the device count), so every layout evaluates the same rows alike.
    eval_spec = BatchSpec(int(section.get("eval_batch_size", EVAL_BATCH)), process_index,
                          process_count)  # fmt: skip
    evals = _eval_batches(eval_rows_all, count, eval_spec) if len(eval_rows_all) else []
    loaders = Loaders(
        iterator, evals, stats, eval_note, tok.name, tok.vocab_size, seq_len,
    )  # fmt: skip
    iterator.summary = loaders.describe()  # what the training loop's start line names
    return loaders
