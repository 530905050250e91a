"""Bulk log replay (recovery.replay: groups of batch records as one engine plan, row-disjoint runs
as one engine apply) against record-by-record replay (recovery.replay_each), bit for bit: rows,
strengths, touches, row ids, the applied set with its per-column idempotency (applied_set.py
"Which columns"), the row-size counts and the counts of applied and skipped records. Training-like
logs (records sharing rows, keys repeated across records, increments of mixed magnitudes whose
float32 sums depend on their order) check the group replay's order of adds."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import mmap
import platform
import shutil
import sys
import weakref
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.rowengine import inorder
from giaannd.storage import ColumnStore, DurableStore
from giaannd.storage.engine import recovery
from giaannd.storage.engine.recovery import replay, replay_each
from giaannd.storage.engine.snapshot import read_snapshot
from giaannd.storage.engine.update_log import (
    KIND_BATCH,
    KIND_DROP,
    KIND_FLOOR,
    LogRecord,
    SegmentMapper,
    list_segments,
    scan_segment,
)

BIG = 1 << 44
TRACKED, UNTRACKED = 7, 9


def _batch(rng: np.random.Generator, first_column: int, columns: int, entries: int) -> RowBatch:
    """Rows in ``columns`` columns from ``first_column`` (overlapping ranges share rows)."""
    return RowBatch.from_entries(
        (first_column + rng.integers(0, columns, entries)).astype(np.uint64), rng.integers(0, 3, entries),
        rng.integers(0, 9, entries), rng.integers(0, 40, entries), rng.integers(0, 40, entries),
        rng.random(entries, dtype=np.float32) + np.float32(0.01))


def _records(rng: np.random.Generator, count: int) -> list[LogRecord]:
    """A log: mostly batches (new rows, rows shared with recent batches, another share of an id
    applied before, an id repeated whole, empty rows), with floors and drops among them."""
    records: list[LogRecord] = []
    seqs = {TRACKED: 0, UNTRACKED: 0}
    records.append(LogRecord(1, KIND_FLOOR, writer=TRACKED, floor=0))  # the writer is tracked from here
    for _ in range(count):
        seq = len(records) + 1
        kind = rng.choice(["new", "new", "overlap", "share", "again", "floor", "drop"])
        if kind == "floor":
            records.append(LogRecord(seq, KIND_FLOOR, writer=TRACKED, floor=int(rng.integers(0, seqs[TRACKED] + 1))))
            continue
        if kind == "drop":
            records.append(LogRecord(seq, KIND_DROP, columns=np.unique(rng.integers(0, 60, 3).astype(np.uint64))))
            continue
        writer = TRACKED if rng.random() < 0.6 else UNTRACKED
        earlier = [r for r in records if r.kind == KIND_BATCH and r.batch_id is not None]
        if kind in ("share", "again") and earlier:
            prev = earlier[int(rng.integers(0, len(earlier)))]
            assert prev.batch_id is not None
            batch = prev.batch if kind == "again" else _batch(rng, int(rng.integers(0, 60)), 4, 30)
            records.append(LogRecord(seq, KIND_BATCH, batch_id=prev.batch_id, batch=batch))
            continue
        seqs[writer] += 1
        first = 1000 * seq if kind == "new" else int(rng.integers(0, 60))  # "new": columns no one had
        batch = _batch(rng, first, int(rng.integers(1, 6)), int(rng.integers(1, 80)))
        if rng.random() < 0.1 and batch.num_rows > 1:  # a row without entries
            lengths = np.diff(batch.offsets)
            lengths[0] = 0
            keep = np.concatenate([np.zeros(int(np.diff(batch.offsets)[0]), bool), np.ones(batch.num_entries -
                                   int(np.diff(batch.offsets)[0]), bool)])
            batch = RowBatch(batch.row_column, batch.row_feature, np.concatenate([[0], np.cumsum(lengths)]),
                             batch.segment[keep], batch.target_column[keep], batch.target_feature[keep],
                             batch.strength[keep])
        records.append(LogRecord(seq, KIND_BATCH, batch_id=BatchId(writer, seqs[writer]), batch=batch))
    return records


def _training_batch(rng: np.random.Generator, rows: list[tuple[int, int]], entries: int) -> RowBatch:
    """Adds to a few of ``rows`` over a small key space (keys repeat across batches), increments
    of mixed magnitudes and signs (float32 sums then depend on their order), a few -0.0."""
    picked = np.array(rows, np.uint64)[rng.integers(0, len(rows), entries)]
    st_ = (rng.choice([1e-3, 1.0, 3e3], entries) * (rng.random(entries) - 0.3)).astype(np.float32)
    st_[rng.random(entries) < 0.03] = np.float32(-0.0)
    batch = RowBatch.from_entries(picked[:, 0], picked[:, 1], rng.integers(0, 2, entries), rng.integers(0, 5, entries),
                                  rng.integers(0, 5, entries), st_)
    return batch


def _training_records(rng: np.random.Generator, count: int) -> list[LogRecord]:
    """A training-like log: batches adding to rows the ones before added to, new rows arriving
    mid-log and added to again by later batches, an id repeated whole and another share of an id,
    with floors and drops between some of them."""
    records: list[LogRecord] = [LogRecord(1, KIND_FLOOR, writer=TRACKED, floor=0)]
    rows = [(c, f) for c in range(6) for f in range(2)]
    seqs = {TRACKED: 0, UNTRACKED: 0}
    for _ in range(count):
        seq = len(records) + 1
        kind = rng.choice(["add"] * 8 + ["grow", "again", "share", "floor", "drop"])
        if kind == "floor":
            records.append(LogRecord(seq, KIND_FLOOR, writer=TRACKED, floor=int(rng.integers(0, seqs[TRACKED] + 1))))
            continue
        if kind == "drop":
            records.append(LogRecord(seq, KIND_DROP, columns=np.array([int(rng.integers(0, 6))], np.uint64)))
            continue
        earlier = [r for r in records if r.kind == KIND_BATCH]
        if kind in ("again", "share") and earlier:
            prev = earlier[int(rng.integers(0, len(earlier)))]
            assert prev.batch_id is not None
            batch = prev.batch if kind == "again" else _training_batch(rng, rows, int(rng.integers(1, 30)))
            records.append(LogRecord(seq, KIND_BATCH, batch_id=prev.batch_id, batch=batch))
            continue
        if kind == "grow":  # a new row, which later batches may add to
            rows.append((1000 + seq, int(rng.integers(0, 3))))
        writer = TRACKED if rng.random() < 0.7 else UNTRACKED
        seqs[writer] += 1
        batch = _training_batch(rng, rows[-3:] if kind == "grow" else rows, int(rng.integers(1, 40)))
        records.append(LogRecord(seq, KIND_BATCH, batch_id=BatchId(writer, seqs[writer]), batch=batch))
    return records


def _assert_same(a: ColumnStore, b: ColumnStore) -> None:
    x, y = a.read_all(), b.read_all()
    for p, q in zip(x.buffers(), y.buffers()):
        assert p.dtype == q.dtype and np.array_equal(p.view(np.uint8), q.view(np.uint8))
    assert [(k, t) for k, t, _ in a.iter_slots()] == [(k, t) for k, t, _ in b.iter_slots()]  # touches
    ka, kb = a.engine.keys(), b.engine.keys()
    assert np.array_equal(ka[0], kb[0]) and np.array_equal(ka[1], kb[1])  # the same row ids
    assert a.applied == b.applied
    assert a.applied.to_arrays()[0].tolist() == b.applied.to_arrays()[0].tolist()
    assert [c.tolist() for c in a.applied.column_arrays()] == [c.tolist() for c in b.applied.column_arrays()]
    assert a.row_size_log2() == b.row_size_log2() and a.usage() == b.usage()


def _base_read_only(on: bool) -> Any:
    """``ColumnStore.base_read_only`` forced (True: the replay's path over a mapped snapshot, every
    record through one ``apply_in_order``), or left alone."""
    if not on:
        return contextlib.nullcontext()
    return mock.patch.object(ColumnStore, "base_read_only", new_callable=mock.PropertyMock, return_value=True)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 40), after=st.integers(0, 6),
       run_limit=st.sampled_from([50, 1 << 22]), keep_base=st.booleans())
def test_bulk_replay_equals_record_by_record(seed: int, count: int, after: int, run_limit: int,
                                             keep_base: bool) -> None:
    records = _records(np.random.default_rng(seed), count)
    bulk, each = ColumnStore(BIG), ColumnStore(BIG)
    saved = recovery.MAX_REPLAY_RUN_ENTRIES
    recovery.MAX_REPLAY_RUN_ENTRIES = run_limit  # small: runs are also cut by size
    try:
        with _base_read_only(keep_base):
            got = replay(bulk, records, after)
    finally:
        recovery.MAX_REPLAY_RUN_ENTRIES = saved
    assert got == replay_each(each, records, after)
    _assert_same(bulk, each)
    # and the stores go on alike: a later share of a tracked batch applies the same columns
    later = [r for r in records if r.batch_id is not None and r.batch_id.writer == TRACKED]
    if later:
        extra = _batch(np.random.default_rng(seed + 1), 0, 60, 50)
        assert bulk.apply(later[-1].batch_id, extra) == each.apply(later[-1].batch_id, extra)
        _assert_same(bulk, each)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 60), after=st.integers(0, 6),
       run_limit=st.sampled_from([40, 200, 1 << 22]), keep_base=st.booleans())
def test_group_replay_of_a_training_log_equals_record_by_record(seed: int, count: int, after: int,
                                                                run_limit: int, keep_base: bool) -> None:
    """Records that share rows and keys are replayed as groups (one plan each, cut by size, by
    floors and by drops): every key's increments added in log order, float32 sums bit for bit."""
    records = _training_records(np.random.default_rng(seed), count)
    bulk, each = ColumnStore(BIG), ColumnStore(BIG)
    saved = recovery.MAX_REPLAY_RUN_ENTRIES, recovery.MAX_REPLAY_GROUP_ENTRIES
    recovery.MAX_REPLAY_RUN_ENTRIES = recovery.MAX_REPLAY_GROUP_ENTRIES = run_limit
    try:
        with _base_read_only(keep_base):
            got = replay(bulk, records, after)
    finally:
        recovery.MAX_REPLAY_RUN_ENTRIES, recovery.MAX_REPLAY_GROUP_ENTRIES = saved
    assert got == replay_each(each, records, after)
    _assert_same(bulk, each)


