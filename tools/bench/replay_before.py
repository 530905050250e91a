"""The group replay as it was before window replay (commit c9a178f), kept as tools.bench.snapshot's
same-run baseline: ``replay_groups_as_before`` replaces ``recovery.replay``.

Before: consecutive batch records formed groups of up to 2^20 entries (2^22 for row-disjoint
runs), ended by floors and drops as well; a group that shares rows was one engine plan in which
every entry was searched for in log order (``search.find`` in the base, then the delta runs), the
keys found got their increments with ``np.add.at``, and the keys found nowhere were sorted
(``_new_keys``) into one delta run that the engine's tiers merged and folded; a run of
row-disjoint records that were not all new rows was one engine ``plan``. The engine's private
state is used as it was then (its runs, index, tiers), so the baseline is that code, not an
imitation of it.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
from numpy.typing import NDArray

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.rowengine import Entries, RowEngine
from giaannd.rowengine.run import Run
from giaannd.rowengine.search import find
from giaannd.storage import ColumnStore, DurableStore
from giaannd.storage.engine import recovery
from giaannd.storage.engine.snapshot import read_snapshot
from giaannd.storage.engine.update_log import KIND_BATCH, LogRecord

__all__ = ["open_as_before", "replay_groups_as_before"]

I64 = NDArray[np.int64]
MAX_GROUP_ENTRIES_BEFORE = 1 << 20


def _new_keys(row: I64, occ: I64, seg: NDArray[np.uint8], tc: NDArray[np.uint64], tf: NDArray[np.uint64],
              st: NDArray[np.float32], pos: I64) -> tuple[NDArray[np.generic], ...]:
    """The keys found nowhere, sorted by (row id, key), each once with the left fold of its increments."""
    if row.shape[0] > 1 and bool(np.any(row[1:] < row[:-1])):
        order = np.argsort(row, kind="stable")
        row, occ, seg, tc, tf, st, pos = row[order], occ[order], seg[order], tc[order], tf[order], st[order], pos[order]
    starts = np.ones(row.shape[0], bool)
    starts[1:] = row[1:] != row[:-1]
    mixed_at = np.zeros(row.shape[0], bool)
    mixed_at[1:] = ~starts[1:] & (occ[1:] != occ[:-1])
    if not mixed_at.any():
        return row, seg, tc, tf, st, pos
    row_no = np.cumsum(starts) - 1
    mixed = np.zeros(int(row_no[-1]) + 1, bool)
    mixed[row_no[mixed_at]] = True
    at = np.flatnonzero(mixed[row_no])
    sub = at[np.lexsort((tf[at], tc[at], seg[at]))]
    sub = sub[np.argsort(row[sub], kind="stable")]
    row[at], seg[at], tc[at], tf[at], st[at], pos[at] = row[sub], seg[sub], tc[sub], tf[sub], st[sub], pos[sub]
    first = np.ones(row.shape[0], bool)
    first[1:] = starts[1:] | (seg[1:] != seg[:-1]) | (tc[1:] != tc[:-1]) | (tf[1:] != tf[:-1])
    if first.all():
        return row, seg, tc, tf, st, pos
    slot = np.cumsum(first) - 1
    value = st[first]
    later = np.flatnonzero(~first)
    np.add.at(value, slot[later], st[later])
    return row[first], seg[first], tc[first], tf[first], value, pos[first]


def _apply_in_order(engine: RowEngine, a: NDArray[np.uint64], b: NDArray[np.uint64], offsets: I64,
                    entries: Entries) -> I64:
    """``RowEngine.plan_in_order`` + ``commit_in_order`` as they were; returns the occurrences' ids."""
    lengths = np.diff(offsets)
    held = len(engine._index)
    ids = engine._index.lookup(a, b)
    new = np.flatnonzero(ids < 0)
    new_a, new_b = a[new], b[new]
    if new.shape[0]:
        order = np.lexsort((new_b, new_a))
        sa, sb = new_a[order], new_b[order]
        first = np.ones(order.shape[0], bool)
        first[1:] = (sa[1:] != sa[:-1]) | (sb[1:] != sb[:-1])
        by_time = np.argsort(order[first], kind="stable")
        rank = np.empty(by_time.shape[0], np.int64)
        rank[by_time] = np.arange(by_time.shape[0], dtype=np.int64)
        got = np.empty(order.shape[0], np.int64)
        got[order] = held + rank[np.cumsum(first) - 1]
        ids[new] = got
        new_a, new_b = sa[first][by_time], sb[first][by_time]
    adds: list[tuple[Run, I64, NDArray[np.float32]]] = []
    new_run = None
    seg, tc, tf, st = entries.seg, entries.tc, entries.tf, entries.st
    if st.shape[0]:
        occ = np.repeat(np.arange(ids.shape[0], dtype=np.int64), lengths)
        row = ids[occ]
        fresh = row >= held
        old = np.flatnonzero(~fresh)
        base = engine._base
        lo, hi = base.ranges(ids)
        old_occ = occ[old]
        pos, hit = find(base.seg, base.tc, base.tf, lo[old_occ], hi[old_occ], seg[old], tc[old], tf[old])
        adds.append((base, pos[hit], st[old[hit]]))
        miss = np.flatnonzero(~hit)
        q = old[miss]
        q_occ = occ[q]
        qs, qc, qf, qpos = seg[q], tc[q], tf[q], pos[miss]
        found = engine._find_in_deltas(q, ids[q_occ], qs, qc, qf, qpos, st, adds)  # (the engine's today)
        keep = ~np.isin(q, found)
        q, q_occ, qs, qc, qf, qpos = q[keep], q_occ[keep], qs[keep], qc[keep], qf[keep], qpos[keep]
        parts = [_new_keys(row[q], q_occ, qs, qc, qf, st[q], qpos)] if q.shape[0] else []
        f = np.flatnonzero(fresh)
        if f.shape[0]:
            f_occ = occ[f]
            parts.append(_new_keys(row[f], f_occ, seg[f], tc[f], tf[f], st[f], lo[f_occ]))
        if parts:
            fields = [np.concatenate(x) if len(parts) > 1 else x[0] for x in zip(*parts)]
            new_run = Run.from_sorted(*fields)
    engine._version += 1
    if new_a.shape[0]:
        engine._index.append(new_a, new_b)
    engine._grow_lengths(len(engine._index))
    for run, at, add in adds:
        np.add.at(run.st, at, add)
    if new_run is not None:
        engine._add_delta(new_run)
    return ids


