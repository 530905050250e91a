"""The room a stream receiver reserves (``ColumnStore.reserve``) is mapped by a thread ahead of the
chunks that fill it (giaannd/prefault.py): the pages are resident before any row is written, the
rows written into the room are the rows applied, and the thread stops when the streams close
(``allow_huge_pages``)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.rowengine import RowEngine
from giaannd.storage import ColumnStore

STREAM = 0x5EED


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
def test_reserve_maps_the_rooms_pages_before_anything_is_written():
    store = ColumnStore(1 << 40)
    room_bytes = 96 << 20
    before = _resident_bytes()
    store.reserve(room_bytes)
    assert store._prefault is not None  # noqa: SLF001 - the thread under test
    assert store._prefault.wait(60)  # noqa: SLF001
    grown = _resident_bytes() - before
    assert grown >= 0.8 * room_bytes, f"only {grown} of {room_bytes} bytes of room resident"


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