def test_replay_applies_a_training_log_as_groups(monkeypatch) -> None:
    """Records sharing rows: one ``apply_in_order`` per group (not one apply per record); a floor
    record goes into the group in its place (it changes the applied set only), a drop record ends
    the group; the result is record-by-record replay's."""
    rng = np.random.default_rng(8)
    rows = [(c, f) for c in range(4) for f in range(2)]
    records = [LogRecord(i + 1, KIND_BATCH, batch_id=BatchId(1, i + 1), batch=_training_batch(rng, rows, 30))
               for i in range(10)]
    records.insert(6, LogRecord(7, KIND_FLOOR, writer=1, floor=3))
    records.insert(9, LogRecord(10, KIND_DROP, columns=np.array([3], np.uint64)))
    records = [dataclasses.replace(r, seq=i + 1) for i, r in enumerate(records)]
    store = ColumnStore(BIG)
    calls: list[int] = []
    group = store.apply_in_order
    monkeypatch.setattr(store, "apply_in_order",
                        lambda items, threads=1: calls.append(len(items)) or group(items, threads))
    assert replay(store, records, 0) == (12, 0)
    each = ColumnStore(BIG)
    replay_each(each, records, 0)
    _assert_same(store, each)
    assert calls == [8, 2]  # record 1 alone (its rows may all be new), then 2-9 (the floor among them), 11-12


