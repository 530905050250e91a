"""The in-RAM column store: the rows of a storage node on the row engine (issue 14, ARCHITECTURE §8).

Theory of operation
-------------------
State: a :class:`~giaannd.rowengine.RowEngine` (every row's entries in shared field arrays: one base
run and a few delta runs, a key index from row key to a dense row id; engine.py), arrays indexed by
row id for what the store keeps per row (``touches``: the applied batches that touched it), the
:class:`AppliedSet` of batch ids, and the row-size counts. The single-process core's ``RowStore``
runs on the same engine: one engine, not two. There is no Python object per row anywhere.

- ``apply(batch_id, batch)``: a batch id already applied is ignored (returns False). Otherwise the
  engine *plans* the whole batch (``RowEngine.plan``: every search, no change), which gives the exact
  growth in entries and rows; the batch is refused as a whole with :class:`StoreFullError` if that
  does not fit, else committed (``RowEngine.commit``: in-place adds, the new keys as a delta run).
  So a refused or invalid batch leaves the store exactly as it was. Rows of a batch with no
  entries change nothing (and are not created).
- ``drop_columns(columns)`` deletes every row of the given columns (``RowEngine.drop_rows``: the
  runs filtered, the rows renumbered, the key index rebuilt; O(store), vectorised, rare) and
  returns their bytes to the capacity. The applied set is kept: batch ids stay applied, so a late
  duplicate is still ignored.
- Memory accounting: ``ENTRY_BYTES`` per entry plus ``ROW_OVERHEAD_BYTES`` per row plus
  ``APPLIED_ID_BYTES`` per stored batch id, against ``capacity_bytes``: what the engine's arrays
  take (its docstring), counted from the plan so a refusal is decided before anything changes and
  the same on every replica (the arrays' actual size also depends on when they last doubled).
- Reads: ``row`` (one row: views of the base when no delta run holds part of it, else a merged
  copy), ``read_rows``/``read_all``/``read_bounded`` (copies: one ``RowEngine.gather``),
  ``read_part`` (the chunked reads of rows of any size, protocol "Rows of any size"; a row's
  version is its ``touches`` and the store's ``drops``, bumped by every ``drop_columns``),
  ``digest``/``rows_digest`` for repair and stream verification (row_digest.py), and ``scan``
  pages for the cluster-wide export (row_scan.py). The sorted key order (``_sorted_keys``) is
  rebuilt lazily, when the rows changed since it was last made.

The store is synchronous and does no I/O: durability (update log, snapshots) wraps it in
recovery.py, and the asyncio service is glue on top of that. Single-threaded by contract, except
``freeze``'s view, which another thread may read, and ``fold_deltas``, which may run in a worker
thread: with ``on_fold_due`` set (a storage node's service), a commit never folds the delta runs
into the base itself, nor merges two large delta runs (``RowEngine.INLINE_MERGE_ENTRIES``), but
calls it when one is due, and the service runs ``fold_deltas`` off its event loop while no write
comes (the engine's lock makes any other call wait for the fold,
rowengine/engine.py "Threads").

Snapshots that never stop writes: ``freeze()`` returns a :class:`FrozenRows` — the engine's frozen
view (rowengine/frozen.py: references to the runs' key arrays, which the engine replaces but never
writes while they are held, and copies of what it changes in place: the strengths, 4 bytes per
entry, and the lengths), the touches and the applied set as arrays. A snapshot thread writes from
it while applies go on; ``release`` drops the references (while they are held the engine defers
its folds, which the first apply after the release does in place: rowengine/engine.py
``HELD_FOLD_LIMIT``, run.py "Merges in place"). With ``lazy`` (a snapshot's freeze) the copies
are not made in the freeze, where writes wait: the snapshot's thread makes them before it reads
(``FrozenRows.materialize``), and an apply that would write a chunk not copied yet copies that
chunk first (rowengine/cow.py: the touches here, the strengths and lengths in the engine).

Restart: ``load_bulk`` makes a snapshot's arrays the engine's base run as they are (no per-row
work; the key index built in one vectorised pass).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from giaannd.model.rows import Row, RowBatch, RowKey
from giaannd.prefault import Prefault
from giaannd.protocol import BatchId
from giaannd.rowengine import Entries, RowEngine
from giaannd.rowengine.cow import PendingCopies, PendingSet
from giaannd.rowengine.engine import ApplyPlan
from giaannd.rowengine.frozen import FrozenEngine
from giaannd.rowengine.run import Alloc, new_fields
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.bounded_read import pick_bounded
from giaannd.storage.engine.errors import StoreFullError
from giaannd.storage.engine.page_advice import allow_huge_pages, filled_buffer, small_pages
from giaannd.storage.engine.regions import ENTRY_BYTES, pack_regions, row_from_region
from giaannd.storage.engine.row_digest import (
    ROW_DIGEST_VERSIONS,
    RowDigest,
    row_digest,
    row_digests,
    rows_digest,
    rows_digest_v2_pieces,
)
from giaannd.storage.engine.row_scan import ScanResult, scan_page
from giaannd.storage.engine.sorted_keys import MERGE_APART_KEYS, Keys, MainRun, SortedKeys, TailSource
from giaannd.unique import unique

__all__ = [
    "APPLIED_ID_BYTES",
    "BoundedRead",
    "ENTRY_BYTES",
    "ROW_OVERHEAD_BYTES",
    "ColumnStore",
    "DropResult",
    "Floor",
    "PartRead",
    "FrozenRows",
    "PreparedApply",
    "RowDigest",
    "ScanResult",
    "SIZE_BINS",
    "StoreUsage",
    "check_batch_id",
    "log2_bins",
    "log2_histogram",
    "row_from_region",
]

#: The engine's arrays per row, rounded up: the key index (16 bytes of key and 2-4 slots of 8 at
#: load <= 1/2), the length and ``touches`` (8 + 8), the base run's row index (16), with the slack
#: of arrays that grow by doubling (up to 2x). Was 1024 with one Python object per row.
ROW_OVERHEAD_BYTES = 128
#: Per stored batch id in the applied set (a set/dict entry and an int), rounded up.
APPLIED_ID_BYTES = 96
#: Bins of the row-size counts (``row_size_log2``): a length is an int64, so floor(log2(n)) < 63
#: (protocol.MAX_ROW_SIZE_BINS, the reply's limit, is the same 64).
SIZE_BINS = 64
#: ``rows_digest`` hashes the rows as views of the engine (``RowEngine.pieces``) when the pieces
#: average at least this many entries: a piece costs a few µs of Python (four hash updates), about
#: what gathering ~100 entries costs; below that one gather of the rows is cheaper.
MIN_DIGEST_PIECE_ENTRIES = 256
#: A scan page looks at no more than this many keys per row it may return (``scan``'s window of the
#: sorted keys): a filter passing 1 key in 16 still fills a page; one passing fewer ends the page early.
SCAN_WINDOW_ROWS = 16
#: ``row_digests`` gathers rows about this many entries at a time (a few tens of MB of copies).
DIGEST_GATHER_ENTRIES = 1 << 21
#: Entries of room ``freeze_room`` adds beyond 1/64 more than the store holds (a small store's
#: applies between the buffer and the freeze).
FREEZE_ROOM_SPARE = 65_536
#: With ``take_keys_in_apart`` (a storage node), the rows created since the key order last took
#: rows in are sorted in a worker thread once this many wait, so a listing on the event loop sorts
#: at most about this many (~5 ms here) whatever was written since the last one.
KEYS_BEHIND_APART_ROWS = 1 << 16
_EMPTY_IDS = np.empty(0, np.int64)


def check_batch_id(batch_id: tuple[int, int]) -> BatchId:
    """``batch_id`` as a ``BatchId`` of Python ints.

    Raises:
        ValueError: out of range (writer in [0, 2^64), seq in [1, 2^64)).
    """
    out = BatchId(int(batch_id[0]), int(batch_id[1]))
    if not (0 <= out.writer < 2**64 and 1 <= out.seq < 2**64):
        raise ValueError(f"batch id out of range: {out}")
    return out


def _columns_of(batch: RowBatch) -> NDArray[np.uint64]:
    """The distinct columns of a canonical batch (rows sorted by column: one comparison pass)."""
    rc = batch.row_column
    if rc.shape[0] == 0:
        return rc.astype(np.uint64, copy=True)
    return rc[np.concatenate(([True], rc[1:] != rc[:-1]))].astype(np.uint64, copy=False)


def _strictly_ascending(rc: NDArray[np.uint64], rf: NDArray[np.uint64]) -> bool:
    """Whether the keys (rc[i], rf[i]) are sorted by (column, feature) and unique."""
    return bool(np.all((rc[1:] > rc[:-1]) | ((rc[1:] == rc[:-1]) & (rf[1:] > rf[:-1]))))


def _sorted_unique(rc: NDArray[np.uint64], rf: NDArray[np.uint64]) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """The keys sorted by (column, feature), repeats removed (as given when already so)."""
    if rc.shape[0] < 2 or _strictly_ascending(rc, rf):
        return rc, rf
    order = np.lexsort((rf, rc))
    rc, rf = rc[order], rf[order]
    first = np.ones(rc.shape[0], bool)
    first[1:] = (rc[1:] != rc[:-1]) | (rf[1:] != rf[:-1])
    return rc[first], rf[first]


def _keys(row_column: ArrayLike, row_feature: ArrayLike) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    rc = np.asarray(row_column).astype(np.uint64, copy=False).reshape(-1)
    rf = np.asarray(row_feature).astype(np.uint64, copy=False).reshape(-1)
    if rc.shape != rf.shape:
        raise ValueError("row_column and row_feature differ in length")
    return rc, rf


def _frozen_view(values: NDArray[Any]) -> NDArray[Any]:
    """A read-only view (of a cache the caller must not change)."""
    view = values.view()
    view.flags.writeable = False
    return view


def _row(entries: Entries) -> Row:
    return Row(entries.seg, entries.tc, entries.tf, entries.st)


@dataclass(frozen=True, slots=True)
class PreparedApply:
    """A checked, planned apply (``ColumnStore.prepare``). ``batch`` is what will be applied: the
    batch given, or the part of it whose columns were not applied under its id before (applied_set.py,
    "Which columns"); the durable store logs that part. ``columns``: its distinct columns."""

    batch_id: BatchId
    batch: RowBatch
    columns: NDArray[np.uint64]
    plan: ApplyPlan | None
    version: int
    #: rows of ``batch`` the store does not hold, which ``commit`` appends straight into the
    #: engine's base after ``plan`` (then over the held rows only): a stream item's (``append_writers``)
    appended: RowBatch | None = None


@dataclass(frozen=True, slots=True)
class Floor:
    """A writer's floor among the batches of a bulk replay (``apply_in_order``, ``apply_disjoint``):
    advanced in its place in the order, as a floor record is replayed (applied_set.py)."""

    writer: int
    floor: int


@dataclass(frozen=True, slots=True)
class BoundedRead:
    """``read_bounded``: the rows that fit, the large rows left out as (column, feature, entries,
    touches, drops), and the last key looked at when it stopped early (None: every key was)."""

    batch: RowBatch
    large: list[tuple[int, int, int, int, int]]
    stopped_after: RowKey | None


@dataclass(frozen=True, slots=True)
class PartRead:
    """``read_part``: the row's version now (``entries`` 0: absent) and the entries asked for (views of
    the base; a copy of the part alone where delta entries are in the row: ``RowEngine.read_part``)."""

    entries: int
    touches: int
    drops: int
    part: Row


@dataclass(frozen=True, slots=True)
class DropResult:
    """What ``drop_columns`` removed: ``rows``, and ``bytes``, the accounted bytes returned to the
    capacity (``ENTRY_BYTES`` per entry plus ``ROW_OVERHEAD_BYTES`` per row)."""

    rows: int
    bytes: int


@dataclass(slots=True, eq=False)
class FrozenRows:
    """The store at one moment (``ColumnStore.freeze``; module docstring), safe to read from another
    thread while the store goes on applying: ``engine`` (rows in id order; rowengine/frozen.py),
    ``touches`` by row id, ``applied`` (the applied set's ``to_arrays``), ``applied_columns`` (its
    ``column_arrays``). ``release`` drops the references (idempotent)."""

    engine: FrozenEngine | None
    touches: NDArray[np.uint64]
    applied: tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64]]
    applied_columns: tuple[NDArray[np.uint64], ...]
    #: the touches' copy a lazy freeze left to the reader (``materialize``)
    pending: PendingCopies | None = None

    def materialize(self) -> None:
        """Make the copies a lazy ``ColumnStore.freeze`` left pending (rowengine/cow.py), in this
        thread, while the store goes on applying: before anything is read. Idempotent."""
        if self.engine is not None:
            self.engine.materialize()
        if self.pending is not None:
            self.pending.finish()
            self.pending = None

    def release(self) -> None:
        if self.engine is not None:
            self.engine.cancel()  # (copies never made are not needed any more)
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
        self.engine = None


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """For the node's metadata: bytes used / capacity, and whether writes are being refused."""

    used_bytes: int
    capacity_bytes: int
    num_rows: int
    num_entries: int
    applied_ids: int

    @property
    def is_full(self) -> bool:
        return self.used_bytes >= self.capacity_bytes


