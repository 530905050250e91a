import numpy as np
import pytest

from giaannd.model.rows import Row, RowBatch, merge_rows


def _batch(rng, n, ncols=5, nfeat=4):
    return RowBatch.from_entries(
        rng.integers(1, ncols, n), rng.integers(0, nfeat, n), rng.integers(0, 9, n),
        rng.integers(1, ncols, n), rng.integers(0, nfeat, n), rng.random(n).astype(np.float32),
    )


def _as_dict(batch):
    out = {}
    for (c, f), row in batch:
        for s, tc, tf, v in zip(row.segment, row.target_column, row.target_feature, row.strength):
            out[(c, f, int(s), int(tc), int(tf))] = out.get((c, f, int(s), int(tc), int(tf)), 0.0) + float(v)
    return out


def test_rowbatch_from_entries_sums_duplicates_and_is_canonical():
    b = RowBatch.from_entries([2, 1, 2, 2], [0, 3, 0, 0], [8, 1, 8, 3], [7, 7, 7, 7], [1, 1, 1, 1],
                              np.array([1.0, 2.0, 0.5, 4.0], np.float32))
    b.validate()
    assert b.num_rows == 2 and b.num_entries == 3
    assert b.key(0) == (1, 3) and b.key(1) == (2, 0)
    r = b.row(1)
    assert list(r.segment) == [3, 8] and list(r.strength) == [4.0, 1.5]


def test_rowbatch_concat_equals_sum_of_parts():
    rng = np.random.default_rng(1)
    parts = [_batch(rng, 200) for _ in range(4)]
    total = RowBatch.concat(parts)
    total.validate()
    want = {}
    for p in parts:
        for k, v in _as_dict(p).items():
            want[k] = want.get(k, 0.0) + v
    got = _as_dict(total)
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 1e-5 for k in want)


def test_rowbatch_buffers_roundtrip_and_select_rows():
    rng = np.random.default_rng(2)
    b = _batch(rng, 500)
    again = RowBatch.from_buffers(b.buffers())
    assert _as_dict(again) == _as_dict(b)
    mask = (b.row_column % 2) == 0
    sub = b.select_rows(mask)
    sub.validate()
    assert {k for k, _ in sub} == {b.key(i) for i in np.flatnonzero(mask)}
    for k, row in sub:
        i = [j for j in range(b.num_rows) if b.key(j) == k][0]
        assert row.equals(b.row(i))


@pytest.mark.parametrize("breaker", ["unsorted_rows", "bad_offsets", "segment", "nan", "dtype"])
def test_rowbatch_validate_rejects_bad_batches(breaker):
    rng = np.random.default_rng(3)
    bufs = [a.copy() for a in _batch(rng, 100).buffers()]
    if breaker == "unsorted_rows":
        bufs[0] = bufs[0][::-1].copy()
    elif breaker == "bad_offsets":
        bufs[2][-1] += 1
    elif breaker == "segment":
        bufs[3][0] = 9
    elif breaker == "nan":
        bufs[6][0] = np.nan
    elif breaker == "dtype":
        bufs[6] = bufs[6].astype(np.float64)
    with pytest.raises(ValueError):
        RowBatch.from_buffers(bufs)


def test_merge_rows_adds_equal_keys():
    a = Row(np.array([1, 8], np.uint8), np.array([5, 5], np.uint64), np.array([0, 2], np.uint64),
            np.array([1.0, 2.0], np.float32))
    d = Row(np.array([3, 8], np.uint8), np.array([5, 5], np.uint64), np.array([0, 2], np.uint64),
            np.array([0.5, 0.25], np.float32))
    m = merge_rows(a, d)
    assert list(m.segment) == [1, 3, 8] and list(m.strength) == [1.0, 0.5, 2.25]


