"""Gathers of many rows (run.gather_entries, RowEngine.gather, read_many): the rows' slices copied
straight into the result, delta runs' entries merged in, bit for bit what reading row by row gives."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.rowengine import RowEngine
from giaannd.rowengine.run import FIELDS, gather_entries
from tests.unit.rowengine.test_engine import apply

DTYPES = (np.uint8, np.uint64, np.uint64, np.float32)  # FIELDS'


def _bytes(a):
    return a.dtype.str, a.tobytes()


def _fields(rng, size):
    return tuple(rng.random(size, dtype=np.float32) if t == np.float32 else rng.integers(0, 250, size).astype(t)
                 for t in DTYPES)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(0, 300), slices=st.integers(0, 40),
       inserts=st.integers(0, 30))
def test_gather_entries_equals_concatenated_slices_with_inserts(seed, size, slices, inserts):
    """Any slices (empty, overlapping, repeated, in any order), any non-decreasing insert positions
    (before the first, between or inside slices, after the last): numpy's concatenate + insert,
    every field."""
    rng = np.random.default_rng(seed)
    src = _fields(rng, size)
    lo = rng.integers(0, size + 1, slices)
    n = rng.integers(0, size + 1 - lo) if slices else np.empty(0, np.int64)
    cat = [np.concatenate([f[a : a + b] for a, b in zip(lo, n)]) if slices else f[:0] for f in src]
    pos = np.sort(rng.integers(0, cat[0].shape[0] + 1, inserts))
    new = _fields(rng, inserts)
    got = gather_entries(src, lo, n, new, pos)
    assert [_bytes(g) for g in got] == [_bytes(np.insert(c, pos, x)) for c, x in zip(cat, new)]
    assert [_bytes(g) for g in gather_entries(src, lo, n)] == [_bytes(c) for c in cat]


def test_gather_entries_refuses_slices_outside_and_positions_out_of_order():
    src = tuple(np.arange(10).astype(t) for t in DTYPES)
    lo, n = np.array([2, 5], np.int64), np.array([3, 4], np.int64)
    with pytest.raises(ValueError):
        gather_entries(src, np.array([8], np.int64), np.array([3], np.int64))
    with pytest.raises(ValueError):
        gather_entries(src, np.array([-1], np.int64), np.array([1], np.int64))
    with pytest.raises(ValueError):
        gather_entries(src, np.array([4], np.int64), np.array([-1], np.int64))  # a negative length
    with pytest.raises(ValueError):
        gather_entries(src, np.array([0, 4], np.int64), np.array([1], np.int64))  # lo and n differ
    with pytest.raises(ValueError):
        gather_entries((src[0][:9], *src[1:]), lo, n)  # fields of different lengths
    with pytest.raises(ValueError):
        gather_entries((*src[:3], src[3][:9]), lo, n)
    with pytest.raises(ValueError):  # a field of another dtype is refused, not copied into the right one
        gather_entries((*src[:3], src[3].astype(np.float64)), lo, n)
    new = tuple(np.array([100, 101]).astype(t) for t in DTYPES)
    with pytest.raises(ValueError):
        gather_entries(src, lo, n, new, np.array([4, 1], np.int64))  # decreasing
    with pytest.raises(ValueError):
        gather_entries(src, lo, n, new, np.array([1, 8], np.int64))  # past the 7 gathered entries
    got = gather_entries(src, lo, n, new, np.array([3, 7], np.int64))
    assert [g.tolist() for g in got] == [[2, 3, 4, 100, 5, 6, 7, 8, 101]] * 4


def _engine(rng, rows, lengths, base_ratio, touch_batches, compact, fanout=2):
    """An engine of ``rows`` rows (lengths drawn from ``lengths``) in a few batches, then
    ``touch_batches`` batches of new keys and repeated keys into existing rows (delta runs)."""
    engine = RowEngine(fanout=fanout, base_ratio=base_ratio)
    cols = rng.permutation(np.arange(1, 4 * rows + 1, dtype=np.uint64))[:rows]
    feats = rng.integers(0, 4, rows).astype(np.uint64)
    n = rng.choice(lengths, rows)
    for part in np.array_split(np.arange(rows), 3):
        if part.shape[0]:
            apply(engine, _batch(rng, cols[part], feats[part], n[part]))
    for _ in range(touch_batches):
        pick = rng.choice(rows, min(rows, int(rng.integers(1, 6))), replace=False)
        apply(engine, _batch(rng, cols[pick], feats[pick], rng.integers(1, 40, pick.shape[0]), small=True))
    if compact:
        engine.compact()
    return engine


def _batch(rng, cols, feats, n, small=False):
    from giaannd.model.rows import RowBatch

    total = int(n.sum())
    hi = 3 if small else 1 << 40  # small key spaces: repeated keys (adds in place) besides new ones
    return RowBatch.from_entries(np.repeat(cols, n), np.repeat(feats, n), rng.integers(0, 3, total),
                                 rng.integers(0, hi, total, dtype=np.uint64),
                                 rng.integers(0, 1 << 40 if not small else 20, total, dtype=np.uint64),
                                 rng.random(total, dtype=np.float32) + np.float32(0.01))


def _row_by_row(engine, ids):
    """The reference: each row read alone (``RowEngine.read``: its base slice merged with its delta
    entries by run.merge_into_slice), concatenated."""
    rows = [engine.read(int(i)) for i in ids]
    offsets = np.zeros(len(rows) + 1, np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    return offsets, [np.concatenate([getattr(r, f) for r in rows] or [np.empty(0, t)])
                     for f, t in zip(FIELDS, (np.uint8, np.uint64, np.uint64, np.float32))]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 60),
       lengths=st.sampled_from([(1,), (1, 2, 50), (5000, 10_000), (1, 50, 10_000)]),
       base_ratio=st.sampled_from([1, 4, 1000]), touch_batches=st.integers(0, 8), compact=st.booleans())
def test_engine_gather_equals_rows_read_one_by_one(seed, rows, lengths, base_ratio, touch_batches, compact):
    """Rows of 1-10,000 entries, in the base only or partly in delta runs (base_ratio 1: entries stay
    in delta runs until they hold as much as the base, 1000: folded at once), ids in order,
    shuffled, repeated, a subset: the gather is the rows read one by one."""
    rng = np.random.default_rng(seed)
    engine = _engine(rng, rows, np.array(lengths), base_ratio, touch_batches, compact)
    ids = np.arange(engine.num_rows, dtype=np.int64)
    for order in (ids, rng.permutation(ids), rng.choice(ids, 2 * ids.shape[0]), ids[::3], ids[:0]):
        offsets, got = engine.gather(order)
        want_offsets, want = _row_by_row(engine, order)
        assert offsets.tolist() == want_offsets.tolist()
        for f, w in zip(FIELDS, want):
            assert _bytes(getattr(got, f)) == _bytes(w), f


def test_engine_gather_merges_entries_of_several_delta_runs():
    """A fixed case that surely has delta runs (several, unfolded) holding entries of gathered
    rows, before and after their rows' base entries: the gather merges them in key order."""
    rng = np.random.default_rng(3)
    engine = _engine(rng, 40, np.array([1, 50, 3000]), 1000, 0, True)
    engine.base_ratio, engine.fanout = 1, 1  # from here on: no fold; no tier merge of shrinking runs
    for per_row in (64, 16, 4, 1):
        pick = rng.choice(40, 5, replace=False)
        a, b = engine.keys()
        apply(engine, _batch(rng, a[pick], b[pick], np.full(5, per_row)))
    assert engine.num_deltas >= 2
    ids = rng.permutation(np.arange(engine.num_rows, dtype=np.int64))
    offsets, got = engine.gather(ids)
    want_offsets, want = _row_by_row(engine, ids)
    assert any(engine.read(int(i)).st.base is None for i in ids)  # some rows are merged copies
    assert offsets.tolist() == want_offsets.tolist()
    for f, w in zip(FIELDS, want):
        assert _bytes(getattr(got, f)) == _bytes(w), f
    offsets, many = engine.read_many(ids)  # compacts first, then gathers the base alone
    assert engine.num_deltas == 0
    for f, w in zip(FIELDS, want):
        assert _bytes(getattr(many, f)) == _bytes(w), f