def log2_bins(lengths: NDArray[np.int64]) -> NDArray[np.int64]:
    """``SIZE_BINS`` counts: element k, how many of ``lengths`` have floor(log2(n)) == k (n >= 1;
    zeros are left out). Vectorised: ``frexp`` gives n = m * 2**e with m in [0.5, 1), exact for
    every n below 2**53, so floor(log2(n)) = e - 1 (a float ``log2`` can round 2**k - 1 up)."""
    n = lengths[lengths > 0]
    _, exponent = np.frexp(n.astype(np.float64))
    return np.bincount(exponent - 1, minlength=SIZE_BINS).astype(np.int64, copy=False)


def _trimmed(counts: NDArray[np.int64]) -> list[int]:
    nonzero = np.flatnonzero(counts)
    out: list[int] = counts[: int(nonzero[-1]) + 1].tolist() if nonzero.shape[0] else []
    return out


def log2_histogram(lengths: NDArray[np.int64]) -> list[int]:
    """``log2_bins`` of ``lengths`` with trailing zeros trimmed (``[]``: no non-empty row)."""
    return _trimmed(log2_bins(lengths))


#: Entries of each of the room's buffers that one populate call maps (``reserve``): 0.5 MiB of a
#: uint64 field, so a stop waits for at most one such call.
_PREFAULT_ENTRIES = 1 << 16
#: How far ahead of the rows the room's pages are mapped (``reserve``): 2^22 entries, ~88 MB of
#: the four fields, a few chunks of a stream (4 MiB each) at any rate a receiver reaches.
PREFAULT_LEAD_ENTRIES = 1 << 22


