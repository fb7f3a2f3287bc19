"""Packed tokens per second through jzero's data layer, from token files and from JSON Lines.

Run: ``python benchmarks/data_loader.py`` (about 4 MB of ``.npy`` tokens and 3 MB of JSON Lines
written to a temporary folder; 1, 2 and 4 reading threads), or ``--smoke`` (a few kB, 1 and 2
threads: it checks that the script runs). Prints one table: per source and thread count, the
build time (read, tokenize, pack) and the packed tokens per second of reading every training
row of one epoch through :class:`jzero.data.DataIterator` (Grain's threads, prefetching).

Decisions:

* The JSON Lines text is random words from a small fixed vocabulary, tokenized by a BPE
  ``tokenizer.json`` the script trains on it, so only the ``tokenizers`` package is needed.
* "Packed tokens" count real tokens (``segment_ids > 0``), not padding.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from jzero.data import from_config

WORDS = "the of and to in is was for on that with as by at from his her an were which".split()


def write_files(folder: Path, tokens: int, lines: int) -> dict[str, dict]:
    """The two corpora: ``tokens.npy`` (documents end at id 0) and ``text.jsonl`` with its
    ``tokenizer.json``; returns the data sections that read them."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 32000, tokens).astype(np.uint16)
    ids[rng.integers(0, tokens, tokens // 700)] = 0  # documents of ~700 tokens
    np.save(folder / "tokens.npy", ids)
    with (folder / "text.jsonl").open("w") as f:
        for _ in range(lines):
            words = rng.choice(WORDS, rng.integers(50, 400))
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]", "</s>"], show_progress=False
    )
    tok.train([str(folder / "text.jsonl")], trainer)
    tok.save(str(folder / "tokenizer.json"))
    return {
        "npy": {"source": "tokens", "path": str(folder / "tokens.npy"), "eos_id": 0},
        "jsonl+tokenizer.json": {
            "source": "jsonl",
            "path": str(folder / "text.jsonl"),
            "tokenizer": str(folder / "tokenizer.json"),
            "eos_id": 1,
        },
    }


def measure(section: dict, threads: int, seq_len: int, batch: int) -> tuple[float, int, float]:
    """``(build seconds, rows, packed tokens per second)`` over one epoch's rows."""
    start = time.perf_counter()
    loaders = from_config(
        {**section, "num_threads": threads, "prefetch": 8, "eval_fraction": 0},
        seq_len=seq_len,
        vocab_size=None if "tokenizer" in section else 32000,
        seed=0,
        global_batch=batch,
    )
    built = time.perf_counter() - start
    it = loaders.train
    start, real = time.perf_counter(), 0
    for _ in range(max(1, it.num_rows // batch)):
        real += int((it.next()["segment_ids"] > 0).sum())
    it.close()
    return built, it.num_rows, real / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a few kB, 1 and 2 threads")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    tokens, lines, threads = (2_000_000, 4_000, (1, 2, 4))
    seq_len, batch = args.seq_len, args.batch
    if args.smoke:
        tokens, lines, threads, seq_len, batch = 20_000, 100, (1, 2), 64, 4
    with tempfile.TemporaryDirectory() as folder:
        sections = write_files(Path(folder), tokens, lines)
        sizes = {p.name: p.stat().st_size for p in Path(folder).iterdir()}
        print(f"files: {', '.join(f'{n} {s / 1e6:.2f} MB' for n, s in sorted(sizes.items()))}")
        print(f"seq_len {seq_len}, global batch {batch}")
        print(f"{'source':<22}{'threads':>8}{'build s':>9}{'rows':>8}{'packed tokens/s':>17}")
        for name, section in sections.items():
            for n in threads:
                built, rows, rate = measure(section, n, seq_len, batch)
                print(f"{name:<22}{n:>8}{built:>9.2f}{rows:>8}{rate:>17,.0f}")


if __name__ == "__main__":
    main()
