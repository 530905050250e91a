"""The in-RAM column store: one contiguous region per (column, feature) row (ARCHITECTURE §8).

Theory of operation
-------------------
State: ``rows`` (row key -> ``RowSlot``: the row's region, its four array views, the number of
applied batches that touched it), the :class:`AppliedSet` of batch ids, and the bytes in use.

- A row of n entries lives in one ``uint8`` region of ``ENTRY_BYTES * n`` bytes laid out
  ``target_column u64[n] | target_feature u64[n] | strength f32[n] | segment u8[n]`` (regions.py
  owns the layout and every vectorised conversion to and from it). One region = one contiguous
  buffer to send for an inference read of that row (``row_region``) and one ``readinto`` when a
  snapshot is loaded.
- ``apply(batch_id, batch)``: a batch id already applied is ignored (returns False). Otherwise the
  whole batch is *planned* first (apply_plan.py: all small rows in one vectorised pass,
  ``row_merge.plan_batch``) — pure, which yields the exact memory growth — then refused as a whole with
  :class:`StoreFullError` if it
  does not fit, else committed: rows whose delta keys are all stored get an in-place add; every
  growing or new row is merged in one pass (``merge_batch``), staged in one buffer and copied out
  into its own region (``regions.cut_regions``). So a refused or invalid batch leaves the store
  exactly as it was, and the Python work per row is a dict lookup and, for a growing row, one region.
- Rows a batch creates (no stored entries: every row of a stream chunk a joining node receives,
  and the new rows of training batches) skip planning and merging: a canonical delta row *is* the
  merged row, so its region is laid out straight from the batch (``regions.install_regions``: one
  vectorised scatter for all short rows, one byte concatenation per long row). Same bytes as the
  merge path (tests compare the two), a fraction of the work.
- ``drop_columns(columns)`` deletes every row of the given columns (rows of columns the node no
  longer owns after a topology change: release.py) and returns their bytes to the capacity. The
  applied set is kept: batch ids stay applied, so a late duplicate is still ignored.
- Memory accounting: the regions' bytes plus ``ROW_OVERHEAD_BYTES`` per row plus
  ``APPLIED_ID_BYTES`` per stored batch id, against ``capacity_bytes``.
- Reads: ``row``/``row_region`` (one row, live), ``read_rows``/``read_all`` (copies,
  ``regions.gather_rows``), ``read_bounded`` / ``read_part`` (the chunked reads of rows of any
  size, protocol "Rows of any size": a reply bounded in entries, large rows listed with their
  version, then read by parts; a row's version is its applied-batch count ``touches`` and the
  store's ``drops``, bumped by every ``drop_columns``), ``digest``/``rows_digest`` for repair and stream verification
  (row_digest.py) and ``scan`` pages for the cluster-wide export (row_scan.py); the store keeps
  one sorted key index for ``keys``, ``scan`` and the per-column queries.

This module is the facade: ``ColumnStore`` owns the state and the apply/drop logic, and re-exports
the names callers import from it (``ENTRY_BYTES``, ``row_from_region``, ``RowDigest``,
``ScanResult``). The tuning flags below are read here at each call, so tests can patch them on
this module.

The store is synchronous and does no I/O: durability (update log, snapshots) wraps it in
recovery.py, and the asyncio service is glue on top of that.

Concurrency: single-threaded by contract. Views returned by ``row``/``row_region`` are live: an
in-place merge-add changes their strengths, a growing merge replaces the region (the old views keep
the old data alive). ``read_rows`` returns copies, safe to send while applies continue.

Frozen views (snapshots while applies go on, issue 14 item 3): ``freeze()`` returns a
:class:`FrozenRows` — a shallow copy of the row dict (one C-level dict copy: pointers, no row data)
and the applied set as arrays — which another thread may read while this one keeps applying.
That is safe because, while any frozen view is alive, the store never changes a region or a slot
it may hold: the in-place paths (merge-add into a row whose keys are all stored) become
copy-on-write — the row's region is copied, the copy changed, and a new slot put in its place —
and a growing merge already makes a new region and slot. So a region or slot, once in a frozen
view, is immutable until ``release()``. A row is copied once per view (the first in-place change
finds the view holding its slot; later ones change the copy, which the view does not hold); the
replaced regions stay alive, unaccounted, until the view is released.

Restart installs rows in bulk: ``load_bulk`` (a snapshot's rows, views of the one buffer read, or
copies: ``storage.snapshot-load-copy-rows``), and ``share_regions`` for log replay (the regions a
commit lays out are views of the batch's one staging buffer).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice, repeat
from operator import itemgetter

import numpy as np
from numpy.typing import ArrayLike, NDArray

from giaannd.model.rows import Row, RowBatch, RowKey
from giaannd.protocol import BatchId
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.apply_plan import ApplyPlan, plan_apply
from giaannd.storage.engine.errors import StoreFullError
from giaannd.storage.engine.regions import (
    ENTRY_BYTES,
    RowSlot,
    gather_rows,
    install_regions,
    new_region,
    region_part,
    row_from_region,
)
from giaannd.storage.engine.regions import cut_regions as _cut_regions
from giaannd.storage.engine.regions import rows_of_regions as _rows_of_regions  # noqa: F401 (tests use it)
from giaannd.storage.engine.row_digest import RowDigest, row_digest, rows_digest
from giaannd.storage.engine.row_merge import MergePlan, add_in_place, merge_batch, merge_into
from giaannd.storage.engine.row_scan import ScanResult, scan_page

__all__ = [
    "APPLIED_ID_BYTES",
    "BoundedRead",
    "ENTRY_BYTES",
    "GIL_SLICE_ROWS",
    "ROW_OVERHEAD_BYTES",
    "ColumnStore",
    "DropResult",
    "PartRead",
    "FrozenRows",
    "PreparedApply",
    "RowDigest",
    "ScanResult",
    "SIZE_BINS",
    "StoreUsage",
    "log2_bins",
    "log2_histogram",
    "row_from_region",
]

#: Python bookkeeping per row (dict entry, key tuple, slot, Row and four ndarray views): 860 bytes
#: measured with tracemalloc on CPython 3.11 / numpy 2.4, rounded up.
ROW_OVERHEAD_BYTES = 1024
#: Per stored batch id in the applied set (a set/dict entry and an int), rounded up.
APPLIED_ID_BYTES = 96
#: Stored rows at least this long are merged one at a time (``plan_merge``: keys packed once,
#: O(m log n) search, an in-place add when nothing is new); shorter ones together (``plan_batch``).
#: The batch path copies every touched stored entry two or three more times, which costs more than
#: the ~30 µs of per-row Python it saves once a row has several hundred entries. Measured (apply of
#: the bundled corpus's K=256 training batches, 3.5k and 8.8k sentences): thresholds 256 and 512
#: equally fastest, 1024 10 % slower, all-batched 15 % slower; tools/bench/storage.py's synthetic
#: table: 200-entry rows 1.3-1.8x faster batched, 2000-entry rows about 2x slower. (Read at each
#: ``prepare`` and passed to ``apply_plan.plan_apply``, as is ``INSTALL_NEW_ROWS``.)
LARGE_ROW_ENTRIES = 512
#: Rows a batch creates (no stored entries yet) are *installed*: their merged form is the delta row
#: itself, so planning and merging are skipped and each region is laid out straight from the batch
#: (``_install_regions``). False sends them through the general merge path instead (tests compare
#: the two bit for bit).
INSTALL_NEW_ROWS = True
#: New rows at least this long are laid out one at a time (one ``concatenate`` of four byte slices:
#: about 1 µs of Python, then memcpy speed); shorter ones by one vectorised scatter over all of them
#: (``regions.cut_regions``). Measured, 4 MiB of new rows (scatter / one at a time, MB/s): 20
#: entries per row 645 / 326, 50: 837 / 776, 500: 1245 / 5046, 5000: 1359 / 11979.
INSTALL_CONCAT_ENTRIES = 64
#: Per-row loops that run in a snapshot thread beside the applying one go this many rows at a
#: time: a C-level loop (``list(map(...))``, ``np.fromiter``) holds the GIL until it returns, so
#: one over every row of a large store would stall applies for its whole length (hundreds of ms
#: per million rows); 8192 rows take well under a millisecond.
GIL_SLICE_ROWS = 8192
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
#: Bins of the row-size counts (``row_size_log2``): a length is an int64, so floor(log2(n)) < 63
#: (protocol.MAX_ROW_SIZE_BINS, the reply's limit, is the same 64).
SIZE_BINS = 64


def _columns_of(batch: RowBatch) -> NDArray[np.uint64]:
    """The distinct columns of a canonical batch (rows sorted by column: one comparison pass)."""
    rc = batch.row_column
    if rc.shape[0] == 0:
        return rc.astype(np.uint64, copy=True)
    return rc[np.concatenate(([True], rc[1:] != rc[:-1]))].astype(np.uint64, copy=False)


def _strictly_ascending(rc: NDArray[np.uint64], rf: NDArray[np.uint64]) -> bool:
    """Whether the keys (rc[i], rf[i]) are sorted by (column, feature) and unique."""
    return bool(np.all((rc[1:] > rc[:-1]) | ((rc[1:] == rc[:-1]) & (rf[1:] > rf[:-1]))))


def _install_regions(batch: RowBatch, share: bool = False) -> list[NDArray[np.uint8]]:
    """``regions.install_regions`` with this module's ``INSTALL_CONCAT_ENTRIES``, read at each call
    (tests patch it)."""
    return install_regions(batch, INSTALL_CONCAT_ENTRIES, share)


@dataclass(frozen=True, slots=True)
class PreparedApply:
    """A checked, planned apply (``ColumnStore.prepare``). ``batch`` is what will be applied: the
    batch given, or the part of it whose columns were not applied under its id before (applied_set.py,
    "Which columns"); the durable store logs that part."""

    batch_id: BatchId
    batch: RowBatch
    columns: NDArray[np.uint64]
    plans: ApplyPlan
    version: int


@dataclass(frozen=True, slots=True)
class BoundedRead:
    """``read_bounded``: the rows that fit, the large rows left out as (column, feature, entries,
    touches, drops), and the last key looked at when it stopped early (None: every key was)."""

    batch: RowBatch
    large: list[tuple[int, int, int, int, int]]
    stopped_after: RowKey | None


@dataclass(frozen=True, slots=True)
class PartRead:
    """``read_part``: the row's version now (``entries`` 0: absent) and views of the entries asked for."""

    entries: int
    touches: int
    drops: int
    part: Row


