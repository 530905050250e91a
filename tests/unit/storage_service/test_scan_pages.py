"""Scan pages with a byte cap (issue 14 items 5 and 7): rows bigger than a page are cut into pieces
resumed by (row key, entry offset), so no row is unscannable; every page stays under its cap."""

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.model.rows import RowBatch
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.engine.row_scan import page_bytes
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import Answer, StorageRequests


def _rows(lengths, seed=0):
    """One row per length, keys (i + 1, i % 3), random distinct targets."""
    rng = np.random.default_rng(seed)
    parts = []
    for i, n in enumerate(lengths):
        targets = rng.choice(10**6, size=n, replace=False).astype(np.uint64)
        parts.append(RowBatch.from_entries(np.full(n, i + 1, np.uint64), np.full(n, i % 3, np.uint64),
                                           rng.integers(0, 9, n).astype(np.uint8), targets,
                                           rng.integers(0, 50, n, dtype=np.uint64),
                                           rng.integers(1, 9, n).astype(np.float32)))
    return RowBatch.concat(parts)


def _store(batch):
    s = ColumnStore(1 << 28)
    s.apply((1, 1), batch)
    return s


def _drain(store, limit_bytes, limit_rows=10**6, keep=None):
    pages, after, entry = [], None, 0
    for _ in range(10_000):
        res = store.scan(after, limit_rows, 10**9, 10**9, keep, limit_bytes=limit_bytes, after_entry=entry)
        res.batch.validate()
        pages.append(res.batch)
        if res.done:
            return pages
        after, entry = res.next_key, res.next_entry
    raise AssertionError("scan did not finish")


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


@pytest.mark.parametrize("cap", [200, 700, 5_000, 1 << 20])
def test_scan_cuts_a_row_bigger_than_a_page_and_every_page_fits_its_cap(cap):
    batch = _rows([3, 500, 17, 1, 2_000, 40, 40])
    store = _store(batch)
    pages = _drain(store, cap)
    assert all(pg.nbytes <= max(cap, page_bytes(1, 1)) for pg in pages)
    assert _same(RowBatch.concat(pages), store.read_all())
    if cap < 2_000 * 21:
        big = [pg for pg in pages if pg.num_rows == 1 and pg.row_column[0] == 5]
        assert len(big) > 1  # the 2,000-entry row came in pieces, in entry order
        assert np.array_equal(np.concatenate([pg.target_column for pg in big]), store.row((5, 1)).target_column)


def test_scan_without_a_byte_cap_sends_a_big_row_whole_alone_as_before():
    store = _store(_rows([3, 500, 17]))
    res = store.scan(None, 100, 10, 100)  # an older client: no limit_bytes, the row goes whole
    assert res.batch.num_rows == 1 and res.batch.num_entries == 3 and res.next_entry == 0
    res = store.scan(res.next_key, 100, 10, 100)
    assert res.batch.num_entries == 500 and res.next_entry == 0


def test_scan_cut_row_resumes_under_the_filter_and_after_a_dropped_row():
    batch = _rows([10, 300, 10, 10])
    store = _store(batch)
    keep_even = lambda cols: cols % 2 == 0  # noqa: E731
    pages = _drain(store, 1_000, keep=keep_even)
    got = RowBatch.concat(pages)
    assert got.row_column.tolist() == [2, 4]
    assert got.num_entries == 310
    res = store.scan((2, 1), 10, 10**9, 10**9, None, limit_bytes=1_000, after_entry=40)
    assert res.batch.row_column.tolist() == [2] and res.batch.num_entries > 0
    store.drop_columns([2])  # the cut row is gone: the scan goes on after it
    res = store.scan((2, 1), 10, 10**9, 10**9, None, limit_bytes=1_000, after_entry=40)
    assert res.batch.row_column.tolist() == [3, 4]


def test_scan_request_cuts_rows_and_refuses_a_piece_without_a_cursor(tmp_path):
    store = DurableStore.open(tmp_path / "store", 1 << 26)
    hints = HintStore.open(tmp_path / "hints")
    try:
        core = StorageRequests(store, hints, "a", lambda: None)
        batch = _rows([5, 3_000, 5])
        core.handle(p.encode(p.ApplyBatch(1, 1)), batch.buffers())
        pages, after = [], None
        for _ in range(1_000):
            msg = p.ScanRows(*(after[:2] if after else (0, 0)), after is not None, 100, max_bytes=4_096,
                             after_entry=after[2] if after else 0)
            ans = core.handle(p.encode(msg), [])
            assert isinstance(ans, Answer) and isinstance(ans.reply, p.ScanPage), ans
            page = p.check_batch(ans.bulk)
            assert page.nbytes <= 4_096
            pages.append(page)
            if ans.reply.done:
                break
            after = (ans.reply.next_column, ans.reply.next_feature, ans.reply.next_entry)
        assert _same(RowBatch.concat(pages), store.store.read_all()) and len(pages) > 10
        ans = core.handle(p.encode(p.ScanRows(after_entry=3, max_bytes=4_096)), [])
        assert isinstance(ans.reply, p.BadRequest)
    finally:
        store.close()
        hints.close()