def _concat(pieces: list[RowBatch]) -> tuple[NDArray[np.uint64], NDArray[np.uint64], I64, Entries]:
    cat = np.concatenate
    starts = np.cumsum([0] + [p.num_entries for p in pieces[:-1]])
    offsets = cat([pieces[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(pieces, starts.tolist())])
    return (cat([p.row_column for p in pieces]), cat([p.row_feature for p in pieces]),
            offsets.astype(np.int64, copy=False),
            Entries(cat([p.segment for p in pieces]), cat([p.target_column for p in pieces]),
                    cat([p.target_feature for p in pieces]), cat([p.strength for p in pieces])))


def _store_apply_in_order(store: ColumnStore, items: list[tuple[BatchId, RowBatch]]) -> int:
    """``ColumnStore.apply_in_order`` as it was, less its bump of the store's row-set version
    (``_rows_version``: gone since the store's key order follows its rows itself, sorted_keys.py)."""
    applied, pieces = store._replay_parts(items)
    store._version += 1
    if not pieces:
        return applied
    engine = store.engine
    held = engine.num_rows
    before = engine.lengths().copy()
    ids = _apply_in_order(engine, *_concat(pieces))
    mark = np.zeros(engine.num_rows, bool)
    mark[ids] = True
    touched = np.flatnonzero(mark)
    store._count_sizes(before[touched[touched < held]], -1)
    store._count_sizes(engine.lengths()[touched])
    store._grow_touches(engine.num_rows)
    np.add.at(store._touches, ids, np.uint64(1))
    return applied


def _store_apply_disjoint(store: ColumnStore, items: list[tuple[BatchId, RowBatch]], room: int, new_rows: bool
                          ) -> int:
    """``ColumnStore.apply_disjoint`` as it was: new rows appended to the base, else one engine plan
    (less the ``_rows_version`` bump, as ``_store_apply_in_order``)."""
    applied, pieces = store._replay_parts(items)
    store._version += 1
    if not pieces:
        return applied
    cat = np.concatenate
    lengths = cat([np.diff(p.offsets) for p in pieces])
    ids = None if not new_rows else store.engine.append_new_rows(
        cat([p.row_column for p in pieces]), cat([p.row_feature for p in pieces]), lengths,
        [Entries(p.segment, p.target_column, p.target_feature, p.strength) for p in pieces], room)
    if ids is not None:
        store._count_sizes(lengths)
        store._grow_touches(store.engine.num_rows)
        store._touches[ids] += np.uint64(1)
        return applied
    store._commit_plan(store.engine.plan(*_concat(pieces)))
    return applied


def replay_groups_as_before(store: ColumnStore, records: list[LogRecord], after_seq: int,
                            window_entries: int | None = None, threads: int = 1) -> tuple[int, int]:
    """``recovery.replay`` as it was (module docstring); takes ``replay``'s later parameters (the
    window's size, threads) and ignores them, as it did not have them, so that it can stand in for
    ``replay`` under ``replay_segments``."""
    applied = skipped = 0
    todo = [r for r in records if r.seq > after_seq]
    skipped += len(records) - len(todo)
    prev = recovery._previous_record(todo)
    first_seen = np.array([r.batch.num_entries if r.batch is not None and p < 0 else 0 for r, p in zip(todo, prev)],
                          np.int64)
    room_after = np.append(np.cumsum(first_seen[::-1])[::-1], 0)
    run: list[tuple[BatchId, RowBatch]] = []
    run_start = run_entries = 0
    run_fresh = True
    run_shares = False

    def flush(end: int) -> None:
        nonlocal applied, skipped
        if run:
            if run_shares:
                done = _store_apply_in_order(store, run)
            else:
                done = _store_apply_disjoint(store, run, int(room_after[end]), run_fresh)
            applied, skipped = applied + done, skipped + len(run) - done
            run.clear()

    for i, rec in enumerate(todo):
        if rec.kind == KIND_BATCH:
            assert rec.batch_id is not None and rec.batch is not None
            shares = bool(prev[i] >= run_start)
            cap = MAX_GROUP_ENTRIES_BEFORE if run_shares or shares else recovery.MAX_REPLAY_RUN_ENTRIES
            if run and (run_entries + rec.batch.num_entries > cap or (shares and run_fresh)):
                flush(i)
            if not run:
                run_start, run_entries, run_fresh, run_shares = i, 0, True, False
                shares = False
            run_fresh = run_fresh and bool(prev[i] < 0)
            run_shares = run_shares or shares
            run.append((rec.batch_id, rec.batch))
            run_entries += rec.batch.num_entries
            continue
        flush(i)
        recovery._apply_marker(store, rec)
        applied += 1
    flush(len(todo))
    return applied, skipped


def open_as_before(d: Path, capacity_bytes: int, close: bool = True) -> DurableStore | None:
    """``DurableStore.open`` of ``d`` with the replay as it was: ``replay_groups_as_before``, and the
    snapshot loaded without room for the replay (``read_snapshot``'s ``room``, which came with it),
    and read (no mapping then either). Closed again, or with ``close`` False returned open."""
    with mock.patch.object(recovery, "replay", replay_groups_as_before), \
            mock.patch.object(recovery, "read_snapshot",
                              lambda p, c, v, room=0, mapping=None, progress=None, threads=1: read_snapshot(p, c, v)):
        ds = DurableStore.open(d, capacity_bytes, map_snapshot=False)
    if not close:
        return ds
    ds.close()
    return None
