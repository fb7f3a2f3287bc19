"""Every source kind read from small files the test writes, each tokenizer, mixtures, eval
data, and the config's former keys (stdlib, text, tokens; path, max_bytes, eval_fraction)."""

import json

import numpy as np
import pytest

from jzero.data import SourceSpec, from_config, load_tokenizer, read_source

TEXTS = ["the cat sat", "a dog ran far away", "the end"]


def _load(section, seq_len=8, batch=4, vocab_size=None, **kw):
    return from_config(
        section, seq_len=seq_len, vocab_size=vocab_size, seed=0, global_batch=batch, **kw
    )


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _all_real_tokens(loaders):
    """Every real token of the train rows then the eval rows, in row order."""
    out = []
    for rows in (loaders.train.rows,):
        for i in range(len(rows)):
            t, s, _ = rows.get(i)
            out += t[s > 0].tolist()
    return out


def _texts_of(kind, tmp_path):
    if kind == "text":
        for i, t in enumerate(TEXTS):
            (tmp_path / f"d{i}.txt").write_text(t)
        return {"source": "text", "path": str(tmp_path / "d*.txt")}
    if kind == "jsonl":
        _write_jsonl(tmp_path / "d.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
        return {"source": "jsonl", "path": str(tmp_path / "d.jsonl")}
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": TEXTS}), tmp_path / "d.parquet")
        return {"source": "parquet", "path": str(tmp_path / "d.parquet"), "field": "body"}
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(tmp_path / "d.array_record"), "group_size:1")
    writer.write(TEXTS[0].encode())
    writer.write(json.dumps({"text": TEXTS[1]}).encode())
    writer.write(TEXTS[2].encode())
    writer.close()
    return {"source": "arrayrecord", "path": str(tmp_path / "d.array_record")}


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet", "arrayrecord"])
def test_each_text_source_reads_its_documents_in_order(kind, tmp_path):
    section = _texts_of(kind, tmp_path)
    spec = SourceSpec(section["source"], (section["path"],), field=section.get("field", "text"))
    docs = read_source(spec)
    assert [t.decode() if isinstance(t, bytes) else t for t in docs.texts] == TEXTS
    loaders = _load({**section, "eos_id": 0, "eval_fraction": 0}, seq_len=30)
    expected = sum((list(t.encode()) + [0] for t in TEXTS), [])
    assert _all_real_tokens(loaders) == expected
    assert loaders.eval == []


def test_text_split_on_a_separator_names_each_piece_by_line(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n\n\nthree\n\nfour")
    docs = read_source(SourceSpec("text", (str(tmp_path / "a.txt"),), separator="\n\n"))
    assert [t.strip() for t in docs.texts] == [b"one\ntwo", b"three", b"four"]
    assert [w.rsplit(":", 1)[1] for w in docs.where] == ["1", "5", "7"]


def test_token_files_npy_split_at_eos_and_bin_with_its_dtype(tmp_path):
    np.save(tmp_path / "a.npy", np.array([5, 6, 1, 7, 1, 8, 9], np.int32))
    np.array([300, 301, 302, 303], np.uint16).tofile(tmp_path / "b.bin")
    np.array([70000, 70001], np.uint32).tofile(tmp_path / "c.bin")
    docs = read_source(SourceSpec("tokens", (str(tmp_path / "a.npy"),), eos_id=1))
    assert docs.starts[0].tolist() == [0, 3, 5]
    loaders = _load(
        {"source": "tokens", "paths": [str(tmp_path / "a.npy"), str(tmp_path / "b.bin")],
         "eos_id": 1, "eval_fraction": 0},
        seq_len=3,
    )  # fmt: skip
    rows = [loaders.train.rows.get(i) for i in range(len(loaders.train.rows))]
    assert [r[0][r[1] > 0].tolist() for r in rows] == [
        [5, 6, 1],
        [7, 1, 8, 9],
        [300, 301, 302, 303],
    ]
    wide = _load({"source": "tokens", "path": str(tmp_path / "c.bin"), "dtype": "uint32",
                  "eval_fraction": 0}, seq_len=1)  # fmt: skip
    assert wide.train.rows.get(0)[0].tolist() == [70000, 70001]


def test_a_tokenizer_json_and_a_sentencepiece_model_tokenize(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "the": 2, "cat": 3, "sat": 4, "end": 5}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    section = {**_texts_of("jsonl", tmp_path), "tokenizer": str(tmp_path / "tokenizer.json")}
    loaders = _load({**section, "eos_id": 1, "eval_fraction": 0}, seq_len=16)
    assert _all_real_tokens(loaders) == [2, 3, 4, 1, 0, 0, 0, 0, 0, 1, 2, 5, 1]
    assert loaders.vocab_size == 6 and "tokenizer.json" in loaders.describe()

    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 20))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=30,
        model_type="char", minloglevel=2,
    )  # fmt: skip
    sp = load_tokenizer(str(tmp_path / "sp.model"))
    reference = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert sp.vocab_size == reference.get_piece_size() > 10
    ids = sp.encode(["the cat", b"a dog"])
    assert [i.tolist() for i in ids] == reference.encode(["the cat", "a dog"], out_type=int)
    assert ids[0].dtype == np.int32 and len(ids[0]) >= 7


