"""Snapshots that never stop writes, and the bulk snapshot loader (issue 14 items 3 and 4).

A snapshot is begun (log rotated, store frozen), written by another thread while applies go on,
then finished (older snapshots and covered log segments deleted). The snapshot must equal the
store as of its seq, and everything applied after it must be in the log; a crash or a full disk
in the middle leaves the node able to serve and to restart with the same state.
"""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash

import giaannd.storage.engine.snapshot as snapshot_module
from giaannd.model.rows import Row, RowBatch
from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore, CorruptSnapshotError, DurableStore
from giaannd.storage.engine import snapshot_io
from giaannd.storage.engine.regions import pack_regions
from giaannd.storage.engine.snapshot import (
    HEADER_BYTES,
    SNAPSHOT_RECORD,
    body_checksum,
    list_temporaries,
    part_offsets,
    read_snapshot,
    write_snapshot,
)
from giaannd.storage.engine.update_log import list_segments, scan_segment
from tools.bench.snapshot import realistic_batch

from ._gen import cached_pages, direct_io_supported, random_batch, same_state

BIG = 1 << 40
REPO = Path(__file__).resolve().parents[3]


def _batches(seed: int, count: int) -> list[RowBatch]:
    rng = np.random.default_rng(seed)
    return [random_batch(rng, 300) for _ in range(count)]


def _reference(batches: list[tuple[BatchId, RowBatch]]) -> ColumnStore:
    ref = ColumnStore(BIG)
    for bid, b in batches:
        ref.apply(bid, b)
    return ref


def _region_bytes(store: ColumnStore) -> dict[tuple[int, int], tuple[bytes, int]]:
    return {k: (bytes(region), touches) for k, touches, region in store.iter_slots()}


def test_column_store_frozen_view_unchanged_by_later_applies_and_drops(tmp_path: Path) -> None:
    store = ColumnStore(BIG)
    batches = _batches(1, 6)
    for i, b in enumerate(batches[:3]):
        store.apply(BatchId(1, i + 1), b)
    before = _region_bytes(store)
    applied_before = store.applied.to_arrays()
    view = store.freeze()
    for i, b in enumerate(batches[:3]):  # the same keys again: in-place adds only
        store.apply(BatchId(2, i + 1), b)
    for i, b in enumerate(batches[3:]):  # growing merges and new rows
        store.apply(BatchId(3, i + 1), b)
    store.drop_columns(np.array([batches[0].row_column[0]], np.uint64))
    frozen, _ = read_snapshot(snapshot_module.write_frozen(tmp_path, view, 9), BIG)  # what the view holds
    assert _region_bytes(frozen) == before
    assert all(np.array_equal(a, b) for a, b in zip(view.applied, applied_before))
    # the live store went on as if there had been no view
    ref = ColumnStore(BIG)
    for writer, chunk in ((1, batches[:3]), (2, batches[:3]), (3, batches[3:])):
        for i, b in enumerate(chunk):
            ref.apply(BatchId(writer, i + 1), b)
    ref.drop_columns(np.array([batches[0].row_column[0]], np.uint64))
    assert same_state(store, ref)
    view.release()
    view.release()  # idempotent


def _store_and_late_batches(tmp_path: Path, seed: int) -> tuple[DurableStore, list[tuple[BatchId, RowBatch]],
                                                                list[tuple[BatchId, RowBatch]]]:
    """A store with 4 batches applied, and 8 more to apply later (in-place adds and new rows)."""
    ds = DurableStore.open(tmp_path, BIG)
    batches = _batches(seed, 8)
    early = [(BatchId(1, i + 1), b) for i, b in enumerate(batches[:4])]
    late = [(BatchId(2, i + 1), b) for i, b in enumerate(batches)]
    for bid, b in early:
        ds.apply(bid, b)
    return ds, early, late


