"""AppliedSet: same membership as a plain set, compact with floors, exact round trip."""

from __future__ import annotations

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
