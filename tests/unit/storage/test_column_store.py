"""ColumnStore: merge-add equals the plain sum, idempotency, capacity refusal, reads, digests."""

from __future__ import annotations

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore, StoreFullError
from giaannd.storage.engine.column_store import ENTRY_BYTES

from ._gen import random_batch, same_state

BIG = 1 << 40


def _equal_batches(a: RowBatch, b: RowBatch, rtol: float = 1e-6) -> bool:
    same_keys = all(np.array_equal(x, y) for x, y in zip(a.buffers()[:6], b.buffers()[:6]))
    return same_keys and bool(np.allclose(a.strength, b.strength, rtol=rtol, atol=0))


def test_column_store_apply_equals_sum_of_batches() -> None:
    rng = np.random.default_rng(3)
    batches = [random_batch(rng) for _ in range(25)]
    s = ColumnStore(BIG)
    for i, b in enumerate(batches):
        assert s.apply(BatchId(1, i + 1), b)
    s.read_all().validate()
    assert _equal_batches(s.read_all(), RowBatch.concat(batches))


def test_column_store_duplicate_batch_ignored() -> None:
    rng = np.random.default_rng(4)
    b = random_batch(rng)
    s = ColumnStore(BIG)
    assert s.apply(BatchId(9, 1), b)
    before = s.read_all()
    assert not s.apply(BatchId(9, 1), b)
    assert _equal_batches(before, s.read_all(), rtol=0)
    key = s.keys()[0]
    assert s.digest(key).batches == 1  # type: ignore[union-attr]


def test_column_store_full_refuses_without_change() -> None:
    rng = np.random.default_rng(5)
    b1, b2 = random_batch(rng), random_batch(rng, entries=2000, key_space=1000)
    s = ColumnStore(BIG)
    s.apply(BatchId(1, 1), b1)
    small = ColumnStore(s.used_bytes + 10 * ENTRY_BYTES)
    small.apply(BatchId(1, 1), b1)
    ref = ColumnStore(BIG)
    ref.apply(BatchId(1, 1), b1)
    with pytest.raises(StoreFullError) as err:
        small.apply(BatchId(1, 2), b2)
    assert "store full" in str(err.value) and err.value.capacity_bytes == small.capacity_bytes
    assert same_state(small, ref)
    assert (1, 2) not in small.applied
    # A batch that only adds to existing keys needs no new entries: still fits.
    assert small.apply(BatchId(1, 3), b1)
    tight = ColumnStore(1)
    with pytest.raises(StoreFullError):
        tight.apply(BatchId(1, 1), b1)
    assert tight.usage().is_full is False and len(tight) == 0


def test_column_store_usage_reports_full() -> None:
    rng = np.random.default_rng(6)
    b = random_batch(rng)
    s = ColumnStore(BIG)
    s.apply(BatchId(1, 1), b)
    exact = ColumnStore(s.used_bytes)
    exact.apply(BatchId(1, 1), b)
    u = exact.usage()
    assert u.is_full and exact.is_full and u.num_entries == b.num_entries and u.num_rows == b.num_rows


def test_column_store_rejects_bad_batch_without_change() -> None:
    rng = np.random.default_rng(7)
    b = random_batch(rng)
    s = ColumnStore(BIG)
    bad = RowBatch(b.row_column, b.row_feature, b.offsets, b.segment, b.target_column, b.target_feature,
                   np.full_like(b.strength, np.nan))
    with pytest.raises(ValueError):
        s.apply(BatchId(1, 1), bad)
    with pytest.raises(ValueError):
        s.apply(BatchId(1, 0), b)
    assert len(s) == 0 and len(s.applied) == 0


def test_column_store_read_rows_and_region() -> None:
    rng = np.random.default_rng(8)
    b = random_batch(rng)
    s = ColumnStore(BIG)
    s.apply(BatchId(1, 1), b)
    keys = s.keys()
    want = [keys[3], keys[0], (1, 2)]  # unsorted, plus an absent key
    got = s.read_rows([k[0] for k in want], [k[1] for k in want])
    got.validate()
    assert [got.key(i) for i in range(got.num_rows)] == sorted([keys[0], keys[3]])
    row = s.row(keys[0])
    assert row is not None and got.row(0).equals(row)
    region = s.row_region(keys[0])
    assert region is not None and region.nbytes == ENTRY_BYTES * len(row) and region.contiguous


