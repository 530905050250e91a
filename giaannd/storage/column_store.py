"""The in-RAM column store: one contiguous region per (column, feature) row (ARCHITECTURE §8).

Theory of operation
-------------------
State: ``rows`` (row key -> slot: the row's region, its four array views, the number of applied
batches that touched it), the :class:`AppliedSet` of batch ids, and the bytes in use.

- A row of n entries lives in one ``uint8`` region of ``ENTRY_BYTES * n`` bytes laid out
  ``target_column u64[n] | target_feature u64[n] | strength f32[n] | segment u8[n]`` (widest first, so
  every view is naturally aligned). One region = one contiguous buffer to send for an inference read
  of that row (``row_region``) and one ``readinto`` when a snapshot is loaded.
- ``apply(batch_id, batch)``: a batch id already applied is ignored (returns False). Otherwise every
  row of the batch is *planned* first (row_merge.py) — pure, which yields the exact memory growth —
  then refused as a whole with :class:`StoreFullError` if it does not fit, else committed. So a
  refused or invalid batch leaves the store exactly as it was.
- Memory accounting: the regions' bytes plus ``ROW_OVERHEAD_BYTES`` per row plus
  ``APPLIED_ID_BYTES`` per stored batch id, against ``capacity_bytes``.

The store is synchronous and does no I/O: durability (update log, snapshots) wraps it in
recovery.py, and the asyncio service is glue on top of that.

Concurrency: single-threaded by contract. Views returned by ``row``/``row_region`` are live: an
in-place merge-add changes their strengths, a growing merge replaces the region (the old views keep
the old data alive). ``read_rows`` returns copies, safe to send while applies continue.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import xxhash
from numpy.typing import ArrayLike, NDArray

from giaannd.model.rows import Row, RowBatch, RowKey
from giaannd.storage.applied_set import AppliedSet, BatchId
from giaannd.storage.errors import StoreFullError
from giaannd.storage.row_merge import MergePlan, add_in_place, merge_into, plan_merge

__all__ = [
    "APPLIED_ID_BYTES",
    "ENTRY_BYTES",
    "ROW_OVERHEAD_BYTES",
    "ColumnStore",
    "PreparedApply",
    "RowDigest",
    "StoreUsage",
    "row_from_region",
]

#: Bytes per entry in a region: u64 + u64 + f32 + u8, no padding.
ENTRY_BYTES = 21
#: Python bookkeeping per row (dict entry, key tuple, slot, Row and four ndarray views): 860 bytes
#: measured with tracemalloc on CPython 3.11 / numpy 2.4, rounded up.
ROW_OVERHEAD_BYTES = 1024
#: Per stored batch id in the applied set (a set/dict entry and an int), rounded up.
APPLIED_ID_BYTES = 96


def row_from_region(region: NDArray[np.uint8]) -> Row:
    """The four array views of a region (see the module docstring for the layout)."""
    if region.shape[0] % ENTRY_BYTES:
        raise ValueError(f"region of {region.shape[0]} bytes is not a whole number of entries")
    n = region.shape[0] // ENTRY_BYTES
    return Row(
        segment=region[20 * n : 21 * n],
        target_column=region[0 : 8 * n].view(np.uint64),
        target_feature=region[8 * n : 16 * n].view(np.uint64),
        strength=region[16 * n : 20 * n].view(np.float32),
    )


def _new_region(n: int) -> tuple[NDArray[np.uint8], Row]:
    region = np.empty(ENTRY_BYTES * n, np.uint8)
    return region, row_from_region(region)


@dataclass(slots=True)
class _Slot:
    region: NDArray[np.uint8]
    row: Row
    touches: int


_Plan = tuple[RowKey, Row, _Slot | None, MergePlan]


@dataclass(frozen=True, slots=True)
class PreparedApply:
    """A checked, planned apply (``ColumnStore.prepare``); opaque to callers."""

    batch_id: BatchId
    plans: list[_Plan]
    version: int


@dataclass(frozen=True, slots=True)
class RowDigest:
    """What repair compares between replicas.

    ``keys``: xxh3_64 of the row's key arrays (order-independent of how the batches were applied);
    ``strength``: xxh3_64 of the strengths (float sums may differ in the last bit between replicas
    that applied the same batches in a different order); ``batches``: applied batches touching it.
    """

    keys: int
    strength: int
    batches: int


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
        self._rows: dict[RowKey, _Slot] = {}
        self._region_bytes = 0
        self._entries = 0
        self._version = 0  # bumped by every commit, so a stale PreparedApply is caught

    # -- accounting -------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._region_bytes + ROW_OVERHEAD_BYTES * len(self._rows) + APPLIED_ID_BYTES * len(self.applied)

    def usage(self) -> StoreUsage:
        return StoreUsage(self.used_bytes, self.capacity_bytes, len(self._rows), self._entries, len(self.applied))

    @property
    def is_full(self) -> bool:
        return self.usage().is_full

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
        if batch_id in self.applied:
            return None
        if validate:
            batch.validate()
        plans = self._plan(batch)
        growth = APPLIED_ID_BYTES + sum(
            ENTRY_BYTES * plan.new_count + (ROW_OVERHEAD_BYTES if slot is None else 0)
            for _, _, slot, plan in plans
        )
        if enforce_capacity and self.used_bytes + growth > self.capacity_bytes:
            raise StoreFullError(growth, self.used_bytes, self.capacity_bytes)
        return PreparedApply(batch_id, plans, self._version)

    def commit(self, prepared: PreparedApply) -> None:
        """Carry out a plan from ``prepare``; no other write may come between the two."""
        if prepared.version != self._version:
            raise RuntimeError("stale PreparedApply: the store changed after prepare()")
        self._version += 1
        self.applied.add(prepared.batch_id)
        for key, delta, slot, plan in prepared.plans:
            self._commit(key, delta, slot, plan)

    def _plan(self, batch: RowBatch) -> list[_Plan]:
        plans: list[_Plan] = []
        for i in range(batch.num_rows):
            delta = batch.row(i)
            if len(delta) == 0:
                continue
            key = batch.key(i)
            slot = self._rows.get(key)
            plans.append((key, delta, slot, plan_merge(slot.row if slot else Row.empty(), delta)))
        return plans

    def _commit(self, key: RowKey, delta: Row, slot: _Slot | None, plan: MergePlan) -> None:
        if slot is not None and plan.in_place:
            add_in_place(slot.row, delta, plan)
            slot.touches += 1
            return
        base = slot.row if slot is not None else Row.empty()
        region, row = _new_region(len(base) + plan.new_count)
        merge_into(base, delta, plan, row)
        self._region_bytes += region.nbytes - (slot.region.nbytes if slot else 0)
        self._entries += plan.new_count
        self._rows[key] = _Slot(region, row, (slot.touches if slot else 0) + 1)

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
        return sorted(self._rows)

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
        wanted = sorted(set(zip(rc.tolist(), rf.tolist())))
        return self._gather([k for k in wanted if k in self._rows])

    def read_all(self) -> RowBatch:
        """Every row, as one canonical batch (a copy)."""
        return self._gather(self.keys())

    def _gather(self, keys: list[RowKey]) -> RowBatch:
        if not keys:
            return RowBatch.empty()
        rows = [self._rows[k].row for k in keys]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        return RowBatch(
            np.array([k[0] for k in keys], np.uint64),
            np.array([k[1] for k in keys], np.uint64),
            offsets,
            np.concatenate([r.segment for r in rows]),
            np.concatenate([r.target_column for r in rows]),
            np.concatenate([r.target_feature for r in rows]),
            np.concatenate([r.strength for r in rows]),
        )

    def digest(self, key: RowKey) -> RowDigest | None:
        """The row's digest for repair (see :class:`RowDigest`), or None if absent."""
        slot = self._rows.get(key)
        if slot is None:
            return None
        n = len(slot.row)
        region = slot.region
        keys = xxhash.xxh3_64()
        keys.update(region[: 16 * n].data)
        keys.update(region[20 * n :].data)
        return RowDigest(keys.intdigest(), xxhash.xxh3_64_intdigest(region[16 * n : 20 * n].data), slot.touches)

    # -- snapshot support (snapshot.py) -----------------------------------------------------------
    def iter_slots(self) -> Iterator[tuple[RowKey, int, memoryview]]:
        """(key, applied-batch count, region) of every row, in key order."""
        for key in self.keys():
            slot = self._rows[key]
            yield key, slot.touches, slot.region.data

    def load_row(self, key: RowKey, region: NDArray[np.uint8], touches: int) -> None:
        """Install a row read from a snapshot (the caller validated it). Not capacity-checked:
        recovery must restore what was acknowledged; ``is_full`` then tells the operator."""
        if key in self._rows:
            raise ValueError(f"row {key} loaded twice")
        row = row_from_region(region)
        self._rows[key] = _Slot(region, row, touches)
        self._version += 1
        self._region_bytes += region.nbytes
        self._entries += len(row)
