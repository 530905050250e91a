"""Column sets (storage/streaming/column_sets.py) agree with numpy's set functions, edges of the
uint64 range included."""

from __future__ import annotations

import numpy as np
import pytest

from giaannd.storage.streaming.column_sets import member, missing, with_columns

EDGES = np.array([0, 1, 2, 2**63, 2**64 - 2, 2**64 - 1], np.uint64)


@pytest.mark.parametrize("seed", range(5))
def test_member_and_with_columns_agree_with_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    columns = np.zeros(0, np.uint64)
    for _ in range(30):
        values = np.concatenate([rng.choice(EDGES, int(rng.integers(0, 4))),
                                 rng.integers(0, 50, int(rng.integers(0, 20))).astype(np.uint64)])
        assert member(values, columns).tolist() == np.isin(values, columns).tolist()
        assert missing(columns, values).tolist() == np.setdiff1d(values, columns).tolist()
        grown = with_columns(columns, values)
        assert grown.dtype == np.uint64 and grown.tolist() == np.union1d(columns, values).tolist()
        if np.isin(values, columns).all():
            assert grown is columns  # nothing new: the same array
        columns = grown


def test_key_difference_is_the_lexsort_reference():
    """``sorted_keys.difference`` (a stream's rows created since it opened) against set arithmetic
    on key tuples, with shared columns, shared features and empty sides."""
    from giaannd.storage.engine.sorted_keys import difference

    rng = np.random.default_rng(5)
    for trial in range(60):
        n_a, n_b = rng.integers(0, 300, 2)
        pool = [(int(c), int(f)) for c, f in rng.integers(0, 8 if trial % 2 else 2**63, (600, 2))]
        a = sorted(set(pool[:n_a]))
        b = sorted(set(pool[n_a // 2: n_a // 2 + n_b]))

        def arr(keys, i):
            return np.array([k[i] for k in keys], np.uint64)

        oc, of = difference(arr(a, 0), arr(a, 1), arr(b, 0), arr(b, 1))
        want = sorted(set(a) - set(b))
        assert list(zip(oc.tolist(), of.tolist())) == want
