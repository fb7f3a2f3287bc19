"""Weight files from elsewhere are untrusted input: every malformed header, offset, dtype or
shape is refused with one error naming the file and the field, by both readers
(``load_exported`` and ``open_weights``, which ``init_from`` uses), and an index may name only
files inside its own folder. The files are built byte by byte here: no JAX program runs."""

import json
import os
import struct

import numpy as np
import pytest

from jzero.weights import INDEX_NAME, load_exported, open_weights

W = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
DATA = np.arange(2, dtype="<f4").tobytes()


def safetensors(header, data=DATA):
    """A file's bytes: the 8-byte header length, the header (JSON unless bytes), the data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def with_w(**changes):
    return safetensors({"w": {**W, **changes}})


# (name, the file's bytes, what the message says besides the file's name)
MALFORMED = [
    ("under-8-bytes", b"\x01\x02", "it has under 8 bytes"),
    ("header-past-the-end", struct.pack("<Q", 1000) + b"{}", "header claims 1000 bytes"),
    ("header-not-utf8", safetensors(b"\xff\xfe{}"), "its header is not UTF-8 text"),
    ("header-not-json", safetensors(b"{'w': 1}"), "its header is not JSON (Expecting property"),
    ("header-a-list", safetensors(b"[1, 2]"), "its header is a JSON list, not an object"),
    (
        "tensor-named-twice",
        safetensors(("{%s, %s}" % ((f'"w": {json.dumps(W)}',) * 2)).encode()),
        "its header names 'w' twice",
    ),
    (
        "metadata-not-strings",
        safetensors({"__metadata__": {"format": 1}, "w": W}),
        "'__metadata__' is not an object of strings",
    ),
    (
        "paths-not-json",
        safetensors({"__metadata__": {"jzero.paths": "{"}, "w": W}),
        "'__metadata__' 'jzero.paths' is not JSON",
    ),
    (
        "paths-not-lists",
        safetensors({"__metadata__": {"jzero.paths": '{"w": "w"}'}, "w": W}),
        "'jzero.paths' is not a map of tensor names to lists of path entries",
    ),
    ("entry-not-an-object", safetensors({"w": 3}), "tensor 'w' is a JSON int, not an object"),
    ("dtype-unknown", with_w(dtype="F8"), "Tensor 'w' in {file} has dtype F8, which jzero can't"),
    ("dtype-not-a-string", with_w(dtype=["F32"]), "has dtype ['F32'], which jzero can't read"),
    ("shape-missing", safetensors({"w": {"dtype": "F32", "data_offsets": [0, 8]}}), "'shape' is"),
    ("shape-not-integers", with_w(shape=[2, "a"]), "tensor 'w': 'shape' is [2, 'a'], not a list"),
    ("shape-negative", with_w(shape=[-2]), "tensor 'w': 'shape' is [-2], not a list of integers"),
    ("shape-a-bool", with_w(shape=[True, 2]), "'shape' is [True, 2], not a list of integers"),
    ("shape-huge", with_w(shape=[2**40, 2**40]), "'shape' [1099511627776, 1099511627776] is "),
    (
        "offsets-not-integers",
        with_w(data_offsets=["a", 8]),
        "tensor 'w': 'data_offsets' is ['a', 8], not two integers",
    ),
    ("offsets-one-number", with_w(data_offsets=[8]), "'data_offsets' is [8], not two integers"),
    ("offsets-reversed", with_w(data_offsets=[8, 0]), "'data_offsets' is [8, 0], not two integers"),
    ("offsets-negative", with_w(data_offsets=[-8, 0]), "'data_offsets' is [-8, 0], not two"),
    (
        "offsets-not-the-shape",
        with_w(data_offsets=[0, 4]),
        "'data_offsets' [0, 4] span 4 bytes, but 'shape' [2] of F32 needs 8",
    ),
    (
        "data-truncated",
        safetensors({"w": W}, DATA[:4]),
        "end past the end of the file (its data holds 4 bytes)",
    ),
]


# open_weights (init_from) names tensors by their keys and reads no jzero.paths record.
CASES = [
    pytest.param(reader, *case, id=f"{reader.__name__}-{case[0]}")
    for reader in (load_exported, open_weights)
    for case in MALFORMED
    if not (reader is open_weights and case[0].startswith("paths-"))
]


@pytest.mark.parametrize("reader, name, raw, says", CASES)
def test_a_malformed_file_is_refused_naming_the_file_and_the_field(
    tmp_path, reader, name, raw, says
):
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(raw)
    with pytest.raises(ValueError) as e:
        reader(path)
    text = str(e.value)
    assert repr(str(path)) in text, text
    assert says.format(file=repr(str(path))) in text, text


def test_a_well_formed_file_reads_and_names_that_nest_into_each_other_are_refused(tmp_path):
    good = tmp_path / "good.safetensors"
    good.write_bytes(safetensors({"__metadata__": {"jzero.paths": '{"w": ["b", 0]}'}, "w": W}))
    np.testing.assert_array_equal(load_exported(good)["b"][0], [0.0, 1.0])
    np.testing.assert_array_equal(open_weights(good)["w"].read((slice(None),)), [0.0, 1.0])
    clash = tmp_path / "clash.safetensors"
    a = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    b = {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}
    clash.write_bytes(safetensors({"a": a, "a.b": b}))
    with pytest.raises(ValueError, match=r"clash.safetensors' do not form one tree: tensors nest"):
        load_exported(clash)


def _sharded(folder, weight_map):
    """A sharded export in ``folder`` whose index maps tensor ``w`` to ``weight_map``'s file."""
    folder.mkdir(exist_ok=True)
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture
def secret(tmp_path):
    """A readable, valid weight file outside the export's folder."""
    path = tmp_path / "secret.safetensors"
    path.write_bytes(safetensors({"w": W}))
    return path


