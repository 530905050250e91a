"""The scan's k-way merge (client/scan_merge.py): page streams in key order into one, a page at a
time; replicas held twice keep the first stream's row; an empty (missing) stream; cut rows."""

import numpy as np

from giaannd.client.scan_merge import PageMerge, rows_upto, take_rows
from giaannd.model.rows import RowBatch


def _batch(keys, tag=1.0, per_row=2):
    n = len(keys) * per_row
    sc = np.repeat(np.array([k[0] for k in keys], np.uint64), per_row)
    sf = np.repeat(np.array([k[1] for k in keys], np.uint64), per_row)
    return RowBatch.from_entries(sc, sf, np.zeros(n, np.uint8), np.tile(np.arange(per_row, dtype=np.uint64),
                                 len(keys)), np.zeros(n, np.uint64), np.full(n, tag, np.float32))


def _pages(keys, size, tag=1.0):
    return [_batch(keys[i : i + size], tag) for i in range(0, len(keys), size)]


def _run(streams):
    """Feed ``streams`` (lists of pages) through a PageMerge; the batches out and the merge."""
    merge = PageMerge(len(streams))
    its = [iter(s) for s in streams]
    out = []
    for _ in range(10_000):
        if merge.done:
            return out, merge
        for i in merge.wanted():
            merge.feed(i, next(its[i], None))
        got = merge.pop()
        if got is not None:
            got.validate()
            out.append(got)
    raise AssertionError("merge did not finish")


def _keys(out):
    return [(int(c), int(f)) for b in out for c, f in zip(b.row_column, b.row_feature)]


def test_merge_of_interleaved_streams_is_in_key_order_holding_a_page_per_stream():
    rng = np.random.default_rng(3)
    keys = sorted({(int(c), int(f)) for c, f in zip(rng.integers(0, 500, 900), rng.integers(0, 4, 900))})
    owner = rng.integers(0, 3, len(keys))
    streams = [_pages([k for k, o in zip(keys, owner) if o == i], size) for i, size in enumerate((7, 30, 1))]
    out, merge = _run(streams)
    assert _keys(out) == keys and merge.duplicates == 0
    assert max(b.num_rows for b in out) <= 7 + 30 + 1  # never more than one page per stream held


def test_merge_keeps_the_first_streams_row_where_replicas_disagree_and_skips_a_missing_stream():
    a = [_batch([(1, 0), (3, 0)], tag=1.0), _batch([(5, 0)], tag=1.0)]
    b = [_batch([(2, 0), (3, 0), (4, 0)], tag=9.0)]  # (3, 0): a replica that disagrees with a's
    out, merge = _run([a, [], b])
    whole = RowBatch.concat(out)
    assert _keys(out) == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0)] and merge.duplicates == 1
    assert whole.row(2).strength.tolist() == [1.0, 1.0]  # the first stream's copy, not summed


def test_merge_passes_a_row_cut_across_pages_in_order():
    row = _batch([(4, 1)], per_row=10)
    pieces = [take_rows(row, np.array([0])) for _ in range(2)]
    first = RowBatch(pieces[0].row_column, pieces[0].row_feature, np.array([0, 6]), *[x[:6] for x in (
        row.segment, row.target_column, row.target_feature, row.strength)])
    rest = RowBatch(row.row_column, row.row_feature, np.array([0, 4]), *[x[6:] for x in (
        row.segment, row.target_column, row.target_feature, row.strength)])
    a = [RowBatch.concat([_batch([(1, 0)]), first]), rest, _batch([(9, 0)])]
    b = [_batch([(2, 0), (5, 0)])]
    out, _ = _run([a, b])
    whole = RowBatch.concat(out)
    assert _keys([whole]) == [(1, 0), (2, 0), (4, 1), (5, 0), (9, 0)]
    assert whole.row(2).target_column.tolist() == list(range(10))


def test_rows_upto_counts_keys_at_or_below():
    b = _batch([(1, 5), (2, 0), (2, 3), (7, 0)])
    assert [rows_upto(b, *k) for k in [(0, 9), (1, 5), (2, 1), (2, 3), (9, 0)]] == [0, 1, 2, 3, 4]
