"""Update log, snapshots and restart: same rows and applied set; torn tails; corruption errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from giaannd.protocol import BatchId
from giaannd.storage import ColumnStore, CorruptLogError, CorruptSnapshotError, DurableStore
from giaannd.storage.engine.recovery import replay
from giaannd.storage.engine.snapshot import list_snapshots, read_snapshot
from giaannd.storage.engine.update_log import UpdateLog, list_segments, scan_segment

from ._gen import random_batch, same_state

BIG = 1 << 40


def _fill(ds: DurableStore, ref: ColumnStore, rng: np.random.Generator, n: int, start: int) -> None:
    for i in range(start, start + n):
        b = random_batch(rng)
        ds.apply(BatchId(i % 3, i), b)
        ref.apply(BatchId(i % 3, i), b)


def test_durable_restart_from_log_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    ref = ColumnStore(BIG)
    ds = DurableStore.open(tmp_path, BIG)
    _fill(ds, ref, rng, 20, 1)
    ds.advance_floor(0, 10)
    ref.advance_floor(0, 10)
    assert ds.sync() == ds.log.last_seq == 21
    ds.close()
    again = DurableStore.open(tmp_path, BIG)
    assert same_state(again.store, ref)
    assert again.recovery.records_replayed == 21 and again.recovery.torn_tail_bytes == 0
    again.close()


def test_durable_duplicate_not_logged_and_ack_covers_original(tmp_path: Path) -> None:
    ds = DurableStore.open(tmp_path, BIG)
    b = random_batch(np.random.default_rng(2))
    first = ds.apply(BatchId(1, 1), b)
    dup = ds.apply(BatchId(1, 1), b)
    assert first.applied and not dup.applied and dup.seq >= first.seq and ds.log.last_seq == 1
    ds.close()


def test_durable_snapshot_then_more_then_restart(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    ref = ColumnStore(BIG)
    ds = DurableStore.open(tmp_path, BIG, segment_max_bytes=4096)
    _fill(ds, ref, rng, 15, 1)
    ds.snapshot()
    assert len(list_segments(tmp_path)) == 1  # covered segments dropped
    _fill(ds, ref, rng, 10, 16)
    ds.close()
    again = DurableStore.open(tmp_path, BIG)
    assert same_state(again.store, ref)
    assert again.recovery.snapshot_seq == 15 and again.recovery.records_replayed == 10
    # The report says what the restart read, for the recovery-time figures (s/GB by phase).
    (_, snap), = list_snapshots(tmp_path)
    assert again.recovery.snapshot_bytes == snap.stat().st_size
    assert again.recovery.log_bytes == sum(p.stat().st_size for _, p in list_segments(tmp_path)) > 0
    assert again.recovery.snapshot_load_s > 0 and again.recovery.replay_s > 0
    assert again.recovery.snapshot_load_cpu_s > 0 and again.recovery.replay_cpu_s > 0  # (CPU beside wall)
    # Digests (including the per-row applied-batch counts) survive too.
    for key in ref.keys()[:20]:
        assert again.store.digest(key) == ref.digest(key)
    again.close()


def _segments_bytes(directory: Path) -> int:
    """Bytes of the log records in the segments on disk (after a snapshot's clean-up: those after it)."""
    segments = list_segments(directory)
    return sum(scan_segment(path, first, i == len(segments) - 1).good_bytes
               for i, (first, path) in enumerate(segments))


def test_logged_since_snapshot_counts_what_a_restart_replays(tmp_path: Path) -> None:
    rng = np.random.default_rng(31)
    ref = ColumnStore(BIG)
    ds = DurableStore.open(tmp_path, BIG, segment_max_bytes=4096)
    assert ds.logged_since_snapshot == 0
    _fill(ds, ref, rng, 12, 1)
    assert ds.logged_since_snapshot == ds.log.appended_bytes == _segments_bytes(tmp_path) > 0
    job = ds.begin_snapshot()
    _fill(ds, ref, rng, 3, 13)  # after the snapshot's seq: still to replay once it is done
    late = ds.log.appended_bytes - job.log_mark
    job.write()
    ds.finish_snapshot(job)
    assert ds.logged_since_snapshot == late == _segments_bytes(tmp_path) > 0
    ds.sync()
    ds.close()
    again = DurableStore.open(tmp_path, BIG, segment_max_bytes=4096)  # a restart: counts what it replayed
    assert again.recovery.log_bytes == again.logged_since_snapshot == late
    _fill(again, ref, rng, 2, 16)
    assert again.logged_since_snapshot == late + again.log.appended_bytes
    again.snapshot()
    assert again.logged_since_snapshot == 0
    again.close()


def test_durable_crash_between_snapshot_and_truncation(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    ref = ColumnStore(BIG)
    ds = DurableStore.open(tmp_path, BIG)
    _fill(ds, ref, rng, 12, 1)
    ds.sync()
    saved = tmp_path.parent / "saved-segments"
    saved.mkdir()
    for _, p in list_segments(tmp_path):
        shutil.copy2(p, saved / p.name)
    ds.snapshot()
    _fill(ds, ref, rng, 5, 13)
    ds.close()
    for p in saved.iterdir():  # as if the truncation never happened
        shutil.copy2(p, tmp_path / p.name)
    again = DurableStore.open(tmp_path, BIG)
    assert same_state(again.store, ref)
    assert again.recovery.records_skipped == 12
    # Replaying the whole log over the snapshot (ignoring seqs) is a no-op thanks to batch ids.
    snap_store, _ = read_snapshot(list_snapshots(tmp_path)[-1][1], BIG)
    records = [r for _, p in list_segments(tmp_path)[:1] for r in scan_segment(p, 1, False).records]
    before = snap_store.read_all()
    assert replay(snap_store, records, 0) == (0, 12)
    assert all(np.array_equal(x, y) for x, y in zip(before.buffers(), snap_store.read_all().buffers()))
    again.close()


def test_logged_since_snapshot_leaves_out_segments_the_snapshot_covers(tmp_path: Path) -> None:
    """A crash between a snapshot's rename and the log's truncation leaves the segments it covers;
    a restart reads them and skips their records, so they are not log "after the newest snapshot"
    (``logged_since_snapshot``, the snapshot timer's measure and its gauge): it counts only the
    segments after it, as the store did before the crash. The report still counts every byte read."""
    rng = np.random.default_rng(41)
    ref = ColumnStore(BIG)
    ds = DurableStore.open(tmp_path, BIG, segment_max_bytes=4096)
    _fill(ds, ref, rng, 12, 1)
    ds.sync()
    saved = tmp_path.parent / "saved-covered-segments"
    saved.mkdir()
    for _, p in list_segments(tmp_path):
        shutil.copy2(p, saved / p.name)
    covered = _segments_bytes(tmp_path)
    ds.snapshot()
    _fill(ds, ref, rng, 5, 13)
    late = ds.logged_since_snapshot
    assert late == _segments_bytes(tmp_path) > 0
    ds.sync()
    ds.close()
    for p in saved.iterdir():  # as if the truncation never happened
        shutil.copy2(p, tmp_path / p.name)
    again = DurableStore.open(tmp_path, BIG, segment_max_bytes=4096)
    assert same_state(again.store, ref) and again.recovery.records_skipped == 12
    assert again.recovery.log_bytes == covered + late
    assert again.logged_since_snapshot == late
    again.close()


def test_durable_torn_tail_cut_and_reported(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    ref = ColumnStore(BIG)
    ds = DurableStore.open(tmp_path, BIG)
    _fill(ds, ref, rng, 4, 1)
    ds.apply(BatchId(7, 1), random_batch(rng))  # the record the crash tears
    ds.close()
    (_, seg), = list_segments(tmp_path)
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size - 17)
    again = DurableStore.open(tmp_path, BIG)
    assert again.recovery.torn_tail_bytes > 0 and again.recovery.torn_tail_file == str(seg)
    assert same_state(again.store, ref)
    _fill(again, ref, rng, 2, 100)
    again.close()
    third = DurableStore.open(tmp_path, BIG)  # the cut file is now clean, not "corrupt in the middle"
    assert third.recovery.torn_tail_bytes == 0 and same_state(third.store, ref)
    third.close()


def test_durable_bad_checksum_in_middle_stops_startup(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    ds = DurableStore.open(tmp_path, BIG)
    _fill(ds, ColumnStore(BIG), rng, 5, 1)
    ds.close()
    (_, seg), = list_segments(tmp_path)
    data = bytearray(seg.read_bytes())
    data[100] ^= 0x10  # inside the first record's payload
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptLogError) as err:
        DurableStore.open(tmp_path, BIG)
    assert str(seg) in str(err.value) and err.value.offset == 0 and "checksum" in str(err.value)
    assert seg.read_bytes() == bytes(data)  # left untouched


def test_durable_corrupt_snapshot_stops_startup(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    ds = DurableStore.open(tmp_path, BIG)
    _fill(ds, ColumnStore(BIG), rng, 5, 1)
    snap = ds.snapshot()
    ds.close()
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0x01
    snap.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError) as err:
        DurableStore.open(tmp_path, BIG)
    assert str(snap) in str(err.value) and "offset" in str(err.value)


def test_durable_missing_segment_is_an_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    ds = DurableStore.open(tmp_path, BIG, segment_max_bytes=2048)
    _fill(ds, ColumnStore(BIG), rng, 10, 1)
    ds.close()
    segs = list_segments(tmp_path)
    assert len(segs) >= 3
    segs[1][1].unlink()
    with pytest.raises(CorruptLogError, match="expected"):
        DurableStore.open(tmp_path, BIG)


def test_update_log_group_commit(tmp_path: Path) -> None:
    log = UpdateLog(tmp_path, 1)
    b = random_batch(np.random.default_rng(9))
    seqs = [log.append_batch(BatchId(1, i), b) for i in range(1, 6)]
    assert seqs == [1, 2, 3, 4, 5] and log.durable_seq == 0
    assert log.sync() == 5 and log.durable_seq == 5
    log.close()
    with pytest.raises(ValueError):
        log.append_floor(1, 1)


def test_durable_leftover_temporary_removed(tmp_path: Path) -> None:
    (tmp_path / ".snapshot-00000000000000000003.tmp").write_bytes(b"half")
    ds = DurableStore.open(tmp_path, BIG)
    assert ds.recovery.temporaries_removed == 1
    assert not list(tmp_path.glob("*.tmp"))
    ds.close()


def test_durable_full_store_refuses_before_logging(tmp_path: Path) -> None:
    ds = DurableStore.open(tmp_path, 2000)
    from giaannd.storage import StoreFullError
    with pytest.raises(StoreFullError):
        ds.apply(BatchId(1, 1), random_batch(np.random.default_rng(10)))
    assert ds.log.last_seq == 0
    ds.close()


def test_snapshot_row_check_catches_unsorted_row(tmp_path: Path) -> None:
    """A snapshot with a valid checksum but a badly ordered row (a writer bug) is refused."""
    import struct

    import xxhash

    from giaannd.storage.engine.snapshot import HEADER_BYTES, body_checksum

    ds = DurableStore.open(tmp_path, BIG)
    ds.apply(BatchId(1, 1), random_batch(np.random.default_rng(11)))
    snap = ds.snapshot()
    ds.close()
    data = bytearray(snap.read_bytes())
    r = struct.unpack_from("<Q", data, 24)[0]
    regions_at = HEADER_BYTES + 8 * (4 * r + 1)
    n0 = struct.unpack_from("<q", data, HEADER_BYTES + 16 * r + 8)[0]  # entries of row 0
    # Swap the first two target columns of row 0, then re-seal both checksums.
    a, b = data[regions_at : regions_at + 8], data[regions_at + 8 : regions_at + 16]
    data[regions_at : regions_at + 8], data[regions_at + 8 : regions_at + 16] = b, a
    assert n0 >= 2 and a != b
    struct.pack_into("<Q", data, 48, body_checksum(bytes(data[HEADER_BYTES:]), *struct.unpack_from("<QQ", data, 24)))
    struct.pack_into("<Q", data, 56, xxhash.xxh3_64_intdigest(bytes(data[:56])))
    snap.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError, match="row 0: entries not sorted"):
        DurableStore.open(tmp_path, BIG)
    DurableStore.open(tmp_path, BIG, verify_rows=False).close()  # the checksum alone cannot tell


def test_update_log_failed_write_leaves_no_partial_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os as os_mod

    from giaannd.storage.engine import update_log as ul

    log = UpdateLog(tmp_path, 1)
    b = random_batch(np.random.default_rng(12))
    log.append_batch(BatchId(1, 1), b)
    real_writev = os_mod.writev

    def half_then_fail(fd: int, parts: list[bytes]) -> int:
        real_writev(fd, [bytes(parts[0])[:20]])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ul.os, "writev", half_then_fail)
    with pytest.raises(OSError):
        log.append_batch(BatchId(1, 2), b)
    monkeypatch.setattr(ul.os, "writev", real_writev)
    assert log.append_batch(BatchId(1, 3), b) == 2
    log.close()
    (first, seg), = list_segments(tmp_path)
    scan = scan_segment(seg, first, is_last=False)  # clean: no torn bytes anywhere
    assert [r.batch_id for r in scan.records] == [BatchId(1, 1), BatchId(1, 3)]