def _room_bound(engine: weakref.ref[RowEngine], st: NDArray[np.float32]) -> Callable[[], int]:
    """``Prefault``'s bound for the room of ``st`` (``reserve``): the rows the room holds plus the
    lead; -1, which stops the thread, once the engine is gone or its base has left those buffers
    (it outgrew the room). The engine is held weakly: a store dropped with a stream unfinished
    (its source died, the node stopped) takes its thread and room with it."""

    def bound() -> int:
        held = engine()
        fill = -1 if held is None else held.room_fill(st)
        return fill if fill < 0 else fill + PREFAULT_LEAD_ENTRIES

    return bound


class ColumnStore:
    """Rows in RAM with idempotent, capacity-checked merge-add (module docstring).

    Args:
        capacity_bytes: the most bytes the store may account for; applies past it are refused.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        #: maps the pages of the room ``reserve`` made, ahead of the chunks that fill it
        self._prefault: Prefault | None = None
        self.applied = AppliedSet()
        self.engine = RowEngine()
        #: applied batches that touched each row, by row id (grown by doubling)
        self._touches = np.zeros(1024, np.uint64)
        self._version = 0  # bumped by every change, so a stale PreparedApply is caught
        #: bumped by every drop_columns: part of a row's version for chunked reads (module docstring)
        self.drops = 0
        #: every row key in (column, feature) order, kept up to date as rows are created (sorted_keys.py)
        self._keys = SortedKeys()
        self._on_key_merge_due: Callable[[], None] | None = None
        #: called when KEYS_BEHIND_APART_ROWS rows wait to be taken into the key order
        #: (``take_keys_in_apart``); None: the next listing takes them in, on its own thread
        self._on_keys_behind: Callable[[], None] | None = None
        #: rows per floor(log2(entry count)) (``row_size_log2``), kept by every length change
        self._size_counts = np.zeros(SIZE_BINS, np.int64)
        #: writers whose batches bring mostly rows this store does not hold (a stream receiver
        #: adds its streams' writers): ``prepare`` sends those rows straight into the engine's
        #: base (``PreparedApply.appended``) instead of a delta run that tiers merge and a fold
        #: copies again; their held rows merge as any batch's. The same rows, bit for bit.
        self.append_writers: set[int] = set()
        #: None: a commit folds the delta runs into the base when that is due (``RowEngine.commit``);
        #: else it calls this instead, and the caller folds (``fold_deltas``: module docstring)
        self.on_fold_due: Callable[[], None] | None = None
        #: copies a lazy ``freeze`` named and its reader has not made yet (rowengine/cow.py)
        self._pending = PendingSet()
        #: the fold point's multiplier (``RowEngine.fold_due``'s scale): a storage node draws one
        #: per fold, so replicas holding the same rows do not fold together (background_fold.py)
        self.fold_scale = 1.0

    # -- accounting -------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return (ENTRY_BYTES * self.engine.num_entries + ROW_OVERHEAD_BYTES * self.engine.num_rows
                + APPLIED_ID_BYTES * len(self.applied))

    def usage(self) -> StoreUsage:
        return StoreUsage(self.used_bytes, self.capacity_bytes, self.engine.num_rows, self.engine.num_entries,
                          len(self.applied))

    @property
    def is_full(self) -> bool:
        return self.usage().is_full

    def row_size_log2(self) -> list[int]:
        """The row-size histogram for ``GetUsage``: element k counts the rows of 2**k to
        2**(k+1) - 1 entries, trailing zeros trimmed. Kept up to date by every change of a row's
        length (apply, drop, load) in one vectorised pass each, so this costs O(bins)."""
        return _trimmed(self._size_counts)

    def _count_sizes(self, lengths: NDArray[np.int64], sign: int = 1) -> None:
        """Add (``sign`` 1) or remove (-1) rows of ``lengths`` entries to the row-size counts."""
        if lengths.shape[0]:
            self._size_counts += sign * log2_bins(lengths)

    def _grow_touches(self, n: int) -> None:
        if n > self._touches.shape[0]:
            grown = np.zeros(max(n, 2 * self._touches.shape[0]), np.uint64)
            grown[: self._touches.shape[0]] = self._touches
            self._touches = grown

    # -- writes -----------------------------------------------------------------------------------
    def apply(self, batch_id: BatchId, batch: RowBatch, validate: bool = True) -> bool:
        """Merge-add ``batch`` unless ``batch_id`` was applied before (``prepare`` + ``commit``).

        Returns:
            True if applied, False if the id was already applied (nothing changed).

        Raises:
            StoreFullError: the batch would not fit; nothing changed.
            ValueError: the batch is not canonical or the id is out of range; nothing changed.
        """
        prepared = self.prepare(batch_id, batch, validate)
        if prepared is None:
            return False
        self.commit(prepared)
        return True

    def prepare(
        self, batch_id: BatchId, batch: RowBatch, validate: bool = True, enforce_capacity: bool = True
    ) -> PreparedApply | None:
        """Check and plan an apply without changing anything; None if the id was already applied.

        The durable store logs the batch between ``prepare`` and ``commit``, so a batch that would
        be refused never reaches the log.

        Args:
            batch_id: the batch's identity (applied_set.py).
            batch: the delta rows (canonical; checked unless ``validate`` is False).
            validate: skip the O(N) canonical check only for batches this process built itself.
            enforce_capacity: False only for log replay, which must restore what was acknowledged.

        Raises:
            StoreFullError, ValueError: as for ``apply``.
        """
        batch_id = check_batch_id(batch_id)
        if validate:
            batch.validate()
        done = self.applied.columns(batch_id)
        if done is None:
            return None
        columns = _columns_of(batch)
        if done.shape[0]:  # another share of this id was applied: only the columns it lacked
            fresh = ~np.isin(batch.row_column, done)
            if not fresh.any():
                return None
            batch = batch.select_rows(fresh)
            columns = np.setdiff1d(columns, done, assume_unique=True)
        logged = batch
        lengths = np.diff(batch.offsets)
        if not lengths.all():  # rows without entries change nothing and are not created
            batch = batch.select_rows(lengths > 0)
        plan = None
        growth = APPLIED_ID_BYTES * self.ids_added(batch_id)
        if batch.num_rows and batch_id.writer in self.append_writers:
            held, appended = self._split_held(batch)
            if appended is not None:
                if held.num_rows:
                    plan = self.engine.plan(held.row_column, held.row_feature, held.offsets,
                                            Entries(held.segment, held.target_column, held.target_feature,
                                                    held.strength))
                    growth += ENTRY_BYTES * plan.new_entries
                growth += ENTRY_BYTES * appended.num_entries + ROW_OVERHEAD_BYTES * appended.num_rows
                if enforce_capacity and self.used_bytes + growth > self.capacity_bytes:
                    raise StoreFullError(growth, self.used_bytes, self.capacity_bytes)
                return PreparedApply(batch_id, logged, columns, plan, self._version, appended)
        if batch.num_rows:
            plan = self.engine.plan(batch.row_column, batch.row_feature, batch.offsets,
                                    Entries(batch.segment, batch.target_column, batch.target_feature, batch.strength))
            growth += ENTRY_BYTES * plan.new_entries + ROW_OVERHEAD_BYTES * plan.new_rows
        if enforce_capacity and self.used_bytes + growth > self.capacity_bytes:
            raise StoreFullError(growth, self.used_bytes, self.capacity_bytes)
        return PreparedApply(batch_id, logged, columns, plan, self._version)

    def ids_added(self, batch_id: BatchId) -> int:
        """The stored ids that recording ``batch_id`` may add to the applied set, at most (the
        capacity check's share of it): one, the seq (a seq just above the writer's floor adds none,
        counted one, conservatively); two where the writer's floor is 0 and the seq is not 1: a
        writer new here then stores its floor, 0, beside the seq (applied_set.py ``add``), which is
        how a node first meets most writers (their first batches went to other owners). A batch
        deferred during a fold is checked with the same count (deferred_applies.py)."""
        if batch_id.seq > 1 and self.applied.floor(batch_id.writer) == 0 and batch_id not in self.applied:
            return 2
        return 1

    def commit(self, prepared: PreparedApply) -> None:
        """Carry out a plan from ``prepare``; no other write may come between the two."""
        if prepared.version != self._version:
            raise RuntimeError("stale PreparedApply: the store changed after prepare()")
        self._version += 1
        self.applied.add(prepared.batch_id, prepared.columns)
        if prepared.plan is not None:
            self._commit_plan(prepared.plan)
        if prepared.appended is not None:
            self._append_rows(prepared.appended)
        on_behind = self._on_keys_behind
        if on_behind is not None and self._keys.behind(self.engine.num_rows, self.drops) >= KEYS_BEHIND_APART_ROWS:
            on_behind()

    def _split_held(self, batch: RowBatch) -> tuple[RowBatch, RowBatch | None]:
        """``batch`` (rows with entries) as (the rows the store holds, the rows it does not), or
        (batch, None) when it holds them all. One probe of the key index; no per-row work."""
        held = self.engine.row_ids(batch.row_column, batch.row_feature) >= 0
        if held.all():
            return batch, None
        if not held.any():
            return RowBatch.empty(), batch
        return batch.select_rows(held), batch.select_rows(~held)

    def _append_rows(self, rows: RowBatch) -> None:
        """The engine part of ``commit`` for rows the store does not hold (``prepare`` checked, at
        the same version): straight into the base (``RowEngine.append_new_rows``: a copy of the
        entries into the base's room, no search, delta run or fold), then what ``_commit_plan``
        does for new rows (row-size counts, ``touches``). The engine ends holding what a plan of
        these rows would leave: the same ids (the next ones, in batch order), the same entries."""
        lengths = np.diff(rows.offsets)
        ids = self.engine.append_new_rows(
            rows.row_column, rows.row_feature, lengths,
            [Entries(rows.segment, rows.target_column, rows.target_feature, rows.strength)])
        if ids is None:  # prepare saw these rows absent, and nothing changed the store since
            raise RuntimeError("rows appeared between prepare and commit")
        self._count_sizes(lengths)
        self._grow_touches(self.engine.num_rows)
        self._before_touch(ids)
        self._touches[ids] += np.uint64(1)
        self._report_fold_due()  # (a base without room took them as a delta run)

    def apply_disjoint(self, items: Sequence[tuple[BatchId, RowBatch] | Floor], room: int = 0,
                       new_rows: bool = True, threads: int = 1) -> int:
        """Log replay in bulk (recovery.py): apply ``items`` in order, as ``prepare(id, batch,
        validate=False, enforce_capacity=False)`` + ``commit`` of each would, given that no row
        key occurs in two of the batches (the caller checked). Returns how many were applied (the
        others' ids were applied before).

        Why the result is the same bit for bit: the applied-set part (which id, which columns:
        applied_set.py "Which columns") is decided batch by batch, in order, exactly as ``prepare``
        does; then every row the batches touch is touched by one of them only, so one engine apply
        of their concatenation (in batch order: new rows get the same ids as one by one) adds each
        key's increment once to the same value, and ``touches`` grows by one per row, as it would.
        What differs is only how the engine lays its runs out (no delta run: the base holds all).

        When every row of the run is new (a replay of a store's growth, of a stream's chunks), the
        entries go straight into the engine's base (``RowEngine.append_new_rows``: one copy of each
        batch, no concatenation, search, delta run or fold); ``room`` is its hint of the entries
        that may follow. Otherwise the batches are applied as by ``apply_in_order`` (one
        ``RowEngine.apply_in_order``: every key gets at most one increment from them).
        ``new_rows`` False: the caller knows some row is stored already (a record shared it with an
        earlier one), so the straight path is not tried (its refusal costs a probe of every key).
        Meant for a start-up replay, as ``apply_in_order``.
        """
        applied, pieces = self._replay_parts(items)
        self._version += 1
        if not pieces:
            return applied
        cat = np.concatenate
        lengths = cat([np.diff(p.offsets) for p in pieces])
        ids = None if not new_rows else self.engine.append_new_rows(
            cat([p.row_column for p in pieces]), cat([p.row_feature for p in pieces]), lengths,
            [Entries(p.segment, p.target_column, p.target_feature, p.strength) for p in pieces], room)
        if ids is not None:  # as _commit_plan does for a plan of new rows only
            self._count_sizes(lengths)
            self._grow_touches(self.engine.num_rows)
            self._before_touch(ids)
            self._touches[ids] += np.uint64(1)
            return applied
        self._apply_in_order(pieces, threads)
        return applied

    def _replay_parts(self, items: Sequence[tuple[BatchId, RowBatch] | Floor]) -> tuple[int, list[RowBatch]]:
        """The applied-set part of ``prepare`` + ``commit`` for each batch of ``items`` in order (which
        id, which columns: applied_set.py "Which columns"; an id seen before, earlier in ``items``
        too, skips what it applied), recorded as it goes, and each ``Floor`` advanced in its place
        (a floor changes the applied set only, so the rows part of the batches around it need not
        wait for it). Returns how many items were applied (floors count) and the parts to apply to
        the rows (rows without entries left out; parts with no rows too)."""
        pieces: list[RowBatch] = []
        applied = 0
        for item in items:
            if isinstance(item, Floor):
                self.advance_floor(item.writer, item.floor)
                applied += 1
                continue
            batch_id, batch = item
            batch_id = BatchId(int(batch_id[0]), int(batch_id[1]))
            done = self.applied.columns(batch_id)
            if done is None:
                continue
            columns = _columns_of(batch)
            if done.shape[0]:
                fresh = ~np.isin(batch.row_column, done)
                if not fresh.any():
                    continue
                batch = batch.select_rows(fresh)
                columns = np.setdiff1d(columns, done, assume_unique=True)
            lengths = np.diff(batch.offsets)
            if not lengths.all():
                batch = batch.select_rows(lengths > 0)
            self.applied.add(batch_id, columns)
            applied += 1
            if batch.num_rows:
                pieces.append(batch)
        return applied, pieces

    def apply_in_order(self, items: Sequence[tuple[BatchId, RowBatch] | Floor], threads: int = 1) -> int:
        """Log replay of batches that share rows (recovery.py, issue 14 item 4): apply ``items`` in
        order, as ``prepare(id, batch, validate=False, enforce_capacity=False)`` + ``commit`` of
        each would, bit for bit, in one engine call (``RowEngine.apply_in_order``). Returns how
        many were applied (the others' ids were applied before).

        Why the result is the same: the applied-set part is decided batch by batch, in order, as
        ``prepare`` does (``_replay_parts``); the engine adds every key's increments one at a time
        in that order and numbers new rows in order of first occurrence, and ``touches`` grows by
        one per batch that touches a row (a row occurs once per batch). The row-size counts are
        those of the rows' final lengths, which is what the per-batch updates sum to.

        Meant for a start-up replay (as ``apply_disjoint``): it folds every delta run first (the
        base moves, in place only where no view of the rows, a read or a ``freeze``, holds it:
        rowengine/run.py "Merges in place"; else into new buffers) and leaves the call's new keys
        as a delta run unless a fold is due. ``threads``: ``RowEngine.apply_in_order``'s."""
        applied, pieces = self._replay_parts(items)
        self._version += 1
        if not pieces:
            return applied
        self._apply_in_order(pieces, threads)
        return applied

    def _apply_in_order(self, pieces: list[RowBatch], threads: int = 1) -> None:
        """The rows part of ``apply_in_order`` and ``apply_disjoint``: one ``RowEngine.apply_in_order``
        of ``pieces``, then the row-size counts and ``touches`` as a commit of each
        piece would leave them."""
        engine = self.engine
        held = engine.num_rows
        done = engine.apply_in_order([(p.row_column, p.row_feature, p.offsets,
                                       Entries(p.segment, p.target_column, p.target_feature, p.strength))
                                      for p in pieces], threads)
        ids = done.ids
        # the window's rows and their lengths before (now less the keys each gained): all sized by
        # the window, never by the store (no copy of every row's length, no mark per row)
        touched = unique(ids)
        after = engine.lengths()[touched]
        before = after.copy()
        before[np.searchsorted(touched, done.grown)] -= done.added
        self._count_sizes(before[touched < held], -1)
        self._count_sizes(after)
        self._grow_touches(engine.num_rows)
        self._before_touch(ids)
        np.add.at(self._touches, ids, np.uint64(1))

    def _commit_plan(self, plan: ApplyPlan) -> None:
        """The engine part of ``commit``: the plan, the row-size counts, ``touches``."""
        engine = self.engine
        old = plan.ids[plan.ids < engine.num_rows]
        self._count_sizes(engine.lengths()[old], -1)
        self._engine_commit(plan)
        self._count_sizes(engine.lengths()[plan.ids])
        self._grow_touches(engine.num_rows)
        self._before_touch(plan.ids)
        self._touches[plan.ids] += np.uint64(1)

    def held_columns(self, columns: ArrayLike | None = None) -> NDArray[np.uint64]:
        """The columns with at least one stored row (of ``columns`` only, if given: looked up, not
        a pass over every key), sorted, unique."""
        self._refresh_keys()
        if columns is None:
            return self._keys.columns()
        cols = self._keys.of_columns(np.asarray(columns))[0]
        first = np.ones(cols.shape[0], bool)
        first[1:] = cols[1:] != cols[:-1]
        return cols[first]

    def rows_of_columns(self, columns: ArrayLike) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.int64]]:
        """The keys of every row of ``columns``, sorted (as two arrays), and each row's size in
        bytes (``ENTRY_BYTES`` per entry): what a stream source cuts its chunks from. Costs the
        rows found and a binary search per column (sorted_keys.py), not a pass over every key."""
        self._refresh_keys()
        cols, feats, ids = self._keys.of_columns(np.asarray(columns))
        return cols, feats, ENTRY_BYTES * self.engine.lengths()[ids]

    def drop_columns(self, columns: ArrayLike) -> DropResult:
        """Delete every row of ``columns`` (columns with no rows are ignored) and return their bytes
        to the capacity. The applied set is not changed: a batch id applied before stays applied,
        so a late duplicate of it is still ignored (and does not bring the rows back). Views and
        copies handed out earlier keep their data alive until they are dropped themselves.
        """
        wanted = np.asarray(columns).astype(np.uint64, copy=False).reshape(-1)
        engine = self.engine
        if self._keys.current(self.drops):  # the sorted keys name the rows, and follow the drop
            self._refresh_keys()
            gone = np.zeros(engine.num_rows, bool)
            gone[self._keys.of_columns(wanted)[2]] = True
        else:
            gone = np.isin(engine.keys()[0], wanted)
        rows = int(np.count_nonzero(gone))
        if rows == 0:
            return DropResult(0, 0)
        self._version += 1
        self.drops += 1
        lengths = engine.lengths()
        dropped = lengths[gone]
        entries = int(dropped.sum())
        self._count_sizes(dropped, -1)
        kept_touches = self._touches[: engine.num_rows][~gone]
        with self._fresh_memory_in_small_pages():
            engine.drop_rows(~gone)
        self._keys.drop(~gone, self.drops)
        self._touches = np.zeros(max(1024, kept_touches.shape[0]), np.uint64)
        self._touches[: kept_touches.shape[0]] = kept_touches
        return DropResult(rows, ENTRY_BYTES * entries + ROW_OVERHEAD_BYTES * rows)

    def reserve(self, nbytes: int) -> None:
        """Room in the engine's base for about ``nbytes`` of new entries (``RowEngine.reserve``),
        at most the free capacity: a stream receiver knows how much is coming and spares the base
        its regrowths. Changes no row, but makes a ``prepare`` made before stale, as ``copy_base``
        does (the engine's plan is: its commit would fail after recording the batch id). The room is
        not counted in ``used_bytes`` (like the base's append slack, docs/storage.md "Known gaps").
        Its buffers fault in small pages while they fill (``page_advice.filled_buffer``) until
        ``allow_huge_pages``; a thread maps the room's pages ahead of the chunks that fill it, at
        most ``PREFAULT_LEAD_ENTRIES`` ahead (giaannd/prefault.py), so the stream's applies on the
        event loop do not pay the first touch of the store's growth (docs/topology.md "What the
        host allows a receiver"), and the memory resident ahead of the rows stays bounded."""
        free = max(0, self.capacity_bytes - self.used_bytes)
        self._version += 1  # (the engine may replace its base run: a prepare made before is stale)
        self.engine.reserve(min(nbytes, free) // ENTRY_BYTES, filled_buffer)
        room = self.engine.room()
        if room is not None:
            self._stop_prefault()
            buffers, used = room
            self._prefault = Prefault(buffers, _PREFAULT_ENTRIES, start=used,
                                      bound=_room_bound(weakref.ref(self.engine), buffers[3]))

    def _stop_prefault(self) -> None:
        if self._prefault is not None:
            self._prefault.stop()
            self._prefault = None

    def allow_huge_pages(self) -> None:
        """Offer the store's arrays (the engine's runs, key index, lengths and filter, and the
        touch counts) to khugepaged (page_advice.py), after a phase that filled them in small
        pages: the room ``reserve`` made, once the streams that asked for it closed (a huge page's
        first touch cost 2.7-3.4 ms/MB on this project's VM against 0.6-0.9 for small pages, the
        largest item of a join's receiver: docs/topology.md "Fifth pass"), or a recovery
        (recovery.py, ``page_advice.small_pages``). Arrays mapped from a file are left as they are."""
        self._stop_prefault()  # (the room's streams closed: what it did not map, their fills did)
        for array in (*self.engine.arrays(), self._touches):
            allow_huge_pages(array)

    @property
    def base_read_only(self) -> bool:
        """Whether the engine's base keys are read-only views (of a snapshot file mapped at the
        start: snapshot_map.py): a replay over it must leave them where they are."""
        return not self.engine.base_fields()[1].flags.writeable

    def copy_base(self) -> None:
        """Copy the engine's base into this process's memory (``RowEngine.copy_base``; its buffers
        fault in small pages while filled, then go to khugepaged: page_advice.py): a base mapped
        from a snapshot file lets go of it (snapshot_map.py). Changes no row."""
        self._version += 1
        self.engine.copy_base(filled_buffer)
        self.allow_huge_pages()

    def _engine_commit(self, plan: ApplyPlan) -> None:
        """``RowEngine.commit``, its fold left to ``on_fold_due`` when that is set."""
        self.engine.commit(plan, fold=self.on_fold_due is None)
        self._report_fold_due()

    def _report_fold_due(self) -> None:
        """Tell ``on_fold_due`` (a storage node's worker-thread folds) when a fold or a large tier
        merge of the delta runs is due."""
        if self.on_fold_due is not None and (self.engine.fold_due(self.fold_scale) or self.engine.merge_due()):
            self.on_fold_due()

    def fold_deltas(self, due_only: bool = False) -> int:
        """Fold the engine's delta runs into its base (``RowEngine.compact``); returns the entries
        they held (0: there were none, or ``due_only`` and no fold is due, ``RowEngine.fold_due``:
        nothing folded, but a large tier merge a commit left, ``RowEngine.merge_due``, is done).
        Changes no row: a delta entry costs 16-32 B more than a base entry (its base position, the
        run's position index, its buffers' room), so an idle node folds them
        (docs/storage.md "Known gaps", Live RSS). May run in a worker thread (module docstring)."""
        if due_only and not self.engine.fold_due(self.fold_scale):
            if self.engine.merge_due():  # a large tier merge a commit left (INLINE_MERGE_ENTRIES)
                self._version += 1
                self.engine.merge_tiers()
            return 0
        moved = self.engine.delta_entries
        if moved or self.engine.num_deltas:
            self._version += 1
            with self._fresh_memory_in_small_pages():
                self.engine.compact()
        return moved

    @contextmanager
    def _fresh_memory_in_small_pages(self) -> Iterator[None]:
        """Memory made inside faults in small pages; the store's arrays are offered to khugepaged
        after (page_advice.py): for O(store) work that may fill fresh memory in a worker thread (a
        fold into new buffers: the first after a mapped load copies the whole base; a drop).
        Why: with numpy's huge-page advice, a first touch compacts memory in the faulting thread
        while it holds the process's memory-map lock, and the event loop's own allocations (a new
        arena, a large buffer) wait behind it: a drop at 8.6·10^7 entries stopped the loop for
        98-357 ms at a time that way, all of it inside its fold's merges."""
        with small_pages():
            yield
        self.allow_huge_pages()

    def advance_floor(self, writer: int, floor: int) -> None:
        """The writer will never resend a batch with seq <= floor (compacts the applied set)."""
        self._version += 1
        self.applied.advance_floor(writer, floor)

    # -- reads ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.engine.num_rows

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        return self._id(key) >= 0

    def _id(self, key: RowKey) -> int:
        c, f = int(key[0]), int(key[1])
        if not (0 <= c < 2**64 and 0 <= f < 2**64):
            return -1
        return self.engine.row_id(c, f)

    def keys(self) -> list[RowKey]:
        """Every row key, sorted (a Python tuple per row: for tests and tools; ``key_arrays`` is
        the same as two arrays)."""
        cols, feats, _ = self._sorted_keys()
        return list(zip(cols.tolist(), feats.tolist()))

    def key_arrays(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """Every row key as two arrays sorted by (column, feature) (read-only views of a cache)."""
        cols, feats, _ = self._sorted_keys()
        return _frozen_view(cols), _frozen_view(feats)

    def row(self, key: RowKey) -> Row | None:
        """One row (views of the base when no delta run holds part of it, else a merged copy;
        live until the next change: module docstring), or None if the store has no entries for it."""
        i = self._id(key)
        return None if i < 0 else _row(self.engine.read(i))

    def row_entries(self, key: RowKey) -> int:
        """The row's entry count (0: not stored)."""
        i = self._id(key)
        return 0 if i < 0 else int(self.engine.lengths()[i])

    def row_lengths(self, row_column: ArrayLike, row_feature: ArrayLike) -> NDArray[np.int64]:
        """Each given row's entry count (0: not stored), in the given order."""
        ids = self.engine.row_ids(*_keys(row_column, row_feature))
        if not ids.shape[0]:
            return np.zeros(0, np.int64)
        return np.where(ids >= 0, self.engine.lengths()[np.maximum(ids, 0)], 0).astype(np.int64)

    def row_region(self, key: RowKey) -> memoryview | None:
        """The row in the region layout (regions.py: a copy), or None: for comparisons of rows bit
        for bit (tests, tools), not a serving path."""
        i = self._id(key)
        if i < 0:
            return None
        row = _row(self.engine.read(i))
        return pack_regions(np.array([0, len(row)], np.int64), row).data

    def _gather(self, ids: NDArray[np.int64], alloc: Alloc = new_fields) -> tuple[NDArray[np.int64], Row]:
        offsets, entries = self.engine.gather(ids, alloc)
        return offsets, _row(entries)

    def _batch(self, rc: NDArray[np.uint64], rf: NDArray[np.uint64], ids: NDArray[np.int64],
               alloc: Alloc = new_fields) -> RowBatch:
        if ids.shape[0] == 0:
            return RowBatch.empty()
        offsets, got = self._gather(ids, alloc)
        return RowBatch(rc, rf, offsets, got.segment, got.target_column, got.target_feature, got.strength)

    def read_rows(self, row_column: ArrayLike, row_feature: ArrayLike, alloc: Alloc = new_fields) -> RowBatch:
        """A canonical batch (a copy) of the requested rows that exist; absent rows are left out.
        Also a stream's page (streaming/sender.py): ``RowEngine.gather`` copies each row's slices
        straight into the batch's arrays, one compiled pass, short rows or long; ``alloc`` says
        where the entries go (rowengine.run.gather_entries: a stream's reused page buffers)."""
        rc, rf = _sorted_unique(*_keys(row_column, row_feature))
        ids = self.engine.row_ids(rc, rf)
        held = ids >= 0
        return self._batch(rc[held], rf[held], ids[held], alloc)

    def read_bounded(self, row_column: ArrayLike, row_feature: ArrayLike, max_entries: int,
                     max_large: int) -> BoundedRead:
        """The requested rows in key order (a copy) while they add up to at most ``max_entries``
        entries; a row longer than ``max_entries`` is left out and listed in ``large`` (at most
        ``max_large`` of them). Stops before the first row that does not fit, so the caller asks
        again for the keys after ``stopped_after``. The rows are picked in one compiled pass over the keys
        (bounded_read.py), the reply gathered in another (``RowEngine.gather``)."""
        rc, rf = _sorted_unique(*_keys(row_column, row_feature))
        ids = self.engine.row_ids(rc, rf)
        lengths = self.engine.lengths()
        pick, listed_at, stop = pick_bounded(ids, lengths, max_entries, max_large)  # (bounded_read.py)
        big = []
        if listed_at.shape[0]:  # (at most max_large rows)
            at = ids[listed_at]
            big = [(c, f, e, t, self.drops) for c, f, e, t in zip(
                rc[listed_at].tolist(), rf[listed_at].tolist(), lengths[at].tolist(), self._touches[at].tolist())]
        stopped = (int(rc[stop - 1]), int(rf[stop - 1])) if 0 < stop < rc.shape[0] else None
        return BoundedRead(self._batch(rc[pick], rf[pick], ids[pick]), big, stopped)

    def read_part(self, key: RowKey, offset: int, limit: int) -> PartRead:
        """Entries ``[offset, offset + limit)`` of one row and its version. Views of the base where
        the engine has them (live: an in-place add changes their strengths, which is safe because it
        also bumps ``touches``, and a reader accepts a row only if a version check made after it
        received every part still reports the version the parts did: giaannd/client/row_parts.py,
        "No torn rows"; a fold replaces the arrays, the old ones live on while views are queued)."""
        i = self._id(key)
        if i < 0:
            return PartRead(0, 0, self.drops, Row.empty())
        start = max(offset, 0)
        # (only the part: a row with delta entries was merged whole, then sliced, for every part)
        n, e = self.engine.read_part(i, start, start + max(limit, 0))
        return PartRead(n, int(self._touches[i]), self.drops, Row(e.seg, e.tc, e.tf, e.st))

    def read_all(self) -> RowBatch:
        """Every row, as one canonical batch (a copy)."""
        cols, feats, ids = self._sorted_keys()
        return self._batch(cols, feats, ids)

    def digest(self, key: RowKey) -> RowDigest | None:
        """The row's digest for repair (see :class:`RowDigest`), or None if absent."""
        i = self._id(key)
        return None if i < 0 else row_digest(_row(self.engine.read(i)), int(self._touches[i]))

    def row_digests(self, row_column: ArrayLike, row_feature: ArrayLike, version: int = ROW_DIGEST_VERSIONS[-1]
                    ) -> tuple[NDArray[np.bool_], NDArray[np.uint64], NDArray[np.uint64]]:
        """The repair digests of the given rows, in the given order (row_digest.py ``row_digests``,
        repair digest ``version``): whether each is stored, and its keys and strength digests (0
        where absent). The rows are gathered (merged with their delta entries) about
        ``DIGEST_GATHER_ENTRIES`` at a time, a longer row alone: no per-row Python (version 2).

        Raises:
            ValueError: an unknown digest version.
        """
        if version not in ROW_DIGEST_VERSIONS:
            raise ValueError(f"unknown row digest version {version}")
        rc, rf = _keys(row_column, row_feature)
        ids = self.engine.row_ids(rc, rf)
        present = ids >= 0
        keys, strength = np.zeros(ids.shape[0], np.uint64), np.zeros(ids.shape[0], np.uint64)
        at = np.flatnonzero(present)
        if at.shape[0]:
            ends = np.cumsum(self.engine.lengths()[ids[at]])
            # groups of rows of about DIGEST_GATHER_ENTRIES entries (a row past it is a group alone)
            cuts = unique(np.searchsorted(ends, np.arange(DIGEST_GATHER_ENTRIES, int(ends[-1]),
                                                             DIGEST_GATHER_ENTRIES), "right"))
            for group in np.split(at, cuts[(cuts > 0) & (cuts < at.shape[0])]):
                offsets, got = self._gather(ids[group])
                keys[group], strength[group] = row_digests(offsets, got, version)
        return present, keys, strength

    def rows_digest(self, row_column: ArrayLike, row_feature: ArrayLike, version: int = 1
                    ) -> tuple[NDArray[np.uint8], int]:
        """Which of the given rows are stored (1/0 per key, in the given order), and one xxh3-64
        over the stored ones, in that order, in digest ``version`` (row_digest.py): two stores
        give equal results exactly when they hold the same rows bit for bit. For stream
        verification (streaming/sender.py).

        Raises:
            ValueError: an unknown digest version.
        """
        rc, rf = _keys(row_column, row_feature)
        ids = self.engine.row_ids(rc, rf)
        present = ids >= 0
        if version == 2 and present.any():
            # the rows as views where they lie together in the engine (a stream's receiver holds
            # them chunk by chunk, long rows are long slices): hashed without gathering a copy
            held = ids[present]
            lengths = self.engine.lengths()[held]
            pieces = self.engine.pieces(held, max(1, int(lengths.sum()) // MIN_DIGEST_PIECE_ENTRIES))
            if pieces is not None:
                fields = [(p.seg, p.tc, p.tf, p.st) for p in pieces]
                return present.astype(np.uint8), rows_digest_v2_pieces(lengths, fields)
        offsets, got = self._gather(ids[present]) if present.any() else (np.zeros(1, np.int64), Row.empty())
        return present.astype(np.uint8), rows_digest(offsets, got, version)

    def holds_any(self, row_column: ArrayLike, row_feature: ArrayLike) -> bool:
        """Whether any of the given rows is stored (one probe of the key index per key)."""
        rc, rf = _keys(row_column, row_feature)
        return bool(np.any(self.engine.row_ids(rc, rf) >= 0))

    def row_touches(self, row_column: ArrayLike, row_feature: ArrayLike
                    ) -> tuple[NDArray[np.bool_], NDArray[np.uint64]]:
        """Which of the given rows are stored, and each one's ``touches`` (0 when absent): with
        ``drops``, a row's version. Every change of a row's entries is a commit that bumps its
        touches (``drop_columns`` bumps ``drops``), so a row whose touches and the store's drops
        are what they were holds what it held then: a stream source keeps the digest of a page
        it sent and need not read the rows again to verify them (streaming/sender.py)."""
        rc, rf = _keys(row_column, row_feature)
        ids = self.engine.row_ids(rc, rf)
        present = ids >= 0
        return present, np.where(present, self._touches[np.maximum(ids, 0)], np.uint64(0))

    # -- snapshot support (snapshot.py) -----------------------------------------------------------
    def freeze(self, room: NDArray[np.float32] | None = None, lazy: bool = False) -> FrozenRows:
        """The rows, touches and applied set as they are now, for a snapshot written by another
        thread while applies go on (module docstring); O(entries) memcpy of the strengths, into
        ``room`` where it is big enough (``RowEngine.freeze``; ``freeze_room`` makes one).
        ``lazy``: the strengths, lengths and touches are copied by the reader (``materialize``)
        and, for the chunks they touch first, by the applies (rowengine/cow.py): the freeze costs
        no copy, O(runs) and the applied set."""
        n = self.engine.num_rows
        touches = np.empty(n, np.uint64)
        pending = PendingCopies([(self._touches, n, touches)])
        if lazy:
            self._pending.add(pending)
        else:
            pending.finish()
        return FrozenRows(self.engine.freeze(room, lazy), touches, self.applied.to_arrays(),
                          self.applied.column_arrays(), pending if lazy else None)

    def _before_touch(self, ids: NDArray[np.int64]) -> None:
        """The touch counts are about to be written at ``ids``: a lazy freeze's copy takes what it
        still needs first (rowengine/cow.py)."""
        self._pending.before_write(self._touches, ids)

    def freeze_room(self) -> NDArray[np.float32]:
        """A buffer for the next ``freeze``'s strengths, every page touched: for the entries held
        now, 1/64 more and 64 Ki (applies go on until the freeze: milliseconds; every page of the
        buffer is resident while the snapshot is written, so no more). Safe to call from another thread
        while applies go on (it reads one count); the caller calls it *before* holding writes off."""
        n = self.engine.num_entries
        # Small pages (page_advice.py): the room lives for one snapshot and is read once, in order.
        # Filled in huge pages it cost a storage node of 8.6·10^7 entries ~1.4 s of CPU in a minute
        # (py-spy, the end of the cluster bench's 300k interval: the kernel compacting memory for
        # 2 MiB pages under the node's load), against ~0.4 ms/MB in small pages.
        room = filled_buffer(np.float32, n + n // 64 + FREEZE_ROOM_SPARE)
        room.fill(0.0)  # the page faults happen here
        return room

    def iter_slots(self) -> Iterator[tuple[RowKey, int, memoryview]]:
        """(key, applied-batch count, region layout copy) of every row, in key order: for tests
        and tools comparing stores bit for bit, one row at a time (not a serving path)."""
        cols, feats, ids = self._sorted_keys()
        for key, i in zip(zip(cols.tolist(), feats.tolist()), ids.tolist()):
            row = _row(self.engine.read(i))
            yield key, int(self._touches[i]), pack_regions(np.array([0, len(row)], np.int64), row).data

    def load_bulk(self, row_column: NDArray[np.uint64], row_feature: NDArray[np.uint64],
                  offsets: NDArray[np.int64], rows: Row, touches: NDArray[np.uint64], spare: bool = False) -> None:
        """Install every row of a snapshot at once (the caller validated them: keys unique, offsets
        a partition of the entries into non-empty rows, each row canonical), in the order given:
        the arrays become the engine's base run, its key index's keys and the touch counts as they
        are (no copy into fresh memory, whose page faults cost the most: docs/storage.md "Bulk
        load"; the caller gives them up), with no per-row work. Only into
        an empty store; not capacity-checked (recovery must restore what was acknowledged).

        ``spare``: the four entry arrays are prefixes of buffers with room past their end that the
        caller hands over (``RowEngine.from_arrays``): a replay's merges fill that room.

        Raises:
            ValueError: the store holds rows, or a key repeats.
        """
        if self.engine.num_rows:
            raise ValueError("load_bulk into a store that already holds rows")
        self.engine = RowEngine.from_arrays(
            row_column, row_feature, offsets,
            Entries(rows.segment, rows.target_column, rows.target_feature, rows.strength), spare=spare)
        n = self.engine.num_rows
        if (n >= 1024 and touches.shape == (n,) and touches.dtype == np.uint64 and touches.flags.c_contiguous
                and touches.flags.writeable):
            self._touches = touches  # kept as it is, like the entry arrays (grown into a new array later)
        else:
            self._touches = np.zeros(max(1024, n), np.uint64)
            self._touches[:n] = touches
        self._version += 1
        self._count_sizes(self.engine.lengths())

    def load_row(self, key: RowKey, region: NDArray[np.uint8], touches: int) -> None:
        """Install one row given in the region layout (tools, tests). Not capacity-checked.

        Raises:
            ValueError: the row is stored already.
        """
        if key in self:
            raise ValueError(f"row {key} loaded twice")
        row = row_from_region(region)
        plan = self.engine.plan(np.array([key[0]], np.uint64), np.array([key[1]], np.uint64),
                                np.array([0, len(row)], np.int64),
                                Entries(row.segment, row.target_column, row.target_feature, row.strength))
        self._version += 1
        self._engine_commit(plan)
        self._count_sizes(np.array([len(row)], np.int64))
        self._grow_touches(self.engine.num_rows)
        self._before_touch(plan.ids)
        self._touches[plan.ids] = np.uint64(touches)

    # -- scan (cluster-wide export; docs/replication.md "Scan") -------------------------------------
    def scan(self, after: RowKey | None, limit_rows: int, limit_entries: int, max_examine: int,
             keep: Callable[[NDArray[np.uint64]], NDArray[np.bool_]] | None = None,
             limit_bytes: int | None = None, after_entry: int = 0) -> ScanResult:
        """One page of rows in key order after the cursor ``(after, after_entry)`` (None: from the
        first row; row_scan.py has the rules).

        Looks at most ``max_examine`` keys; of those, returns the rows whose column ``keep`` accepts
        (all when None), at most ``limit_rows`` rows, ``limit_entries`` entries and ``limit_bytes``
        bytes. A first row over the limits is cut into pieces when ``limit_bytes`` is given
        (``next_entry`` then says where the next piece starts), else sent whole, alone, so a huge
        row cannot stall a scan. The page is a copy (safe to send while applies continue);
        ``next_key`` is the cursor for the next call, ``done`` says nothing follows it. Rows added
        behind the cursor during a scan are not seen by it; rows added ahead of it are.
        """
        self._refresh_keys()
        # the keys from the cursor's on, as many as a page of ``limit_rows`` rows may look at
        # (SCAN_WINDOW_ROWS each): the page's cost, not the store's (sorted_keys.py); a page whose
        # filter passes fewer rows ends at the window's end (not the last: the caller goes on)
        window = min(max(1, max_examine), max(1, limit_rows) * SCAN_WINDOW_ROWS)
        (cols, feats, ids), more = self._keys.window(after, window + 1)
        return scan_page(cols, feats, ids, self.engine.lengths(), self._gather,
                         lambda i, a, z: _row(self.engine.read_part(i, a, z)[1]),
                         after, limit_rows, limit_entries, max_examine, keep, limit_bytes, after_entry, more)

    def key_order_source(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64], int, int] | None:
        """What a worker thread sorts into the key order (``sorted_keys.sorted_rows``): the
        engine's keys, its rows and the store's drop count; None when the order is built already.
        The key arrays are never written below the row count (new rows go after it, a drop
        replaces the arrays), so the thread reads them while the store goes on."""
        if self._keys.current(self.drops):
            return None
        a, b = self.engine.keys()
        return a, b, self.engine.num_rows, self.drops

    def install_key_order(self, main: MainRun, num_rows: int, drops: int) -> bool:
        """Take the key order a worker thread sorted from ``key_order_source``, unless a drop came
        since (``drops`` is not the store's any more) or a listing built it meanwhile; returns
        whether it was taken (sorted_keys.py ``install``)."""
        return drops == self.drops and self._keys.install(main, num_rows, drops)

    def _sorted_keys(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.int64]]:
        """Every row key as two arrays sorted by (column, feature), and each one's row id (shared:
        do not change them; sorted_keys.py keeps them up to date without sorting the store)."""
        self._refresh_keys()
        return self._keys.full()

    def _refresh_keys(self) -> None:
        a, b = self.engine.keys()
        self._keys.refresh(a, b, self.engine.num_rows, self.drops)
        if self._keys.merge_due and self._on_key_merge_due is not None:
            self._on_key_merge_due()

    def merge_key_order_apart(self, due: Callable[[], None]) -> None:
        """Leave the key order's large merges (sorted_keys.py ``merge_apart``) to another thread:
        ``due()`` is called (on the caller's thread) when one is due; ``key_merge_source`` and
        ``install_key_merge`` do it."""
        self._keys.merge_apart = MERGE_APART_KEYS
        self._on_key_merge_due = due

    def take_keys_in_apart(self, due: Callable[[], None]) -> None:
        """Leave the sort of the rows created since the key order last took rows in to another
        thread once ``KEYS_BEHIND_APART_ROWS`` of them wait: ``due()`` is called (on the committing
        thread) from then on after each commit until they are taken in; ``key_tail_source`` and
        ``install_key_tail`` do it. Without this, the next listing sorts them all where it runs: on
        a storage node's event loop, after hours of training, millions of rows (~0.1 s per 10^6)."""
        self._on_keys_behind = due

    def key_tail_source(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64], TailSource] | None:
        """The engine's keys and ``SortedKeys.tail_source``: what a worker thread needs for
        ``sorted_keys.extended_tail``; None when no row waits. The key arrays are never written
        below the row count (new rows go after it, a drop replaces the arrays)."""
        source = self._keys.tail_source(self.engine.num_rows, self.drops)
        if source is None:
            return None
        a, b = self.engine.keys()
        return a, b, source

    def install_key_tail(self, tail: Keys, source: TailSource) -> bool:
        """``SortedKeys.install_tail`` of ``tail`` (``extended_tail`` of ``source``); a merge of the
        tail into the main run that this makes due is reported as a listing's would be."""
        taken = self._keys.install_tail(tail, source)
        if taken and self._keys.merge_due and self._on_key_merge_due is not None:
            self._on_key_merge_due()
        return taken

    def key_merge_source(self) -> tuple[Any, ...] | None:
        """``SortedKeys.merge_source``: the runs of a due merge of the key order (None: none due)."""
        return self._keys.merge_source()

    def install_key_merge(self, merged: MainRun, source: tuple[Any, ...]) -> bool:
        """``SortedKeys.install_merge`` of ``merged`` (``merge_runs`` of ``source``'s runs)."""
        main, _, rows, drops = source
        return self._keys.install_merge(merged, main, rows, drops)
