"""The compiled canonical check (rowengine/canon.py) against ``RowBatch.validate``, the numpy
reference: random rows, each broken (or not) one way at a random entry."""

import numpy as np
import pytest

from giaannd.client.row_parts import check_canonical_row
from giaannd.model.rows import NUM_SEGMENTS, RowBatch
from giaannd.protocol import ProtocolViolation
from giaannd.rowengine.canon import first_non_canonical


def _row(rng, n):
    """A canonical row of ``n`` entries: sorted unique (segment, column, feature) keys."""
    keys = np.unique(np.stack([rng.integers(0, NUM_SEGMENTS, 3 * n), rng.integers(0, 50, 3 * n),
                               rng.integers(0, 50, 3 * n)], axis=1), axis=0)[:n]
    return (keys[:, 0].astype(np.uint8), keys[:, 1].astype(np.uint64), keys[:, 2].astype(np.uint64),
            rng.random(keys.shape[0], dtype=np.float32))


def _reference(seg, tc, tf, st):
    """Whether numpy's validate accepts the entries as one row."""
    n = seg.shape[0]
    batch = RowBatch(np.array([1], np.uint64), np.array([1], np.uint64), np.array([0, n], np.int64), seg, tc, tf, st)
    try:
        batch.validate()
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("seed", range(40))
def test_canon_agrees_with_numpy_validate(seed):
    rng = np.random.default_rng(seed)
    seg, tc, tf, st = _row(rng, int(rng.integers(1, 400)))
    n = seg.shape[0]
    i = int(rng.integers(0, n))
    how = seed % 5
    if how == 1:
        seg[i] = NUM_SEGMENTS + int(rng.integers(0, 3))
    elif how == 2:
        st[i] = rng.choice([np.inf, -np.inf, np.nan])
    elif how == 3 and n > 1:  # a duplicate key
        j = max(i, 1)
        seg[j], tc[j], tf[j] = seg[j - 1], tc[j - 1], tf[j - 1]
    elif how == 4 and n > 1:  # two entries swapped
        j = max(i, 1)
        for a in (seg, tc, tf):
            a[j - 1], a[j] = a[j].copy(), a[j - 1].copy()
    got = first_non_canonical(seg, tc, tf, st, NUM_SEGMENTS)
    assert (got < 0) == _reference(seg, tc, tf, st)
    if got >= 0:  # the first bad entry: everything before it is canonical
        assert _reference(seg[:got], tc[:got], tf[:got], st[:got])
        assert not _reference(seg[: got + 1], tc[: got + 1], tf[: got + 1], st[: got + 1])
        with pytest.raises(ProtocolViolation):
            check_canonical_row(seg, tc, tf, st, "row")
    else:
        check_canonical_row(seg, tc, tf, st, "row")


def test_canon_names_what_is_wrong():
    seg, tc, tf, st = (np.zeros(3, np.uint8), np.arange(3, dtype=np.uint64), np.zeros(3, np.uint64),
                       np.ones(3, np.float32))
    st[2] = np.nan
    with pytest.raises(ProtocolViolation, match="non-finite strength"):
        check_canonical_row(seg, tc, tf, st, "row")
    st[2], seg[1] = 1, NUM_SEGMENTS
    with pytest.raises(ProtocolViolation, match="segment out of range"):
        check_canonical_row(seg, tc, tf, st, "row")
    seg[1], tc[2] = 0, 1
    with pytest.raises(ProtocolViolation, match="not sorted and unique"):
        check_canonical_row(seg, tc, tf, st, "row")


@pytest.mark.parametrize("seed", range(30))
def test_entries_fault_is_the_batch_check_without_the_row_keys(seed):
    """``entries_fault`` (a snapshot's rows, whose keys are checked apart) finds what
    ``batch_fault`` finds on the same rows under ascending keys."""
    from giaannd.rowengine.canon import BATCH_FAULTS, batch_fault, entries_fault

    rng = np.random.default_rng(100 + seed)
    rows = [_row(rng, int(rng.integers(1, 60))) for _ in range(int(rng.integers(1, 12)))]
    seg, tc, tf, st = (np.concatenate([r[k] for r in rows]) for k in range(4))
    offsets = np.concatenate([[0], np.cumsum([r[0].shape[0] for r in rows])]).astype(np.int64)
    n = seg.shape[0]
    i = int(rng.integers(0, n))
    how = seed % 4
    if how == 1:
        seg[i] = NUM_SEGMENTS
    elif how == 2:
        st[i] = np.nan
    elif how == 3:  # an entry not after the one before, inside a row (across rows it is no fault)
        inside = np.setdiff1d(np.arange(1, n), offsets[1:-1])
        if inside.size == 0:
            how = 0
        else:
            j = int(rng.choice(inside))
            seg[j], tc[j], tf[j] = seg[j - 1], tc[j - 1], tf[j - 1]
    ascending = np.arange(len(rows), dtype=np.uint64)
    want = batch_fault(ascending, ascending, offsets, seg, tc, tf, st, NUM_SEGMENTS)
    assert entries_fault(offsets, seg, tc, tf, st, NUM_SEGMENTS) == want
    assert BATCH_FAULTS[want] != "rows not sorted and unique"
    assert (want != 0) == (how != 0)  # the damage is found, and only it
