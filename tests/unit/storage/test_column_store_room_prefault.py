"""The room a stream receiver reserves (``ColumnStore.reserve``) is mapped by a thread ahead of the
chunks that fill it (giaannd/prefault.py): the pages are resident before any row is written, the
rows written into the room are the rows applied, and the thread stops when the streams close
(``allow_huge_pages``)."""

from __future__ import annotations

import gc
import sys
import time

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.rowengine import RowEngine
from giaannd.storage import ColumnStore
from giaannd.storage.engine.column_store import PREFAULT_LEAD_ENTRIES
from giaannd.storage.engine.regions import ENTRY_BYTES
from tests.unit.smaps import resident_share

STREAM = 0x5EED


def _new_rows(rng: np.random.Generator, rows: int, per_row: int, first_feature: int) -> RowBatch:
    n = rows * per_row
    return RowBatch.from_entries(
        np.repeat(np.arange(1, rows + 1, dtype=np.uint64), per_row),
        np.full(n, first_feature, np.uint64),
        rng.integers(0, 3, n), rng.integers(0, 10**6, n), rng.integers(0, 10**6, n),
        rng.random(n, dtype=np.float32) + np.float32(0.01))


def test_engine_room_names_the_base_buffers_and_their_fill_after_a_reserve():
    engine = RowEngine()
    assert engine.room() is None  # no spare room yet
    engine.reserve(10_000)
    room = engine.room()
    assert room is not None
    buffers, used = room
    assert used == 0 and len(buffers) == 4 and all(b.shape[0] >= 10_000 for b in buffers)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE and /proc are Linux's")
def test_reserve_maps_the_rooms_pages_ahead_of_any_write_up_to_the_lead():
    store = ColumnStore(1 << 40)
    lead = PREFAULT_LEAD_ENTRIES
    store.reserve(3 * lead * ENTRY_BYTES // 2)  # a room half again the lead: only the lead is mapped
    room = store.engine.room()
    assert room is not None
    tc = room[0][1]  # the target columns' buffer (uint64: the largest)
    pre = store._prefault  # noqa: SLF001 - the thread under test
    assert pre is not None
    deadline = time.monotonic() + 60
    while pre.mapped < lead and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # (time for a thread without a bound to map the rest: ~50 ms here)
    assert pre.mapped == lead  # up to the lead, not past it: no row written yet
    assert resident_share(tc, 0, lead) >= 0.99
    assert resident_share(tc, lead + (1 << 16), tc.shape[0]) <= 0.05  # (a page's rounding at its start)
    store.allow_huge_pages()  # (the streams closed: the thread stops)
    assert store._prefault is None  # noqa: SLF001


def test_rows_written_into_a_mapped_room_are_the_rows_applied_and_the_thread_stops_with_the_streams():
    rng = np.random.default_rng(3)
    batches = [_new_rows(rng, 200, 50, i) for i in range(8)]
    mapped, plain = ColumnStore(1 << 40), ColumnStore(1 << 40)
    for store in (mapped, plain):
        store.append_writers.add(STREAM)
    mapped.reserve(sum(b.nbytes for b in batches))
    for i, b in enumerate(batches):  # (the thread may still be mapping: it writes nothing)
        mapped.apply(BatchId(STREAM, i + 1), b)
        plain.apply(BatchId(STREAM, i + 1), b)
    got, want = mapped.read_all(), plain.read_all()
    for field in ("row_column", "row_feature", "offsets", "segment", "target_column", "target_feature", "strength"):
        assert np.array_equal(getattr(got, field), getattr(want, field)), field
    mapped.allow_huge_pages()
    assert mapped._prefault is None  # noqa: SLF001


def test_the_thread_stops_when_the_base_leaves_the_room_or_the_store_is_dropped():
    """A stream whose source died never closes: its room's thread must not outlive the room (the
    base moved to other buffers) nor the store, waiting for rows that never come."""
    lead = PREFAULT_LEAD_ENTRIES
    moved = ColumnStore(1 << 40)
    moved.reserve(3 * lead * ENTRY_BYTES // 2)
    pre = moved._prefault  # noqa: SLF001 - the thread under test
    assert pre is not None
    moved.copy_base()  # (the base in new buffers, as when a fold outgrows the room)
    assert pre.wait(30)
    dropped = ColumnStore(1 << 40)
    dropped.reserve(3 * lead * ENTRY_BYTES // 2)
    pre = dropped._prefault  # noqa: SLF001
    assert pre is not None
    del dropped
    gc.collect()
    assert pre.wait(30)