@pytest.mark.parametrize("with_room", [False, True])
def test_snapshot_while_applies_continue_equals_state_at_its_seq(tmp_path: Path, monkeypatch, with_room) -> None:
    ds, early, late = _store_and_late_batches(tmp_path, 2)
    # The writer thread stops part-way through the file until every late batch is applied, so
    # they are applied while the snapshot is being written (not before, not after).
    applied_late, writing = threading.Event(), threading.Event()
    write = snapshot_module._HashingWriter.write
    calls = 0

    def paused_write(self, buf):
        nonlocal calls
        calls += 1
        if calls == 3:
            writing.set()
            assert applied_late.wait(10)
        write(self, buf)

    monkeypatch.setattr(snapshot_module._HashingWriter, "write", paused_write)
    room = ds.freeze_room() if with_room else None  # (the service makes it before holding writes off)
    job = ds.begin_snapshot(room)
    assert job.seq == ds.log.last_seq == len(early)
    if room is not None:  # the strengths were copied into it, not into fresh arrays
        assert job.view.engine is not None and np.shares_memory(job.view.engine.base.st, room)
    writer = threading.Thread(target=job.write)
    writer.start()
    try:
        assert writing.wait(10)
        for bid, b in late:
            ds.apply(bid, b)
    finally:
        applied_late.set()
        writer.join(10)
    assert not writer.is_alive()
    path = ds.finish_snapshot(job)
    ds.sync()
    # the snapshot is the state at its seq ...
    snap, seq = read_snapshot(path, BIG)
    assert seq == job.seq and same_state(snap, _reference(early))
    # ... the log holds exactly what came after it, and no segment it still needs was deleted
    records = [r for first, p in list_segments(tmp_path) for r in scan_segment(p, first, is_last=False).records]
    assert [r.seq for r in records] == list(range(job.seq + 1, ds.log.last_seq + 1))
    assert [r.batch_id for r in records] == [bid for bid, _ in late]
    assert same_state(ds.store, _reference(early + late))
    ds.close()
    again = DurableStore.open(tmp_path, BIG)
    assert again.recovery.snapshot_seq == job.seq and again.recovery.records_replayed == len(late)
    assert same_state(again.store, _reference(early + late))
    again.close()


def test_snapshot_begins_without_copying_and_applies_before_its_write_are_not_in_it(tmp_path: Path) -> None:
    """``begin_snapshot`` (writes held off) names the strengths', lengths' and touches' copies and
    makes none (rowengine/cow.py): the applies that come next copy the chunks they touch first, the
    job's ``write`` the rest. The snapshot is the state at its seq all the same; a restart from it
    and the log after it is the live state."""
    ds, early, late = _store_and_late_batches(tmp_path, 3)
    job = ds.begin_snapshot(ds.freeze_room())
    engine_view = job.view.engine
    assert engine_view is not None and engine_view.pending is not None and not engine_view.pending.done
    assert job.view.pending is not None and not job.view.pending.done  # the touches
    for bid, b in late:  # before the write: these copy what they touch first
        ds.apply(bid, b)
    assert engine_view.pending.copied_by_writers > 0
    job.write()
    path = ds.finish_snapshot(job)
    snap, seq = read_snapshot(path, BIG)
    assert seq == job.seq and same_state(snap, _reference(early))
    assert same_state(ds.store, _reference(early + late))
    ds.sync()
    ds.close()
    again = DurableStore.open(tmp_path, BIG)
    assert again.recovery.records_replayed == len(late) and same_state(again.store, _reference(early + late))
    again.close()


def test_a_snapshot_released_unwritten_stops_its_copies(tmp_path: Path) -> None:
    """A snapshot given up before its write (the service stopping) drops its pending copies: later
    applies copy nothing for it."""
    ds = DurableStore.open(tmp_path, BIG)
    for i, b in enumerate(_batches(4, 4)):
        ds.apply(BatchId(1, i + 1), b)
    job = ds.begin_snapshot()
    engine_view = job.view.engine
    assert engine_view is not None and engine_view.pending is not None
    pending = engine_view.pending
    job.view.release()
    assert pending.done
    for i, b in enumerate(_batches(5, 4)):
        ds.apply(BatchId(2, i + 1), b)
    assert pending.copied_by_writers == 0
    ds.close()


