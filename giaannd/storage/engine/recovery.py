"""The durable store: column store + update log + snapshots, and restart (= snapshot + log replay).

Theory of operation
-------------------
Directory contents: at most one current ``snapshot-<S>.snap`` (rows and applied set through log seq
S), and the log segments. Invariants:

- Every acknowledged batch is in a synced log record, or in a snapshot.
- A record is appended only after ``ColumnStore.prepare`` accepted the batch (capacity, shape), and
  applied in RAM right after, so the log never holds a batch the store refused and replay never
  meets one it cannot apply. During a fold (``defer``, deferred_applies.py) a batch is checked
  against the most it could add, logged, and applied in RAM when the fold ends, before anything
  reads the rows; records are applied in log order either way.
- Replay applies the records with seq > S in order. Records <= S (left behind by a crash between
  a snapshot's rename and the log truncation) are skipped by seq, and would be ignored by batch id
  anyway: replay is idempotent twice over. It is done in bulk (``replay``: windows of consecutive
  batch records as one engine call, their increments to a key added in log order), with the
  result of applying them one by one (``replay_each``) bit for bit.
- A drop (``drop_columns``: rows of columns this node no longer owns, release.py) is a log record
  too, appended before the rows leave RAM, and replayed in log order like the rest: a batch before
  it is replayed and then dropped, a batch after it recreates the column exactly as it was created
  live. Drops leave the applied set alone, so replay by batch id stays idempotent. A snapshot
  holds what is left after the drops it covers, so truncation loses nothing.

``open`` recovers: deletes leftover snapshot temporaries, loads the newest snapshot (a corrupt one
stops start-up: falling back to an older one would silently lose the rows it added, whose log
segments are gone), scans and replays the segments one by one (a torn tail of the last one is cut
off: truncated on disk, logged as a warning and counted in the report; any other damage stops
start-up), and opens a fresh segment for new records. Files change only once every segment was
read and checked.

The async service drives it as: ``seq = apply(...)`` on the event loop; ``sync()`` in a worker
thread, shared by every batch appended meanwhile; acknowledge batches whose seq <= the returned
durable seq; and from time to time a snapshot in three steps, so it never stops writes (issue 14
item 3): ``freeze_room()`` while writes go on (a touched buffer for the strengths' copy), then
``begin_snapshot(room)`` with writes held off (rotate the log so that the records up to the
snapshot's seq S end a segment, freeze the store: references to the engine's arrays and one copy
of the strengths into the room, column_store.py), then ``job.write()`` in a worker thread while applies go on
(they land in the log after S), then ``finish_snapshot(job)``: delete older
snapshots and the log segments whose records are all <= S — never a record after S. A write
that fails deletes its temporary and changes nothing else (the log still holds everything).
``snapshot()`` is the three in a row.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from giaannd.atomic_file import fsync_dir
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.rowengine.engine import DEFAULT_BASE_RATIO
from giaannd.rowengine.inorder import latest_before
from giaannd.rowengine.keyindex import KeyIndex
from giaannd.storage.engine.column_store import ENTRY_BYTES, ColumnStore, DropResult, Floor, FrozenRows
from giaannd.storage.engine.deferred_applies import Deferred, DeferredApplies
from giaannd.storage.engine.errors import CorruptLogError, CorruptSnapshotError
from giaannd.storage.engine.page_advice import small_pages
from giaannd.storage.engine.read_ahead import DEFAULT_WINDOW_BYTES, ReadAhead
from giaannd.storage.engine.snapshot import (
    Pacer,
    WriteMode,
    list_snapshots,
    list_temporaries,
    read_snapshot,
    write_frozen,
)
from giaannd.storage.engine.snapshot_map import SnapshotMapping
from giaannd.storage.engine.update_log import (
    DEFAULT_SEGMENT_MAX_BYTES,
    KIND_BATCH,
    KIND_DROP,
    KIND_FLOOR,
    LogRecord,
    SegmentMapper,
    SegmentScan,
    UpdateLog,
    list_segments,
    scan_segment,
)

__all__ = ["MAX_REPLAY_GROUP_ENTRIES", "MAX_REPLAY_RUN_ENTRIES", "REPLAY_WINDOW_BASE_SHARE", "ApplyResult",
           "DurableStore", "RecoveryReport", "ReplayedSegments", "SnapshotJob", "fix_mmap_threshold", "map_with_log",
           "replay", "replay_each", "replay_room", "replay_segments", "replay_window_entries", "return_freed_heap"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What ``DurableStore.open`` found and did (for logs and the node's metadata)."""

    snapshot: str | None
    snapshot_seq: int
    records_replayed: int
    records_skipped: int
    last_seq: int
    torn_tail_bytes: int
    torn_tail_file: str | None
    temporaries_removed: int
    #: Wall seconds spent reading (and checking) the snapshot, and replaying the log after it: with
    #: the byte counts below, what a restart's recovery costs per GB (issue 14 item 4).
    snapshot_load_s: float = 0.0
    replay_s: float = 0.0
    snapshot_bytes: int = 0
    log_bytes: int = 0
    #: The same two phases in CPU seconds of the process (user and system; the replay's threads
    #: included, and whatever else the process ran meanwhile: little, at a daemon's start-up):
    #: against the wall seconds, what was waiting (a cold page cache: the disk) or sharing a busy
    #: core, or how much the replay's threads overlapped.
    snapshot_load_cpu_s: float = 0.0
    replay_cpu_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """``applied``: False for a batch id seen before. ``seq``: acknowledge once ``sync()`` >= seq
    (for a duplicate, the last seq appended so far, which covers the original's record).
    ``part``: what was applied, the batch or, for another share of a batch id applied before,
    only its rows in columns not applied under that id yet (None when nothing was)."""

    applied: bool
    seq: int
    part: RowBatch | None = None


