"""A restart's files read ahead of the load (read_ahead.py, ``DurableStore.open``'s
``read_ahead_bytes``): every byte of the snapshot and the log after it asked for, in steps the
kernel does not cut, in load order, never further ahead of the load than the window; a hint that
never changes what loads."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from giaannd.protocol import BatchId
from giaannd.storage import DurableStore
from giaannd.storage.engine.read_ahead import STEP_BYTES, ReadAhead
from giaannd.storage.engine.snapshot import read_snapshot
from giaannd.storage.engine.update_log import list_segments

from ._gen import random_batch, same_state

BIG = 1 << 40


class _Advice:
    """``os.posix_fadvise`` recorded (and passed on): (path, offset, length, advice) per call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, int, int]] = []
        self._lock = threading.Lock()
        real = os.posix_fadvise

        def record(fd: int, offset: int, length: int, advice: int) -> None:
            with self._lock:
                self.calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
            real(fd, offset, length, advice)

        monkeypatch.setattr(os, "posix_fadvise", record)

    def willneed(self, path: Path) -> list[tuple[int, int]]:
        return [(o, n) for p, o, n, a in self.calls if p == str(path.resolve()) and a == os.POSIX_FADV_WILLNEED]


def _covered(ranges: list[tuple[int, int]], size: int) -> bool:
    """Whether the ranges, in order, are exactly [0, size) in consecutive steps of at most STEP_BYTES."""
    at = 0
    for offset, length in ranges:
        if offset != at or not 0 < length <= STEP_BYTES:
            return False
        at += length
    return at == size


def _store(directory: Path, batches: int = 40, logged: int = 30) -> tuple[Path, list[Path]]:
    """A store with a snapshot and ``logged`` batches in small log segments after it, left as a
    kill -9 leaves it (no final snapshot): (snapshot, segments)."""
    rng = np.random.default_rng(7)
    ds = DurableStore.open(directory, BIG, segment_max_bytes=64 << 10)
    for i in range(batches):
        ds.apply(BatchId(1, i + 1), random_batch(rng, entries=3000, columns=40, features=8))
    snap = ds.snapshot()
    for i in range(logged):
        ds.apply(BatchId(1, batches + i + 1), random_batch(rng, entries=2000, columns=40, features=8))
    ds.sync()
    ds.close()  # (no final snapshot: as a kill -9 leaves it)
    return snap, [p for _, p in list_segments(directory)]


def test_open_asks_for_every_byte_of_the_snapshot_and_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    snap, segments = _store(tmp_path)
    assert len(segments) > 3 and snap.stat().st_size > 4 * STEP_BYTES
    advice = _Advice(monkeypatch)
    ds = DurableStore.open(tmp_path, BIG, read_ahead_bytes=1 << 30)
    for path in (snap, *segments):
        assert _covered(advice.willneed(path), path.stat().st_size), path.name
    # in the load's order: the snapshot first, then the segments oldest first
    order = [p for p, *_ in advice.calls]
    firsts = [order.index(str(p.resolve())) for p in (snap, *segments)]
    assert firsts == sorted(firsts)
    ds.close()


def test_read_ahead_changes_nothing_that_loads(tmp_path: Path) -> None:
    _store(tmp_path / "a")
    os.rename(tmp_path / "a", tmp_path / "b")
    _store(tmp_path / "a")
    ahead = DurableStore.open(tmp_path / "a", BIG, read_ahead_bytes=1 << 20)
    plain = DurableStore.open(tmp_path / "b", BIG, read_ahead_bytes=0)
    assert ahead.recovery.records_replayed == plain.recovery.records_replayed > 0
    assert same_state(ahead.store, plain.store)
    for ds in (ahead, plain):
        ds.close()


def test_no_read_ahead_at_window_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _store(tmp_path, batches=4, logged=2)
    advice = _Advice(monkeypatch)
    DurableStore.open(tmp_path, BIG, read_ahead_bytes=0).close()
    assert not [c for c in advice.calls if c[3] == os.POSIX_FADV_WILLNEED]


def _files(directory: Path, sizes: list[int]) -> list[Path]:
    paths = []
    for i, size in enumerate(sizes):
        p = directory / f"f{i}"
        p.write_bytes(b"\x01" * size)
        paths.append(p)
    return paths


def test_never_further_ahead_than_the_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _files(tmp_path, [5 * STEP_BYTES + 100, 3 * STEP_BYTES, 1000])
    window = 2 * STEP_BYTES
    consumed = 0
    seen: list[tuple[int, int]] = []  # (sequence offset asked for, what the reader had read then)
    real = os.posix_fadvise
    sizes = [p.stat().st_size for p in paths]
    starts = [0, sizes[0], sizes[0] + sizes[1]]
    names = {str(p.resolve()): i for i, p in enumerate(paths)}

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        seen.append((starts[names[os.readlink(f"/proc/self/fd/{fd}")]] + offset, consumed))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    ra = ReadAhead(paths, window)
    total = sum(sizes)
    assert ra.starts == starts
    for consumed in range(0, total + STEP_BYTES, STEP_BYTES // 2):
        ra.advance(consumed)
        time.sleep(0.002)
    deadline = time.monotonic() + 10
    while ra.issued < total and time.monotonic() < deadline:
        time.sleep(0.01)
    ra.close()
    assert ra.issued == total
    assert seen and all(at < had + window for at, had in seen)
    assert any(at >= had + window - STEP_BYTES for at, had in seen)  # it did run ahead of the reader


def test_close_stops_a_thread_waiting_for_the_reader(tmp_path: Path) -> None:
    paths = _files(tmp_path, [20 * STEP_BYTES])
    ra = ReadAhead(paths, STEP_BYTES)  # one step, then it waits for an advance that never comes
    deadline = time.monotonic() + 10
    while ra.issued == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    ra.close()
    assert time.monotonic() - started < 5
    assert ra.issued == STEP_BYTES


def test_a_missing_file_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _files(tmp_path, [STEP_BYTES, STEP_BYTES + 1, 300])
    advice = _Advice(monkeypatch)
    with ReadAhead([paths[0], tmp_path / "gone", *paths[1:]], 1 << 30) as ra:
        deadline = time.monotonic() + 10
        while ra.issued < sum(p.stat().st_size for p in paths) and time.monotonic() < deadline:
            time.sleep(0.01)
    for p in paths:
        assert _covered(advice.willneed(p), p.stat().st_size)


@pytest.mark.parametrize("mapped", [False, True])
def test_a_snapshot_load_reports_its_progress_to_the_end(tmp_path: Path, mapped: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from giaannd.storage.engine import snapshot as snapshot_module
    from giaannd.storage.engine.snapshot_map import SnapshotMapping

    snap, _ = _store(tmp_path, logged=0)
    monkeypatch.setattr(snapshot_module, "READ_CHUNK_BYTES", 64 << 10)  # many pieces per section
    reported: list[int] = []
    mapping = SnapshotMapping.open(snap) if mapped else None
    store, _ = read_snapshot(snap, BIG, mapping=mapping, progress=reported.append)
    assert len(reported) > 8 and reported == sorted(reported) and reported[-1] == snap.stat().st_size
    assert store.usage().num_entries > 0
