"""The key order's sort (sorted_keys.py ``_sorted``, through ``sorted_rows``): by column, then by
(column's rank, feature) packed into one key where both fit, else ``lexsort`` of both; the same
order and ids as ``lexsort`` of both whatever the keys, repeats included."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.storage.engine.sorted_keys import sorted_rows


def _lexsorted(c, f, n):
    order = np.lexsort((f[:n], c[:n]))
    return c[order], f[order], np.arange(n, dtype=np.int64)[order]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 2000), columns=st.integers(1, 60),
       column_bits=st.sampled_from([3, 40, 64]), feature_bits=st.sampled_from([1, 20, 50, 63, 64]),
       distinct=st.booleans())
def test_sorted_rows_is_lexsort_order(seed, n, columns, column_bits, feature_bits, distinct):
    """Features narrow (packed) and wide (past 64 bits with the ranks: ``lexsort``), columns of any
    width, keys distinct (a store's) or repeated (ties in id order, as ``lexsort`` keeps them)."""
    rng = np.random.default_rng(seed)
    col_values = rng.integers(0, 2**column_bits - 1, columns, dtype=np.uint64, endpoint=True)
    c = rng.choice(col_values, n) if n else np.zeros(0, np.uint64)
    f = rng.integers(0, 2**feature_bits - 1, n, dtype=np.uint64, endpoint=True)
    if distinct and n:
        keys = np.unique(np.stack([c, f]), axis=1)
        keys = keys[:, rng.permutation(keys.shape[1])]
        c, f = keys[0].copy(), keys[1].copy()
    extra = 3  # rows past num_rows are not sorted in
    c_all, f_all = np.append(c, np.zeros(extra, np.uint64)), np.append(f, np.zeros(extra, np.uint64))
    (got_c, got_f, got_ids), got_columns = sorted_rows(c_all, f_all, c.shape[0])
    want_c, want_f, want_ids = _lexsorted(c_all, f_all, c.shape[0])
    assert got_c.dtype == np.uint64 and got_f.dtype == np.uint64 and got_ids.dtype == np.int64
    assert got_c.tolist() == want_c.tolist() and got_f.tolist() == want_f.tolist()
    assert got_ids.tolist() == want_ids.tolist()
    assert got_columns.tolist() == np.unique(c).tolist()


def test_sorted_rows_peak_memory_is_its_output_and_two_arrays():
    """A store's first listing sorts every key, on a node holding 10^9 rows: the packed sort frees
    each temporary once used. Its peak, with the ids ``sorted_rows`` makes (8 bytes a key) and the
    three output arrays (24), is 56 bytes a key; it was 80 when the packed key, the sorted copies
    and the ids' order were all alive at once."""
    import tracemalloc

    rng = np.random.default_rng(3)
    columns, features = (rng.integers(0, k, 100_000, dtype=np.uint64) for k in (5_000, 3_000))
    keys = np.unique(columns * np.uint64(4096) + features)
    keys = keys[rng.permutation(keys.shape[0])]
    c, f = keys >> np.uint64(12), keys & np.uint64(4095)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        sorted_rows(c, f, c.shape[0])
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak <= 60 * c.shape[0], peak / c.shape[0]