@dataclass(frozen=True, slots=True)
class DropResult:
    """What ``drop_columns`` removed: ``rows``, and ``bytes``, the accounted bytes returned to the
    capacity (the rows' regions plus ``ROW_OVERHEAD_BYTES`` each)."""

    rows: int
    bytes: int


@dataclass(slots=True)
class FrozenRows:
    """An immutable view of a store at one moment (``ColumnStore.freeze``; module docstring).

    ``rows`` (key -> slot, unordered; neither the dict nor the slots and regions in it change
    while the view is alive), ``applied`` (the applied set's ``to_arrays``), ``applied_columns``
    (its ``column_arrays``), and ``release``, to call once the view is no longer read
    (idempotent): the store then stops copying on write.
    """

    rows: dict[RowKey, RowSlot]
    applied: tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64]]
    applied_columns: tuple[NDArray[np.uint64], ...]
    _release: Callable[[], None] = field(repr=False)
    _released: bool = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()

    def in_key_order(self, pause: Callable[[], None] = lambda: None
                     ) -> tuple[NDArray[np.uint64], NDArray[np.uint64], list[RowSlot]]:
        """The view's row keys as two arrays sorted by (column, feature), and its slots in that
        order. Meant for the snapshot thread: only C-level loops (no Python frame per row, no key
        hashing: the slots are taken in dict order and permuted), ``GIL_SLICE_ROWS`` at a time,
        calling ``pause`` after each (snapshot.Pacer)."""
        n = len(self.rows)
        cols, feats = np.empty(n, np.uint64), np.empty(n, np.uint64)
        values: list[RowSlot] = []
        keys, slots = iter(self.rows), iter(self.rows.values())
        for a in range(0, n, GIL_SLICE_ROWS):
            chunk = list(islice(keys, GIL_SLICE_ROWS))
            cols[a : a + len(chunk)] = np.fromiter(map(_FIRST, chunk), np.uint64, len(chunk))
            feats[a : a + len(chunk)] = np.fromiter(map(_SECOND, chunk), np.uint64, len(chunk))
            values += islice(slots, GIL_SLICE_ROWS)
            pause()
        order = np.lexsort((feats, cols))
        ordered: list[RowSlot] = []
        for a in range(0, n, GIL_SLICE_ROWS):
            ordered += map(values.__getitem__, order[a : a + GIL_SLICE_ROWS].tolist())
            pause()
        return cols[order], feats[order], ordered

    def holds(self, key: RowKey, slot: RowSlot) -> bool:
        """Whether ``slot`` is the view's slot for ``key`` (then it must not change)."""
        return self.rows.get(key) is slot


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


