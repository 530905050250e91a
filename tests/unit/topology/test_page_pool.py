"""A stream source's page buffers (streaming/pages.py): pages read into reused buffers equal fresh
reads; a set comes back only for the page it was lent to, only once, and the pool stays bounded."""

import gc

import numpy as np

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import ColumnStore
from giaannd.storage.streaming.pages import PagePool
from giaannd.storage.streaming.stream import StreamSender
from tools.cluster_harness import make_batch


def _store(rows=400, per_row=9):
    rng = np.random.default_rng(1)
    store = ColumnStore(1 << 30)
    for seq in range(1, 6):
        columns = rng.choice(np.arange(1, 50, dtype=np.uint64), rows)
        store.apply(BatchId(1, seq), make_batch(rng, rows, per_row, columns))
    return store


def _same(a: RowBatch, b: RowBatch) -> bool:
    return all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


def test_pages_read_into_reused_buffers_equal_fresh_reads():
    store = _store()
    keys = store.keys()
    cols = np.array([k[0] for k in keys], np.uint64)
    feats = np.array([k[1] for k in keys], np.uint64)
    pool = PagePool(entries=50_000, keep=2)
    for lo in range(0, len(keys), 150):
        sl = slice(lo, lo + 150)
        page = store.read_rows(cols[sl], feats[sl], pool.take)
        assert _same(page, store.read_rows(cols[sl], feats[sl]))
        assert pool.give_back(page)
    assert pool.allocations == 1 and pool.reused >= 2


def test_a_set_comes_back_once_and_only_from_the_page_it_was_lent_to():
    pool = PagePool(entries=100, keep=1)
    fields = pool.take(40)
    page = RowBatch(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.array([0, 40]), *fields)
    fresh = RowBatch(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.array([0, 40]),
                     *(np.empty(40, f.dtype) for f in fields))
    assert not pool.give_back(fresh)  # not the pool's
    assert pool.give_back(page)
    assert not pool.give_back(page)  # once
    again = pool.take(100)
    assert again[1].base is fields[1].base and pool.reused == 1
    big = pool.take(101)  # over the pool's size: fresh arrays, never lent
    big_page = RowBatch(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.array([0, 101]), *big)
    assert big[0].base is None and not pool.give_back(big_page)


def test_the_pool_keeps_at_most_keep_sets_and_holds_none_it_lent():
    pool = PagePool(entries=10, keep=2)
    pages = [RowBatch(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.array([0, 5]), *pool.take(5))
             for _ in range(5)]
    assert pool.allocations == 5
    assert all(pool.give_back(p) for p in pages)
    assert pool.idle_sets == 2
    del pages  # (acknowledged pages are dropped by the sender)
    lost = pool.take(5)  # lent, never given back (a page cut into parts): freed with the page
    assert pool.lent_sets == 1
    del lost
    gc.collect()
    assert pool.lent_sets == 0


def test_acknowledged_items_are_returned_to_the_sender():
    """``StreamSender.on_position`` / ``rewind`` return the items they acknowledged (the runner
    gives their pages back to the pool), each once, in order."""
    store = _store(rows=60)
    keys = store.keys()
    cols = np.array([k[0] for k in keys], np.uint64)
    feats = np.array([k[1] for k in keys], np.uint64)
    sender = StreamSender(5, np.unique(cols), cols, feats, chunk_bytes=2000, window=4)
    for _ in range(4):
        sender.read_chunk(store.read_rows)
        sender.next_to_send()
    assert [i.index for i in sender.on_position(2)] == [0, 1]
    assert sender.on_position(2) == []
    assert [i.index for i in sender.rewind(3)] == [2]
