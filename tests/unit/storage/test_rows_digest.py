"""ColumnStore.rows_digest (stream verification) and read_rows's sorted-input path."""

import numpy as np
import pytest
import xxhash

from giaannd.model.rows import Row, RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.engine.regions import pack_regions
from giaannd.storage.engine.row_digest import rows_digest

CAP = 1 << 30


def rand_batch(rng, rows=40, per_row=5):
    n = rows * per_row
    sc = np.repeat(rng.integers(1, 6, rows, dtype=np.uint64), per_row)
    sf = np.repeat(rng.integers(0, 200, rows, dtype=np.uint64), per_row)
    return RowBatch.from_entries(sc, sf, rng.integers(0, 9, n).astype(np.uint8),
                                 rng.integers(1, 300, n, dtype=np.uint64), rng.integers(0, 300, n, dtype=np.uint64),
                                 rng.random(n).astype(np.float32))


def stores_with_same_rows(seed=1):
    """Two stores holding the same rows, built along different paths (one batch vs row by row)."""
    rng = np.random.default_rng(seed)
    b = rand_batch(rng)
    a, c = ColumnStore(CAP), ColumnStore(CAP)
    a.apply(BatchId(1, 1), b)
    for i in range(b.num_rows):
        keep = np.zeros(b.num_rows, bool)
        keep[i] = True
        c.apply(BatchId(2, i + 1), b.select_rows(keep))
    return a, c, b


def test_equal_rows_give_equal_digests_and_presence():
    a, c, b = stores_with_same_rows()
    cols, feats = b.row_column, b.row_feature
    pa, da = a.rows_digest(cols, feats)
    pc, dc = c.rows_digest(cols, feats)
    assert pa.dtype == np.uint8 and pa.tolist() == [1] * b.num_rows == pc.tolist()
    assert da == dc
    # absent keys: flagged 0, and the digest covers the present rows only
    extra_c = np.concatenate([cols, np.array([99], np.uint64)])
    extra_f = np.concatenate([feats, np.array([7], np.uint64)])
    p, d = a.rows_digest(extra_c, extra_f)
    assert p.tolist() == [1] * b.num_rows + [0] and d == da
    assert a.rows_digest(np.zeros(0, np.uint64), np.zeros(0, np.uint64))[0].size == 0


def test_digest_sees_one_bit_of_strength_a_segment_and_the_order():
    a, c, b = stores_with_same_rows(2)
    cols, feats = b.row_column, b.row_feature
    base = a.rows_digest(cols, feats)[1]
    key = (int(cols[7]), int(feats[7]))
    row = c.row(key)
    assert row is not None
    s = row.strength.view(np.uint32)
    s[0] ^= 1  # the last bit of one strength
    assert c.rows_digest(cols, feats)[1] != base
    s[0] ^= 1
    assert c.rows_digest(cols, feats)[1] == base
    row.segment[-1] ^= 1
    assert c.rows_digest(cols, feats)[1] != base
    row.segment[-1] ^= 1
    order = np.arange(b.num_rows)[::-1]
    assert a.rows_digest(cols[order], feats[order])[1] != base  # rows hashed in the order asked


def test_digest_sees_a_row_split_differently():
    """Same bytes overall, different rows: the region sizes are hashed too."""
    a, b_store = ColumnStore(CAP), ColumnStore(CAP)
    one = RowBatch.from_entries(np.array([1, 1], np.uint64), np.array([5, 5], np.uint64),
                                np.zeros(2, np.uint8), np.array([1, 2], np.uint64), np.array([3, 4], np.uint64),
                                np.ones(2, np.float32))
    a.apply(BatchId(1, 1), one)
    b_store.apply(BatchId(1, 1), one)
    more = RowBatch.from_entries(np.array([1], np.uint64), np.array([5], np.uint64), np.zeros(1, np.uint8),
                                 np.array([9], np.uint64), np.array([9], np.uint64), np.ones(1, np.float32))
    b_store.apply(BatchId(1, 2), more)
    k = (np.array([1], np.uint64), np.array([5], np.uint64))
    assert a.rows_digest(*k)[1] != b_store.rows_digest(*k)[1]