def _validate_reference(b):
    """``RowBatch.validate`` as it was before its fast form (np.* wrappers, a boundary mask)."""
    from giaannd.model.rows import NUM_SEGMENTS

    r, n = b.num_rows, b.num_entries
    if b.row_feature.shape[0] != r or b.offsets.shape[0] != r + 1:
        raise ValueError("row batch: row arrays disagree in length")
    if not (b.segment.shape[0] == b.target_column.shape[0] == b.target_feature.shape[0] == n):
        raise ValueError("row batch: entry arrays disagree in length")
    if b.offsets[0] != 0 or b.offsets[-1] != n or np.any(np.diff(b.offsets) < 0):
        raise ValueError("row batch: offsets are not a partition of the entries")
    if n and int(b.segment.max()) >= NUM_SEGMENTS:
        raise ValueError(f"row batch: segment out of range (max {int(b.segment.max())})")
    if not np.all(np.isfinite(b.strength)):
        raise ValueError("row batch: non-finite strength")
    if r > 1:
        rc, rf = b.row_column, b.row_feature
        if not np.all((rc[1:] > rc[:-1]) | ((rc[1:] == rc[:-1]) & (rf[1:] > rf[:-1]))):
            raise ValueError("row batch: rows not sorted and unique")
    if n > 1:
        seg, tc, tf = b.segment, b.target_column, b.target_feature
        later = (tc[1:] > tc[:-1]) | ((tc[1:] == tc[:-1]) & (tf[1:] > tf[:-1]))
        gt = (seg[1:] > seg[:-1]) | ((seg[1:] == seg[:-1]) & later)
        boundary = np.zeros(n - 1, dtype=bool)
        inner = b.offsets[1:-1]
        boundary[inner[(inner > 0) & (inner < n)] - 1] = True
        if not np.all(gt | boundary):
            raise ValueError("row batch: entries of a row not sorted and unique")


def _outcome(fn, b):
    try:
        fn(b)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("seed", range(40))
def test_rowbatch_validate_agrees_with_reference_on_broken_batches(seed):
    """Canonical batches pass and every kind of broken one is refused with the same message."""
    rng = np.random.default_rng(seed)
    good = _batch(rng, int(rng.integers(0, 60)))
    assert _outcome(RowBatch.validate, good) is None
    for _ in range(30):
        bufs = [x.copy() for x in good.buffers()]
        which = int(rng.integers(0, 8))
        if which == 7:
            bufs = [x[: max(0, x.shape[0] - 1)] if i == int(rng.integers(0, 7)) else x for i, x in enumerate(bufs)]
        elif bufs[which].size:
            i = int(rng.integers(0, bufs[which].size))
            if which == 6:
                bufs[6][i] = rng.choice([np.nan, np.inf, -np.inf, 0.5])
            elif which == 3:
                bufs[3][i] = rng.choice([0, 3, 8, 9, 255])
            elif which == 2:
                bufs[2][i] = int(rng.integers(-2, good.num_entries + 3))
            else:
                bufs[which][i] = rng.integers(0, 6)
        b = RowBatch(*bufs)
        assert _outcome(RowBatch.validate, b) == _outcome(_validate_reference, b)


@pytest.mark.parametrize("empty_rows", [0, 1, 3])
def test_rowbatch_validate_allows_a_row_start_below_the_row_before_with_empty_rows_between(empty_rows):
    """A row's first entry may sort below the previous row's last, also where empty rows share that
    row start (counted once), and not anywhere else: the same outcome as the reference."""
    rows = 2 + empty_rows
    rc = np.arange(rows, dtype=np.uint64)
    rf = np.zeros(rows, np.uint64)
    offsets = np.array([0, 2] + [2] * empty_rows + [4], np.int64)
    seg = np.array([5, 6, 1, 2], np.uint8)  # the last row starts below the first's end
    tc = np.zeros(4, np.uint64)
    tf = np.zeros(4, np.uint64)
    st = np.ones(4, np.float32)
    good = RowBatch(rc, rf, offsets, seg, tc, tf, st)
    assert _outcome(RowBatch.validate, good) is None is _outcome(_validate_reference, good)
    bad = RowBatch(rc, rf, offsets, np.array([5, 6, 2, 1], np.uint8), tc, tf, st)  # inside the last row
    assert _outcome(RowBatch.validate, bad) == _outcome(_validate_reference, bad) is not None
    worse = RowBatch(rc, rf, offsets, np.array([6, 5, 1, 2], np.uint8), tc, tf, st)  # inside the first row
    assert _outcome(RowBatch.validate, worse) == _outcome(_validate_reference, worse) is not None