def test_snapshot_is_flushed_to_disk_as_it_is_written(tmp_path: Path, monkeypatch) -> None:
    """Every ``SYNC_EVERY_BYTES`` of body the writer fdatasyncs its file (bounded dirty data, so
    the log's group-commit fsyncs do not wait behind a whole snapshot's writeback), and the file
    reads back the same."""
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    store = _reference([(BatchId(1, i + 1), b) for i, b in enumerate(_batches(4, 6))])
    (tmp_path / "a").mkdir()
    write_snapshot(tmp_path / "a", store, 6)
    assert synced == []  # a body under SYNC_EVERY_BYTES: only the final fsync
    monkeypatch.setattr(snapshot_io, "SYNC_EVERY_BYTES", 4096)
    path = write_snapshot(tmp_path, store, 6)
    assert path.stat().st_size - HEADER_BYTES > 8 * 4096 and len(synced) >= 3  # a sync per write past 4 KiB
    snap, seq = read_snapshot(path, BIG)
    assert seq == 6 and same_state(snap, store)


def test_snapshot_disk_full_while_applies_continue_keeps_serving(tmp_path: Path, monkeypatch) -> None:
    ds = DurableStore.open(tmp_path, BIG)
    batches = _batches(3, 6)
    done = []
    for i, b in enumerate(batches[:3]):
        ds.apply(BatchId(1, i + 1), b)
        done.append((BatchId(1, i + 1), b))
    job = ds.begin_snapshot()
    for i, b in enumerate(batches[3:]):
        ds.apply(BatchId(1, i + 4), b)
        done.append((BatchId(1, i + 4), b))
    write = snapshot_module._HashingWriter.write
    calls = 0

    def fills_up(self, buf):  # the disk fills part-way through the file
        nonlocal calls
        calls += 1
        if calls > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, buf)

    monkeypatch.setattr(snapshot_module._HashingWriter, "write", fills_up)
    with pytest.raises(OSError, match="No space"):
        job.write()
    monkeypatch.undo()
    assert not list_temporaries(tmp_path) and not list(tmp_path.glob("snapshot-*"))
    ds.apply(BatchId(1, 99), batches[0])  # still serving
    done.append((BatchId(1, 99), batches[0]))
    ds.snapshot()  # and a later attempt works
    ds.close()
    again = DurableStore.open(tmp_path, BIG)
    assert same_state(again.store, _reference(done))
    again.close()


_CRASH_CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import giaannd.storage.engine.snapshot as snapshot_module
    from giaannd.protocol import BatchId
    from giaannd.storage import DurableStore
    from tests.unit.storage._gen import random_batch

    ds = DurableStore.open(sys.argv[1], 1 << 40)
    rng = np.random.default_rng(4)
    batches = [random_batch(rng, 300) for _ in range(6)]
    for i, b in enumerate(batches[:3]):
        ds.apply(BatchId(1, i + 1), b)
    job = ds.begin_snapshot()
    for i, b in enumerate(batches[3:]):  # applied while the snapshot is under way
        ds.apply(BatchId(1, i + 4), b)
    ds.sync()
    write = snapshot_module._HashingWriter.write
    calls = 0
    def dies(self, buf):
        global calls
        calls += 1
        if calls == 5:  # part-way through the temporary (before the rows): the process is killed
            os.kill(os.getpid(), signal.SIGKILL)
        write(self, buf)
    snapshot_module._HashingWriter.write = dies
    job.write()