def test_gather_entries_writes_where_alloc_says_and_checks_what_it_returns():
    """``alloc``: the result is the caller's buffers (a stream's reused pages), checked before the
    kernel writes (it has no bounds checks)."""
    rng = np.random.default_rng(3)
    src = _fields(rng, 100)
    lo, n = np.array([5, 50, 0]), np.array([10, 20, 3])
    bufs = tuple(np.zeros(64, t) for t in DTYPES)
    got = gather_entries(src, lo, n, alloc=lambda total: tuple(b[:total] for b in bufs))
    assert all(g.base is b for g, b in zip(got, bufs))
    assert [_bytes(g) for g in got] == [_bytes(x) for x in gather_entries(src, lo, n)]
    for wrong in (lambda total: tuple(b[: total - 1] for b in bufs),  # too short
                  lambda total: tuple(np.zeros(total, np.float64) for _ in bufs),  # other dtypes
                  lambda total: tuple(b[: 2 * total : 2] for b in bufs),  # not contiguous
                  lambda total: tuple(b[:total] for b in bufs[:3])):  # three fields
        with pytest.raises(ValueError):
            gather_entries(src, lo, n, alloc=wrong)


def _ranges_reference(run, row_ids):
    """``Run.ranges`` as whole-array passes (the code before the kernel)."""
    rows, n = run.rows, run.rows.shape[0]
    if n and int(rows[-1]) == n - 1:
        lo = run.offsets[np.minimum(row_ids, n)]
        return lo, np.where(row_ids < n, run.offsets[np.minimum(row_ids + 1, n)], lo)
    i = np.searchsorted(rows, row_ids)
    lo = run.offsets[i]
    if n == 0:
        return lo, lo
    held = rows[np.minimum(i, n - 1)] == row_ids
    return lo, np.where(held, run.offsets[np.minimum(i + 1, n)], lo)


@pytest.mark.parametrize("seed", range(8))
def test_run_ranges_equal_the_whole_array_rule(seed):
    """Runs holding every id below their count (indexed directly) and runs holding some ids
    (searched), empty runs; ids held, absent, past the last."""
    from giaannd.rowengine.run import Run, offsets_of

    rng = np.random.default_rng(seed)
    for direct in (True, False):
        count = int(rng.integers(0, 40))
        rows = (np.arange(count) if direct else np.sort(rng.choice(100, count, replace=False))).astype(np.int64)
        offsets = offsets_of(rng.integers(1, 9, count).astype(np.int64))
        total = int(offsets[-1])
        run = Run(rows, offsets, *(np.zeros(total, t) for t in DTYPES))
        ids = rng.integers(0, 120, int(rng.integers(0, 30))).astype(np.int64)
        got, want = run.ranges(ids), _ranges_reference(run, ids)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
