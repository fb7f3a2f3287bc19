"""Byte-level data: the stdlib corpus, file loading, splits, and the resumable batch iterator."""

import numpy as np
import pytest

from jzero.demo.data import (
    BatchIterator,
    eval_batches,
    load_tokens,
    split_train_eval,
    stdlib_corpus_bytes,
)

TOKENS = np.arange(1000, dtype=np.uint16) % 256


def test_stdlib_corpus_is_deterministic_python_source():
    corpus = stdlib_corpus_bytes(100_000)
    assert len(corpus) == 100_000
    assert corpus == stdlib_corpus_bytes(100_000)
    assert corpus.startswith(stdlib_corpus_bytes(1_000))
    assert b"import " in corpus and b"def " in corpus
    tokens = load_tokens("stdlib", max_bytes=5_000)
    assert tokens.dtype == np.uint8 and tokens.tobytes() == corpus[:5_000]


def test_load_text_and_token_files(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_bytes(b"hello, bytes")
    assert load_tokens("text", text).tobytes() == b"hello, bytes"
    assert load_tokens("text", text, max_bytes=5).tobytes() == b"hello"

    ids = np.array([1, 300, 65535, 7], dtype=np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    ids.astype("<u2").tofile(tmp_path / "ids.bin")
    np.testing.assert_array_equal(load_tokens("tokens", tmp_path / "ids.npy"), ids)
    np.testing.assert_array_equal(load_tokens("tokens", tmp_path / "ids.bin", max_bytes=2), ids[:2])


def test_load_errors_name_the_problem_and_the_fix(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"nope\.txt.*source='stdlib'"):
        load_tokens("text", missing)
    with pytest.raises(ValueError, match=r"Unknown data source 'wiki'.*'stdlib'"):
        load_tokens("wiki")
    with pytest.raises(ValueError, match="pass path="):
        load_tokens("tokens")
    (tmp_path / "ids.csv").write_text("1,2")
    with pytest.raises(ValueError, match=r"'\.csv'.*\.npy"):
        load_tokens("tokens", tmp_path / "ids.csv")
    np.save(tmp_path / "floats.npy", np.zeros(3))
    with pytest.raises(ValueError, match="integer token ids"):
        load_tokens("tokens", tmp_path / "floats.npy")


def test_split_keeps_the_tail_for_eval():
    train, held_out = split_train_eval(TOKENS, eval_fraction=0.1)
    assert len(train) == 900 and len(held_out) == 100
    np.testing.assert_array_equal(np.concatenate([train, held_out]), TOKENS)
    with pytest.raises(ValueError, match="between 0 and 1"):
        split_train_eval(TOKENS, eval_fraction=1.0)


def test_batches_are_deterministic_windows():
    a, b = BatchIterator(TOKENS, 8, 16, seed=3), BatchIterator(TOKENS, 8, 16, seed=3)
    batch = a.next()
    assert batch["tokens"].shape == (8, 17) and batch["tokens"].dtype == np.int32
    np.testing.assert_array_equal(batch["tokens"], next(b)["tokens"])
    # Every row is a contiguous window of the token stream (here: consecutive ids mod 256).
    np.testing.assert_array_equal(np.diff(batch["tokens"], axis=1) % 256, 1)
    assert not np.array_equal(a.next()["tokens"], batch["tokens"])
    other_seed = BatchIterator(TOKENS, 8, 16, seed=4).next()["tokens"]
    assert not np.array_equal(other_seed, batch["tokens"])


def test_processes_split_the_global_batch():
    whole = BatchIterator(TOKENS, 8, 16, seed=0)
    parts = [BatchIterator(TOKENS, 8, 16, seed=0, process_index=p, process_count=2) for p in (0, 1)]
    for _ in range(3):
        local = [part.next()["tokens"] for part in parts]
        assert local[0].shape == (4, 17)
        np.testing.assert_array_equal(np.concatenate(local), whole.next()["tokens"])
    with pytest.raises(ValueError, match=r"batch_size=6 is not divisible by process_count=4"):
        BatchIterator(TOKENS, 6, 16, seed=0, process_count=4)
    with pytest.raises(ValueError, match="process_index=2"):
        BatchIterator(TOKENS, 8, 16, seed=0, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="seq_len"):
        BatchIterator(TOKENS[:10], 8, 16, seed=0)


def test_state_restore_resumes_exactly():
    it = BatchIterator(TOKENS, 4, 8, seed=7)
    it.next()
    state = it.state()
    expected = [it.next()["tokens"] for _ in range(2)]
    # A fresh iterator, even with another process count, continues with the same global batches.
    resumed = [
        BatchIterator(TOKENS, 4, 8, seed=7, process_index=p, process_count=2) for p in (0, 1)
    ]
    for part in resumed:
        part.restore(state)
    for batch in expected:
        np.testing.assert_array_equal(np.concatenate([r.next()["tokens"] for r in resumed]), batch)
    with pytest.raises(ValueError, match="seed=7.*seed=8"):
        BatchIterator(TOKENS, 4, 8, seed=8).restore(state)


def test_eval_batches_are_fixed_and_process_sliced():
    batches = eval_batches(TOKENS, 4, 8, num_batches=3)
    assert len(batches) == 3 and batches[0]["tokens"].shape == (4, 9)
    again = eval_batches(TOKENS, 4, 8, num_batches=3)
    for x, y in zip(batches, again, strict=True):
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
    halves = [eval_batches(TOKENS, 4, 8, 3, process_index=p, process_count=2) for p in (0, 1)]
    for i, batch in enumerate(batches):
        local = np.concatenate([halves[0][i]["tokens"], halves[1][i]["tokens"]])
        np.testing.assert_array_equal(local, batch["tokens"])