#: Most entries one bulk replay apply gathers (``replay``): the run's batches are concatenated (a
#: copy of this many entries, 21 bytes each, on top of the log read), and past a few million
#: entries per apply the per-apply overhead it saves is already under 1%.
MAX_REPLAY_RUN_ENTRIES = 1 << 22
#: Fewest entries of a window of records that share rows (``replay``, ``ColumnStore.apply_in_order``;
#: the cap is ``replay_window_entries``): each window's new keys are folded into the engine's base
#: once (before the next window, or by the node's folds after the last), a move of the whole base
#: (``run.fold_into_base``, in place), so windows are large. Its
#: temporaries are ~30 bytes per entry (the entries grouped by row, their base positions) on top of
#: the log segments its records are read from; with the freed heap given back after the replay
#: (``return_freed_heap``) tools.bench.snapshot's restarts kept 24-27 B per stored entry resident
#: after the replay, at a peak of 35 (Zipf log) and 110 (training-like log: 1.7 logged entries per
#: stored one).
MAX_REPLAY_GROUP_ENTRIES = 1 << 22
#: A window of records that share rows holds up to 1/this of the entries the store holds (when that
#: is more than ``MAX_REPLAY_GROUP_ENTRIES``), and spans log segments to fill it
#: (``replay_segments``). Why: each window moves the whole base once, so with windows of a fixed
#: size a replay of L logged entries over a base of B moved L/window × B entries: at the mission's
#: size (10^10 entries a node, a log of 10 % of it, windows of one 64 MiB segment) that is ~330
#: moves of the whole base, hours of copying. With windows of B/8 it is at most 8 entries moved
#: per logged entry, whatever B (plus one move for the last window), for a transient of ~50-80
#: bytes per window entry at its peak (its log bytes, the grouped copy, base positions): up to
#: ~10 B per stored entry past the 2^22 floor (tools.bench.replay_windows).
REPLAY_WINDOW_BASE_SHARE = 8


def map_with_log(log_entries: int, snapshot_bytes: int) -> bool:
    """Whether a snapshot of ``snapshot_bytes`` may be mapped (``DurableStore.open``'s
    ``map_snapshot``) with a log of at most ``log_entries`` entries after it (``replay_room``).

    Yes when the log is empty, or when its replay leaves the base's arrays alone: it fits one
    window (``replay_window_entries``) and its new keys stay under the fold point
    (1/``DEFAULT_BASE_RATIO`` of the store), so the one window's new keys stay a delta run
    (``RowEngine.apply_in_order``) and nothing merges into the mapped arrays, which would copy them
    into new buffers. The snapshot's entries are taken as its bytes over ``ENTRY_BYTES`` (a few
    percent too many: its row index); a log of mostly adds to held keys fits either way. A log
    that does not fit is replayed into a read base with room for it."""
    if log_entries == 0:
        return True
    held = snapshot_bytes // ENTRY_BYTES
    return log_entries * DEFAULT_BASE_RATIO < held and log_entries <= replay_window_entries(held)