def test_column_store_digest_changes_with_content() -> None:
    rng = np.random.default_rng(9)
    b = random_batch(rng)
    s = ColumnStore(BIG)
    s.apply(BatchId(1, 1), b)
    key = s.keys()[0]
    d1 = s.digest(key)
    s.apply(BatchId(1, 2), b.select_rows(np.arange(b.num_rows) == 0))
    d2 = s.digest(key)
    assert d1 is not None and d2 is not None
    assert d1.keys == d2.keys and d1.strength != d2.strength and d2.batches == 2
    assert s.digest((0, 0)) is None


def test_column_store_stale_prepare_is_refused() -> None:
    rng = np.random.default_rng(10)
    s = ColumnStore(BIG)
    p1 = s.prepare(BatchId(1, 1), random_batch(rng))
    p2 = s.prepare(BatchId(1, 2), random_batch(rng))
    assert p1 is not None and p2 is not None
    s.commit(p1)
    with pytest.raises(RuntimeError):
        s.commit(p2)


def test_column_store_reserve_makes_a_prepare_stale_before_anything_changes() -> None:
    # reserve may replace the engine's base run, so a plan made before it is stale: the commit is
    # refused before the batch id is recorded (it was recorded, then the engine refused the plan:
    # the id applied without its rows, and a retry of the batch ignored)
    rng = np.random.default_rng(11)
    first, batch = random_batch(rng), random_batch(rng)
    s = ColumnStore(BIG)
    s.apply(BatchId(1, 1), first)
    prepared = s.prepare(BatchId(1, 2), batch)
    assert prepared is not None
    before = s.read_all()
    s.reserve(1 << 20)
    with pytest.raises(RuntimeError, match="stale PreparedApply"):
        s.commit(prepared)
    assert BatchId(1, 2) not in s.applied
    assert _equal_batches(before, s.read_all(), rtol=0)
    assert s.apply(BatchId(1, 2), batch)
    ref = ColumnStore(BIG)
    ref.apply(BatchId(1, 1), first)
    ref.apply(BatchId(1, 2), batch)
    assert same_state(s, ref)


@pytest.mark.parametrize("append", [False, True])
def test_column_store_capacity_counts_a_new_writers_floor(append: bool) -> None:
    # a writer's first batch here with seq > 1 stores two ids (its floor, 0, and the seq): the check
    # counted one, so a batch one applied id past the capacity was applied
    rng = np.random.default_rng(12)
    first, batch = random_batch(rng), random_batch(rng, columns=9)

    def loaded(capacity: int) -> ColumnStore:
        s = ColumnStore(capacity)
        if append:
            s.append_writers.add(2)
        s.apply(BatchId(1, 1), first)
        return s

    probe = loaded(BIG)
    probe.apply(BatchId(2, 5), batch)
    need = probe.used_bytes
    tight = loaded(need - 1)
    ref = loaded(BIG)
    with pytest.raises(StoreFullError):
        tight.apply(BatchId(2, 5), batch)
    assert same_state(tight, ref) and tight.used_bytes == ref.used_bytes
    exact = loaded(need)
    assert exact.apply(BatchId(2, 5), batch) and exact.used_bytes == exact.capacity_bytes


def test_column_store_read_part_of_a_long_row_with_a_delta_holds_only_the_part() -> None:
    """A part of a 10^6-entry row with one delta entry: the entries of the whole row's slice, in an
    array of the part's size. Before, the row was merged whole (21 MB here; 2.1 GB at 10^8 entries
    for every 8 MiB part of a bounded read) and the part was a view that kept that copy alive."""
    store = ColumnStore(BIG)
    n = 1_000_000
    tf = np.arange(0, 2 * n, 2, dtype=np.uint64)
    store.apply(BatchId(1, 1), RowBatch.from_entries(np.full(n, 7), np.zeros(n), np.zeros(n), np.zeros(n), tf,
                                                     np.ones(n, np.float32)))
    store.fold_deltas()
    store.apply(BatchId(1, 2), RowBatch.from_entries([7], [0], [0], [0], [1_000_001], np.array([2.0], np.float32)))
    whole = store.row((7, 0))
    assert whole is not None
    part = store.read_part((7, 0), 499_500, 1_024)
    assert part.entries == n + 1 and len(part.part) == 1_024
    held = part.part.target_feature.base if part.part.target_feature.base is not None else part.part.target_feature
    assert held.nbytes <= 1_024 * 8
    assert np.array_equal(part.part.target_feature, whole.target_feature[499_500:500_524])
    assert np.array_equal(part.part.strength, whole.strength[499_500:500_524])
