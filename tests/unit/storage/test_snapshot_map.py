"""A snapshot loaded by mapping its file (snapshot_map.py, ``DurableStore.open``'s ``map_snapshot``):
the same store and the same errors as a read load, applies and folds after it bit-identical, the
file deleted by the next snapshot while mapped (its disk counted), restarts after that."""

from __future__ import annotations

import gc
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import CorruptSnapshotError, DurableStore
from giaannd.storage.engine.disk_usage import disk_usage
from giaannd.storage.engine.snapshot import HEADER_BYTES, body_checksum, read_snapshot
from giaannd.storage.engine.snapshot_map import SnapshotMapping

from ._gen import random_batch, same_state

BIG = 1 << 40


def _snapshotted(directory: Path, seed: int, batches: int = 12) -> Path:
    """A store of ``batches`` random batches, snapshotted and closed (an empty log after it)."""
    rng = np.random.default_rng(seed)
    ds = DurableStore.open(directory, BIG)
    for i in range(batches):
        ds.apply(BatchId(i % 3, i + 1), random_batch(rng, entries=400, columns=20, features=8))
    snap = ds.snapshot()
    ds.close()
    return snap


def _base_is_mapped(ds: DurableStore) -> bool:
    """Whether the engine's base keys are views of a live mapping (read-only, not owned)."""
    seg, tc, tf, st = ds.store.engine.base_fields()
    return (ds.mapping is not None and ds.mapping.live and not tc.flags.writeable and not tf.flags.writeable
            and not seg.flags.writeable and st.flags.writeable)


def test_mapped_load_is_the_read_load(tmp_path: Path) -> None:
    _snapshotted(tmp_path, 1)
    mapped = DurableStore.open(tmp_path, BIG, map_snapshot=True)
    read = DurableStore.open(tmp_path, BIG, map_snapshot=False)
    assert _base_is_mapped(mapped) and read.mapping is None
    assert same_state(mapped.store, read.store)
    assert mapped.store.row_size_log2() == read.store.row_size_log2()
    assert mapped.store.usage() == read.store.usage()
    for ds in (mapped, read):
        ds.close()


def _logged(directory: Path, seed: int, batches: int, entries: int) -> None:
    """``batches`` more random batches of ``entries`` logged after the snapshot (kill -9: no final
    snapshot), their rows overlapping the snapshot's."""
    rng = np.random.default_rng(seed)
    ds = DurableStore.open(directory, BIG)
    for i in range(batches):
        ds.apply(BatchId(9, i + 1), random_batch(rng, entries=entries, columns=24, features=8))
    ds.sync()
    ds.close()


def test_mapping_with_a_small_log_to_replay(tmp_path: Path) -> None:
    """A log under a quarter of the store after the snapshot (a node killed between snapshots):
    mapped all the same, the replay's new keys left in a delta run, the base still the mapping's
    views; the same store as a read load and its replay. (Before: read whenever a log followed.)"""
    _snapshotted(tmp_path, 2)
    _logged(tmp_path, 3, batches=3, entries=100)
    mapped = DurableStore.open(tmp_path, BIG, map_snapshot=True)
    read = DurableStore.open(tmp_path, BIG, map_snapshot=False)
    assert mapped.recovery.records_replayed == read.recovery.records_replayed == 3
    assert _base_is_mapped(mapped) and mapped.store.engine.num_deltas == 1 and read.mapping is None
    assert same_state(mapped.store, read.store)
    assert mapped.store.usage() == read.store.usage()
    b = random_batch(np.random.default_rng(4), entries=300, columns=24, features=8)  # and they go on alike
    assert mapped.apply(BatchId(9, 50), b).applied and read.apply(BatchId(9, 50), b).applied
    mapped.fold_deltas()
    read.fold_deltas()
    assert same_state(mapped.store, read.store)
    for ds in (mapped, read):
        ds.close()


