"""The NVMe tier's files: bit-exact round trips, asynchronous reads and writes, corruption and
truncation caught and named, failed writes that keep the old content, path checks, and a close
that removes only what the store made."""

import os
import shutil
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jzero.nvme import NvmeIOError, NvmeStore, check_nvme_path
from jzero.nvme import store as nvme

ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal((33, 17)).astype(np.float32),
        rng.standard_normal((1000,)).astype(jnp.bfloat16),
        rng.integers(-(2**31), 2**31 - 1, size=(4, 5, 6), dtype=np.int32),
        np.float32(3.5).reshape(()),  # 0-d
        np.zeros((0, 3), np.float32),  # empty
        np.array([np.nan, -0.0, np.inf], np.float32),
    ]


def assert_same_bits(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()


@pytest.fixture
def store(tmp_path):
    s = NvmeStore(tmp_path, buffer_count=3)
    yield s
    s.close()


def test_round_trip_is_bit_identical(store):
    want = arrays()
    size = store.write((0, 0), want)
    assert_same_bits(store.read((0, 0)), want)
    assert os.path.getsize(store.path_of((0, 0))) == size
    assert store.read((0, 0))[1].dtype == jnp.bfloat16
    assert store.keys() == ["0-0"]
    # rewriting replaces the content
    again = arrays(1)
    store.write((0, 0), again)
    assert_same_bits(store.read((0, 0)), again)
    store.write("empty", [])
    assert store.read("empty") == []


def test_prefetch_then_read(store):
    for g in range(4):
        store.write((g, 0), arrays(g))
    store.prefetch((0, 0))
    store.prefetch((1, 0))
    assert_same_bits(store.read((1, 0)), arrays(1))
    assert_same_bits(store.read((0, 0)), arrays(0))
    # read without a prefetch reads now
    assert_same_bits(store.read((3, 0)), arrays(3))


def test_prefetch_beyond_buffers_is_refused(store):
    for g in range(4):
        store.write((g, 0), arrays(g))
    for g in range(3):
        store.prefetch((g, 0))
    with pytest.raises(RuntimeError, match=r"All 3 buffers.*read\(\) one"):
        store.prefetch((3, 0))
    store.read((0, 0))
    store.prefetch((3, 0))
    assert_same_bits(store.read((3, 0)), arrays(3))


def test_write_async_flush_and_read_after_write(store):
    for g in range(8):  # more than buffer_count: write_async waits for room
        store.write_async((g, 1), arrays(g))
    # a read or prefetch of a key is ordered after its pending write
    assert_same_bits(store.read((7, 1)), arrays(7))
    store.write_async((7, 1), arrays(70))
    store.prefetch((7, 1))
    assert_same_bits(store.read((7, 1)), arrays(70))
    store.flush()
    for g in range(7):
        assert_same_bits(store.read((g, 1)), arrays(g))
    assert store.disk_bytes() == sum(os.path.getsize(store.path_of((g, 1))) for g in range(8))


def test_write_drops_a_stale_prefetch(store):
    store.write("k", arrays(0))
    store.prefetch("k")
    store.write("k", arrays(1))
    assert_same_bits(store.read("k"), arrays(1))


def test_read_checks_expected_layout(store):
    want = arrays()
    store.write("k", want)
    assert_same_bits(store.read("k", like=want), want)
    other = [want[0].astype(np.float64), *want[1:]]
    with pytest.raises(NvmeIOError, match=r"k\.jznv holds \[float32\(33, 17\).*float64"):
        store.read("k", like=other)
    with pytest.raises(NvmeIOError, match=r"was expected"):
        store.read("k", like=want[:2])


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_corrupted_data_is_detected(store):
    store.write((2, 0), arrays())
    path = store.path_of((2, 0))
    flip_byte(path, os.path.getsize(path) - 5)  # inside the last array's bytes
    with pytest.raises(NvmeIOError, match=r"2-0\.jznv is corrupted: array 5 .*CRC-32") as e:
        store.read((2, 0))
    assert path in str(e.value)
    store.prefetch((2, 0))  # the same from a background read
    with pytest.raises(NvmeIOError, match=r"is corrupted"):
        store.read((2, 0))


def test_corrupted_header_is_detected(store):
    store.write("h", arrays())
    path = store.path_of("h")
    flip_byte(path, 20)  # in the JSON header
    with pytest.raises(NvmeIOError, match=r"h\.jznv is corrupted: its header"):
        store.read("h")
    flip_byte(path, 20)
    flip_byte(path, 0)  # the magic
    with pytest.raises(NvmeIOError, match=r"not an NVMe store file"):
        store.read("h")


def test_truncated_file_is_detected(store):
    store.write("t", arrays())
    path = store.path_of("t")
    size = os.path.getsize(path)
    for keep in (size - 1, 4100, 10, 0):
        with open(path, "r+b") as f:
            f.truncate(keep)
        with pytest.raises(NvmeIOError, match=r"t\.jznv is truncated") as e:
            store.read("t")
        assert path in str(e.value)


def test_missing_file_is_named(store):
    with pytest.raises(NvmeIOError, match=r"nope\.jznv is missing"):
        store.read("nope")
    assert issubclass(NvmeIOError, OSError)


def test_failed_write_keeps_previous_content(store, monkeypatch):
    old = arrays(0)
    store.write("w", old)

    def refuse(src, dst):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(nvme.os, "replace", refuse)
    with pytest.raises(NvmeIOError, match=r"Writing .*w\.jznv failed: Read-only.*kept"):
        store.write("w", arrays(1))
    # the asynchronous path reports it at flush, and a read never returns the stale content
    store.write_async("w", arrays(2))
    with pytest.raises(NvmeIOError, match=r"Read-only"):
        store.flush()
    store.flush()  # reported once
    monkeypatch.undo()
    with pytest.raises(NvmeIOError, match=r"last write of .*w\.jznv failed.*stale"):
        store.read("w")
    # the file on disk is still the old one, whole, and no temporary file is left
    assert_same_bits(nvme.read_file(store.path_of("w"), True), old)
    assert sorted(os.listdir(store.directory)) == ["w.jznv"]
    store.write("w", arrays(3))  # a good write clears the failure
    assert_same_bits(store.read("w"), arrays(3))


@pytest.mark.skipif(ROOT_USER, reason="root ignores directory permissions")
def test_failed_write_read_only_directory(store):
    store.write("r", arrays(0))
    os.chmod(store.directory, 0o500)
    try:
        with pytest.raises(NvmeIOError, match=r"Writing .*r\.jznv failed"):
            store.write("r", arrays(1))
    finally:
        os.chmod(store.directory, 0o700)
    assert_same_bits(nvme.read_file(store.path_of("r"), True), arrays(0))


def test_check_nvme_path_missing_and_file(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"nvme_path is .*nope.*does not exist.*mkdir -p"):
        check_nvme_path(missing, 0)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=r"afile.*is a file, not a directory"):
        check_nvme_path(afile, 0, what="zero_optimization.offload_param.nvme_path")
    assert check_nvme_path(tmp_path, 1) == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["afile"]  # the probe file is gone