def test_a_restart_syncs_the_records_a_crash_left_unsynced_before_calling_them_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that died between an append and its sync (kill -9) left the record in the page
    cache only. The restart replays it and its log calls it durable (``durable_seq``, the group
    commit's start): a writer's retry of that batch is a duplicate, acknowledged at that seq with
    no sync covering the old segment (a sync only syncs the segment current now). So the restart
    syncs the segment it inherits before calling its records durable."""
    import os as os_mod

    from giaannd.storage.engine import update_log as ul

    ds = DurableStore.open(tmp_path, BIG)
    b = random_batch(np.random.default_rng(13))
    seq = ds.apply(BatchId(1, 1), b).seq
    (_, segment), = list_segments(tmp_path)
    inode = segment.stat().st_ino
    os_mod.close(ds.log._fd)  # the crash: nothing synced, nothing closed cleanly
    ds.log._fd = -1
    synced: list[int] = []
    real_fdatasync, real_fsync = os_mod.fdatasync, os_mod.fsync

    def recording(real):  # type: ignore[no-untyped-def]
        def call(fd: int) -> None:
            synced.append(os_mod.fstat(fd).st_ino)
            real(fd)
        return call

    monkeypatch.setattr(ul.os, "fdatasync", recording(real_fdatasync))
    monkeypatch.setattr(ul.os, "fsync", recording(real_fsync))
    again = DurableStore.open(tmp_path, BIG)
    retry = again.apply(BatchId(1, 1), b)
    assert not retry.applied and retry.seq == seq
    assert again.sync() >= seq  # what the service acknowledges the retry with
    assert inode in synced, "the replayed record was called durable without a sync of its segment"
    again.close()
