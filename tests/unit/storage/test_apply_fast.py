"""The vectorised batch apply (row_merge.plan_batch / merge_batch, ColumnStore.apply).

Every check compares against the plain per-row reference ``rows.merge_rows`` with *exact*
strengths (rtol 0): the batch path must add the same float32 values, not merely close ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from giaannd.model.rows import Row, RowBatch, RowKey, merge_rows
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore, StoreFullError
from giaannd.storage.engine import column_store
from giaannd.storage.engine.column_store import APPLIED_ID_BYTES, ENTRY_BYTES, ROW_OVERHEAD_BYTES
from giaannd.storage.engine.regions import pack_regions, unpack_regions
from giaannd.storage.engine.row_merge import concat_rows, merge_batch, plan_batch

from ._gen import random_batch, random_row

BIG = 1 << 40
TOP = 2**64 - 1


def _reference_apply(rows: dict[RowKey, Row], batch: RowBatch) -> None:
    for key, delta in batch:
        if len(delta):
            rows[key] = merge_rows(rows.get(key, Row.empty()), delta)


def _assert_store_equals(store: ColumnStore, rows: dict[RowKey, Row]) -> None:
    assert sorted(rows) == store.keys()
    for key, want in rows.items():
        got = store.row(key)
        assert got is not None and got.equals(want), key  # exact strengths
    usage = store.usage()
    assert usage.num_entries == sum(len(r) for r in rows.values())
    region_bytes = sum(region.nbytes for _, _, region in store.iter_slots())
    assert region_bytes == ENTRY_BYTES * usage.num_entries
    assert usage.used_bytes == region_bytes + ROW_OVERHEAD_BYTES * len(rows) + APPLIED_ID_BYTES * len(store.applied)


@pytest.mark.parametrize("seed", range(20))
def test_plan_and_merge_batch_equal_per_row_merge(seed: int) -> None:
    rng = np.random.default_rng(seed)
    r = int(rng.integers(1, 30))
    key_space = int(rng.integers(2, 40))
    bases = [random_row(rng, int(rng.integers(0, 3)) * int(rng.integers(0, 200)), key_space) for _ in range(r)]
    deltas = [random_row(rng, int(rng.integers(0, 60)), key_space) for _ in range(r)]
    offsets, delta = concat_rows(deltas)
    plan = plan_batch(*concat_rows(bases), offsets, delta)
    want = [merge_rows(b, d) for b, d in zip(bases, deltas)]
    assert plan.new_count.tolist() == [len(w) - len(b) for w, b in zip(want, bases)]
    for mask in (None, rng.random(r) < 0.5):
        out_offsets, out = merge_batch(plan, mask)
        picked = [w for i, w in enumerate(want) if mask is None or mask[i]]
        assert out_offsets.tolist() == concat_rows(picked)[0].tolist()
        for i, w in enumerate(picked):
            a, b = int(out_offsets[i]), int(out_offsets[i + 1])
            got = Row(out.segment[a:b], out.target_column[a:b], out.target_feature[a:b], out.strength[a:b])
            assert got.equals(w), (seed, i)


def test_plan_batch_extreme_keys_stay_in_their_rows() -> None:
    """Row index is the most significant key field: a delta key above every key of its stored row
    must not be matched against (or inserted into) the next row, whatever the id values."""
    def row(seg: list[int], tc: list[int], tf: list[int]) -> Row:
        return Row(np.array(seg, np.uint8), np.array(tc, np.uint64), np.array(tf, np.uint64),
                   np.ones(len(seg), np.float32))

    bases = [row([0], [0], [0]), row([0, 8], [0, TOP], [0, TOP])]
    deltas = [row([0, 8], [TOP, TOP], [TOP, TOP]), row([0, 8], [0, TOP], [0, TOP])]
    offsets, delta = concat_rows(deltas)
    plan = plan_batch(*concat_rows(bases), offsets, delta)
    assert plan.new_count.tolist() == [2, 0]
    out_offsets, out = merge_batch(plan)
    assert out_offsets.tolist() == [0, 3, 5]
    assert out.strength.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0]


def test_plan_batch_rejects_bad_offsets() -> None:
    with pytest.raises(ValueError, match="partition"):
        plan_batch(*concat_rows([Row.empty()]), np.array([0, 5], np.int64), Row.empty())
    with pytest.raises(ValueError, match="partition"):
        plan_batch(np.array([0, 1], np.int64), Row.empty(), np.array([0, 0], np.int64), Row.empty())


def test_store_apply_equals_plain_merge_exactly() -> None:
    """Absent rows, all-found rows (in place), growing rows, over many batches (the engine's base,
    delta runs, merges and folds all on the way)."""
    rng = np.random.default_rng(7)
    store = ColumnStore(BIG)
    rows: dict[RowKey, Row] = {}
    batch = RowBatch.empty()
    for i in range(40):
        if i % 2:
            # the previous batch's keys again (those rows merge in place) plus a few entries that
            # grow some rows: both commit paths in one batch
            again = RowBatch.from_buffers([*batch.buffers()[:6], rng.random(batch.num_entries, dtype=np.float32)])
            batch = RowBatch.concat([again, random_batch(rng, entries=5, columns=8, features=5)])
        else:
            batch = random_batch(rng, entries=int(rng.integers(1, 400)), columns=8, features=5,
                                 key_space=int(rng.integers(3, 30)))
        assert store.apply(BatchId(1, i + 1), batch)
        _reference_apply(rows, batch)
        _assert_store_equals(store, rows)


def test_store_apply_all_found_is_in_place_and_growth_replaces_region() -> None:
    rng = np.random.default_rng(8)
    store = ColumnStore(BIG)
    first = random_batch(rng, entries=300)
    store.apply(BatchId(1, 1), first)
    key = store.keys()[0]
    view = store.row(key)
    assert view is not None
    before = view.strength.copy()
    # the same keys again: every row in place, the old view sees the new strengths
    again = RowBatch.from_buffers([b.copy() for b in first.buffers()])
    store.apply(BatchId(1, 2), again)
    assert np.array_equal(view.strength, before + first.row(0).strength)
    assert store.digest(key) is not None and store.digest(key).batches == 2  # type: ignore[union-attr]
    # a new key in that row: a new region; the old view keeps the old data
    one = [np.array([v], np.uint64) for v in (key[0], key[1], 8, TOP, TOP)]
    grow = RowBatch.from_entries(one[0], one[1], one[2], one[3], one[4], np.ones(1, np.float32))
    store.apply(BatchId(1, 3), grow)
    row = store.row(key)
    assert row is not None and len(row) == len(view) + 1
    assert np.array_equal(view.strength, before + first.row(0).strength)
    assert store.digest(key).batches == 3  # type: ignore[union-attr]


def test_store_regions_are_private_copies() -> None:
    """The store keeps no view of a batch (a pooled receive buffer)."""
    rng = np.random.default_rng(9)
    batch = random_batch(rng, entries=500)
    store = ColumnStore(BIG)
    store.apply(BatchId(1, 1), batch)
    store.apply(BatchId(1, 2), random_batch(rng, entries=500))
    stored = [getattr(row, f) for row in map(store.row, store.keys()) if row is not None
              for f in ("segment", "target_column", "target_feature", "strength")]
    for buf in batch.buffers():
        assert not any(np.shares_memory(r, buf) for r in stored)
    snapshot = store.read_all()
    for buf in batch.buffers():
        buf[...] = 0  # the transport reuses its buffers
    assert all(np.array_equal(x, y) for x, y in zip(snapshot.buffers(), store.read_all().buffers()))


def test_store_full_refusal_is_exact_and_changes_nothing() -> None:
    rng = np.random.default_rng(10)
    first, batch = random_batch(rng), random_batch(rng)

    def loaded(capacity: int) -> ColumnStore:
        s = ColumnStore(capacity)
        s.apply(BatchId(1, 1), first)
        return s

    probe = loaded(BIG)
    before = probe.used_bytes
    probe.apply(BatchId(1, 2), batch)
    growth = probe.used_bytes - before  # rows and entries (the applied set may compact the id)
    # one byte short of the rows' growth: refused with nothing changed; with room for the rows and
    # an applied id (the check reserves one, conservatively): accepted
    tight = loaded(before + growth - 1)
    state = tight.read_all()
    with pytest.raises(StoreFullError):
        tight.apply(BatchId(1, 2), batch)
    assert all(np.array_equal(x, y) for x, y in zip(state.buffers(), tight.read_all().buffers()))
    assert BatchId(1, 2) not in tight.applied and tight.used_bytes == before
    assert loaded(before + growth + APPLIED_ID_BYTES).apply(BatchId(1, 2), batch)


def test_store_duplicate_and_invalid_batches_change_nothing() -> None:
    rng = np.random.default_rng(11)
    store = ColumnStore(BIG)
    batch = random_batch(rng)
    store.apply(BatchId(1, 1), batch)
    state = store.read_all()
    assert not store.apply(BatchId(1, 1), random_batch(rng))
    bad = RowBatch(batch.row_column, batch.row_feature, batch.offsets, batch.segment,
                   batch.target_column, batch.target_feature, batch.strength[::-1].copy())
    bad.strength[0] = np.nan
    with pytest.raises(ValueError):
        store.apply(BatchId(1, 2), bad)
    assert all(np.array_equal(x, y) for x, y in zip(state.buffers(), store.read_all().buffers()))


def test_store_apply_equals_core_rowstore_on_training_stream() -> None:
    """The real workload: K-sentence windows of the bundled corpus, store vs the core's RowStore."""
    from giaannd.model.columns import ColumnAssigner
    from giaannd.model.rowstore import RowStore
    from giaannd.model.tokens import load_bundled_corpus
    from giaannd.model.train import train_batch

    encoded = list(ColumnAssigner().encode_many(load_bundled_corpus(300)))
    store, core = ColumnStore(BIG), RowStore()
    for i in range(0, len(encoded), 64):
        batch = train_batch(encoded[i : i + 64]).rows
        store.apply(BatchId(1, i + 1), batch)
        core.apply(batch)
    assert store.keys() == core.keys()
    for key, row in core:
        got = store.row(key)
        assert got is not None and got.equals(row), key


