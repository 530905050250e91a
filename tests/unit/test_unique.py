"""``giaannd.unique.unique``: numpy's ``np.unique`` by a sort (numpy 2.4 hashes first, 10-40x
slower on 64-bit ids): the same values, dtype and order for every input the project gives it."""

from __future__ import annotations

import numpy as np
import pytest

from giaannd.unique import unique


@pytest.mark.parametrize("n, high", [(0, 1), (1, 5), (2, 1), (7, 3), (1000, 50), (20000, 10**9), (5000, 2**62)])
@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int32, np.uint8])
def test_unique_equals_numpy_unique(n: int, high: int, dtype: type) -> None:
    rng = np.random.default_rng(n)
    values = rng.integers(0, min(high, np.iinfo(dtype).max), n).astype(dtype)
    got, want = unique(values), np.unique(values)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_unique_keeps_its_input_and_takes_lists_and_other_shapes() -> None:
    ids = np.array([5, 3, 5, 1, 3], np.int64)
    np.testing.assert_array_equal(unique(ids), [1, 3, 5])
    np.testing.assert_array_equal(ids, [5, 3, 5, 1, 3])
    np.testing.assert_array_equal(unique([[2, 1], [2, 0]]), np.unique([[2, 1], [2, 0]]))  # flattened
    np.testing.assert_array_equal(unique(np.int64(4)), np.unique(np.int64(4)))  # 0-d
    np.testing.assert_array_equal(unique(np.array([True, False, True])), [False, True])
    np.testing.assert_array_equal(unique(np.uint64(2**64 - 1) - np.arange(3, dtype=np.uint64)),
                                  np.uint64(2**64 - 1) - np.arange(3, dtype=np.uint64)[::-1])


def test_unique_of_floats_is_numpys_nans_collapsed() -> None:
    values = np.array([np.nan, 1.0, np.nan, 0.5])
    np.testing.assert_array_equal(unique(values), np.unique(values))
    assert np.isnan(unique(values)).sum() == 1