def replay_window_entries(held_entries: int) -> int:
    """The most entries of a replay window of records that share rows, for a store of
    ``held_entries`` entries (``REPLAY_WINDOW_BASE_SHARE``)."""
    return max(MAX_REPLAY_GROUP_ENTRIES, held_entries // REPLAY_WINDOW_BASE_SHARE)


def return_freed_heap() -> bool:
    """Give the C heap's free pages back to the kernel (glibc ``malloc_trim(0)``); False where the C
    library has no such call (musl, macOS), which changes nothing else.

    Why, after a replay: glibc serves blocks under its mmap threshold, which rises to the largest
    block freed (up to 32 MiB), from the heap, and keeps the heap's free pages mapped. A replay frees
    hundreds of MB of such temporaries (segment buffers, plans, gathered keys); without the trim a
    restart of tools.bench.snapshot's training-like log (8·10^6 entries) stayed at 36 B per entry
    resident against 26 after it, over the ≤ 32 B budget. One call per start-up, milliseconds; a
    running storage node calls it on a timer too (``storage.heap-trim-interval-s``: live applies
    leave the same kind of garbage, 47-54 B per entry resident on a cluster run against 29 after
    one trim)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


#: glibc's ``mallopt`` parameter M_MMAP_THRESHOLD (malloc.h).
_M_MMAP_THRESHOLD = -3


def fix_mmap_threshold(nbytes: int) -> bool:
    """Serve every C heap block of ``nbytes`` or more from its own mapping (a storage node:
    ``storage.malloc-mmap-threshold-bytes``, 1 MiB by default) (glibc ``mallopt``
    M_MMAP_THRESHOLD), which also stops glibc raising the threshold to the largest block freed (up
    to 32 MiB); False where the C library has no ``mallopt`` (musl, macOS): nothing changes.

    Why, on a storage node: with the sliding threshold, an apply's and a merge's temporaries of
    1-32 MiB come from the main arena, which in a daemon grows in mapped segments beside the
    ``brk`` heap; a settled cluster node then kept 100-316 MB (3.4-10.7 B per stored entry at
    3·10^7 entries) resident in no live array, which ``malloc_trim`` did not return. With 1 MiB
    fixed the same run's nodes kept 48-55 MB and settled at 25.0-29.5 B per entry against
    29.4-33.8 (docs/storage.md "Known gaps", Live RSS). The cost: such blocks pay their page
    faults at each allocation instead of reusing touched heap memory."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, nbytes))


def _map_snapshot(path: Path) -> SnapshotMapping | None:
    """``SnapshotMapping.open(path)``, or None where the file cannot be mapped: the open then reads
    the snapshot (with room for the log), as it does with ``map_snapshot`` off.

    Why: mapping is a speed-up of the load (snapshot_map.py), on by default
    (``storage.snapshot-load-map``), and a file system without ``mmap`` for files (ENODEV: some
    network and FUSE file systems) or a process out of address space or mappings (ENOMEM:
    ``vm.max_map_count``, ``RLIMIT_AS``) refused it with an ``OSError`` that stopped the restart,
    where the log's segments, mapped the same way, are read instead (``SegmentMapper``). A damaged
    file is not this case: the read load refuses it with the same ``CorruptSnapshotError``."""
    try:
        return SnapshotMapping.open(path)
    except (OSError, ValueError) as exc:
        log.warning("snapshot not mapped, read instead file=%s: %s", path, exc)
        return None


def replay_room(segments: list[tuple[int, Path]]) -> int:
    """The room a snapshot is loaded with before the log ``segments`` are replayed into it
    (``read_snapshot``'s ``room``): an entry takes at least ``ENTRY_BYTES`` of log, so their size
    over that bounds the entries the replay can add. The windows' merges then fill that room
    (``run.fold_into_base``, in place) instead of copying the loaded rows into larger buffers first."""
    return sum(path.stat().st_size for _, path in segments) // ENTRY_BYTES


def _previous_record(records: list[LogRecord]) -> NDArray[np.int64]:
    """For each of ``records`` (batch records only), the index of the latest earlier record that
    has a row key in common with it (-1: none). Every row key numbered by a hash index of the
    records' own keys, then one compiled pass in log order (``inorder.latest_before``); was a
    lexsort of every row key, 3.6x the time on a training log's window."""
    counts = np.array([r.batch.num_rows if r.batch is not None else 0 for r in records], np.int64)
    if counts.sum() < 2:
        return np.full(len(records), -1, np.int64)
    rc = np.concatenate([r.batch.row_column for r in records if r.batch is not None])
    rf = np.concatenate([r.batch.row_feature for r in records if r.batch is not None])
    rec = np.repeat(np.arange(len(records), dtype=np.int64), counts)
    index = KeyIndex()
    ids = index.ids_of(rc, rf)
    return latest_before(ids, rec, len(index), len(records))


def replay(store: ColumnStore, records: list[LogRecord], after_seq: int,
           window_entries: int | None = None, threads: int = 1) -> tuple[int, int]:
    """Apply the records with seq > ``after_seq``; returns (applied, skipped). Idempotent.

    In bulk (issue 14 item 4), with the result of ``replay_each`` bit for bit: consecutive batch
    records form a window (at most ``MAX_REPLAY_RUN_ENTRIES`` entries, ``window_entries`` once two
    of them share a row, ``MAX_REPLAY_GROUP_ENTRIES`` by default: ``replay_segments`` passes
    ``replay_window_entries``); a floor record goes into the window in its place (it changes
    the applied set only), a drop record ends it and is applied in log order between windows:

    - records whose rows are pairwise disjoint: ``ColumnStore.apply_disjoint`` (each key gets one
      increment). A run of new rows only goes straight into the engine's base (its ``room`` and
      ``new_rows``: below); such a run is applied on its own, before a record that shares a row
      with it, to keep that path. Whether a run's rows may all be new is known from the log
      (no earlier record of the segment had them) and one probe of its first record's row keys
      (an earlier segment or the snapshot may hold them).
    - records that share rows (a training log: every batch adds to rows the ones before added to):
      ``ColumnStore.apply_in_order``, one ``RowEngine.apply_in_order`` of the window, in which
      every key's increments are added one at a time in log order (float32 sums are those of
      record-by-record replay) and the new keys are merged into the base once.

    Records are not checked again (``validate=False``): each was checked when it was applied live
    and is read back under its checksum. Per record, Python work is a few calls; never per row or
    entry. ``threads``: a window's rows are grouped and walked in that many threads
    (``RowEngine.apply_in_order``), with the same result."""
    applied = skipped = 0
    window_cap = MAX_REPLAY_GROUP_ENTRIES if window_entries is None else window_entries
    # over a base mapped from its snapshot file (a log that fits one window: map_with_log), every
    # record goes through one apply_in_order, whose new keys stay a delta run: a run of new rows
    # appended to the base's tail, or a delta run folded at the next window's start, would copy
    # the whole mapped base into new buffers (and end the mapping) in the replay
    keep_base = store.base_read_only
    todo = [r for r in records if r.seq > after_seq]
    skipped += len(records) - len(todo)
    prev = _previous_record(todo)
    # entries of the records from i on that share no row with an earlier record: an upper bound
    # of the new rows' entries still to come, the room a run of new rows grows the store's arrays by
    first_seen = np.array([r.batch.num_entries if r.batch is not None and p < 0 else 0 for r, p in zip(todo, prev)],
                          np.int64)
    room_after = np.append(np.cumsum(first_seen[::-1])[::-1], 0)
    run: list[tuple[BatchId, RowBatch] | Floor] = []
    run_start = run_entries = 0
    run_fresh = True  # no record of the group shares a row with an earlier one: its rows may all be new
    run_shares = False  # a record of the group shares a row with another one of it

    def flush(end: int) -> None:
        nonlocal applied, skipped
        if run:
            if run_shares:
                done = store.apply_in_order(run, threads)
            else:
                done = store.apply_disjoint(run, int(room_after[end]), new_rows=run_fresh, threads=threads)
            applied, skipped = applied + done, skipped + len(run) - done
            run.clear()

    for i, rec in enumerate(todo):
        if rec.kind == KIND_BATCH:
            assert rec.batch_id is not None and rec.batch is not None
            shares = keep_base or bool(prev[i] >= run_start)
            cap = window_cap if run_shares or shares else MAX_REPLAY_RUN_ENTRIES
            if run and (run_entries + rec.batch.num_entries > cap or (shares and run_fresh)):
                flush(i)
            if not run:  # a run starts: its rows may all be new if no earlier record had them
                run_start, run_entries, run_shares = i, 0, False
                run_fresh = (not keep_base and bool(prev[i] < 0)
                             and not store.holds_any(rec.batch.row_column, rec.batch.row_feature))
                shares = keep_base
            run_fresh = run_fresh and bool(prev[i] < 0)
            run_shares = run_shares or shares
            run.append((rec.batch_id, rec.batch))
            run_entries += rec.batch.num_entries
            continue
        if rec.kind == KIND_FLOOR and run:  # a floor changes the applied set only: it goes in its place
            run.append(Floor(rec.writer, rec.floor))
            continue
        flush(i)
        _apply_marker(store, rec)
        applied += 1
    flush(len(todo))
    return applied, skipped


@dataclass(frozen=True, slots=True)
class ReplayedSegments:
    """What ``replay_segments`` did: records applied and skipped (seq at or below the snapshot's,
    or a batch id seen before), the seq after the last record (None: no segment), the bytes of
    good records, and the last segment's scan if it ended in a torn record (to cut off).
    ``after_bytes``: the good bytes of the segments holding records after ``after_seq`` (what a
    restart replays: ``DurableStore.logged_since_snapshot``), not those a snapshot covers whole
    (left by a crash between its rename and the log's truncation). A snapshot begins with a
    rotation, so no segment holds records on both sides of it."""

    applied: int
    skipped: int
    next_seq: int | None
    log_bytes: int
    torn: SegmentScan | None
    after_bytes: int = 0


def replay_segments(store: ColumnStore, segments: list[tuple[int, Path]], after_seq: int,
                    threads: int = 1, at_segment: Callable[[int], None] | None = None) -> ReplayedSegments:
    """Check and replay the log ``segments`` (``list_segments``: (first seq, path), in order) into
    ``store``, records with seq > ``after_seq`` (``replay``).

    Windows span segments. The records of consecutive segments are gathered until they hold
    ``replay_window_entries`` of the store's size (or the log ends), then replayed in one call: a
    window of records that share rows moves the whole base once (``REPLAY_WINDOW_BASE_SHARE``),
    so its size must grow with the base, not stop at a segment's end. Each segment is mapped
    (update_log.SegmentMapper: nothing else touches the log files while the store opens) and its
    records are views of the mapping, which goes once a window's records are replayed and dropped.
    ``threads``: ``replay``'s. ``at_segment``: called with a segment's index as its scan begins
    (a restart's read-ahead follows it: read_ahead.py).

    Raises:
        CorruptLogError: a gap or overlap between segments, a log that starts after
            ``after_seq + 1``, or damage inside a segment other than a torn tail of the last one.
    """
    mapper = SegmentMapper()
    pending: list[LogRecord] = []
    pending_entries = applied = skipped = log_bytes = after_bytes = 0
    expected: int | None = None
    torn: SegmentScan | None = None

    def flush() -> None:
        nonlocal applied, skipped, pending_entries
        if pending:
            a, s = replay(store, pending, after_seq, replay_window_entries(store.engine.num_entries), threads)
            applied, skipped = applied + a, skipped + s
            pending.clear()
            pending_entries = 0

    for i, (first, path) in enumerate(segments):
        if expected is not None and first != expected:
            raise CorruptLogError(str(path), 0, f"log segment starts at seq {first}, expected {expected}")
        if expected is None and first > after_seq + 1:
            raise CorruptLogError(str(path), 0, f"log starts at seq {first} but the snapshot ends at {after_seq}")
        if at_segment is not None:
            at_segment(i)
        scan = scan_segment(path, first, is_last=i == len(segments) - 1, reader=mapper)
        expected = first + len(scan.records)
        log_bytes += scan.good_bytes
        if scan.records and scan.records[-1].seq > after_seq:
            after_bytes += scan.good_bytes
        if scan.torn_bytes:
            torn = scan
        pending.extend(scan.records)
        pending_entries += sum(r.batch.num_entries for r in scan.records if r.batch is not None)
        if pending_entries >= replay_window_entries(store.engine.num_entries):
            flush()
    flush()
    return ReplayedSegments(applied, skipped, expected, log_bytes, torn, after_bytes)


def _apply_marker(store: ColumnStore, rec: LogRecord) -> None:
    """Replay one record that is not a batch: a drop of columns or a writer's floor."""
    if rec.kind == KIND_DROP:
        assert rec.columns is not None
        store.drop_columns(rec.columns)
    else:
        store.advance_floor(rec.writer, rec.floor)


def replay_each(store: ColumnStore, records: list[LogRecord], after_seq: int) -> tuple[int, int]:
    """``replay`` record by record (one ``prepare`` + ``commit`` each): the reference the bulk
    replay is tested against bit for bit (tests/unit/storage), and the baseline of its benchmark."""
    applied = skipped = 0
    for rec in records:
        if rec.seq <= after_seq:
            skipped += 1
            continue
        if rec.kind == KIND_BATCH:
            assert rec.batch_id is not None and rec.batch is not None
            prepared = store.prepare(rec.batch_id, rec.batch, validate=False, enforce_capacity=False)
            if prepared is None:
                skipped += 1
                continue
            store.commit(prepared)
        else:
            _apply_marker(store, rec)
        applied += 1
    return applied, skipped


@dataclass(slots=True)
class SnapshotJob:
    """A snapshot begun (``DurableStore.begin_snapshot``): the frozen view at log seq ``seq``.
    ``write()`` (any thread, once) writes it and releases the view; ``path`` is then set."""

    directory: Path
    seq: int
    view: FrozenRows
    path: Path | None = None
    #: ``UpdateLog.appended_bytes`` when it began: what the log held after the snapshot's seq then
    log_mark: int = 0

    def write(self, busy_share: float = 1.0, mode: WriteMode = "cached") -> Path:
        """Write the snapshot file (durable on return) and release the view, even on failure;
        ``busy_share``: the most of its time the writing thread works (``snapshot.Pacer``);
        ``mode``: how its bytes reach the disk (``snapshot.write_frozen``).

        Raises:
            OSError: the write failed (ENOSPC...); its temporary is deleted.
        """
        try:
            self.path = write_frozen(self.directory, self.view, self.seq, Pacer(busy_share), mode)
        finally:
            self.view.release()
        return self.path


class DurableStore:
    """A :class:`ColumnStore` whose writes survive restarts. Build it with :meth:`open`."""

    def __init__(self, directory: Path, store: ColumnStore, log_: UpdateLog, report: RecoveryReport,
                 mapping: SnapshotMapping | None = None, logged_before: int | None = None) -> None:
        self.directory = directory
        #: the snapshot file the store's base run was loaded from by mapping it, if it was
        #: (``open``'s ``map_snapshot``; snapshot_map.py): ``held_disk_bytes`` says what it holds
        self.mapping = mapping
        self.store = store
        self.log = log_
        self.recovery = report
        self.snapshot_seq = report.snapshot_seq
        # ``logged_since_snapshot``: the records replayed at open (``logged_before``: the bytes of
        # the segments after the snapshot; by default the report's ``log_bytes``), plus those
        # appended since the log's byte count was ``_log_mark``
        self._logged_before = report.log_bytes if logged_before is None else logged_before
        self._log_mark = 0
        #: batches logged during a fold, applied when it ends (``defer``, deferred_applies.py)
        self.deferred = DeferredApplies(store, log_)

    def held_disk_bytes(self) -> int:
        """Disk bytes a deleted or replaced snapshot file still takes because the store's base is
        mapped from it (``SnapshotMapping.held_bytes``; 0 when not mapped or the mapping is gone):
        the next snapshot unlinks the file, its blocks come back when the base's first fold
        replaces the mapped arrays. A directory walk does not see them."""
        return 0 if self.mapping is None else self.mapping.held_bytes()

    @property
    def logged_since_snapshot(self) -> int:
        """Bytes of log records after the newest snapshot: what a restart would replay now (the
        snapshot timer's ``storage.snapshot-min-log-ratio`` compares it with the store's size)."""
        return self._logged_before + self.log.appended_bytes - self._log_mark

    @classmethod
    def open(
        cls,
        directory: Path | str,
        capacity_bytes: int,
        segment_max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES,
        verify_rows: bool = True,
        map_snapshot: bool = True,
        replay_threads: int = 1,
        read_ahead_bytes: int = DEFAULT_WINDOW_BYTES,
    ) -> DurableStore:
        """Recover the store in ``directory`` (created if missing).

        Args:
            verify_rows: how the snapshot is loaded (``snapshot.read_snapshot``).
            map_snapshot: map the snapshot file and let the base run's key fields be views of it
                (``snapshot.read_snapshot``'s ``mapping``, snapshot_map.py) instead of reading it
                into fresh memory (``storage.snapshot-load-map``), when the log after it is empty
                (a stop's final snapshot) or small enough to leave the base alone
                (``map_with_log``: its new keys then stay a delta run). A larger log is replayed
                into a read base with room for it: its windows' merges would copy a mapped base
                into new buffers.
            replay_threads: threads that group and walk a replay window's rows
                (``replay_segments``; ``storage.replay-threads``), and that check the snapshot's
                rows (``snapshot.first_bad_row``).
            read_ahead_bytes: how far ahead of the load and the replay a thread asks the kernel to
                read the snapshot and the segments (read_ahead.py; ``storage.restart-read-ahead-bytes``);
                0: not at all.

        Raises:
            CorruptSnapshotError, CorruptLogError: damage that is not a torn log tail; the files are
                left untouched for the operator.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        temporaries = list_temporaries(d)
        snapshots = list_snapshots(d)
        segments = list_segments(d)
        started, started_cpu = time.perf_counter(), time.process_time()
        snapshot_bytes = 0
        mapping: SnapshotMapping | None = None
        # The files in the order the load reads them, read ahead of it (read_ahead.py).
        files = ([snapshots[-1][1]] if snapshots else []) + [path for _, path in segments]
        first_segment = 1 if snapshots else 0
        # The load and the replay fill much fresh memory at once: in small pages, without compaction
        # in the fault path; the store's arrays then go to khugepaged (page_advice.py).
        with ReadAhead(files, read_ahead_bytes) as ahead, small_pages():
            if snapshots:
                snap_seq, snap_path = snapshots[-1]
                snapshot_bytes = snap_path.stat().st_size
                room = replay_room(segments)
                if map_snapshot and snapshot_bytes > 0 and map_with_log(room, snapshot_bytes):
                    mapping = _map_snapshot(snap_path)
                store, seq_in_file = read_snapshot(snap_path, capacity_bytes, verify_rows,
                                                   0 if mapping is not None else room, mapping, ahead.advance,
                                                   replay_threads)
                if seq_in_file != snap_seq:
                    raise CorruptSnapshotError(str(snap_path), 8, f"name says seq {snap_seq}, header {seq_in_file}")
            else:
                snap_seq, snap_path, store = 0, None, ColumnStore(capacity_bytes)
            loaded, loaded_cpu = time.perf_counter(), time.process_time()
            # Replay changes RAM only: a damaged segment further on still stops start-up before any
            # file changes.
            done = replay_segments(store, segments, snap_seq, replay_threads,
                                   lambda i: ahead.advance(ahead.starts[first_segment + i]))
        store.allow_huge_pages()
        applied, skipped, torn, log_bytes = done.applied, done.skipped, done.torn, done.log_bytes
        if applied:
            return_freed_heap()
        replayed, replayed_cpu = time.perf_counter(), time.process_time()
        last_seq = max(snap_seq, (done.next_seq or 1) - 1)
        # Everything is checked: only now change files.
        for p in temporaries:
            p.unlink()
        if torn is not None:
            log.warning("update log torn tail cut off file=%s offset=%d bytes=%d",
                        torn.path, torn.good_bytes, torn.torn_bytes)
            with open(torn.path, "r+b") as f:
                f.truncate(torn.good_bytes)
                os.fsync(f.fileno())
        for _, old in snapshots[:-1]:
            old.unlink()
        if temporaries or torn or snapshots[:-1]:
            fsync_dir(d)
        report = RecoveryReport(
            str(snap_path) if snap_path else None, snap_seq, applied, skipped, last_seq,
            torn.torn_bytes if torn else 0, str(torn.path) if torn else None, len(temporaries),
            loaded - started, replayed - loaded, snapshot_bytes, log_bytes, loaded_cpu - started_cpu,
            replayed_cpu - loaded_cpu,
        )
        return cls(d, store, UpdateLog(d, last_seq + 1, segment_max_bytes, drop_synced=True), report, mapping,
                   done.after_bytes)

    # -- writes -------------------------------------------------------------------------------------
    def apply(self, batch_id: BatchId, batch: RowBatch, validate: bool = True, track: bool = False) -> ApplyResult:
        """Log and apply a batch (idempotent). Durable once ``sync()`` returns >= the result's seq.

        ``track``: the batch comes from a training writer, whose batch ids are idempotent per
        column (applied_set.py, "Which columns"); the first such batch of a writer logs a floor
        record first, so that a replay tracks the writer again before its batches.

        Raises:
            StoreFullError, ValueError: refused before logging; nothing changed.
            OSError: the log write failed; the batch is not applied (the caller retries or fails).
        """
        prepared = self.store.prepare(batch_id, batch, validate)
        if prepared is None:
            return ApplyResult(False, self.log.last_seq)
        writer = prepared.batch_id.writer
        if track and not self.store.applied.tracked(writer):
            self.log.append_floor(writer, 0)
            self.store.applied.promise(writer, 0)
        seq = self.log.append_batch(prepared.batch_id, prepared.batch)
        self.store.commit(prepared)
        return ApplyResult(True, seq, prepared.batch)

    def defer(self, batch_id: BatchId, batch: RowBatch, writer_floor: int = 0, epoch: str = "") -> Deferred | None:
        """Log a writer's batch and floor now, apply them to the rows when the fold that moves them
        ends (``apply_deferred``; deferred_applies.py); None when it cannot be deferred (nothing
        done: the caller waits for the fold). Durable once ``sync()`` returns >= the result's seq.
        ``epoch``: the placement epoch the writer computed its shares under, handed with the
        batch to ``deferred.on_applied`` when it is applied.

        Raises:
            ValueError: a batch id out of range.
            OSError: a log write failed; the batch is not kept.
        """
        return self.deferred.defer(batch_id, batch, writer_floor, epoch)

    def apply_deferred(self) -> int:
        """Apply what ``defer`` logged, in log order (no write may run meanwhile); returns the
        batches applied."""
        return self.deferred.apply()

    def advance_floor(self, writer: int, floor: int) -> int:
        """Log and apply a writer's floor (applied_set.py); returns the record's seq."""
        seq = self.log.append_floor(writer, floor)
        self.store.advance_floor(writer, floor)
        return seq

    def drop_columns(self, columns: NDArray[np.uint64]) -> DropResult:
        """Log and carry out the deletion of every row of ``columns`` (those this store holds;
        nothing is logged when it holds none). Durable once ``sync()`` returns >= ``log.last_seq``
        as of the return; until then a crash may bring the rows back (dropping again is harmless).
        The applied set is unchanged (``ColumnStore.drop_columns``).

        Raises:
            OSError: the log write failed; nothing was dropped.
        """
        held = self.store.held_columns(columns)
        if held.shape[0] == 0:
            return DropResult(0, 0)
        self.log_drop(held)
        return self.store.drop_columns(held)

    def log_drop(self, columns: NDArray[np.uint64]) -> int:
        """Log the drop of ``columns`` (sorted, unique) and return its seq, without dropping: the
        first half of ``drop_columns`` for a caller that drops the rows (``store.drop_columns``)
        in a worker thread next, behind a fold's gate (replication/background_fold.py ``drop``),
        with nothing applied in between.

        Raises:
            ValueError: columns not sorted and unique.
            OSError: the log write failed.
        """
        return self.log.append_drop(columns)

    def fold_deltas(self, due_only: bool = False) -> int:
        """``ColumnStore.fold_deltas``: nothing is logged (no row changes). No write may run
        during this call, and no snapshot's frozen view should be held (the fold would then copy
        the runs the view holds instead of moving them in place). May run in a worker thread. A
        base still mapped from a snapshot file that a later snapshot deleted (``held_disk_bytes``:
        no fold replaced it, as when every write since the start added to stored keys) is copied
        into memory by an idle node's call (not ``due_only``: ``fold_when_idle``), which gives the
        file's disk space back."""
        moved = self.store.fold_deltas(due_only)
        if not due_only and self.held_disk_bytes():
            self.store.copy_base()
        return moved

    def sync(self) -> int:
        """Group commit: fsync the log; returns the highest durable seq."""
        return self.log.sync()

    def snapshot(self) -> Path:
        """Write a snapshot of everything applied, then drop the log segments it covers
        (``begin_snapshot``, ``write``, ``finish_snapshot`` in a row)."""
        job = self.begin_snapshot()
        job.write()
        return self.finish_snapshot(job)

    def begin_snapshot(self, room: NDArray[np.float32] | None = None, lazy: bool = True) -> SnapshotJob:
        """Start a snapshot of everything applied so far: rotate the log (the records up to the
        snapshot's seq end a synced segment) and freeze the store. No write may run during this
        call; they may during the job's ``write``. ``room``: ``freeze_room()``'s buffer, made
        before writes were held off (the strengths' copy then pays no page faults). ``lazy`` False:
        the copies are made here, while writes wait (the way before rowengine/cow.py; benchmarks'
        baseline).

        Raises:
            OSError: the rotation failed (a full disk); nothing changed, the log goes on as it was.
        """
        self.log.rotate()
        # lazy: the strengths', lengths' and touches' copies are made by the job's ``write`` (its
        # thread) and by the applies for the chunks they touch first (rowengine/cow.py), so the
        # writes wait for no copy here
        return SnapshotJob(self.directory, self.log.last_seq, self.store.freeze(room, lazy),
                           log_mark=self.log.appended_bytes)

    def freeze_room(self) -> NDArray[np.float32]:
        """``ColumnStore.freeze_room``: call it before holding writes off for ``begin_snapshot``."""
        return self.store.freeze_room()

    def finish_snapshot(self, job: SnapshotJob) -> Path:
        """After ``job.write()``: the snapshot is current; delete older snapshots and the log
        segments whose records are all <= its seq (``UpdateLog.drop_through``: the segment that
        holds records after it is kept). Safe while applies go on."""
        assert job.path is not None, "finish_snapshot before the job was written"
        if job.seq >= self.snapshot_seq:  # the newest: the log after it is what was appended since
            self._logged_before, self._log_mark = 0, job.log_mark
        self.snapshot_seq = max(self.snapshot_seq, job.seq)
        for s, old in list_snapshots(self.directory):
            if s < job.seq:
                old.unlink()
        self.log.drop_through(job.seq)
        return job.path

    def close(self) -> None:
        self.log.close()