def test_restart_after_a_torn_tail_of_a_training_log(tmp_path: Path) -> None:
    """A training-like log written live, its last segment cut at several places (a crash mid
    write): the restart replays the whole records in groups to the state record-by-record
    replay of the same records gives."""
    src = tmp_path / "live"
    _training_log_store(src, seed=21, batches=59, segment_bytes=6_000, snapshot_at=0)
    last = list_segments(src)[-1][1]
    size = last.stat().st_size
    torn = 0
    for cut in (size - 1, size - 7, size // 2, 30):
        d = tmp_path / f"cut{cut}"
        shutil.copytree(src, d)
        with open(d / last.name, "r+b") as f:
            f.truncate(cut)
        reopened = DurableStore.open(d, BIG)
        each = ColumnStore(BIG)
        segments = list_segments(d)
        for n, (first, path) in enumerate(segments):
            replay_each(each, scan_segment(path, first, n == len(segments) - 1).records, 0)
        torn += reopened.recovery.torn_tail_bytes  # (the open cut the tail off the segment replayed above)
        _assert_same(reopened.store, each)
        reopened.close()
    assert torn > 0


def test_replay_applies_disjoint_records_in_one_engine_apply(monkeypatch) -> None:
    """New rows in every record (a stream's chunks, a bulk load): one apply for the whole run;
    a record sharing a row with the run starts the next one."""
    rng = np.random.default_rng(3)
    records = [LogRecord(i + 1, KIND_BATCH, batch_id=BatchId(1, i + 1), batch=_batch(rng, 100 * i, 5, 40))
               for i in range(6)]
    records.append(LogRecord(7, KIND_BATCH, batch_id=BatchId(1, 7), batch=records[0].batch))
    calls: list[int] = []
    store = ColumnStore(BIG)
    apply = store.apply_disjoint
    monkeypatch.setattr(store, "apply_disjoint",
                        lambda items, room=0, new_rows=True, threads=1:
                        calls.append(len(items)) or apply(items, room, new_rows, threads))
    assert replay(store, records, 0) == (7, 0)
    assert calls == [6, 1]
    each = ColumnStore(BIG)
    replay_each(each, records, 0)
    _assert_same(store, each)


def test_restart_replays_the_log_in_bulk_to_the_live_state(tmp_path: Path) -> None:
    """A DurableStore written live (tracked writer, shares, drops), reopened: equal to the live
    store and to a record-by-record replay of the same segments."""
    rng = np.random.default_rng(11)
    ds = DurableStore.open(tmp_path / "s", BIG, segment_max_bytes=20_000)
    for i in range(1, 40):
        batch = _batch(rng, int(rng.integers(0, 30)) if i % 3 else 1000 * i, 4, int(rng.integers(1, 60)))
        ds.apply(BatchId(TRACKED if i % 2 else UNTRACKED, i), batch, track=bool(i % 2))
        if i % 11 == 0:
            ds.drop_columns(np.arange(0, 10, dtype=np.uint64))
        if i % 7 == 0:
            ds.advance_floor(TRACKED, i - 5)
    ds.sync()
    live = ds.store
    ds.close()
    reopened = DurableStore.open(tmp_path / "s", BIG)
    each = ColumnStore(BIG)
    segments = list_segments(tmp_path / "s")
    for n, (first, path) in enumerate(segments):
        replay_each(each, scan_segment(path, first, n == len(segments) - 1).records, 0)
    _assert_same(reopened.store, each)
    x, y = reopened.store.read_all(), live.read_all()
    assert all(np.array_equal(p, q) for p, q in zip(x.buffers(), y.buffers()))
    assert reopened.store.applied == live.applied
    reopened.close()


def test_replay_of_new_rows_goes_straight_into_the_base(tmp_path: Path) -> None:
    """A log of new rows only (a store's growth): each run is appended to the engine's base (no
    search, no delta run, no fold: issue 14 item 4), with the result of record-by-record replay."""
    rng = np.random.default_rng(5)
    records = [LogRecord(i + 1, KIND_BATCH, batch_id=BatchId(1, i + 1), batch=_batch(rng, 100 * i, 5, 40))
               for i in range(12)]
    saved = recovery.MAX_REPLAY_RUN_ENTRIES
    recovery.MAX_REPLAY_RUN_ENTRIES = 100  # several runs, each appended after the one before
    try:
        bulk = ColumnStore(BIG)
        assert replay(bulk, records, 0) == (12, 0)
    finally:
        recovery.MAX_REPLAY_RUN_ENTRIES = saved
    assert (bulk.engine.stats.folds, bulk.engine.stats.delta_merges, bulk.engine.num_deltas) == (0, 0, 0)
    each = ColumnStore(BIG)
    replay_each(each, records, 0)
    _assert_same(bulk, each)


def test_replay_keeps_no_view_of_the_mapped_segments(tmp_path: Path, monkeypatch) -> None:
    """A start-up maps every segment (update_log.SegmentMapper), so a replay must copy all it keeps
    (new rows appended to the base, planned runs, drops, the applied set): once ``open`` returns
    every mapping is gone (a view kept would hold a deleted segment's disk and pages), and the
    store is the live one."""
    rng = np.random.default_rng(12)
    ds = DurableStore.open(tmp_path / "s", BIG, segment_max_bytes=8_000)
    first = _batch(rng, 5000, 3, 40)
    ds.apply(BatchId(UNTRACKED, 100), first)  # a run of one record into the empty base,
    ds.apply(BatchId(UNTRACKED, 101), first)  # then in-place adds to its rows
    for i in range(1, 50):
        batch = _batch(rng, int(rng.integers(0, 30)) if i % 3 == 0 else 1000 * i, 4, int(rng.integers(1, 60)))
        ds.apply(BatchId(TRACKED if i % 2 else UNTRACKED, i), batch, track=bool(i % 2))
        if i % 13 == 0:
            ds.drop_columns(np.arange(0, 10, dtype=np.uint64))
    ds.sync()
    live = ds.store
    ds.close()
    assert len(list_segments(tmp_path / "s")) > 4
    mapped: list[weakref.ref] = []
    real = SegmentMapper.read

    def read(self: SegmentMapper, path: Path) -> memoryview:
        view = real(self, path)
        assert isinstance(view.obj, mmap.mmap)
        mapped.append(weakref.ref(view.obj))
        return view

    monkeypatch.setattr(SegmentMapper, "read", read)
    reopened = DurableStore.open(tmp_path / "s", BIG, replay_threads=2)
    gc.collect()
    assert len(mapped) == len(list_segments(tmp_path / "s")) - 1  # (less the fresh segment open made)
    assert [ref() for ref in mapped] == [None] * len(mapped)
    x, y = reopened.store.read_all(), live.read_all()
    assert all(np.array_equal(p.view(np.uint8), q.view(np.uint8)) for p, q in zip(x.buffers(), y.buffers()))
    assert reopened.store.applied == live.applied
    assert [c.tolist() for c in reopened.store.applied.column_arrays()] == [c.tolist() for c in
                                                                          live.applied.column_arrays()]
    reopened.close()


def test_restart_that_replayed_gives_the_freed_heap_back(tmp_path: Path, monkeypatch) -> None:
    """A replay's temporaries, freed, stayed in glibc's heap (36 B resident per entry after a
    restart of tools.bench.snapshot's training-like log, 26 once given back): a start-up that
    replayed records trims the heap once; one with nothing to replay does not."""
    calls: list[bool] = []
    real = recovery.return_freed_heap
    monkeypatch.setattr(recovery, "return_freed_heap", lambda: calls.append(real()) or True)
    DurableStore.open(tmp_path / "s", BIG).close()
    assert calls == []
    rng = np.random.default_rng(3)
    ds = DurableStore.open(tmp_path / "s", BIG)
    ds.apply(BatchId(UNTRACKED, 1), _batch(rng, 0, 4, 8))
    ds.sync()
    ds.close()
    DurableStore.open(tmp_path / "s", BIG).close()
    assert len(calls) == 1
    assert calls[0] is (sys.platform == "linux" and platform.libc_ver()[0] == "glibc")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), window=st.sampled_from([60, 400, 1 << 22]))
