"""Every bad input is one clear DataError naming the file and the line or record: missing or
empty sources, truncated Parquet and ArrayRecord files, bad JSON lines, ids past the
vocabulary, bad mixture weights; skip_bad_records skips and counts instead."""

import json
import re

import numpy as np
import pytest

from jzero.data import DataError, from_config


def _load(section, seq_len=8, vocab_size=None):
    return from_config(section, seq_len=seq_len, vocab_size=vocab_size, seed=0, global_batch=2)


def _raises(section, *parts, **kw):
    with pytest.raises(DataError) as err:
        _load(section, **kw)
    for part in parts:
        assert part in str(err.value), f"{part!r} not in {err.value}"
    return str(err.value)


def test_missing_paths_globs_and_empty_sources_are_named(tmp_path):
    _raises({"source": "jsonl", "path": str(tmp_path / "nope.jsonl")}, "nope.jsonl", "not exist")
    _raises({"source": "text", "path": str(tmp_path / "*.txt")}, "*.txt", "matches no file")
    _raises({"source": "tokens"}, "no path was given")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    _raises(
        {"source": "jsonl", "path": str(tmp_path / "empty.jsonl")}, "empty.jsonl", "no document"
    )
    _raises({"source": "csv", "path": "x"}, "Unknown data source 'csv'")
    _raises({"source": "text", "colour": 1}, "unknown key(s) ['colour']")


def test_a_bad_json_line_or_a_missing_field_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n')
    _raises({"source": "jsonl", "path": str(path)}, f"{path}:3", "not JSON", "skip_bad_records")
    path.write_text('{"text": "a"}\n\n{"body": "b"}\n')
    _raises({"source": "jsonl", "path": str(path)}, f"{path}:3", "no field 'text'", "['body']")
    path.write_text('{"text": "a"}\n[1, 2]\n{"text": 5}\n')
    _raises({"source": "jsonl", "path": str(path)}, f"{path}:2", "is a list")


def test_skip_bad_records_skips_and_counts(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = ['{"text": "aaaa"}', "not json", '{"body": 1}', '{"text": "bbbb"}', '{"text": "cc"}']
    path.write_text("\n".join(lines))
    loaders = _load({"source": "jsonl", "path": str(path), "skip_bad_records": True}, seq_len=3)
    assert loaders.train.skipped_records == 2
    assert loaders.sources[0].documents == 3


def test_truncated_parquet_and_arrayrecord_files_are_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    pq.write_table(pa.table({"text": ["abc"] * 100}), tmp_path / "d.parquet")
    data = (tmp_path / "d.parquet").read_bytes()
    (tmp_path / "d.parquet").write_bytes(data[: len(data) // 2])
    _raises({"source": "parquet", "path": str(tmp_path / "d.parquet")}, "d.parquet", "Parquet")
    pq.write_table(pa.table({"body": ["abc"]}), tmp_path / "e.parquet")
    _raises({"source": "parquet", "path": str(tmp_path / "e.parquet")}, "e.parquet", "no column")
    writer = ArrayRecordWriter(str(tmp_path / "d.ar"), "group_size:1")
    for i in range(50):
        writer.write(f"record {i} ".encode() * 20)
    writer.close()
    data = (tmp_path / "d.ar").read_bytes()
    (tmp_path / "d.ar").write_bytes(data[: len(data) // 2])
    _raises({"source": "arrayrecord", "path": str(tmp_path / "d.ar")}, "d.ar", "ArrayRecord")


def test_a_bad_arrayrecord_record_is_named_by_number(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(tmp_path / "d.ar"), "group_size:1")
    writer.write(b"fine")
    writer.write(json.dumps({"other": "x"}).encode())
    writer.write(b"\xff\xfe")
    writer.close()
    path = str(tmp_path / "d.ar")
    _raises({"source": "arrayrecord", "path": path}, f"{path} record 1", "no field 'text'")
    loaders = _load({"source": "arrayrecord", "path": path, "skip_bad_records": True,
                     "eval_fraction": 0}, seq_len=3)  # fmt: skip
    assert loaders.train.skipped_records == 2


def test_ids_past_the_vocabulary_name_the_file_the_document_and_the_id(tmp_path):
    tokens = np.array([1, 2, 0, 3, 4, 0, 5, 700, 6], np.int32)
    np.save(tmp_path / "t.npy", tokens)
    section = {"source": "tokens", "path": str(tmp_path / "t.npy"), "eos_id": 0, "eval_fraction": 0}
    message = _raises(
        section, "t.npy document 2 (token 7)", "id 700", "vocab_size 512", vocab_size=512
    )
    assert re.search(r"token 0 has id 700", message)
    _load(section, vocab_size=701)  # fits
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "plain"}\n{"text": "caf\\u00e9 ~"}\n')
    _raises(
        {"source": "jsonl", "path": str(path)},
        f"{path}:2",
        "id 195",
        "vocab_size 128",
        vocab_size=128,
    )


def test_bad_mixture_weights_are_refused_before_reading(tmp_path):
    entry = {"source": "tokens", "path": str(tmp_path / "never-read.npy")}
    _raises({"mixture": [{**entry, "weight": 1}, {**entry, "weight": -2}]}, "mixture[1]", "-2")
    _raises({"mixture": [{**entry, "weight": 0}, {**entry, "weight": 0}]}, "all zero")