def test_store_empty_delta_rows_create_nothing() -> None:
    """A canonical batch may carry a row with no entries: it neither creates nor touches a row."""
    rng = np.random.default_rng(12)
    store = ColumnStore(BIG)
    store.apply(BatchId(1, 1), random_batch(rng))
    stored = store.keys()[0]
    batch = RowBatch(
        np.array([1, stored[0], TOP], np.uint64), np.array([1, stored[1], 0], np.uint64),
        np.array([0, 0, 0, 2], np.int64), np.array([0, 3], np.uint8), np.array([5, 6], np.uint64),
        np.array([7, 8], np.uint64), np.array([0.5, 0.25], np.float32),
    )
    batch.validate()
    touches = store.digest(stored).batches  # type: ignore[union-attr]
    rows = {k: store.row(k) for k in store.keys()}
    reference = {k: Row(r.segment.copy(), r.target_column.copy(), r.target_feature.copy(), r.strength.copy())
                 for k, r in rows.items() if r is not None}
    assert store.apply(BatchId(1, 2), batch)
    _reference_apply(reference, batch)
    _assert_store_equals(store, reference)
    assert (1, 1) not in store
    assert store.digest(stored).batches == touches  # type: ignore[union-attr]


def test_pack_and_unpack_regions_equal_region_views() -> None:
    """The vectorised region layout (unaligned accesses at any byte offset) equals each region's own
    array views, for regions of odd lengths side by side, both ways."""
    rng = np.random.default_rng(13)
    regions, rows = [], []
    for n in (1, 3, 0, 7, 50, 2):
        row = random_row(rng, n, key_space=1000)
        region = np.empty(ENTRY_BYTES * len(row), np.uint8)
        view = column_store.row_from_region(region)
        for field in ("segment", "target_column", "target_feature", "strength"):
            getattr(view, field)[...] = getattr(row, field)
        regions.append(region)
        rows.append(row)
    offsets, want = concat_rows(rows)
    raw = np.concatenate(regions)
    assert unpack_regions(raw, offsets).equals(want)
    assert np.array_equal(pack_regions(offsets, want), raw)