def test_read_rows_sorted_and_unsorted_input_agree():
    a, _, b = stores_with_same_rows(3)
    cols, feats = b.row_column, b.row_feature
    want = a.read_rows(cols, feats)  # sorted, unique: the fast path
    rng = np.random.default_rng(4)
    order = rng.permutation(np.concatenate([np.arange(b.num_rows), np.arange(5)]))  # shuffled, repeats
    got = a.read_rows(cols[order], feats[order])
    for x, y in zip(want.buffers(), got.buffers()):
        assert np.array_equal(x, y)
    for x, y in zip(want.buffers(), b.buffers()):
        assert np.array_equal(x, y)
    # absent keys are left out on both paths
    c2 = np.concatenate([cols, np.array([2**63], np.uint64)])
    f2 = np.concatenate([feats, np.array([1], np.uint64)])
    assert a.read_rows(c2, f2).num_rows == b.num_rows
    assert a.read_rows(c2[::-1], f2[::-1]).num_rows == b.num_rows


# -- digest version 2 (the field arrays as they are: row_digest.py) -----------------------------------


def test_digest_v2_equal_rows_equal_digests_and_every_bit_counts():
    a, c, b = stores_with_same_rows(6)
    cols, feats = b.row_column, b.row_feature
    base = a.rows_digest(cols, feats, 2)[1]
    assert c.rows_digest(cols, feats, 2)[1] == base
    assert base != a.rows_digest(cols, feats, 1)[1]  # another version, another value
    row = c.row((int(cols[3]), int(feats[3])))
    assert row is not None
    for field in (row.strength.view(np.uint32), row.segment, row.target_column, row.target_feature):
        field[-1] ^= 1
        assert c.rows_digest(cols, feats, 2)[1] != base
        field[-1] ^= 1
    assert c.rows_digest(cols, feats, 2)[1] == base
    order = np.arange(b.num_rows)[::-1]
    assert a.rows_digest(cols[order], feats[order], 2)[1] != base


def test_digest_v2_sees_a_row_split_differently():
    """Same entries, cut into rows differently: the row lengths are hashed first."""
    rng = np.random.default_rng(1)
    n = 6
    rows = Row(rng.integers(0, 9, n).astype(np.uint8), rng.integers(0, 9, n).astype(np.uint64),
               rng.integers(0, 9, n).astype(np.uint64), rng.random(n).astype(np.float32))
    assert rows_digest(np.array([0, 2, 6]), rows, 2) != rows_digest(np.array([0, 3, 6]), rows, 2)


def test_digest_v1_is_the_region_layout_hash_and_unknown_versions_are_refused():
    """Version 1 keeps the value nodes computed before (regions.py), so old peers still agree."""
    a, _, b = stores_with_same_rows(7)
    cols, feats = b.row_column, b.row_feature
    offsets = b.offsets
    want = xxhash.xxh3_64((21 * np.diff(offsets)).astype(np.int64).tobytes())
    want.update(pack_regions(offsets, Row(b.segment, b.target_column, b.target_feature, b.strength)).data)
    assert a.rows_digest(cols, feats)[1] == a.rows_digest(cols, feats, 1)[1] == want.intdigest()
    with pytest.raises(ValueError, match="digest version 3"):
        a.rows_digest(cols, feats, 3)


@pytest.mark.parametrize("per_row", [300, 3000])
def test_digest_v2_of_rows_hashed_as_views_equals_the_gathered_digest(per_row, monkeypatch):
    """Long rows (or rows lying together) are hashed as views of the engine (RowEngine.pieces):
    the digest is the one of the gathered rows, with rows in the base, in delta runs, or both."""
    rng = np.random.default_rng(4)
    store = ColumnStore(CAP)
    for seq in range(1, 6):
        store.apply(BatchId(1, seq), rand_batch(rng, rows=6, per_row=per_row))
        cols, feats, _ = store.rows_of_columns(np.arange(1, 6, dtype=np.uint64))
        order = rng.permutation(cols.size)
        keys = (np.append(cols[order], 7), np.append(feats[order], 1))  # (and one absent key)
        views = store.rows_digest(*keys, version=2)
        assert store.engine.pieces(store.engine.row_ids(cols, feats), 1000) is not None  # views were used
        monkeypatch.setattr(store.engine, "pieces", lambda ids, most: None)  # the gathered way
        gathered = store.rows_digest(*keys, version=2)
        monkeypatch.undo()
        assert views[0].tolist() == gathered[0].tolist() and views[1] == gathered[1]