def test_a_mixture_draws_each_source_by_its_weight(tmp_path):
    np.save(tmp_path / "a.npy", np.full(40, 3, np.int32))  # 10 rows of 4
    np.save(tmp_path / "b.npy", np.full(40, 9, np.int32))
    section = {
        "mixture": [
            {"source": "tokens", "path": str(tmp_path / "a.npy"), "weight": 3},
            {"source": "tokens", "path": str(tmp_path / "b.npy"), "weight": 1},
        ],
        "eval_fraction": 0,
    }
    loaders = _load(section, seq_len=3, batch=4)
    assert loaders.train.num_rows == 20
    firsts = [int(t) for _ in range(5) for t in loaders.train.next()["tokens"][:, 0]]
    assert sorted(firsts) == [3] * 15 + [9] * 5  # one epoch: 15 of a, 5 of b
    assert "weight 3" in loaders.describe()


def test_eval_is_a_held_out_tail_or_a_source_of_its_own_and_the_same_each_call(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(100, dtype=np.int32))  # 20 rows of 5
    np.save(tmp_path / "e.npy", np.arange(500, 510, dtype=np.int32))
    section = {"source": "tokens", "path": str(tmp_path / "a.npy"), "eval_fraction": 0.1}
    default = _load(section, seq_len=4, batch=2)  # eval batches of 32 rows, whatever the batch
    assert [len(b["tokens"]) for b in default.eval] == [32] * 4
    section["eval_batch_size"] = 2
    loaders = _load(section, seq_len=4, batch=2, process_index=1, process_count=2)
    assert loaders.train.num_rows == 18
    assert [b["tokens"][:, 0].tolist() for b in loaders.eval] == [[95], [95], [95], [95]]
    again = _load(section, seq_len=4, batch=2, process_index=1, process_count=2)
    assert np.array_equal(
        np.stack([b["tokens"] for b in loaders.eval]), np.stack([b["tokens"] for b in again.eval])
    )
    own = _load({**section, "eval": {"source": "tokens", "path": str(tmp_path / "e.npy")},
                 "eval_batches": 1}, seq_len=4, batch=4)  # fmt: skip
    assert own.train.num_rows == 20
    assert [t[0] for t in own.eval[0]["tokens"].tolist()] == [500, 505]
    assert "2 rows of tokens(" in own.describe()


def test_the_former_data_keys_still_work(tmp_path):
    stdlib = _load({"source": "stdlib", "max_bytes": 20000, "eval_fraction": 0.05}, seq_len=64)
    assert 0 < stdlib.train.rows.tokens() <= 20000
    assert stdlib.describe().startswith("data: stdlib: ")
    (tmp_path / "t.txt").write_bytes(b"hello world " * 20)
    text = _load({"source": "text", "path": str(tmp_path / "t.txt"), "max_bytes": 100}, seq_len=9)
    assert text.train.rows.tokens() == 90 and text.sources[0].eval_rows == 1  # 100 bytes
    assert bytes(text.eval[0]["tokens"][0].astype(np.uint8)) == (b"hello world " * 20)[90:100]
    assert text.train.next()["tokens"].shape == (4, 10)
