"""Order and position: batches fixed by the seed and the sample index, not the process count;
resume at another process count or batch size; no sample twice in an epoch; epochs advance."""

import json
import logging

import numpy as np
import pytest

from jzero.data import BatchSpec, DataError, DataIterator, pack, sample_ids


def _rows(n_rows=23, width=5):
    flat = np.arange(n_rows * width, dtype=np.int32)  # row r's tokens start at r * width
    starts = np.arange(n_rows) * width
    return pack([flat], np.zeros(n_rows, np.int32), starts, starts + width, width - 1)


def _it(rows, batch, p=0, count=1, seed=3, **kw):
    return DataIterator(rows, seed, BatchSpec(batch, p, count), fingerprint="f", **kw)


def _row_of(tokens):
    return (tokens[:, 0] // tokens.shape[1]).tolist()


def test_process_rows_together_are_the_single_process_batch():
    rows = _rows()
    whole = _it(rows, 8)
    parts = [_it(rows, 8, p, 4) for p in range(4)]
    for k in range(5):
        batch = whole.next()
        got = [it.next() for it in parts]
        assert np.array_equal(np.concatenate([g["tokens"] for g in got]), batch["tokens"])
        ids = np.concatenate([it.last_sample_ids for it in parts])
        assert ids.tolist() == whole.last_sample_ids.tolist() == list(range(8 * k, 8 * k + 8))
        assert parts[2].last_sample_ids.tolist() == sample_ids(k, 8, 2, 4).tolist()
        for g in got:
            assert set(g) == {"tokens", "segment_ids", "positions"}
            assert all(v.dtype == np.int32 and v.shape == (2, 5) for v in g.values())


def test_no_row_twice_within_an_epoch_and_each_epoch_reshuffles(caplog):
    rows = _rows(24)
    it = _it(rows, 6)
    with caplog.at_level(logging.INFO, logger="jzero.data"):
        epochs = [sum((_row_of(it.next()["tokens"]) for _ in range(4)), []) for _ in range(3)]
    assert [sorted(e) for e in epochs] == [list(range(24))] * 3
    assert epochs[0] != epochs[1] != epochs[2]
    assert it.epoch == 3
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "data epoch 1 begins",
        "data epoch 2 begins",
    ]


@pytest.mark.parametrize("threads", [0, 3])
def test_restore_continues_exactly_at_another_process_count_and_batch_size(threads):
    rows = _rows(23)
    straight = _it(rows, 6, num_threads=threads)
    seen = [straight.next() for _ in range(9)]  # 54 samples: into epoch 2
    first = _it(rows, 6, num_threads=threads)
    for _ in range(4):
        first.next()
    state = json.loads(json.dumps(first.get_state()))  # JSON round trip
    assert state["sample"] == 24
    # resumed by 3 processes with a global batch of 3: samples 24, 25, ...
    resumed = [_it(rows, 3, p, 3, num_threads=threads) for p in range(3)]
    for it in resumed:
        it.set_state(state)
    got = []
    for _ in range(10):
        got += [it.next()["tokens"] for it in resumed]
    expected = np.concatenate([s["tokens"] for s in seen])[24:54]
    assert np.array_equal(np.concatenate(got), expected)
    # the same iterator restored in place goes back too
    first.restore(state)
    assert np.array_equal(first.next()["tokens"], seen[4]["tokens"])


def test_restore_refuses_another_seed_or_other_data():
    it = _it(_rows(23), 4)
    it.next()
    state = it.state()
    with pytest.raises(DataError, match="seed=3 but this iterator has seed=4"):
        _it(_rows(23), 4, seed=4).restore(state)
    with pytest.raises(DataError, match="other data"):
        _it(_rows(22), 4).restore(state)
    with pytest.raises(DataError, match="no sample position"):
        it.restore({"step": 3, "seed": 3})


def test_a_batch_not_divisible_by_the_processes_is_refused():
    with pytest.raises(DataError, match="not divisible by process_count=4"):
        BatchSpec(6, 0, 4)
