"""Dropping columns: in RAM (capacity returned, applied set kept), the drop log record (format
version 2, old logs still read, torn tail and corruption), replay in log order, snapshots."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore, CorruptLogError, DurableStore
from giaannd.storage.engine.column_store import APPLIED_ID_BYTES, ENTRY_BYTES, ROW_OVERHEAD_BYTES, DropResult
from giaannd.storage.engine.snapshot import list_snapshots
from giaannd.storage.engine.update_log import (
    KIND_DROP,
    LOG_FORMAT_VERSION,
    UpdateLog,
    list_segments,
    scan_segment,
)

from ._gen import random_batch, same_state

BIG = 1 << 40


def _columns(store: ColumnStore) -> list[int]:
    return sorted({k[0] for k in store.keys()})


def _filled(rng: np.random.Generator, n: int = 12) -> tuple[ColumnStore, list[tuple[BatchId, RowBatch]]]:
    store, batches = ColumnStore(BIG), []
    for i in range(1, n + 1):
        b = random_batch(rng)
        store.apply(BatchId(7, i), b)
        batches.append((BatchId(7, i), b))
    return store, batches


def _reference_without(batches: list[tuple[BatchId, RowBatch]], dropped: set[int]) -> ColumnStore:
    """Every batch applied, restricted to the columns not dropped (a store that never had them)."""
    ref = ColumnStore(BIG)
    for bid, b in batches:
        keep = ~np.isin(b.row_column, np.array(sorted(dropped), np.uint64))
        ref.apply(bid, b.select_rows(keep))
    return ref


def test_drop_columns_removes_rows_and_returns_capacity() -> None:
    store, batches = _filled(np.random.default_rng(1))
    cols = _columns(store)
    before = store.usage()
    victims = [cols[0], cols[2]]
    rows = [k for k in store.keys() if k[0] in victims]
    region_bytes = sum(len(store.row_region(k) or b"") for k in rows)
    result = store.drop_columns(np.array(victims + [12345], np.uint64))  # 12345: not held, ignored
    assert result == DropResult(len(rows), region_bytes + ROW_OVERHEAD_BYTES * len(rows))
    after = store.usage()
    assert before.used_bytes - after.used_bytes == result.bytes
    assert after.num_rows == before.num_rows - len(rows)
    assert after.num_entries == before.num_entries - region_bytes // ENTRY_BYTES
    assert after.applied_ids == before.applied_ids  # the applied set is untouched
    assert all(k not in store for k in rows)
    assert store.read_rows([k[0] for k in rows], [k[1] for k in rows]).num_rows == 0
    assert _columns(store) == [c for c in cols if c not in victims]
    assert same_state(store, _reference_without(batches, set(victims)))
    # used_bytes is exactly the accounting formula again
    regions = sum(len(r) for _, _, r in store.iter_slots())
    assert store.used_bytes == regions + ROW_OVERHEAD_BYTES * len(store) + APPLIED_ID_BYTES * len(store.applied)
    assert store.drop_columns(np.array(victims, np.uint64)) == DropResult(0, 0)


def test_drop_keeps_batch_ids_applied_so_a_late_duplicate_is_ignored() -> None:
    store, batches = _filled(np.random.default_rng(2), 4)
    store.drop_columns(store.held_columns())
    assert len(store) == 0
    for bid, b in batches:
        assert bid in store.applied
        assert store.apply(bid, b) is False  # does not bring the rows back
    assert len(store) == 0


def test_drop_then_reapply_recreates_the_column_exactly() -> None:
    rng = np.random.default_rng(3)
    store, batches = _filled(rng, 6)
    col = _columns(store)[1]
    store.drop_columns(np.array([col], np.uint64))
    later = [(BatchId(8, i), random_batch(rng)) for i in range(1, 6)]
    for bid, b in later:
        store.apply(bid, b)
    # the dropped column holds exactly what came after the drop
    ref = _reference_without(batches, {col})
    for bid, b in later:
        ref.apply(bid, b)
    assert same_state(store, ref)
    # scan/keys index is rebuilt after a drop even when the row count comes back to the same value
    assert store.keys() == sorted(store.keys()) == ref.keys()


def test_held_columns_and_scan_index_after_drop() -> None:
    store, _ = _filled(np.random.default_rng(4), 5)
    cols = store.held_columns()
    assert cols.tolist() == _columns(store)
    assert store.held_columns(np.array([cols[0], 99], np.uint64)).tolist() == [cols[0]]
    page = store.scan(None, 10_000, 10_000_000, 10_000)
    assert page.batch.num_rows == len(store)
    store.drop_columns(cols[:1])
    page = store.scan(None, 10_000, 10_000_000, 10_000)
    assert page.batch.num_rows == len(store) and cols[0] not in page.batch.row_column.tolist()


def test_rows_of_columns_lists_keys_and_region_sizes() -> None:
    store, _ = _filled(np.random.default_rng(12), 6)
    cols = store.held_columns()
    pick = np.array([cols[1], cols[3], 4242], np.uint64)
    c, f, sizes = store.rows_of_columns(pick)
    want = [k for k in store.keys() if k[0] in set(pick.tolist())]
    assert list(zip(c.tolist(), f.tolist())) == want
    assert sizes.tolist() == [len(store.row_region(k) or b"") for k in want]
    store.drop_columns(cols[1:2])
    assert set(store.rows_of_columns(pick)[0].tolist()) == {int(cols[3])}


def _durable_with_drop(path: Path, rng: np.random.Generator, **kw: int) -> tuple[DurableStore, ColumnStore]:
    """A durable store and a reference: 8 batches, a drop of two columns, 6 more batches."""
    ds, ref = DurableStore.open(path, BIG, **kw), ColumnStore(BIG)
    for i in range(1, 9):
        b = random_batch(rng)
        ds.apply(BatchId(1, i), b)
        ref.apply(BatchId(1, i), b)
    victims = ref.held_columns()[[0, 3]]
    assert ds.drop_columns(victims) == ref.drop_columns(victims) != DropResult(0, 0)
    for i in range(9, 15):
        b = random_batch(rng)
        ds.apply(BatchId(1, i), b)
        ref.apply(BatchId(1, i), b)
    return ds, ref


def test_durable_drop_is_logged_and_replayed_in_order(tmp_path: Path) -> None:
    ds, ref = _durable_with_drop(tmp_path, np.random.default_rng(5))
    assert ds.log.last_seq == 15  # 14 batches + 1 drop
    ds.close()
    again = DurableStore.open(tmp_path, BIG)
    assert same_state(again.store, ref)
    assert again.store.usage() == ref.usage()
    assert again.recovery.records_replayed == 15
    # nothing held: nothing logged
    assert again.drop_columns(np.array([1, 2], np.uint64)) == DropResult(0, 0) and again.log.last_seq == 15
    again.close()


def test_durable_drop_survives_snapshot_and_truncation(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    ds, ref = _durable_with_drop(tmp_path, rng, segment_max_bytes=2048)
    ds.snapshot()
    assert len(list_segments(tmp_path)) == 1 and len(list_snapshots(tmp_path)) == 1
    # a drop after the snapshot, replayed on top of it
    victim = ref.held_columns()[:1]
    ds.drop_columns(victim)
    ref.drop_columns(victim)
    ds.close()
    again = DurableStore.open(tmp_path, BIG)
    assert same_state(again.store, ref) and again.recovery.records_replayed == 1
    again.close()


def _records(path: Path) -> list[tuple[int, int, int]]:
    """(offset, version, kind) of each record of one segment."""
    raw, out, off = path.read_bytes(), [], 0
    while off < len(raw):
        _, version, kind, length = struct.unpack_from("<4sHHQ", raw, off)
        out.append((off, version, kind))
        off += 40 + length
    return out


def test_log_versions_old_records_stay_version_1_drop_is_version_2(tmp_path: Path) -> None:
    ds, _ = _durable_with_drop(tmp_path, np.random.default_rng(7))
    ds.close()
    (_, seg), = list_segments(tmp_path)[:1]
    recs = _records(seg)
    assert LOG_FORMAT_VERSION == 2
    assert [(v, k) for _, v, k in recs].count((2, KIND_DROP)) == 1
    assert all(v == 1 for _, v, k in recs if k != KIND_DROP)  # a version-1 reader reads them


def _rewrite_header(raw: bytearray, off: int, version: int, kind: int) -> None:
    struct.pack_into("<HH", raw, off + 4, version, kind)
    struct.pack_into("<Q", raw, off + 32, xxhash.xxh3_64_intdigest(bytes(raw[off : off + 32])))


def test_log_drop_kind_in_a_version_1_record_is_corruption(tmp_path: Path) -> None:
    ds, _ = _durable_with_drop(tmp_path, np.random.default_rng(8))
    ds.close()
    seg = list_segments(tmp_path)[0][1]
    raw = bytearray(seg.read_bytes())
    off = next(o for o, _, k in _records(seg) if k == KIND_DROP)
    _rewrite_header(raw, off, 1, KIND_DROP)
    seg.write_bytes(bytes(raw))
    with pytest.raises(CorruptLogError) as err:
        DurableStore.open(tmp_path, BIG)
    assert err.value.offset == off and "kind 3" in str(err.value)
    _rewrite_header(raw, off, 3, KIND_DROP)  # a version from the future
    seg.write_bytes(bytes(raw))
    with pytest.raises(CorruptLogError, match="unsupported log format version 3"):
        DurableStore.open(tmp_path, BIG)


def test_log_version_1_segment_is_read(tmp_path: Path) -> None:
    """A log written before drops existed (every record version 1) replays unchanged."""
    rng = np.random.default_rng(9)
    ref = ColumnStore(BIG)
    log = UpdateLog(tmp_path, 1)
    for i in range(1, 6):
        b = random_batch(rng)
        log.append_batch(BatchId(2, i), b)
        ref.apply(BatchId(2, i), b)
    log.append_floor(2, 5)
    ref.advance_floor(2, 5)
    log.close()
    seg = list_segments(tmp_path)[0][1]
    assert {v for _, v, _ in _records(seg)} == {1}
    again = DurableStore.open(tmp_path, BIG)
    assert same_state(again.store, ref)
    again.close()


def test_log_torn_drop_record_is_cut_and_the_rows_stay(tmp_path: Path) -> None:
    rng = np.random.default_rng(10)
    ds = DurableStore.open(tmp_path, BIG)
    ref = ColumnStore(BIG)
    for i in range(1, 5):
        b = random_batch(rng)
        ds.apply(BatchId(3, i), b)
        ref.apply(BatchId(3, i), b)
    ds.drop_columns(ref.held_columns()[:2])  # never synced: the crash tears it
    ds.close()
    seg = list_segments(tmp_path)[-1][1]
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size - 5)
    again = DurableStore.open(tmp_path, BIG)
    assert again.recovery.torn_tail_bytes > 0 and again.recovery.last_seq == 4
    assert same_state(again.store, ref)  # the drop is gone: the rows are back
    again.close()


@pytest.mark.parametrize("damage", ["unsorted", "length"])
def test_log_malformed_drop_payload_is_corruption(tmp_path: Path, damage: str) -> None:
    ds, _ = _durable_with_drop(tmp_path, np.random.default_rng(11))
    ds.close()
    seg = list_segments(tmp_path)[0][1]
    raw = bytearray(seg.read_bytes())
    off = next(o for o, _, k in _records(seg) if k == KIND_DROP)
    (length,) = struct.unpack_from("<Q", raw, off + 8)
    payload = off + 40
    if damage == "unsorted":
        a, b = struct.unpack_from("<QQ", raw, payload + 8)
        struct.pack_into("<QQ", raw, payload + 8, b, a)
    else:
        struct.pack_into("<Q", raw, payload, 7)
    struct.pack_into("<Q", raw, off + 24, xxhash.xxh3_64_intdigest(bytes(raw[payload : payload + length])))
    struct.pack_into("<Q", raw, off + 32, xxhash.xxh3_64_intdigest(bytes(raw[off : off + 32])))
    seg.write_bytes(bytes(raw))
    with pytest.raises(CorruptLogError, match="drop record"):
        DurableStore.open(tmp_path, BIG)


def test_update_log_append_drop_refuses_unsorted_columns(tmp_path: Path) -> None:
    log = UpdateLog(tmp_path, 1)
    with pytest.raises(ValueError, match="sorted"):
        log.append_drop(np.array([5, 3], np.uint64))
    assert log.last_seq == 0
    assert log.append_drop(np.array([3, 5], np.uint64)) == 1
    log.close()
    (scan,) = [scan_segment(p, first, True) for first, p in list_segments(tmp_path)]
    assert scan.records[0].kind == KIND_DROP and scan.records[0].columns.tolist() == [3, 5]
