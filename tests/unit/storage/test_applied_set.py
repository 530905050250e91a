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
    assert AppliedSet.from_arrays(*s.to_arrays()) == s


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