@pytest.mark.parametrize("reader", [load_exported, open_weights], ids=["load_exported", "open"])
def test_an_index_may_name_only_files_inside_its_folder(tmp_path, secret, reader):
    export = tmp_path / "export"
    for name in ["../secret.safetensors", str(secret), "sub/../../secret.safetensors"]:
        _sharded(export, {"w": name})
        with pytest.raises(ValueError) as e:
            reader(export)
        text = str(e.value)
        assert repr(str(export / INDEX_NAME)) in text and f"places tensor 'w' in {name!r}" in text
        assert "not inside the index's folder" in text
    # A symlink inside the folder that leads out of it is refused too ...
    os.symlink(secret, export / "model.safetensors")
    _sharded(export, {"w": "model.safetensors"})
    with pytest.raises(ValueError, match="'model.safetensors', which is not inside the index's"):
        reader(export / INDEX_NAME)
    # ... one that stays inside is followed.
    (export / "model.safetensors").unlink()
    (export / "real.safetensors").write_bytes(safetensors({"w": W}))
    os.symlink("real.safetensors", export / "model.safetensors")
    got = reader(export)
    w = got["w"] if reader is load_exported else got["w"].read((slice(None),))
    np.testing.assert_array_equal(w, [0.0, 1.0])


@pytest.mark.parametrize(
    "index, says",
    [
        ('{"weight_map": {"w": ', "is not a safetensors index: its text is not JSON"),
        ('{"weight_map": ["model.safetensors"]}', "it needs a 'weight_map' object"),
        ('{"weight_map": {"w": 7}}', "gives tensor 'w' the file 7, which is not a file name"),
        ('{"weight_map": {"w": "a.safetensors"}, "metadata": [1]}', "'metadata' is not an object"),
        (
            '{"weight_map": {"w": "a.safetensors"}, "metadata": {"jzero.paths": "[1]"}}',
            "'metadata' 'jzero.paths' is not a map of tensor names",
        ),
        ('{"weight_map": {"w": "gone.safetensors"}}', "names the file 'gone.safetensors', which"),
    ],
    ids=["not-json", "map-a-list", "file-not-a-name", "metadata-a-list", "paths-bad", "missing"],
)
def test_a_malformed_index_is_refused_naming_it(tmp_path, index, says):
    export = tmp_path / "export"
    export.mkdir()
    (export / "a.safetensors").write_bytes(safetensors({"w": W}))
    (export / INDEX_NAME).write_text(index)
    readers = [load_exported] + ([] if "paths" in index else [open_weights])
    for reader in readers:
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            reader(export)
        assert repr(str(export / INDEX_NAME)) in str(e.value) and says in str(e.value)