def test_check_nvme_path_not_writable(tmp_path, monkeypatch):
    if not ROOT_USER:
        os.chmod(tmp_path, 0o500)
        try:
            with pytest.raises(ValueError, match=r"is not writable by this process.*chmod"):
                check_nvme_path(tmp_path, 0)
        finally:
            os.chmod(tmp_path, 0o700)
    # root ignores permissions: both checks are exercised by making them fail
    monkeypatch.setattr(nvme.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=r"is not writable by this process.*chmod u\+w"):
        check_nvme_path(tmp_path, 0)
    monkeypatch.undo()

    def no_files(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(nvme.tempfile, "mkstemp", no_files)
    with pytest.raises(ValueError, match=r"creating a file there failed \(Permission denied\)"):
        check_nvme_path(tmp_path, 0)


def test_check_nvme_path_too_small(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match=r"free \(.* bytes\), but the offloaded state needs") as e:
        check_nvme_path(tmp_path, free * 2 + 1)
    assert f"{free * 2 + 1:,} bytes" in str(e.value)
    with pytest.raises(ValueError, match=r"needs"):
        NvmeStore(tmp_path, needed_bytes=free * 2 + 1)
    assert os.listdir(tmp_path) == []


def test_run_id_directory_must_be_new(tmp_path):
    s = NvmeStore(tmp_path, run_id="x")
    with pytest.raises(ValueError, match=r"jzero-nvme-x' exists already.*another run_id"):
        NvmeStore(tmp_path, run_id="x")
    with pytest.raises(ValueError, match=r"run_id 'a/b' may hold only"):
        NvmeStore(tmp_path, run_id="a/b")
    s.close()


def test_close_removes_only_the_store(tmp_path):
    (tmp_path / "user.txt").write_text("keep me")
    (tmp_path / "jzero-nvme-other").mkdir()  # someone else's directory with our prefix
    s = NvmeStore(tmp_path, run_id="run1")
    assert os.path.dirname(s.directory) == str(tmp_path)
    assert os.path.basename(s.directory) == "jzero-nvme-run1"
    for g in range(3):
        s.write_async((g, 0), arrays(g))
    s.flush()
    assert s.disk_bytes() > 0
    s.close()
    s.close()
    assert sorted(os.listdir(tmp_path)) == ["jzero-nvme-other", "user.txt"]
    assert (tmp_path / "user.txt").read_text() == "keep me"
    with pytest.raises(RuntimeError, match=r"is closed"):
        s.read((0, 0))
    # a foreign file inside the store's directory is left, and so is the directory
    s = NvmeStore(tmp_path)
    s.write("a", arrays())
    with open(os.path.join(s.directory, "notes.txt"), "w") as f:
        f.write("mine")
    s.close()
    assert os.listdir(s.directory) == ["notes.txt"]


def test_store_removed_when_garbage_collected(tmp_path):
    s = NvmeStore(tmp_path)
    s.write("a", arrays())
    directory = s.directory
    del s
    for _ in range(50):  # CPython frees it at once; allow the pool's threads to wind down
        if not os.path.exists(directory):
            break
        time.sleep(0.01)
    assert not os.path.exists(directory)


def test_bad_keys_and_arrays(store):
    with pytest.raises(ValueError, match=r"key '\.\./x'.*letters, digits"):
        store.write("../x", [np.zeros(2)])
    with pytest.raises(ValueError, match=r"must be an int or a str, not float"):
        store.write((1.5, 0), [np.zeros(2)])
    with pytest.raises(ValueError, match=r"as a list"):
        store.write("k", np.zeros(2))
    with pytest.raises(ValueError, match=r"Python objects"):
        store.write("k", [np.array([object()])])
    with pytest.raises(ValueError, match=r"buffer_count is 0"):
        NvmeStore(store.directory, buffer_count=0)


def test_many_threads_of_io_stay_consistent(tmp_path):
    """Interleaved async writes and prefetches of the same keys from one caller: every read
    returns the latest content written before it."""
    with NvmeStore(tmp_path, buffer_count=2) as s:
        latest = {}
        rng = np.random.default_rng(0)
        for i in range(60):
            k = int(rng.integers(0, 4))
            if rng.random() < 0.6:
                s.write_async(k, arrays(i))
                latest[k] = i
            elif k in latest:
                if rng.random() < 0.5:
                    s.prefetch(k)
                assert_same_bits(s.read(k), arrays(latest[k]))
        s.flush()


def test_jax_and_strided_inputs_and_durable_modes(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    x = jnp.arange(10, dtype=jnp.bfloat16)
    for fsync, page_cache in ((True, True), (False, False)):
        with NvmeStore(tmp_path, fsync=fsync, page_cache=page_cache) as s:
            s.write("k", [a.T, a[:, ::2], x])  # not C-contiguous, and a jax array
            got = s.read("k")
            assert_same_bits(got[:2], [np.ascontiguousarray(a.T), np.ascontiguousarray(a[:, ::2])])
            assert got[2].dtype == jnp.bfloat16 and got[2].tobytes() == np.asarray(x).tobytes()
    assert os.listdir(tmp_path) == []
