"""The store's update log drops what each sync made durable from the page cache
(``UpdateLog(drop_synced=True)``, update_log.py): every byte synced is advised
``POSIX_FADV_DONTNEED`` once, never a byte before it is durable, and the log reads back whole."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from giaannd.protocol import BatchId
from giaannd.storage import DurableStore
from giaannd.storage.engine import update_log as ul
from giaannd.storage.engine.update_log import UpdateLog, list_segments, scan_segment
from peers.madvise import PAGE

from ._gen import random_batch

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise (Linux)")


def _record_advice(monkeypatch: pytest.MonkeyPatch, log: UpdateLog) -> list[tuple[int, int, int]]:
    """(offset, length, segment size synced so far) of every fadvise the log makes (a length of 0,
    "to the end of the file", as the length it stands for)."""
    calls: list[tuple[int, int, int]] = []
    real_sync, real_advise = os.fdatasync, os.posix_fadvise
    synced = [0]

    def fdatasync(fd: int) -> None:
        real_sync(fd)
        synced[0] = os.fstat(fd).st_size  # everything written before is durable now

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        if length == 0:  # to the end of the file
            length = max(0, os.fstat(fd).st_size - offset)
        calls.append((offset, length, synced[0]))
        real_advise(fd, offset, length, advice)

    monkeypatch.setattr(ul.os, "fdatasync", fdatasync)
    monkeypatch.setattr(ul.os, "posix_fadvise", advise)
    return calls


def test_synced_bytes_are_dropped_once_and_never_before_they_are_durable(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    log = UpdateLog(tmp_path, 1, drop_synced=True)
    calls = _record_advice(monkeypatch, log)
    rng = np.random.default_rng(5)
    sizes = []
    for i in range(1, 40):
        log.append_batch(BatchId(1, i), random_batch(rng))
        if i % 3 == 0:
            log.sync()
            sizes.append(os.fstat(log._fd).st_size)
    log.close()
    assert calls
    covered = 0
    for offset, length, synced in calls:
        assert offset % PAGE == 0 and offset + length <= synced  # only durable bytes
        assert offset <= covered  # no hole: every synced byte is advised ...
        assert offset >= covered - PAGE  # ... once (the partial last page again, at most)
        covered = offset + length
    assert covered == sizes[-1]  # the close's sync covered the rest
    (first, seg), = list_segments(tmp_path)
    assert [r.batch_id for r in scan_segment(seg, first, is_last=True).records] == [BatchId(1, i) for i in range(1, 40)]


def test_rotation_drops_the_rest_of_the_old_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = UpdateLog(tmp_path, 1, segment_max_bytes=8 * PAGE, drop_synced=True)
    calls = _record_advice(monkeypatch, log)
    rng = np.random.default_rng(6)
    for i in range(1, 30):
        log.append_batch(BatchId(1, i), random_batch(rng))
    log.close()
    segments = list_segments(tmp_path)
    assert len(segments) > 2
    ends = [offset + length for offset, length, _ in calls]
    for _, path in segments:
        assert path.stat().st_size in ends  # every segment was dropped to its end
    records = [r for first, path in segments for r in scan_segment(path, first, is_last=False).records]
    assert [r.batch_id for r in records] == [BatchId(1, i) for i in range(1, 30)]


def test_without_drop_synced_nothing_is_advised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = UpdateLog(tmp_path, 1)
    calls = _record_advice(monkeypatch, log)
    log.append_batch(BatchId(1, 1), random_batch(np.random.default_rng(7)))
    log.sync()
    log.close()
    assert calls == []


def test_the_stores_log_drops_what_it_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DurableStore.open(tmp_path, 1 << 40)
    assert store.log.drop_synced
    calls = _record_advice(monkeypatch, store.log)
    store.apply(BatchId(1, 1), random_batch(np.random.default_rng(8)))
    store.sync()
    assert calls and calls[-1][0] + calls[-1][1] == calls[-1][2] // PAGE * PAGE
    store.close()


def test_a_sync_keeps_the_partial_last_page_and_close_drops_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page the next append writes into stays cached after a sync (dropping it would make that
    append read it back from the disk); once the segment is closed nothing is appended to it."""
    log = UpdateLog(tmp_path, 1, drop_synced=True)
    calls = _record_advice(monkeypatch, log)
    rng = np.random.default_rng(9)
    while os.fstat(log._fd).st_size % PAGE == 0 or os.fstat(log._fd).st_size < 3 * PAGE:
        log.append_batch(BatchId(1, log.last_seq + 1), random_batch(rng))
    size = os.fstat(log._fd).st_size
    log.sync()
    assert calls[-1][0] + calls[-1][1] == size // PAGE * PAGE  # the partial page is left
    log.close()
    assert calls[-1] == (size // PAGE * PAGE, size % PAGE, size)  # to the end of the file


@pytest.mark.parametrize("errno_", [22, 38, 1])  # EINVAL, ENOSYS, EPERM: a file system or sandbox refusing it
def test_a_refused_drop_is_advice_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_: int) -> None:
    """The drop after a sync is advice: a kernel refusing it must not fail the sync that made the
    bytes durable (before: ``sync`` raised, so no write was ever acknowledged again, and a
    rotation raised with its old segment left open)."""
    asked: list[int] = []

    def refuse(fd: int, offset: int, length: int, advice: int) -> None:
        asked.append(offset)
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    log = UpdateLog(tmp_path, 1, segment_max_bytes=8 * PAGE, drop_synced=True)
    rng = np.random.default_rng(6)
    for i in range(1, 30):
        log.append_batch(BatchId(1, i), random_batch(rng))
        assert log.sync() == i  # durable, whatever the advice did
    log.rotate()
    log.close()
    assert asked  # the advice was asked for, and refused
    batches = [r.batch_id for first, seg in list_segments(tmp_path)
               for r in scan_segment(seg, first, is_last=True).records]
    assert batches == [BatchId(1, i) for i in range(1, 30)]
