"""Row-size distribution of a storage node (``UsageReply.row_size_log2``, issue 21): the pure
histogram, the store's cached answer, the protocol field an older peer leaves out, and the
``GetUsage`` answer."""

from __future__ import annotations

import msgspec
import numpy as np

from giaannd import protocol as p
from giaannd.model.rows import Row, RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore
from giaannd.storage.engine.column_store import log2_histogram

from ._gen import random_batch


def _rows(sizes: list[int], first_column: int = 1) -> RowBatch:
    """One row per size (columns first_column, first_column + 1, ...), distinct entry keys."""
    n = sum(sizes)
    cols = np.repeat(np.arange(first_column, first_column + len(sizes), dtype=np.uint64), sizes)
    pos = np.arange(n) - np.repeat(np.cumsum([0, *sizes[:-1]]), sizes)
    return RowBatch.from_entries(cols, np.zeros(n, np.uint64), np.zeros(n, np.uint8), np.ones(n, np.uint64),
                                 pos.astype(np.uint64), np.ones(n, np.float32))


def test_log2_histogram_hand_computed() -> None:
    # 1 -> 0; 2, 3 -> 1; 4 -> 2; 1000 -> 9 (512 <= 1000 < 1024)
    assert log2_histogram(np.array([1, 2, 3, 4, 1000], np.int64)) == [1, 2, 1, 0, 0, 0, 0, 0, 0, 1]
    # powers of two and their neighbours, where a float log2 would round
    assert log2_histogram(np.array([7, 8, 1023, 1024, 2**52 - 1, 2**52], np.int64)) == \
        [0, 0, 1, 1] + [0] * 5 + [1, 1] + [0] * 40 + [1, 1]
    assert log2_histogram(np.array([], np.int64)) == []
    assert log2_histogram(np.array([0, 0], np.int64)) == []  # an empty row is no row


def test_column_store_row_size_log2_follows_applies_and_drops() -> None:
    s = ColumnStore(1 << 40)
    assert s.row_size_log2() == []
    s.apply(BatchId(1, 1), _rows([1, 2, 3, 4, 1000]))
    assert s.row_size_log2() == [1, 2, 1, 0, 0, 0, 0, 0, 0, 1]
    # a row grows (1 -> 2 entries: new keys in column 1) without a new row: the cache is not stale
    s.apply(BatchId(1, 2), RowBatch.from_entries(np.ones(1, np.uint64), np.zeros(1, np.uint64),
                                                 np.zeros(1, np.uint8), np.full(1, 9, np.uint64),
                                                 np.full(1, 9, np.uint64), np.ones(1, np.float32)))
    assert s.row_size_log2() == [0, 3, 1, 0, 0, 0, 0, 0, 0, 1]
    s.drop_columns(np.array([5], np.uint64))  # the 1000-entry row
    assert s.row_size_log2() == [0, 3, 1]


def _recount(s: ColumnStore) -> list[int]:
    return log2_histogram(np.diff(s.read_all().offsets))


def test_column_store_row_size_counts_equal_a_recount_through_every_path() -> None:
    """The counts kept by each length change (new rows, in-place adds, growth, drop, bulk and
    row loads) equal a histogram of the rows recounted from scratch."""
    rng = np.random.default_rng(11)
    s = ColumnStore(1 << 40)
    for i in range(30):
        s.apply(BatchId(1, i + 1), random_batch(rng, entries=int(rng.integers(20, 400)), key_space=60))
        assert s.row_size_log2() == _recount(s)
        if i % 7 == 6:
            s.drop_columns(np.unique(s.read_all().row_column)[:2])
            assert s.row_size_log2() == _recount(s)
    assert len(s.row_size_log2()) > 4  # rows of many sizes were met
    everything = s.read_all()
    bulk = ColumnStore(1 << 40)
    bulk.load_bulk(everything.row_column, everything.row_feature, everything.offsets,
                   Row(everything.segment, everything.target_column, everything.target_feature, everything.strength),
                   np.ones(everything.num_rows, np.uint64))
    assert bulk.row_size_log2() == s.row_size_log2()
    one = ColumnStore(1 << 40)
    for key in s.keys():
        one.load_row(key, np.frombuffer(s.row_region(key), np.uint8).copy(), 1)
    assert one.row_size_log2() == s.row_size_log2()


class _UsageBefore(msgspec.Struct, frozen=True, tag=67):
    """``UsageReply`` as a node older than ``row_size_log2`` sends it."""

    capacity_bytes: int
    used_bytes: int
    num_rows: int
    num_entries: int
    is_full: bool
    hints_held: int = 0
    disk_bytes: int = 0
    disk_free_bytes: int = 0
    disk_total_bytes: int = 0


def test_usage_reply_row_size_log2_round_trip_and_old_peer() -> None:
    msg = p.UsageReply(10, 5, 1, 2, False, 3, 4, 5, 6, [1, 0, 2])
    assert p.decode_reply(p.encode(msg)) == msg
    old = p.decode_reply(msgspec.msgpack.encode(_UsageBefore(10, 5, 1, 2, False, 3, 4, 5, 6)))
    assert isinstance(old, p.UsageReply) and old.row_size_log2 is None and old.disk_total_bytes == 6
    # a newer reply read by an older node: the field is ignored
    assert msgspec.msgpack.decode(p.encode(msg), type=_UsageBefore).disk_total_bytes == 6