def test_a_log_of_new_rows_leaves_the_mapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A log whose records bring only rows the snapshot lacks (a store's growth: a stream's chunks,
    new columns) replayed over a mapped base: the rows become a delta run and the base stays the
    mapping's views. (Before: appended to the base's tail, which copied the whole mapped base into
    new buffers in the replay, O(store), and let go of the mapping.) The same store as a read load."""
    from giaannd.rowengine import engine as engine_mod

    monkeypatch.setattr(engine_mod, "INLINE_MERGE_ENTRIES", 64)  # the snapshot's base is larger
    _snapshotted(tmp_path, 5)
    rng = np.random.default_rng(6)
    ds = DurableStore.open(tmp_path, BIG)
    for i in range(2):
        b = random_batch(rng, entries=200, columns=8, features=8)
        fresh = RowBatch(b.row_column + np.uint64(1 << 40), b.row_feature, b.offsets, b.segment, b.target_column,
                         b.target_feature, b.strength)  # columns the snapshot has none of
        ds.apply(BatchId(9, i + 1), fresh)
    ds.sync()
    ds.close()
    mapped = DurableStore.open(tmp_path, BIG, map_snapshot=True)
    read = DurableStore.open(tmp_path, BIG, map_snapshot=False)
    assert mapped.recovery.records_replayed == read.recovery.records_replayed == 2
    assert _base_is_mapped(mapped) and mapped.store.engine.num_deltas >= 1
    assert same_state(mapped.store, read.store)
    assert mapped.store.usage() == read.store.usage()
    assert mapped.store.row_size_log2() == read.store.row_size_log2()
    for ds in (mapped, read):
        ds.close()


def test_no_mapping_with_a_large_log_to_replay(tmp_path: Path) -> None:
    """A log past a quarter of the store: its replay would fold into the base (a merge that
    copies a mapped base into new buffers), so the snapshot is read with room for it."""
    _snapshotted(tmp_path, 2)
    _logged(tmp_path, 3, batches=6, entries=400)
    again = DurableStore.open(tmp_path, BIG, map_snapshot=True)
    assert again.mapping is None and again.recovery.records_replayed == 6
    again.close()
    with pytest.raises(ValueError, match="no room"):
        read_snapshot(next(tmp_path.glob("snapshot-*.snap")), BIG, room=10,
                      mapping=SnapshotMapping.open(next(tmp_path.glob("snapshot-*.snap"))))


def test_applies_folds_drops_after_a_mapped_load_match_the_read_load(tmp_path: Path) -> None:
    """Adds in place (the strengths are copies), new keys in delta runs, folds into new buffers, a
    drop, a stream's reserve: bit-identical to the same after a read load, and the file never
    written (the mapping is read-only)."""
    snap = _snapshotted(tmp_path, 4)
    on_disk = snap.read_bytes()
    mapped = DurableStore.open(tmp_path, BIG, map_snapshot=True).store
    read = DurableStore.open(tmp_path, BIG, map_snapshot=False).store
    rng = np.random.default_rng(5)
    for i in range(40):
        b = random_batch(rng, entries=300, columns=22, features=8)
        assert mapped.apply(BatchId(7, i + 1), b) == read.apply(BatchId(7, i + 1), b)
        if i == 10:
            cols = mapped.held_columns()[:2]
            assert mapped.drop_columns(cols) == read.drop_columns(cols)
        if i == 20:
            mapped.reserve(1 << 16)
            read.reserve(1 << 16)
        if i % 7 == 0:
            assert mapped.fold_deltas() == read.fold_deltas()
        assert same_state(mapped, read)
    assert snap.read_bytes() == on_disk


def test_first_fold_unmaps(tmp_path: Path) -> None:
    _snapshotted(tmp_path, 6)
    ds = DurableStore.open(tmp_path, BIG, map_snapshot=True)
    assert ds.mapping is not None and ds.mapping.live
    ds.apply(BatchId(8, 1), random_batch(np.random.default_rng(7), entries=400, columns=40, features=8))
    assert ds.store.engine.num_deltas  # new keys wait in a delta run; the base is still mapped
    assert _base_is_mapped(ds)
    ds.fold_deltas()
    gc.collect()
    assert not ds.mapping.live
    ds.close()


def test_snapshot_file_replaced_while_mapped_then_restart(tmp_path: Path) -> None:
    """The next snapshot deletes the mapped file: the store keeps serving from the mapping, the
    deleted file's bytes are counted in the disk use until the fold unmaps it, and a restart loads
    the new snapshot (mapped again), the same rows."""
    old = _snapshotted(tmp_path, 8)
    size = old.stat().st_size
    ds = DurableStore.open(tmp_path, BIG, map_snapshot=True)
    ref_store = read_snapshot(old, BIG)[0]  # the same batches on a store that never mapped
    assert ds.held_disk_bytes() == 0
    rng = np.random.default_rng(9)
    for i in range(3):
        b = random_batch(rng, entries=50, columns=20, features=8)
        ds.apply(BatchId(5, i + 1), b)
        ref_store.apply(BatchId(5, i + 1), b)
    new = ds.snapshot()
    assert not old.exists() and new.exists()
    assert _base_is_mapped(ds)
    assert ds.held_disk_bytes() == size
    assert disk_usage(tmp_path, held_bytes=ds.held_disk_bytes()).files_bytes == disk_usage(tmp_path).files_bytes + size
    assert same_state(ds.store, ref_store)
    b = random_batch(rng, entries=50, columns=20, features=8)
    ds.apply(BatchId(5, 4), b)
    ref_store.apply(BatchId(5, 4), b)
    ds.sync()
    ds.close()
    # a restart with a small log after the new snapshot, then one after a stop's snapshot: both mapped
    for _ in range(2):
        again = DurableStore.open(tmp_path, BIG, map_snapshot=True)
        assert again.mapping is not None
        assert same_state(again.store, ref_store)
        again.snapshot()
        again.close()
    # and the first store's mapping went away with it once nothing referenced the rows
    mapping = ds.mapping
    del ds
    gc.collect()
    assert mapping is not None and not mapping.live and mapping.held_bytes() == 0


def _corrupt_cases(data: bytes) -> dict[str, bytes]:
    """Damaged copies of a snapshot's bytes: a flipped byte in each section, a truncation, and a
    row badly ordered under valid checksums (a writer bug)."""
    r = struct.unpack_from("<Q", data, 24)[0]
    n = struct.unpack_from("<Q", data, 32)[0]
    entries_at = HEADER_BYTES + 8 * (4 * r + 1)
    at = {"header": 20, "row keys": HEADER_BYTES + 3, "offsets": HEADER_BYTES + 16 * r + 9,
          "target columns": entries_at + 5, "strengths": entries_at + 16 * n + 2,
          "segments": entries_at + 20 * n + 1, "applied set": len(data) - 3}
    out = {}
    for name, i in at.items():
        bad = bytearray(data)
        bad[i] ^= 0x10
        out[name] = bytes(bad)
    out["truncated"] = data[: len(data) - 7]
    out["short header"] = data[:40]
    unsorted = bytearray(data)
    offsets = np.frombuffer(data, np.int64, r + 1, HEADER_BYTES + 16 * r)
    e = int(offsets[np.flatnonzero(np.diff(offsets) >= 2)[0]])  # a row's first two entries, swapped
    for width, start in ((8, entries_at), (8, entries_at + 8 * n), (4, entries_at + 16 * n), (1, entries_at + 20 * n)):
        i, j = start + width * e, start + width * (e + 1)
        unsorted[i : i + width], unsorted[j : j + width] = data[j : j + width], data[i : i + width]
    rows_entries = struct.unpack_from("<QQ", unsorted, 24)
    struct.pack_into("<Q", unsorted, 48, body_checksum(bytes(unsorted[HEADER_BYTES:]), *rows_entries))
    struct.pack_into("<Q", unsorted, 56, xxhash.xxh3_64_intdigest(bytes(unsorted[:56])))
    out["unsorted row"] = bytes(unsorted)
    return out


def test_corrupt_snapshot_refused_with_the_same_error_when_mapped(tmp_path: Path) -> None:
    snap = _snapshotted(tmp_path, 10)
    good = snap.read_bytes()
    for name, bad in _corrupt_cases(good).items():
        snap.write_bytes(bad)
        errors = []
        for map_snapshot in (False, True):
            with pytest.raises(CorruptSnapshotError) as err:
                DurableStore.open(tmp_path, BIG, map_snapshot=map_snapshot)
            errors.append((str(err.value), err.value.offset))
        assert errors[0] == errors[1], name
        assert snap.read_bytes() == bad  # left untouched for the operator
    snap.write_bytes(good)
    DurableStore.open(tmp_path, BIG, map_snapshot=True).close()


def test_mapped_views_die_with_the_store(tmp_path: Path) -> None:
    """A failed mapped load (a corrupt file) keeps no mapping alive."""
    snap = _snapshotted(tmp_path, 12)
    bad = bytearray(snap.read_bytes())
    bad[HEADER_BYTES + 1] ^= 1
    snap.write_bytes(bytes(bad))
    mapping = SnapshotMapping.open(snap)
    with pytest.raises(CorruptSnapshotError):
        read_snapshot(snap, BIG, mapping=mapping)
    gc.collect()
    assert not mapping.live


def test_store_read_only_fields_refuse_writes(tmp_path: Path) -> None:
    """The mapped key fields are read-only: a write into them raises instead of reaching the file."""
    _snapshotted(tmp_path, 13)
    ds = DurableStore.open(tmp_path, BIG, map_snapshot=True)
    seg, tc, _, _ = ds.store.engine.base_fields()
    with pytest.raises(ValueError, match="read-only"):
        tc[0] = 1
    with pytest.raises(ValueError, match="read-only"):
        seg[0] = 1
    ds.close()


def test_idle_fold_gives_a_deleted_mapped_file_back_when_no_fold_did(tmp_path: Path) -> None:
    """Writes that only add to stored keys leave no delta run, so no fold replaces the mapped base;
    after the next snapshot deletes its file, ``DurableStore.fold_deltas`` (an idle node's) copies
    the base into memory and the disk comes back. The rows are unchanged by the copy."""
    old = _snapshotted(tmp_path, 14)
    size = old.stat().st_size
    ds = DurableStore.open(tmp_path, BIG, map_snapshot=True)
    ref = read_snapshot(old, BIG)[0]
    keys = ds.store.keys()[:30]
    held = ds.store.read_rows([k[0] for k in keys], [k[1] for k in keys])
    adds = type(held)(held.row_column, held.row_feature, held.offsets, held.segment, held.target_column,
                      held.target_feature, np.random.default_rng(15).random(held.num_entries, dtype=np.float32))
    ds.apply(BatchId(6, 1), adds)
    ref.apply(BatchId(6, 1), adds)
    assert ds.store.engine.num_deltas == 0  # nothing for a fold to do
    ds.snapshot()
    assert not old.exists() and ds.held_disk_bytes() == size
    assert ds.fold_deltas() == 0
    gc.collect()
    assert ds.mapping is not None and not ds.mapping.live and ds.held_disk_bytes() == 0
    seg, tc, tf, st = ds.store.engine.base_fields()
    assert tc.flags.writeable and seg.flags.writeable
    assert same_state(ds.store, ref)
    ds.close()
