"""The install path for rows a batch creates (column_store.INSTALL_NEW_ROWS) against the general
merge path: the same rows bit for bit, the same accounting, touches and refusals."""

from __future__ import annotations

import numpy as np
import pytest

from giaannd.model.rows import Row, RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore, StoreFullError
from giaannd.storage.engine import column_store
from giaannd.storage.engine.column_store import _cut_regions, _install_regions

from ._gen import same_state


def _batch(rng: np.random.Generator, columns: np.ndarray, rows: int, max_len: int) -> RowBatch:
    """Rows of 1..max_len entries (lengths spread around INSTALL_CONCAT_ENTRIES) over ``columns``."""
    lengths = rng.integers(1, max_len + 1, rows)
    n = int(lengths.sum())
    return RowBatch.from_entries(
        np.repeat(rng.choice(columns, rows), lengths), np.repeat(rng.integers(0, 6, rows), lengths),
        rng.integers(0, 9, n), rng.integers(0, 40, n).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15),
        rng.integers(0, 2**64 - 1, n, dtype=np.uint64), rng.standard_normal(n).astype(np.float32),
    )


def _apply_both(monkeypatch: pytest.MonkeyPatch, fast: ColumnStore, slow: ColumnStore,
                bid: BatchId, batch: RowBatch) -> None:
    monkeypatch.setattr(column_store, "INSTALL_NEW_ROWS", True)
    assert fast.apply(bid, batch)
    monkeypatch.setattr(column_store, "INSTALL_NEW_ROWS", False)
    assert slow.apply(bid, batch)


def _assert_same(fast: ColumnStore, slow: ColumnStore) -> None:
    assert same_state(fast, slow)
    assert fast.usage() == slow.usage()
    for key, touches, region in fast.iter_slots():
        assert slow.digest(key) == fast.digest(key) and fast.digest(key).batches == touches
        assert bytes(region) == bytes(slow.row_region(key) or b"")


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("concat_entries", [column_store.INSTALL_CONCAT_ENTRIES, 1, 10**9])
def test_install_path_equals_merge_path_on_random_batches(monkeypatch: pytest.MonkeyPatch, seed: int,
                                                          concat_entries: int) -> None:
    monkeypatch.setattr(column_store, "INSTALL_CONCAT_ENTRIES", concat_entries)
    rng = np.random.default_rng(seed)
    columns = rng.integers(0, 2**64 - 1, 25, dtype=np.uint64)
    fast, slow = ColumnStore(1 << 40), ColumnStore(1 << 40)
    for i in range(1, 9):  # batches of new rows, stored rows (small and LARGE) and both at once
        batch = _batch(rng, columns, int(rng.integers(1, 40)), int(rng.choice([3, 80, 700])))
        _apply_both(monkeypatch, fast, slow, BatchId(seed, i), batch)
        _assert_same(fast, slow)


def test_install_regions_equal_cut_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(99)
    batch = _batch(rng, rng.integers(0, 2**64 - 1, 50, dtype=np.uint64), 60, 200)
    want = _cut_regions(batch.offsets, Row(batch.segment, batch.target_column, batch.target_feature,
                                           batch.strength))
    for threshold in (1, 64, 150, 10**9):
        monkeypatch.setattr(column_store, "INSTALL_CONCAT_ENTRIES", threshold)
        got = _install_regions(batch)
        assert len(got) == len(want)
        assert all(g.dtype == np.uint8 and g.flags.owndata and np.array_equal(g, w) for g, w in zip(got, want))


def test_install_path_refuses_a_batch_that_does_not_fit() -> None:
    rng = np.random.default_rng(5)
    batch = _batch(rng, rng.integers(0, 2**64 - 1, 5, dtype=np.uint64), 10, 100)
    probe = ColumnStore(1 << 40)
    probe.apply(BatchId(1, 1), batch)
    fits = probe.used_bytes
    tight = ColumnStore(fits - 1)
    with pytest.raises(StoreFullError):
        tight.apply(BatchId(1, 1), batch)
    assert len(tight) == 0 and tight.used_bytes == 0 and BatchId(1, 1) not in tight.applied
    exact = ColumnStore(fits)
    assert exact.apply(BatchId(1, 1), batch) and same_state(exact, probe)


def test_install_path_regions_do_not_share_the_batch_buffers() -> None:
    """Rows installed from a batch own their memory: changing the batch afterwards changes nothing."""
    rng = np.random.default_rng(6)
    batch = _batch(rng, rng.integers(0, 2**64 - 1, 5, dtype=np.uint64), 6, 300)
    store = ColumnStore(1 << 40)
    store.apply(BatchId(1, 1), batch)
    before = store.read_all()
    batch.strength[:] += 1
    after = store.read_all()
    assert np.array_equal(before.strength, after.strength)