""")


def test_snapshot_crash_in_the_middle_restarts_with_the_same_state(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _CRASH_CHILD, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr.decode()
    assert len(list_temporaries(tmp_path)) == 1 and not list(tmp_path.glob("snapshot-*"))
    rng = np.random.default_rng(4)
    batches = [random_batch(rng, 300) for _ in range(6)]
    want = _reference([(BatchId(1, i + 1), b) for i, b in enumerate(batches)])
    again = DurableStore.open(tmp_path, BIG)
    assert again.recovery.temporaries_removed == 1 and not list_temporaries(tmp_path)
    assert again.recovery.snapshot is None and again.recovery.records_replayed == 6
    assert same_state(again.store, want)
    again.snapshot()  # the next snapshot works, and a restart from it gives the same state
    again.close()
    last = DurableStore.open(tmp_path, BIG)
    assert last.recovery.snapshot is not None and same_state(last.store, want)
    last.close()


def _write_format_1(path: Path, store: ColumnStore, seq: int) -> None:
    """``store`` as a format-1 snapshot (rows sorted by key, row regions back to back), as written
    before the row engine: the format an upgraded node finds on disk."""
    everything = store.read_all()
    touches = np.array([store.digest(k).batches for k in store.keys()], np.uint64)  # type: ignore[union-attr]
    regions = pack_regions(everything.offsets, Row(
        everything.segment, everything.target_column, everything.target_feature, everything.strength))
    writers, floors, counts, exceptions = store.applied.to_arrays()
    body = b"".join(np.ascontiguousarray(a).tobytes() for a in (
        everything.row_column, everything.row_feature, everything.offsets, touches, regions,
        np.array([writers.shape[0]], np.uint64), writers, floors, counts, exceptions))
    header = SNAPSHOT_RECORD.pack_header(version=1, payload_bytes=len(body),
                                         payload_xxh3=xxhash.xxh3_64_intdigest(body), last_seq=seq,
                                         rows=everything.num_rows, entries=everything.num_entries)
    path.write_bytes(header + body)


@pytest.mark.parametrize("seed", range(4))
def test_snapshot_bulk_load_equals_the_store_and_format_1_converts(tmp_path: Path, seed: int, monkeypatch) -> None:
    if seed % 2:  # rows checked in many short runs (run boundaries inside the store)
        monkeypatch.setattr(snapshot_module, "VERIFY_CHUNK_ENTRIES", 100)
    rng = np.random.default_rng(seed)
    store = ColumnStore(BIG)
    store.apply(BatchId(1, 1), realistic_batch(rng, 300))  # median 17 entries, a Zipf tail
    for i in range(3):
        store.apply(BatchId(2, i + 1), random_batch(rng, 400))  # (delta runs in the frozen view)
    store.advance_floor(2, 1)
    path = write_snapshot(tmp_path, store, 7)
    old_path = tmp_path / "old.snap"
    _write_format_1(old_path, store, 7)
    for verify in (True, False):
        for p in (path, old_path):
            bulk, seq = read_snapshot(p, BIG, verify)
            assert seq == 7
            assert same_state(bulk, store)
            assert _region_bytes(bulk) == _region_bytes(store)
            assert bulk.usage() == store.usage()
            assert bulk.keys() == store.keys()
            assert bulk.row_size_log2() == store.row_size_log2()
    empty_path = write_snapshot(tmp_path, ColumnStore(BIG), 8)
    assert len(read_snapshot(empty_path, BIG)[0]) == 0


def _corrupt(path: Path, row: int, field: str) -> tuple[bytes, int]:
    """The format-2 snapshot at ``path`` with ``field`` of row ``row`` broken (checksums resealed),
    and the byte offset of that row's first target column."""
    data = bytearray(path.read_bytes())
    r, total = struct.unpack_from("<QQ", data, 24)
    offsets = np.frombuffer(bytes(data[HEADER_BYTES + 16 * r : HEADER_BYTES + 16 * r + 8 * (r + 1)]), np.int64)
    base = HEADER_BYTES + 8 * (4 * r + 1)  # target_column u64[N] | target_feature u64[N] | strength f32[N] | seg u8[N]
    o = int(offsets[row])
    assert int(offsets[row + 1]) - o >= 2
    if field == "segment":
        data[base + 20 * total + o + 1] = 200
    elif field == "strength":
        struct.pack_into("<f", data, base + 16 * total + 4 * (o + 1), float("nan"))
    else:  # swap entries 0 and 1 (column, feature, strength, segment), so they are out of order
        for start, size in ((0, 8), (8 * total, 8), (16 * total, 4), (20 * total, 1)):
            at = base + start + size * o
            a, b = data[at : at + size], data[at + size : at + 2 * size]
            data[at : at + size], data[at + size : at + 2 * size] = b, a
    struct.pack_into("<Q", data, 48, body_checksum(bytes(data[HEADER_BYTES:]), *struct.unpack_from("<QQ", data, 24)))
    struct.pack_into("<Q", data, 56, xxhash.xxh3_64_intdigest(bytes(data[:56])))
    return bytes(data), base + 8 * o


@pytest.mark.parametrize(("field", "reason"), [("segment", "segment out of range"),
                                               ("strength", "non-finite strength"),
                                               ("order", "entries not sorted and unique")])