class ColumnStore:
    """Rows in RAM with idempotent, capacity-checked merge-add (module docstring).

    Args:
        capacity_bytes: the most bytes the store may account for; applies past it are refused.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.applied = AppliedSet()
        self._rows: dict[RowKey, RowSlot] = {}
        self._region_bytes = 0
        self._entries = 0
        self._version = 0  # bumped by every commit, so a stale PreparedApply is caught
        #: bumped by every drop_columns: part of a row's version for chunked reads (module docstring)
        self.drops = 0
        #: (row count, sorted columns, sorted features) for ``keys``/``scan``; reset by a drop
        self._scan_index: tuple[int, NDArray[np.uint64], NDArray[np.uint64]] | None = None
        #: frozen views alive (``freeze``): while any, an in-place change to a row one of them holds
        #: is copy-on-write. A view is released by the thread that read it, hence the lock (the
        #: list is replaced, never changed, so the applying thread may read it without the lock).
        self._frozen: list[FrozenRows] = []
        #: lay out the regions a commit creates as views of one buffer per batch instead of one
        #: copy each (``regions.cut_regions``): set by recovery for log replay only
        #: (``storage.snapshot-load-copy-rows`` false), as the snapshot load does
        self.share_regions = False
        self._frozen_lock = threading.Lock()
        #: rows per floor(log2(entry count)) (``row_size_log2``), kept by every length change
        self._size_counts = np.zeros(SIZE_BINS, np.int64)

    # -- accounting -------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._region_bytes + ROW_OVERHEAD_BYTES * len(self._rows) + APPLIED_ID_BYTES * len(self.applied)

    def usage(self) -> StoreUsage:
        return StoreUsage(self.used_bytes, self.capacity_bytes, len(self._rows), self._entries, len(self.applied))

    @property
    def is_full(self) -> bool:
        return self.usage().is_full

    def row_size_log2(self) -> list[int]:
        """The row-size histogram for ``GetUsage``: element k counts the rows of 2**k to
        2**(k+1) - 1 entries, trailing zeros trimmed (``log2_histogram`` of every row's length).

        Kept up to date by every change of a row's length (install, growing merge, drop, load),
        each adding and removing the counts of the rows it changed in one vectorised pass, so this
        answer costs O(bins), not a walk over millions of slots on the event loop (a walk of C-level
        ``map``s measured 67 ms per million rows)."""
        return _trimmed(self._size_counts)

    def _count_sizes(self, lengths: NDArray[np.int64], sign: int = 1) -> None:
        """Add (``sign`` 1) or remove (-1) rows of ``lengths`` entries to the row-size counts."""
        if lengths.shape[0]:
            self._size_counts += sign * log2_bins(lengths)

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
        batch_id = BatchId(int(batch_id[0]), int(batch_id[1]))
        if not (0 <= batch_id.writer < 2**64 and 1 <= batch_id.seq < 2**64):
            raise ValueError(f"batch id out of range: {batch_id}")
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
        plans = plan_apply(self._rows, batch, LARGE_ROW_ENTRIES, INSTALL_NEW_ROWS)
        growth = APPLIED_ID_BYTES + ENTRY_BYTES * plans.new_entries + ROW_OVERHEAD_BYTES * plans.new_slots
        if enforce_capacity and self.used_bytes + growth > self.capacity_bytes:
            raise StoreFullError(growth, self.used_bytes, self.capacity_bytes)
        return PreparedApply(batch_id, batch, columns, plans, self._version)

    def commit(self, prepared: PreparedApply) -> None:
        """Carry out a plan from ``prepare``; no other write may come between the two."""
        if prepared.version != self._version:
            raise RuntimeError("stale PreparedApply: the store changed after prepare()")
        self._version += 1
        self.applied.add(prepared.batch_id, prepared.columns)
        self._commit(prepared.plans)

    def _commit(self, planned: ApplyPlan) -> None:
        for key, delta, large_slot, row_plan in planned.large:
            self._commit_large(key, delta, large_slot, row_plan)
        if planned.new_rows is not None:
            self._install(planned.new_keys, planned.new_rows)
        plan, slots = planned.plan, planned.slots
        if plan is None:
            return
        grows = plan.new_count > 0  # every absent row grows: its delta row is not empty
        if not grows.all():
            # rows whose delta keys are all stored: strength[pos] += delta, in the live region
            local_pos = plan.local_pos()
            offsets = plan.delta_offsets.tolist()
            strength = plan.delta.strength
            frozen = self._frozen
            for i in np.flatnonzero(~grows).tolist():
                slot = slots[i]
                assert slot is not None
                if frozen and self._is_frozen(planned.keys[i], slot):  # change a copy (docstring)
                    slot = RowSlot(slot.region.copy(), None, slot.touches)
                    self._rows[planned.keys[i]] = slot
                a, b = offsets[i], offsets[i + 1]
                slot.row.strength[local_pos[a:b]] += strength[a:b]
                slot.touches += 1
        if grows.any():
            out_offsets, out = merge_batch(plan, None if grows.all() else grows)
            new_lengths = np.diff(out_offsets)
            self._count_sizes(new_lengths - plan.new_count[grows], -1)  # (0: the row was not stored)
            self._count_sizes(new_lengths)
            rows = self._rows
            keys = planned.keys
            for i, region in zip(np.flatnonzero(grows).tolist(), _cut_regions(out_offsets, out, self.share_regions)):
                slot = slots[i]
                rows[keys[i]] = RowSlot(region, None, 1 if slot is None else slot.touches + 1)
            added = int(plan.new_count.sum())
            self._region_bytes += ENTRY_BYTES * added
            self._entries += added

    def _install(self, keys: list[RowKey], batch: RowBatch) -> None:
        """Add the rows of ``batch`` (none stored yet) as they are: one applied batch each."""
        self._rows.update(zip(keys, map(RowSlot, _install_regions(batch, self.share_regions), repeat(None),
                                        repeat(1))))
        self._region_bytes += ENTRY_BYTES * batch.num_entries
        self._entries += batch.num_entries
        self._count_sizes(np.diff(batch.offsets))

    def _commit_large(self, key: RowKey, delta: Row, slot: RowSlot, plan: MergePlan) -> None:
        if plan.in_place:
            if self._frozen and self._is_frozen(key, slot):  # a frozen view holds it: change a copy
                slot = RowSlot(slot.region.copy(), None, slot.touches)
                self._rows[key] = slot
            slot.touches += 1
            add_in_place(slot.row, delta, plan)
            return
        region, row = new_region(len(slot.row) + plan.new_count)
        merge_into(slot.row, delta, plan, row)
        self._count_sizes(np.array([len(slot.row)], np.int64), -1)
        self._count_sizes(np.array([len(row)], np.int64))
        self._region_bytes += ENTRY_BYTES * plan.new_count
        self._entries += plan.new_count
        self._rows[key] = RowSlot(region, row, slot.touches + 1)

    def held_columns(self, columns: ArrayLike | None = None) -> NDArray[np.uint64]:
        """The columns with at least one stored row (of ``columns`` only, if given), sorted, unique."""
        cols = np.unique(self._sorted_keys()[0])
        if columns is None:
            return cols
        wanted = np.asarray(columns).astype(np.uint64, copy=False).reshape(-1)
        return cols[np.isin(cols, wanted)]

    def rows_of_columns(self, columns: ArrayLike) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.int64]]:
        """The keys of every row of ``columns``, sorted (as two arrays), and each row's region size
        in bytes: what a stream source cuts its chunks from, without a key tuple per stored row."""
        wanted = np.asarray(columns).astype(np.uint64, copy=False).reshape(-1)
        cols, feats = self._sorted_keys()
        hit = np.flatnonzero(np.isin(cols, wanted))
        c, f = cols[hit], feats[hit]
        rows = self._rows
        sizes = np.fromiter((rows[k].region.shape[0] for k in zip(c.tolist(), f.tolist())), np.int64, hit.shape[0])
        return c, f, sizes

    def drop_columns(self, columns: ArrayLike) -> DropResult:
        """Delete every row of ``columns`` (columns with no rows are ignored) and return their bytes
        to the capacity. The applied set is not changed: a batch id applied before stays applied,
        so a late duplicate of it is still ignored (and does not bring the rows back). Views and
        copies handed out earlier keep their data alive until they are dropped themselves.
        """
        wanted = np.asarray(columns).astype(np.uint64, copy=False).reshape(-1)
        cols, feats = self._sorted_keys()
        hit = np.flatnonzero(np.isin(cols, wanted))
        if hit.shape[0] == 0:
            return DropResult(0, 0)
        self._version += 1
        self.drops += 1
        rows = self._rows
        sizes = np.fromiter((rows.pop(key).region.shape[0] for key in zip(cols[hit].tolist(), feats[hit].tolist())),
                            np.int64, hit.shape[0])
        region_bytes = int(sizes.sum())
        self._count_sizes(sizes // ENTRY_BYTES, -1)
        self._scan_index = None  # rows were removed: the cached index is stale whatever the count
        self._region_bytes -= region_bytes
        self._entries -= region_bytes // ENTRY_BYTES
        return DropResult(int(hit.shape[0]), region_bytes + ROW_OVERHEAD_BYTES * int(hit.shape[0]))

    def advance_floor(self, writer: int, floor: int) -> None:
        """The writer will never resend a batch with seq <= floor (compacts the applied set)."""
        self._version += 1
        self.applied.advance_floor(writer, floor)

    # -- reads ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def keys(self) -> list[RowKey]:
        """Every row key, sorted."""
        cols, feats = self._sorted_keys()
        return list(zip(cols.tolist(), feats.tolist()))

    def row(self, key: RowKey) -> Row | None:
        """Live views of one row (module docstring), or None if the store has no entries for it."""
        slot = self._rows.get(key)
        return slot.row if slot else None

    def row_region(self, key: RowKey) -> memoryview | None:
        """The row's single contiguous region (layout in the module docstring), for a zero-copy send."""
        slot = self._rows.get(key)
        return slot.region.data if slot else None

    def read_rows(self, row_column: ArrayLike, row_feature: ArrayLike) -> RowBatch:
        """A canonical batch (a copy) of the requested rows that exist; absent rows are left out."""
        rc = np.asarray(row_column).astype(np.uint64, copy=False).reshape(-1)
        rf = np.asarray(row_feature).astype(np.uint64, copy=False).reshape(-1)
        if rc.shape != rf.shape:
            raise ValueError("row_column and row_feature differ in length")
        if rc.shape[0] > 1 and not _strictly_ascending(rc, rf):
            wanted = sorted(set(zip(rc.tolist(), rf.tolist())))
        else:  # already sorted and unique (a stream's chunk of sorted keys): no set, no sort
            wanted = list(zip(rc.tolist(), rf.tolist()))
        rows = self._rows
        return self._gather([k for k in wanted if k in rows])

    def read_bounded(self, row_column: ArrayLike, row_feature: ArrayLike, max_entries: int,
                     max_large: int) -> BoundedRead:
        """The requested rows in key order (a copy) while they add up to at most ``max_entries``
        entries; a row longer than ``max_entries`` is left out and listed in ``large`` (at most
        ``max_large`` of them). Stops before the first row that does not fit, so the caller asks
        again for the keys after ``stopped_after``. The Python work is one dict lookup per key."""
        rc = np.asarray(row_column).astype(np.uint64, copy=False).reshape(-1)
        rf = np.asarray(row_feature).astype(np.uint64, copy=False).reshape(-1)
        order = np.lexsort((rf, rc))
        rc, rf = rc[order], rf[order]
        rows, drops = self._rows, self.drops
        keys: list[RowKey] = []
        large: list[tuple[int, int, int, int, int]] = []
        total, last, stopped = 0, None, False
        for key in zip(rc.tolist(), rf.tolist()):
            if key == last:
                continue  # a key asked twice
            slot = rows.get(key)
            if slot is not None:
                n = slot.region.shape[0] // ENTRY_BYTES
                if n > max_entries and len(large) < max_large:
                    large.append((key[0], key[1], n, slot.touches, drops))
                elif n > max_entries or total + n > max_entries:
                    stopped = True
                    break
                else:
                    keys.append(key)
                    total += n
            last = key
        return BoundedRead(self._gather(keys), large, last if stopped else None)

    def read_part(self, key: RowKey, offset: int, limit: int) -> PartRead:
        """Entries ``[offset, offset + limit)`` of one row (live views: ``regions.region_part``
        says why that is safe) and its version."""
        slot = self._rows.get(key)
        if slot is None:
            return PartRead(0, 0, self.drops, Row.empty())
        region = slot.region
        return PartRead(region.shape[0] // ENTRY_BYTES, slot.touches, self.drops, region_part(region, offset, limit))

    def read_all(self) -> RowBatch:
        """Every row, as one canonical batch (a copy)."""
        return self._gather(self.keys())

    def _gather(self, keys: list[RowKey]) -> RowBatch:
        """The stored rows ``keys`` as one batch (a copy: ``regions.gather_rows``)."""
        rows = self._rows
        return gather_rows(keys, [rows[k].region for k in keys])

    def digest(self, key: RowKey) -> RowDigest | None:
        """The row's digest for repair (see :class:`RowDigest`), or None if absent."""
        slot = self._rows.get(key)
        return None if slot is None else row_digest(slot)

    def rows_digest(self, row_column: ArrayLike, row_feature: ArrayLike) -> tuple[NDArray[np.uint8], int]:
        """Which of the given rows are stored (1/0 per key, in the given order), and one xxh3-64
        over the stored ones' region sizes (i64) then their regions, in that order: two stores
        give equal results exactly when they hold the same rows bit for bit (row_digest.py).
        For stream verification (streaming/sender.py)."""
        return rows_digest(self._rows, row_column, row_feature)

    # -- snapshot support (snapshot.py) -----------------------------------------------------------
    def freeze(self) -> FrozenRows:
        """An immutable view of the rows and applied set as they are now, for a snapshot written
        by another thread while applies go on (module docstring: frozen views). O(rows) pointer
        copy in C, no row data; call ``release()`` on it when done."""
        view = FrozenRows(dict(self._rows), self.applied.to_arrays(), self.applied.column_arrays(),
                          lambda: self._release_frozen(view))
        with self._frozen_lock:
            self._frozen = [*self._frozen, view]
        return view

    def _release_frozen(self, view: FrozenRows) -> None:
        with self._frozen_lock:  # (a new list: the applying thread may be iterating the old one)
            self._frozen = [v for v in self._frozen if v is not view]

    def _is_frozen(self, key: RowKey, slot: RowSlot) -> bool:
        """Whether a live frozen view holds ``slot`` (so it must be copied before a change). A
        row is copied once per view: the copy is not in the view and changes in place after."""
        return any(view.holds(key, slot) for view in self._frozen)

    def iter_slots(self) -> Iterator[tuple[RowKey, int, memoryview]]:
        """(key, applied-batch count, region) of every row, in key order."""
        for key in self.keys():
            slot = self._rows[key]
            yield key, slot.touches, slot.region.data

    def load_bulk(self, row_column: NDArray[np.uint64], row_feature: NDArray[np.uint64],
                  offsets: NDArray[np.int64], body: NDArray[np.uint8], touches: NDArray[np.uint64],
                  copy_rows: bool = False) -> None:
        """Install every row of a snapshot at once (the caller validated them: keys sorted and
        unique, offsets a partition of the entries into non-empty rows, ``body`` the rows' regions
        back to back). Only into an empty store; not capacity-checked (as ``load_row``).

        Each region is a view of ``body`` (no copy): the per-row work is one slice, one slot and
        one dict entry. The body stays allocated while any of its rows does (a row that grows or
        is dropped later does not return its share of it: docs/storage.md "Bulk load"), unless
        ``copy_rows``: each region is then a copy of its own (``storage.snapshot-load-copy-rows``:
        memory exactly as accounted, at the cost of one allocation and copy per row).
        """
        if self._rows:
            raise ValueError("load_bulk into a store that already holds rows")
        starts = (ENTRY_BYTES * offsets).tolist()
        # Millions of new container objects (slots, key tuples) would each count towards the
        # cyclic GC's thresholds and set off collections that walk all of them again and again
        # (a third of the time, measured); none of them can be garbage here.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            regions = map(body.__getitem__, map(slice, starts[:-1], starts[1:]))
            if copy_rows:
                regions = map(np.ndarray.copy, regions)
            slots = list(map(RowSlot, regions, repeat(None), touches.tolist()))
            self._rows.update(zip(zip(row_column.tolist(), row_feature.tolist()), slots))
        finally:
            if gc_was_enabled:
                gc.enable()
        self._version += 1
        self._region_bytes += ENTRY_BYTES * int(offsets[-1])
        self._entries += int(offsets[-1])
        self._count_sizes(np.diff(offsets))
        self._scan_index = (len(slots), row_column, row_feature)  # already sorted (the caller checked)

    def load_row(self, key: RowKey, region: NDArray[np.uint8], touches: int) -> None:
        """Install a row read from a snapshot (the caller validated it). Not capacity-checked:
        recovery must restore what was acknowledged; ``is_full`` then tells the operator."""
        if key in self._rows:
            raise ValueError(f"row {key} loaded twice")
        row = row_from_region(region)
        self._rows[key] = RowSlot(region, row, touches)
        self._version += 1
        self._region_bytes += region.nbytes
        self._entries += len(row)
        self._count_sizes(np.array([len(row)], np.int64))

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
        behind the cursor during a scan are not seen by it; rows added ahead of it are (the index
        is rebuilt whenever the row count changed).
        """
        cols, feats = self._sorted_keys()
        return scan_page(self._rows, cols, feats, after, limit_rows, limit_entries, max_examine, keep,
                         limit_bytes, after_entry)

    def _sorted_keys(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """Every row key as two arrays sorted by (column, feature), cached while the row count is
        unchanged (between drops rows are only added: an in-place merge or a grown region keeps its
        key; ``drop_columns`` resets the cache)."""
        cached = self._scan_index
        n = len(self._rows)
        if cached is None or cached[0] != n:
            cols = np.fromiter((k[0] for k in self._rows), np.uint64, n)
            feats = np.fromiter((k[1] for k in self._rows), np.uint64, n)
            order = np.lexsort((feats, cols))
            cached = (n, cols[order], feats[order])
            self._scan_index = cached
        return cached[1], cached[2]