def test_restart_from_a_snapshot_replays_windows_into_its_room(tmp_path_factory, seed: int, window: int) -> None:
    """A snapshot, then a training-like log (new rows and new keys of held rows, keys repeated
    across records, floors among them): the restart loads the snapshot with room for the log and
    the windows merge their new keys into it in place (run.fold_into_base, in place), small windows several
    times (the last window's new keys stay a delta run unless a fold is due); the result is the
    snapshot plus record-by-record replay of the same segments."""
    rng = np.random.default_rng(seed)
    d = tmp_path_factory.mktemp("s")
    ds = DurableStore.open(d, BIG, segment_max_bytes=12_000)
    rows = [(c, f) for c in range(5) for f in range(2)]
    for i in range(1, 70):
        if i == 30:
            ds.snapshot()
        if i % 8 == 0:
            rows.append((1000 + i, 0))
        ds.apply(BatchId(TRACKED, i), _training_batch(rng, rows, int(rng.integers(1, 50))), track=True)
        if i % 5 == 0:
            ds.advance_floor(TRACKED, i - 3)
    ds.sync()
    ds.close()
    saved = recovery.MAX_REPLAY_RUN_ENTRIES, recovery.MAX_REPLAY_GROUP_ENTRIES
    recovery.MAX_REPLAY_RUN_ENTRIES = recovery.MAX_REPLAY_GROUP_ENTRIES = window
    try:
        reopened = DurableStore.open(d, BIG)
    finally:
        recovery.MAX_REPLAY_RUN_ENTRIES, recovery.MAX_REPLAY_GROUP_ENTRIES = saved
    assert reopened.recovery.snapshot is not None and reopened.store.engine.num_deltas <= 1
    each, after = read_snapshot(Path(reopened.recovery.snapshot), BIG)
    segments = list_segments(d)
    for n, (first, path) in enumerate(segments):
        replay_each(each, scan_segment(path, first, n == len(segments) - 1).records, after)
    _assert_same(reopened.store, each)
    reopened.close()


