"""bounded_read.pick_bounded against the rule it compiles, written as whole-array passes (the code
``ColumnStore.read_bounded`` ran before)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.storage.engine.bounded_read import pick_bounded


def _reference(ids, lengths, max_entries, max_large):
    n = np.zeros(ids.shape[0], np.int64)  # 0: absent
    n[ids >= 0] = lengths[ids[ids >= 0]]
    large = n > max_entries
    listed = large & (np.cumsum(large) <= max_large)
    taken = (n > 0) & ~large
    over = (large & ~listed) | (taken & (np.cumsum(np.where(taken, n, 0)) > max_entries))
    stop = int(np.argmax(over)) if over.any() else ids.shape[0]
    return np.flatnonzero(taken[:stop]), np.flatnonzero(listed[:stop]), stop


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), keys=st.integers(0, 80), rows=st.integers(1, 60),
       max_entries=st.integers(1, 400), max_large=st.integers(0, 4))
def test_pick_bounded_equals_the_whole_array_rule(seed, keys, rows, max_entries, max_large):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3 * max_entries + 2, rows).astype(np.int64)
    ids = rng.integers(-1, rows, keys).astype(np.int64)  # -1: absent
    got = pick_bounded(ids, lengths, max_entries, max_large)
    pick, listed, stop = _reference(ids, lengths, max_entries, max_large)
    assert got.pick.tolist() == pick.tolist() and got.listed.tolist() == listed.tolist() and got.stop == stop


def test_pick_bounded_refuses_an_id_past_the_lengths():
    with pytest.raises(ValueError):
        pick_bounded(np.array([0, 3], np.int64), np.array([5, 5, 5], np.int64), 10, 1)
