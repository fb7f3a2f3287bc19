"""Tokenizers: UTF-8 bytes, a Hugging Face ``tokenizer.json``, or a SentencePiece ``.model``.

Decisions:

* ``bytes`` is the default: each UTF-8 byte is a token, vocabulary 256, and no end-of-document
  id unless ``eos_id`` is set (all 256 ids are bytes; ``eos_id: 0``, NUL, is the usual choice).
* A Hugging Face or SentencePiece tokenizer adds no special tokens of its own; ``eos_id``,
  when set, is appended after each document by the data layer (never by the tokenizer).
* ``tokenizers`` and ``sentencepiece`` are imported only here, and only for their kind; a
  missing one is a :class:`~jzero.data.errors.DataError` naming ``pip install jzero[data]``.
* Ids are checked against the model's vocabulary before training (:func:`check_ids`): an id at
  or past ``vocab_size`` names the document's file and line (or record) and the id.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jzero.data.errors import DataError

__all__ = ["Tokenizer", "check_ids", "load_tokenizer"]

_BATCH = 1024


class Tokenizer:
    """Turns texts into int32 token arrays.

    Args:
        name: ``"bytes"`` or the tokenizer file's path.
        vocab_size: the tokenizer's vocabulary size (ids are below it).
        model: the loaded Hugging Face or SentencePiece tokenizer; ``None`` for bytes.
    """

    def __init__(self, name: str, vocab_size: int, model: object | None = None):
        self.name = name
        self.vocab_size = vocab_size
        self._model = model

    def encode(self, texts: Sequence[str | bytes], num_threads: int = 1) -> list[np.ndarray]:
        """The tokens of each text (``str`` or UTF-8 ``bytes``), as int32 arrays."""
        if self._model is None:
            return [
                np.frombuffer(t if isinstance(t, bytes) else t.encode(), np.uint8).astype(np.int32)
                for t in texts
            ]
        strings = [t.decode("utf-8", "replace") if isinstance(t, bytes) else t for t in texts]
        out: list[np.ndarray] = []
        for lo in range(0, len(strings), _BATCH):
            batch = strings[lo : lo + _BATCH]
            if hasattr(self._model, "encode_batch"):  # Hugging Face tokenizers
                ids = [e.ids for e in self._model.encode_batch(batch, add_special_tokens=False)]
            else:  # SentencePiece
                ids = self._model.encode(batch, out_type=int, num_threads=max(1, num_threads))
            out += [np.asarray(i, np.int32) for i in ids]
        return out


def _import(module: str, path: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise DataError(
            f"The tokenizer {path!r} needs {module}, which is not installed ({err}). Install "
            "the data extra: pip install jzero[data]."
        ) from err


def load_tokenizer(spec: str = "bytes") -> Tokenizer:
    """The tokenizer ``spec`` names: ``"bytes"``, a ``tokenizer.json`` or a ``.model`` file.

    Raises:
        DataError: for a missing or unreadable file, or an unknown suffix.
    """
    if spec == "bytes":
        return Tokenizer("bytes", 256)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(
            f"The tokenizer file {spec!r} does not exist. Set data.tokenizer to a Hugging Face "
            "tokenizer.json, a SentencePiece .model, or bytes."
        )
    try:
        if path.suffix == ".json":
            model = _import("tokenizers", spec).Tokenizer.from_file(str(path))
            return Tokenizer(spec, model.get_vocab_size(with_added_tokens=True), model)
        if path.suffix == ".model":
            model = _import("sentencepiece", spec).SentencePieceProcessor(model_file=str(path))
            return Tokenizer(spec, model.get_piece_size(), model)
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"{spec}: not a readable tokenizer file ({err}).") from err
    raise DataError(
        f"The tokenizer file {spec!r} must be a Hugging Face .json or a SentencePiece .model."
    )


def check_ids(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Raises a :class:`DataError` naming ``where`` if a token id is ``>= vocab_size``."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        at = int(np.argmax(np.asarray(tokens) >= vocab_size))
        raise DataError(
            f"{where}: token {at} has id {int(tokens[at])}, not below the model's vocab_size "
            f"{vocab_size}. Use the tokenizer the model was built for, or a larger vocab_size."
        )