def _training_log_store(d: Path, seed: int, batches: int, segment_bytes: int, snapshot_at: int) -> None:
    """A DurableStore written live with training-like batches (rows shared batch after batch, new
    rows mid-log, floors, a drop), a snapshot after ``snapshot_at`` batches, small segments."""
    rng = np.random.default_rng(seed)
    ds = DurableStore.open(d, BIG, segment_max_bytes=segment_bytes)
    rows = [(c, f) for c in range(5) for f in range(2)]
    for i in range(1, batches + 1):
        if i % 7 == 0:
            rows.append((1000 + i, 0))
        ds.apply(BatchId(TRACKED, i), _training_batch(rng, rows, int(rng.integers(1, 40))), track=True)
        if i % 23 == 0:
            ds.drop_columns(np.array([2], np.uint64))
        if i % 11 == 0:
            ds.advance_floor(TRACKED, i - 3)
        if i == snapshot_at:
            ds.snapshot()
    ds.sync()
    ds.close()


def _replayed_each(d: Path) -> ColumnStore:
    """The store in ``d`` rebuilt record by record: its snapshot, then every segment."""
    snaps = sorted(d.glob("snapshot-*.snap"))
    store, after = read_snapshot(snaps[-1], BIG) if snaps else (ColumnStore(BIG), 0)
    segments = list_segments(d)
    for n, (first, path) in enumerate(segments):
        replay_each(store, scan_segment(path, first, n == len(segments) - 1).records, after)
    return store


