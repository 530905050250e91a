"""ColumnInfo (issue 7): the storage core's per-column counts and digests, paged, without I/O."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from giaannd import protocol as p
from giaannd.model.rows import RowBatch
from giaannd.storage.engine.column_store import ENTRY_BYTES, ROW_OVERHEAD_BYTES
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.replication.hints import HintStore
from giaannd.storage.replication.requests import Answer, StorageRequests, fold_row_digest

U64_MAX = (1 << 64) - 1
#: (column, features): a column before, the one under test, one after, and the id-space edges.
LAYOUT = {0: [0, 3], 4: [1, 2], 5: [0, 1, 7, 9, 11], 6: [0], U64_MAX: [0, U64_MAX]}


def _rows(layout: dict[int, list[int]], seed: int = 0) -> RowBatch:
    """Each (column, feature) row gets 1..4 entries with random targets and strengths."""
    rng = np.random.default_rng(seed)
    sc, sf, tc, tf = [], [], [], []
    for col, feats in layout.items():
        for f in feats:
            n = int(rng.integers(1, 5))
            sc += [col] * n
            sf += [f] * n
            tc += rng.integers(1, 1000, n).tolist()
            tf += list(range(n))
    m = len(sc)
    return RowBatch.from_entries(np.array(sc, np.uint64), np.array(sf, np.uint64), np.zeros(m, np.uint8),
                                 np.array(tc, np.uint64), np.array(tf, np.uint64),
                                 rng.random(m, dtype=np.float32) + 0.5)


def _open(path: Path) -> StorageRequests:
    return StorageRequests(DurableStore.open(path / "store", 1 << 22), HintStore.open(path / "hints"), "",
                           lambda: None)


@pytest.fixture
def core(tmp_path: Path) -> Iterator[StorageRequests]:
    c = _open(tmp_path)
    yield c
    c.store.close()
    c.hints.close()


def _apply(core: StorageRequests, batch: RowBatch, seq: int) -> None:
    core.handle(p.encode(p.ApplyBatch(1, seq)), batch.buffers())


def _pages(core: StorageRequests, column: int, limit: int = p.MAX_COLUMN_INFO_ROWS) -> list[p.ColumnInfoPage]:
    pages: list[p.ColumnInfoPage] = []
    msg = p.ColumnInfo(column, limit=limit)
    for _ in range(100):
        step = core.handle(p.encode(msg), [])
        assert isinstance(step, Answer) and isinstance(step.reply, p.ColumnInfoPage), step
        pages.append(step.reply)
        if step.reply.done:
            return pages
        msg = p.ColumnInfo(column, step.reply.next_feature, True, limit)
    raise AssertionError("column info did not finish in 100 pages")


def _total(pages: list[p.ColumnInfoPage]) -> tuple[int, int, int, int, int, int]:
    return (sum(x.rows for x in pages), sum(x.entries for x in pages), sum(x.bytes for x in pages),
            sum(x.keys_digest for x in pages) % (1 << 64), sum(x.strength_digest for x in pages) % (1 << 64),
            sum(x.batches for x in pages))


def _expected(core: StorageRequests, column: int) -> tuple[int, int, int, int, int, int]:
    store = core.store.store
    keys = [k for k in store.keys() if k[0] == column]  # noqa: SIM118 (the sorted key list)
    entries = sum(len(row) for k in keys if (row := store.row(k)) is not None)
    digests = [(k, store.digest(k)) for k in keys]
    return (len(keys), entries, entries * ENTRY_BYTES + len(keys) * ROW_OVERHEAD_BYTES,
            sum(fold_row_digest(*k, d.keys) for k, d in digests if d) % (1 << 64),
            sum(fold_row_digest(*k, d.strength) for k, d in digests if d) % (1 << 64),
            sum(d.batches for _, d in digests if d))


@pytest.mark.parametrize("limit", [1, 2, 3, p.MAX_COLUMN_INFO_ROWS])
def test_column_info_counts_only_that_column_in_any_page_size(core: StorageRequests, limit: int) -> None:
    _apply(core, _rows(LAYOUT), 1)
    for column, feats in LAYOUT.items():
        got = _total(_pages(core, column, limit))
        assert got == _expected(core, column)
        assert got[0] == len(feats)
    pages = _pages(core, 5, 2)
    assert len(pages) == 3 and [x.rows for x in pages] == [2, 2, 1]


def test_column_info_absent_column_is_empty_and_done(core: StorageRequests) -> None:
    _apply(core, _rows(LAYOUT), 1)
    for column in (1, 3, 5 + 1000, U64_MAX - 1):
        (page,) = _pages(core, column)
        assert (page.rows, page.entries, page.bytes, page.keys_digest, page.batches) == (0, 0, 0, 0, 0)


def test_column_info_digest_agrees_across_batch_splits_and_detects_difference(tmp_path: Path) -> None:
    """Two replicas that applied the same rows in different batches agree on the keys digest (the
    batch counts differ, and say so); a replica missing a row, or holding other targets, differs."""
    a, b, c = (_open(tmp_path / n) for n in "abc")
    try:
        whole = _rows(LAYOUT, seed=1)
        _apply(a, whole, 1)
        cols = np.asarray(whole.row_column)
        _apply(b, whole.select_rows(cols < 5), 1)
        _apply(b, whole.select_rows(cols >= 5), 2)
        assert _total(_pages(a, 5, 2))[:5] == _total(_pages(b, 5, 3))[:5]
        _apply(c, _rows({k: v for k, v in LAYOUT.items() if k != 5} | {5: [0, 1, 7, 9]}, seed=1), 1)
        assert _total(_pages(c, 5))[3] != _total(_pages(a, 5))[3]
        assert _total(_pages(c, 4))[3] == _total(_pages(a, 4))[3]
    finally:
        for x in (a, b, c):
            x.store.close()
            x.hints.close()


def test_column_info_bad_requests_are_typed(core: StorageRequests) -> None:
    for payload in (b"\x92\x09", p.encode(p.ColumnInfo(5))[:-1]):
        step = core.handle(payload, [])
        assert isinstance(step, Answer) and isinstance(step.reply, p.BadRequest)
    raw = bytearray(p.encode(p.ColumnInfo(5, limit=1)))
    raw[-1] = 0  # limit 0
    step = core.handle(bytes(raw), [])
    assert isinstance(step, Answer) and isinstance(step.reply, p.BadRequest)