def test_snapshot_bulk_load_rejects_bad_rows_naming_the_offset(tmp_path: Path, field: str, reason: str,
                                                               monkeypatch) -> None:
    monkeypatch.setattr(snapshot_module, "VERIFY_CHUNK_ENTRIES", 1000)  # many runs
    rng = np.random.default_rng(5)
    store = ColumnStore(BIG)
    store.apply(BatchId(1, 1), realistic_batch(rng, 3000))
    path = write_snapshot(tmp_path, store, 1)
    good = path.read_bytes()
    lengths = np.diff(np.frombuffer(good[HEADER_BYTES + 16 * len(store):], np.int64, len(store) + 1))
    for row in (0, 1, 1234, len(store) - 1):
        row = int(np.flatnonzero(lengths >= 2)[np.searchsorted(np.flatnonzero(lengths >= 2), row)])
        data, at = _corrupt(path, row, field)
        path.write_bytes(data)
        with pytest.raises(CorruptSnapshotError) as bulk:
            read_snapshot(path, BIG)
        assert f"at byte offset {at}: row {row}: {reason}" in str(bulk.value)
        path.write_bytes(good)
    read_snapshot(path, BIG)


def test_durable_replay_in_bulk_equals_live(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    ds = DurableStore.open(tmp_path, BIG)
    done = []
    for i in range(4):
        done.append((BatchId(1, i + 1), realistic_batch(rng, 200, 50 * i)))  # new rows
        done.append((BatchId(2, i + 1), random_batch(rng, 300)))  # merges, growing and in place
    for bid, b in done:
        ds.apply(bid, b)
    ds.close()
    again = DurableStore.open(tmp_path, BIG)
    assert same_state(again.store, _reference(done))
    assert _region_bytes(again.store) == _region_bytes(_reference(done))
    again.apply(BatchId(3, 1), done[0][1])  # and it goes on like any store
    assert same_state(again.store, _reference([*done, (BatchId(3, 1), done[0][1])]))
    again.close()


def test_snapshot_pacer_rests_for_its_share() -> None:
    now, slept = [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    pacer = snapshot_module.Pacer(0.25, clock=lambda: now[0], sleep=sleep)
    for work in (0.004, 0.0, 0.010):
        now[0] += work
        pacer.pause()
    assert slept == pytest.approx([0.012, 0.030])  # work * (1 - 0.25) / 0.25; no rest after no work
    assert pacer.rested_s == pytest.approx(0.042)
    never = snapshot_module.Pacer(1.0, clock=lambda: now[0], sleep=sleep)
    now[0] += 1.0
    never.pause()
    assert len(slept) == 2
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError):
            snapshot_module.Pacer(bad)


def test_snapshot_paced_write_equals_unpaced(tmp_path: Path) -> None:
    store = ColumnStore(BIG)
    store.apply(BatchId(1, 1), realistic_batch(np.random.default_rng(7), 2000))
    view = store.freeze()
    rests: list[float] = []
    pacer = snapshot_module.Pacer(0.5, sleep=rests.append)  # (records the rests instead of sleeping)
    paced = snapshot_module.write_frozen(tmp_path, view, 1, pacer).read_bytes()
    view.release()
    unpaced = write_snapshot(tmp_path, store, 2).read_bytes()
    assert rests and paced[HEADER_BYTES:] == unpaced[HEADER_BYTES:]  # same body (headers: seq)


def test_snapshot_load_keeps_touches_and_keys_that_grow_like_the_store(tmp_path: Path) -> None:
    """A store of more than 1024 rows (its touch counts and row keys are the snapshot's arrays as
    read, not copies) goes on like the one it was written from: new rows, adds to held rows, the
    touch counts and keys of both equal after each batch."""
    rng = np.random.default_rng(12)
    store = ColumnStore(BIG)
    for j in range(4):  # the first rows again and again: touch counts from 1 to 4
        store.apply(BatchId(1, j + 1), realistic_batch(rng, 3000 // (j + 1)))
    store.apply(BatchId(2, 1), random_batch(rng, 500))
    loaded, _ = read_snapshot(write_snapshot(tmp_path, store, 1), BIG)
    for i in range(3):
        batch = realistic_batch(rng, 2000, 10_000 * (i + 1)) if i % 2 == 0 else random_batch(rng, 400)
        for s in (store, loaded):
            s.apply(BatchId(3, i + 1), batch)
        keys = store.read_all()
        assert same_state(loaded, store)
        held, touches = loaded.row_touches(keys.row_column, keys.row_feature)
        assert held.all() and np.array_equal(touches, store.row_touches(keys.row_column, keys.row_feature)[1])
        assert sorted(loaded.keys()) == sorted(store.keys())


def _frozen_with_delta_runs(tmp_path: Path) -> tuple[ColumnStore, object, object]:
    """A store and a frozen view of it that holds several delta runs (an older view held the first
    run while more batches came, so they were not merged into it), and the older view."""
    store = ColumnStore(BIG)
    rng = np.random.default_rng(11)
    for i in range(8):
        store.apply(BatchId(1, i + 1), random_batch(rng, 300))
    store.fold_deltas()
    older = None
    for i in range(3):  # small batches: new rows and adds, each a delta run of its own
        store.apply(BatchId(2, i + 1), random_batch(rng, 12))
        older = older or store.freeze()
    view = store.freeze()
    assert view.engine is not None and len(view.engine.deltas) >= 2
    return store, view, older


def _expected_file(view, seq: int) -> bytes:
    """The format-3 file of a frozen view, built in one piece with plain numpy and xxhash: the
    reference of the streamed writers (their pieces, parts and blocks)."""
    frozen = view.engine
    offsets = frozen.offsets()
    pieces = list(frozen.entry_chunks(["tc", "tf", "st", "seg"], 1 << 40))  # one piece: one merge
    empty = (np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.float32), np.empty(0, np.uint8))
    tc, tf, st, seg = pieces[0] if pieces else empty
    writers, floors, counts, exceptions = view.applied
    tracked, promised, bw, bs, bc, cols = view.applied_columns
    u64 = lambda k: np.array([k], np.uint64)  # noqa: E731
    sections = [frozen.a, frozen.b, offsets, view.touches, tc, tf, st, seg,
                u64(writers.shape[0]), writers, floors, counts, exceptions,
                u64(tracked.shape[0]), tracked, promised, u64(bw.shape[0]), bw, bs, bc, cols]
    body = b"".join(np.ascontiguousarray(a).tobytes() for a in sections)
    r, n = frozen.num_rows, int(offsets[-1])
    cut = HEADER_BYTES + 8 * (4 * r + 1) + 8 * n  # parts: ... tc | tf | st | seg + the rest
    whole = bytes(HEADER_BYTES) + body
    bounds = [HEADER_BYTES, cut, cut + 8 * n, cut + 12 * n, len(whole)]
    digests = [xxhash.xxh3_64_intdigest(whole[a:b]) for a, b in zip(bounds, bounds[1:])]
    header = SNAPSHOT_RECORD.pack_header(version=3, payload_bytes=len(body), last_seq=seq, rows=r, entries=n,
                                         payload_xxh3=xxhash.xxh3_64_intdigest(struct.pack("<4Q", *digests)))
    return header + body


class _AlignedWrites:
    """``os.pwrite`` that records (offset, length, buffer address) and checks direct I/O's rules."""

    def __init__(self) -> None:
        self.real, self.calls = os.pwrite, []

    def __call__(self, fd, data, offset):
        view = memoryview(data)
        address = np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0
        self.calls.append((offset, len(view), address))
        block = snapshot_io.DIRECT_BLOCK
        assert offset % block == 0 and len(view) % block == 0 and address % block == 0, (offset, len(view))
        return self.real(fd, data, offset)


def _plain_open(path, direct):  # the direct writer's blocks on any file system (no O_DIRECT flag)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


@pytest.mark.parametrize("stage", [4096, 8192, 3 * 4096, 1 << 20])
@pytest.mark.parametrize("chunk", [24, 256, 1 << 20])
def test_every_writer_writes_the_reference_file(tmp_path: Path, monkeypatch, stage: int, chunk: int) -> None:
    """The cached, dropped and direct writers, with the entries cut in many pieces and staged in
    many blocks, write byte for byte the file built in one piece; the direct one in whole aligned
    blocks from aligned buffers only, each block once; and the file loads as the store."""
    store, view, older = _frozen_with_delta_runs(tmp_path)
    monkeypatch.setattr(snapshot_module, "WRITE_CHUNK_BYTES", chunk)
    monkeypatch.setattr(snapshot_io, "DIRECT_STAGE_BYTES", stage)
    monkeypatch.setattr(snapshot_io, "SYNC_EVERY_BYTES", 4096)
    want = _expected_file(view, 7)
    for mode in ("cached", "dropped", "direct"):
        (tmp_path / mode).mkdir()
        if mode == "direct":
            aligned = _AlignedWrites()
            monkeypatch.setattr(snapshot_module, "open_temporary", _plain_open)
            monkeypatch.setattr(os, "pwrite", aligned)
        path = snapshot_module.write_frozen(tmp_path / mode, view, 7, mode=mode)
        monkeypatch.setattr(os, "pwrite", _AlignedWrites().real)
        assert path.read_bytes() == want, mode
        if mode == "direct":
            blocks = [o // 4096 + k for o, size, _ in aligned.calls for k in range(size // 4096)]
            assert sorted(blocks) == list(range(-(-len(want) // 4096)))  # every block once, none twice
        snap, seq = read_snapshot(path, BIG)
        assert seq == 7 and same_state(snap, store)
    view.release()
    older.release()


@pytest.mark.parametrize("rows", [0, 1, 3, 200])
def test_direct_writer_small_and_empty_stores(tmp_path: Path, monkeypatch, rows: int) -> None:
    """Files smaller than a block, parts that begin and end inside one block, empty parts."""
    store = ColumnStore(BIG)
    if rows:
        store.apply(BatchId(1, 1), random_batch(np.random.default_rng(rows), rows))
    monkeypatch.setattr(snapshot_module, "open_temporary", _plain_open)
    monkeypatch.setattr(os, "pwrite", _AlignedWrites())
    view = store.freeze()
    try:
        path = snapshot_module.write_frozen(tmp_path, view, 3, mode="direct")
        monkeypatch.undo()
        assert path.read_bytes() == _expected_file(view, 3)
    finally:
        view.release()
    snap, seq = read_snapshot(path, BIG)
    assert seq == 3 and same_state(snap, store)


def test_snapshot_one_pass_disk_full_deletes_its_temporary(tmp_path: Path, monkeypatch) -> None:
    store, view, older = _frozen_with_delta_runs(tmp_path)
    for mode in ("cached", "direct"):
        real, calls = os.pwrite, 0

        def fills_up(fd, data, offset):  # the disk fills part-way through the parts' writes
            nonlocal calls
            calls += 1
            if calls > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data, offset)

        monkeypatch.setattr(snapshot_module, "WRITE_CHUNK_BYTES", 256)
        monkeypatch.setattr(snapshot_io, "DIRECT_STAGE_BYTES", 4096)
        monkeypatch.setattr(snapshot_module, "open_temporary", _plain_open)
        monkeypatch.setattr(os, "pwrite", fills_up)
        with pytest.raises(OSError, match="No space"):
            snapshot_module.write_frozen(tmp_path, view, 7, mode=mode)
        monkeypatch.undo()
        assert calls > 2 and not list_temporaries(tmp_path) and not list(tmp_path.glob("snapshot-*"))
    path = snapshot_module.write_frozen(tmp_path, view, 7, mode="direct")  # and a later attempt works
    assert same_state(read_snapshot(path, BIG)[0], store)
    view.release()
    older.release()


def test_direct_io_refused_falls_back_to_the_page_cache_once_per_directory(tmp_path: Path, monkeypatch,
                                                                          caplog) -> None:
    """A file system that refuses O_DIRECT (EINVAL at the open or at a write): the snapshot is
    written through the page cache, the same bytes, with one warning; the directory's later
    snapshots do not try again."""
    store, view, older = _frozen_with_delta_runs(tmp_path)
    monkeypatch.setattr(snapshot_module, "_NO_DIRECT", set())
    want = _expected_file(view, 7)
    opened: list[bool] = []
    real_open = snapshot_module.open_temporary

    def refuses(path, direct):
        opened.append(direct)
        if direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, direct)

    monkeypatch.setattr(snapshot_module, "open_temporary", refuses)
    with caplog.at_level("WARNING", logger=snapshot_module.__name__):
        first = snapshot_module.write_frozen(tmp_path, view, 7, mode="direct")
        assert first.read_bytes() == want
        second = snapshot_module.write_frozen(tmp_path, view, 7, mode="direct")
    assert opened == [True, False, False] and second.read_bytes() == want
    assert [r.getMessage() for r in caplog.records].count(
        f"direct I/O refused in {tmp_path} ([Errno 22] Invalid argument): its snapshots are written through "
        "the page cache") == 1
    # a refusal at the first write (the open succeeded) is the same
    (tmp_path / "w").mkdir()
    monkeypatch.setattr(snapshot_module, "open_temporary", _plain_open)
    real_pwrite = os.pwrite

    def einval_once(fd, data, offset):
        monkeypatch.setattr(os, "pwrite", real_pwrite)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", einval_once)
    assert snapshot_module.write_frozen(tmp_path / "w", view, 7, mode="direct").read_bytes() == want
    assert snapshot_module.direct_io_refused(tmp_path / "w") and not list_temporaries(tmp_path / "w")
    view.release()
    older.release()


def test_format_2_still_loads_and_each_part_is_checked(tmp_path: Path) -> None:
    """A format-2 file (the same body under one xxh3 of all of it, as written before format 3)
    loads as the store; in format 3 a byte changed in any of the four parts fails the checksum."""
    store, view, older = _frozen_with_delta_runs(tmp_path)
    path = snapshot_module.write_frozen(tmp_path, view, 7)
    view.release()
    older.release()
    data = bytearray(path.read_bytes())
    r, n = struct.unpack_from("<QQ", data, 24)
    v2 = bytearray(data)
    struct.pack_into("<I", v2, 8, 2)
    struct.pack_into("<Q", v2, 48, xxhash.xxh3_64_intdigest(bytes(v2[HEADER_BYTES:])))
    struct.pack_into("<Q", v2, 56, xxhash.xxh3_64_intdigest(bytes(v2[:56])))
    old = tmp_path / "v2.snap"
    old.write_bytes(bytes(v2))
    snap, seq = read_snapshot(old, BIG)
    assert seq == 7 and same_state(snap, store)
    cuts = part_offsets(r, n)
    for at in (0, *cuts, cuts[-1] + n - 1):  # the first byte of each part, the last segment
        bad = bytearray(data)
        bad[HEADER_BYTES + at] ^= 0x40
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptSnapshotError, match="body checksum mismatch"):
            read_snapshot(path, BIG, verify_rows=False)
    v2_read_as_3 = bytearray(v2)  # the one-hash checksum under version 3: refused
    struct.pack_into("<I", v2_read_as_3, 8, 3)
    struct.pack_into("<Q", v2_read_as_3, 56, xxhash.xxh3_64_intdigest(bytes(v2_read_as_3[:56])))
    path.write_bytes(bytes(v2_read_as_3))
    with pytest.raises(CorruptSnapshotError, match="body checksum mismatch"):
        read_snapshot(path, BIG)
    assert body_checksum(bytes(data[HEADER_BYTES:]), r, n) == struct.unpack_from("<Q", data, 48)[0]


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or sys.platform != "linux", reason="Linux page cache")
@pytest.mark.parametrize("mode", ["dropped", "direct"])
def test_a_timers_snapshot_leaves_the_page_cache(tmp_path: Path, monkeypatch, mode: str) -> None:
    """A timer's snapshot ("dropped": ``storage.snapshot-drop-cache``; "direct":
    ``storage.snapshot-direct-io``) leaves no page of its file in the page cache, where the kept
    one (a stop's) stays; the bytes are the kept file's."""
    if mode == "direct" and not direct_io_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    store, view, older = _frozen_with_delta_runs(tmp_path)
    monkeypatch.setattr(snapshot_io, "SYNC_EVERY_BYTES", 4096)
    monkeypatch.setattr(snapshot_module, "WRITE_CHUNK_BYTES", 1024)
    (tmp_path / "kept").mkdir()
    (tmp_path / mode).mkdir()
    kept = snapshot_module.write_frozen(tmp_path / "kept", view, 7)
    timer = snapshot_module.write_frozen(tmp_path / mode, view, 7, mode=mode)
    cached_kept, pages = cached_pages(kept)
    if cached_kept < pages // 2:
        pytest.skip("this filesystem does not keep written pages cached")
    cached_timer, _ = cached_pages(timer)
    assert pages > 8 and cached_timer == 0
    assert not snapshot_module.direct_io_refused(tmp_path / mode)
    assert timer.read_bytes() == kept.read_bytes()
    assert same_state(read_snapshot(timer, BIG)[0], store)
    view.release()
    older.release()