def test_replay_windows_span_log_segments(tmp_path: Path, monkeypatch) -> None:
    """Records that share rows, logged over many small segments after a snapshot: the restart
    gathers the segments into one window (one ``apply_in_order``, one move of the base), not one
    window per segment, with the result of record-by-record replay. (Before: a window per segment.)"""
    d = tmp_path / "s"
    _training_log_store(d, seed=4, batches=60, segment_bytes=3_000, snapshot_at=10)
    segments = len(list_segments(d))
    assert segments >= 8
    calls: list[int] = []
    real = ColumnStore.apply_in_order
    monkeypatch.setattr(ColumnStore, "apply_in_order",
                        lambda self, items, threads=1: calls.append(len(items)) or real(self, items, threads))
    reopened = DurableStore.open(d, BIG)
    windows = len(calls)
    assert windows <= 4 < segments  # the drops (every 23rd batch) and the fresh-rows run cut windows too
    monkeypatch.undo()
    _assert_same(reopened.store, _replayed_each(d))
    reopened.close()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batches=st.integers(1, 70),
       segment_bytes=st.sampled_from([2_000, 9_000, 1 << 20]), least=st.sampled_from([30, 300, 1 << 22]),
       share=st.sampled_from([1, 3, 8]),
       snapshot_at=st.integers(0, 40), threads=st.sampled_from([1, 2, 4]))
def test_restart_with_windows_over_segments_equals_record_by_record(
        tmp_path_factory, seed: int, batches: int, segment_bytes: int, least: int, share: int,
        snapshot_at: int, threads: int) -> None:
    """Whatever the segments' size and the window's bounds (the fewest entries, the share of the
    store), a restart (windows gathered over segments, each segment read into a buffer of its own
    while a window holds its records) leaves the store record-by-record replay leaves; in one
    replay thread or several (each window's rows split between them, whatever its size)."""
    d = tmp_path_factory.mktemp("w") / "s"
    _training_log_store(d, seed, batches, segment_bytes, snapshot_at)
    saved = recovery.MAX_REPLAY_GROUP_ENTRIES, recovery.REPLAY_WINDOW_BASE_SHARE, inorder.PARALLEL_MIN_ENTRIES
    recovery.MAX_REPLAY_GROUP_ENTRIES, recovery.REPLAY_WINDOW_BASE_SHARE = least, share
    inorder.PARALLEL_MIN_ENTRIES = 0
    try:
        reopened = DurableStore.open(d, BIG, replay_threads=threads)
    finally:
        recovery.MAX_REPLAY_GROUP_ENTRIES, recovery.REPLAY_WINDOW_BASE_SHARE, inorder.PARALLEL_MIN_ENTRIES = saved
    _assert_same(reopened.store, _replayed_each(d))
    reopened.close()


def test_replay_window_grows_with_the_store() -> None:
    assert recovery.replay_window_entries(0) == recovery.MAX_REPLAY_GROUP_ENTRIES
    big = 100 * recovery.MAX_REPLAY_GROUP_ENTRIES
    assert recovery.replay_window_entries(big) == big // recovery.REPLAY_WINDOW_BASE_SHARE
