"""Packing: chunks of at most seq_len + 1, greedy rows, segment ids and positions, and a
document's chunks independent of every other document."""

import numpy as np

from jzero.data import pack


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 250, n).astype(np.int32) for n in lengths]


def _pack(docs, seq_len):
    flat = np.concatenate(docs)
    ends = np.cumsum([len(d) for d in docs])
    return pack([flat], np.zeros(len(docs), np.int32), ends - [len(d) for d in docs], ends, seq_len)


def _rows(rows):
    return [rows.get(i) for i in range(len(rows))]


def _chunks(rows):
    """Each row's chunks, as (tokens, positions) pairs, in order."""
    out = []
    for tokens, segments, positions in _rows(rows):
        for s in range(1, segments.max() + 1):
            at = segments == s
            out.append((tuple(tokens[at]), tuple(positions[at])))
    return out


def test_rows_hold_whole_chunks_with_segment_ids_and_positions():
    docs = _docs([3, 5, 12, 4])  # seq_len 5: width 6
    rows = _pack(docs, 5)
    got = _rows(rows)
    # greedy in order: [3] + (5 does not fit) | [5] | [6] | [6] | [4]
    assert len(rows) == 5
    tokens, segments, positions = got[0]
    assert segments.tolist() == [1, 1, 1, 0, 0, 0]
    assert positions.tolist() == [0, 1, 2, 0, 0, 0]
    assert tokens[:3].tolist() == docs[0].tolist() and tokens[3:].tolist() == [0, 0, 0]
    assert got[2][0].tolist() == docs[2][:6].tolist()
    assert got[3][0].tolist() == docs[2][6:].tolist()
    assert got[3][2].tolist() == list(range(6))  # positions restart at each chunk
    small = _pack(_docs([2, 2, 1, 4]), 5)
    _, segments, positions = small.get(0)
    assert segments.tolist() == [1, 1, 2, 2, 3, 0]
    assert positions.tolist() == [0, 1, 0, 1, 0, 0]
    assert all(len(r[0]) == 6 and r[0].dtype == np.int32 for r in got)


def test_every_token_lands_once_in_order():
    docs = _docs([1, 7, 30, 2, 13, 6, 6, 9], seed=1)
    rows = _pack(docs, 7)
    real = np.concatenate([t[s > 0] for t, s, _ in _rows(rows)])
    assert real.tolist() == np.concatenate(docs).tolist()
    assert rows.tokens() == sum(map(len, docs))


def test_changing_one_document_leaves_the_others_chunks_unchanged():
    docs = _docs([5, 17, 9, 40, 3, 11, 8], seed=2)
    changed = list(docs)
    changed[2] = np.arange(1, 23, dtype=np.int32)  # another length too
    before, after = _chunks(_pack(docs, 7)), _chunks(_pack(changed, 7))
    own = set(_chunks(_pack([docs[2]], 7))) | set(_chunks(_pack([changed[2]], 7)))
    others = [c for c in before if c not in own]
    assert others == [c for c in after if c not in own]
    assert len(others) == sum(-(-len(d) // 8) for i, d in enumerate(docs) if i != 2)
