"""AppliedSet: same membership as a plain set, compact with floors, exact round trip."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.protocol import BatchId
from giaannd.storage import AppliedSet


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), max_size=120))
def test_applied_set_membership_like_a_plain_set(ids: list[tuple[int, int]]) -> None:
    s, plain = AppliedSet(), set()
    for w, q in ids:
        s.add(BatchId(w, q))
        plain.add((w, q))
    for w in range(4):
        for q in range(1, 42):
            assert ((w, q) in s) == ((w, q) in plain)
    assert len(s) <= len(plain) + 4
    loaded = AppliedSet.from_arrays(*s.to_arrays())
    assert loaded == s
    # the same size after a restart (``used_bytes`` counts it): a writer whose floor is still 0
    # keeps its floor entry
    assert len(loaded) == len(s)


def test_applied_set_round_trip_keeps_a_zero_floor_entry() -> None:
    s = AppliedSet()
    s.add(BatchId(3, 5))  # a gap below: floor 0, one exception
    assert len(s) == 2
    assert len(AppliedSet.from_arrays(*s.to_arrays())) == 2


def test_applied_set_in_order_stays_one_entry_per_writer() -> None:
    s = AppliedSet()
    for q in range(1, 10_001):
        s.add(BatchId(7, q))
    assert len(s) == 1 and s.floor(7) == 10_000


def test_applied_set_floor_compacts_gaps() -> None:
    s = AppliedSet()
    for q in (2, 4, 6, 9):
        s.add(BatchId(1, q))
    assert len(s) == 5  # floor entry + 4 exceptions
    s.advance_floor(1, 5)
    assert (1, 3) in s and (1, 5) in s and (1, 6) in s and (1, 7) not in s and (1, 9) in s
    assert s.floor(1) == 6 and len(s) == 2


def test_applied_set_rejects_bad_ids_and_arrays() -> None:
    with pytest.raises(ValueError):
        AppliedSet().add(BatchId(1, 0))
    s = AppliedSet()
    s.add(BatchId(1, 5))
    w, f, c, e = s.to_arrays()
    with pytest.raises(ValueError, match="count"):
        AppliedSet.from_arrays(w, f, c + 1, e)
    e[0] = 0  # an exception at or below the writer's floor
    with pytest.raises(ValueError, match="invalid"):
        AppliedSet.from_arrays(w, f, c, e)


# -- which columns of a batch were applied (applied_set.py, "Which columns") ------------------------

def _cols(*c: int) -> np.ndarray:
    return np.array(c, np.uint64)


def test_applied_columns_of_a_tracked_writer_merge_and_are_forgotten_at_the_promise() -> None:
    s = AppliedSet()
    assert s.columns(BatchId(1, 5)).tolist() == []  # nothing applied, writer untracked
    s.promise(1, 0)
    assert s.tracked(1) and s.columns(BatchId(1, 5)).tolist() == []
    s.add(BatchId(1, 5), _cols(3, 9))
    s.add(BatchId(1, 5), _cols(4))  # another share of the same id
    s.add(BatchId(1, 6), _cols(3))
    assert s.columns(BatchId(1, 5)).tolist() == [3, 4, 9] and s.columns(BatchId(1, 6)).tolist() == [3]
    assert (1, 5) in s and (1, 6) in s
    s.promise(1, 5)
    assert s.columns(BatchId(1, 5)) is None and s.columns(BatchId(1, 6)).tolist() == [3]
    s.advance_floor(1, 6)
    assert s.columns(BatchId(1, 6)) is None and s.column_arrays()[2].shape == (0,)


def test_applied_columns_untracked_or_unknown_count_as_whole() -> None:
    s = AppliedSet()
    s.add(BatchId(2, 1), _cols(7))  # untracked writer (a stream's): no columns kept
    assert s.columns(BatchId(2, 1)) is None and s.column_arrays()[2].shape == (0,)
    s.promise(2, 0)
    s.add(BatchId(2, 1), _cols(8))  # applied before without columns: stays whole
    assert s.columns(BatchId(2, 1)) is None


def test_applied_columns_round_trip_and_reject_bad_arrays() -> None:
    s = AppliedSet()
    s.promise(1, 2)
    s.promise(4, 0)
    s.add(BatchId(1, 5), _cols(3, 9))
    s.add(BatchId(4, 1), _cols(1))
    t = AppliedSet.from_arrays(*s.to_arrays())
    t.load_column_arrays(*s.column_arrays())
    assert t == s and all(np.array_equal(a, b) for a, b in zip(t.column_arrays(), s.column_arrays()))
    assert t.promised(1) == 2 and t.tracked(4)
    tracked, promised, w, q, c, cols = s.column_arrays()
    with pytest.raises(ValueError, match="count"):
        AppliedSet.from_arrays(*s.to_arrays()).load_column_arrays(tracked, promised, w, q, c + 1, cols)
    with pytest.raises(ValueError, match="not applied"):
        AppliedSet().load_column_arrays(tracked, promised, w, q, c, cols)
    with pytest.raises(ValueError, match="not sorted"):
        AppliedSet.from_arrays(*s.to_arrays()).load_column_arrays(tracked, promised, w, q, c, cols[[1, 0, 2]])


def _load_reference(s: AppliedSet, tracked, promised, writers, seqs, counts, columns) -> dict:
    """The per-batch load this replaced (checks and result), as the reference."""
    promised_of = dict(zip(tracked.tolist(), promised.tolist()))
    out: dict = {}
    ends = np.cumsum(counts.astype(np.int64))
    for w, q, end, n in zip(writers.tolist(), seqs.tolist(), ends.tolist(), counts.tolist()):
        cols = columns[end - n: end]
        if (BatchId(w, q) not in s or q <= promised_of.get(w, 2**64 - 1)
                or (n > 1 and not np.all(cols[1:] > cols[:-1]))):
            raise ValueError("reference refuses")
        out.setdefault(w, {})[q] = cols.copy()
    return out


def test_applied_columns_load_matches_the_per_batch_reference_on_random_sets_and_damage() -> None:
    """The whole-array load against the loop per batch it replaced: random sets (several writers,
    floors, seqs above them, promises, untracked writers, empty column lists), their arrays loaded
    as saved and after one random change (a seq, a writer, a count, a column order, a promise)."""
    rng = np.random.default_rng(12)
    refused = loaded = 0
    for trial in range(300):
        s = AppliedSet()
        for w in rng.integers(1, 6, rng.integers(1, 4)).tolist():
            if rng.random() < 0.8:
                s.promise(w, int(rng.integers(0, 5)))
            for q in rng.choice(np.arange(1, 40), rng.integers(1, 12), replace=False).tolist():
                cols = np.unique(rng.integers(0, 50, rng.integers(0, 6)).astype(np.uint64))
                s.add(BatchId(w, q), cols)
        arrays = [a.copy() for a in s.column_arrays()]
        if trial % 3:
            k = int(rng.integers(0, 6))
            a = arrays[k]
            if k == 4 and a.size:  # a count: move one column between batches (the total stays)
                i, j = rng.integers(0, a.size, 2)
                if a[i]:
                    a[i] -= 1
                    a[j] += 1
            elif k == 5 and a.size > 1:
                a[:] = a[rng.permutation(a.size)]
            elif a.size:
                a[int(rng.integers(0, a.size))] = int(rng.integers(0, 45))
        base = AppliedSet.from_arrays(*s.to_arrays())
        try:
            want = _load_reference(base, *arrays)
        except ValueError:
            with pytest.raises(ValueError):
                AppliedSet.from_arrays(*s.to_arrays()).load_column_arrays(*arrays)
            refused += 1
            continue
        got = AppliedSet.from_arrays(*s.to_arrays())
        got.load_column_arrays(*arrays)
        assert {w: {q: c.tolist() for q, c in per.items()} for w, per in got._columns.items()} == \
            {w: {q: c.tolist() for q, c in per.items()} for w, per in want.items()}
        loaded += 1
    assert refused > 30 and loaded > 100


def test_len_beside_a_thread_that_adds_and_absorbs_writers() -> None:
    """``len`` (the store's ``used_bytes``, read on the event loop) while a worker thread applies a
    fold's held writes (adding exceptions, absorbing them into floors): writers enter and leave the
    exceptions' dict meanwhile. Before, a Python loop over that dict raised "dictionary changed
    size during iteration" (every run here; thread switches every microsecond make it likely)."""
    import sys
    import threading

    applied = AppliedSet()
    stop = threading.Event()

    def churn() -> None:
        floor = 0
        while not stop.is_set():
            floor += 10
            for w in range(1, 200):
                applied.add(BatchId(w, floor + 3))  # an exception above the floor: the writer enters
            for w in range(1, 200):
                applied.advance_floor(w, floor + 5)  # absorbed: the writer leaves

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(200_000):
            assert len(applied) >= 0
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(old)


def test_touching_lists_the_ids_a_share_may_still_come_for_among_columns() -> None:
    """``touching``: tracked writers' ids above their promises whose recorded columns meet the
    given ones (what a stream's chunk names); untracked writers' and promised ids are not listed."""
    s = AppliedSet()
    s.promise(1, 0)
    s.add(BatchId(1, 3), _cols(5, 9))
    s.add(BatchId(1, 4), _cols(11))
    s.add(BatchId(1, 6), _cols(2, 20))
    s.add(BatchId(2, 1), _cols(9))  # untracked: no columns recorded
    assert s.touching(_cols(9, 20)) == [BatchId(1, 3), BatchId(1, 6)]
    assert s.touching(_cols(1, 3, 4)) == [] and s.touching(_cols()) == []
    s.promise(1, 3)  # seq 3 will never be sent again: not listed any more
    assert s.touching(_cols(9, 20)) == [BatchId(1, 6)]
    assert AppliedSet().touching(_cols(9)) == []
