"""Writes logged during a fold and applied to the rows when it ends (the durable store's ``defer``).

Theory of operation
-------------------
A fold of the delta runs into the base (rowengine/engine.py) moves the whole base in a worker
thread: seconds at 10^8 entries per node, minutes at 10^9-10^10. The rows cannot take a write
meanwhile, and a write that waited for the fold held up its writer: the client reserves each
owner's share in that owner's byte budget before sending it (client/writes.py, "Backpressure"), so
a replica that does not answer for seconds stops the writer once its budget is full, even when the
other replicas make the quorum.

What an acknowledgement promises is that the batch is in the synced update log (recovery.py,
invariants): applying it to the rows may come later, as long as nothing reads those rows in
between and everything is applied in log order. So during a fold a batch of a writer is:

1. checked as ``ColumnStore.prepare`` checks it, except for what needs the rows: its id is looked up
   in the applied set (a batch applied before is a duplicate, acknowledged as before), and the
   capacity is checked against the most the batch could add (every entry a new key, every row a
   new row) on top of what is deferred already;
2. logged (with the writer's floor record, when it moves, after it, and a first floor record
   before it for a writer not tracked yet, exactly as a live apply logs them) and acknowledged
   once the log is synced;
3. kept (a copy: the caller's arrays are the transport's receive buffers) with the floor changes
   in log order, and applied when the fold ends, before any read is let through
   (storage/replication/background_fold.py): the rows and the applied set then are what applying
   each batch live, in log order, would have left, and a replay of the log after a crash at any
   point gives the same. Many batches are applied in a worker thread (``take``, ``apply_ops``,
   ``settle``) while new ones are still deferred, so that a long fold's writes are not applied on
   the event loop all at once; the last few on the owner's thread (``apply``).

Whoever follows what the store applies (a stream source forwarding the batches applied during a
join: storage/streaming/sender.py) sets ``on_applied``: it is told of each deferred batch when it
is applied to the rows, not when it is logged, as a live apply tells it.

A batch that cannot be deferred (its id applied in part before, or deferred already: a retry; its
largest growth past the capacity; more than ``max_bytes`` deferred) is refused by ``defer`` (None,
nothing changed), and the caller waits for the fold and applies it then, as before. Floors do not
cut a deferred batch out: ``apply`` applies a batch before any floor change logged after it.
Reads of the rows wait for the fold and these applies (or go to another replica: client/reads.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.engine.column_store import (
    APPLIED_ID_BYTES,
    ENTRY_BYTES,
    ROW_OVERHEAD_BYTES,
    ColumnStore,
    check_batch_id,
)
from giaannd.storage.engine.update_log import UpdateLog

__all__ = ["DEFAULT_DEFER_BYTES", "Deferred", "DeferredApplies"]

#: Bytes of batches a fold may hold logged but not applied; past them, writes wait for the fold.
DEFAULT_DEFER_BYTES: Final = 256 << 20


@dataclass(frozen=True, slots=True)
class _Batch:
    batch_id: BatchId
    batch: RowBatch
    epoch: str
    #: the most it adds to the store's used bytes (the capacity check's bound)
    growth: int


@dataclass(frozen=True, slots=True)
class _Floor:
    """A writer's floor change: ``logged`` (a floor record: ``ColumnStore.advance_floor``) or a
    promise (``AppliedSet.promise``, not logged)."""

    writer: int
    floor: int
    logged: bool


#: What ``take`` hands over: batches and floor changes, in log order.
Ops = list[_Batch | _Floor]
#: What ``apply_ops`` applied, for ``on_applied``: (id, the part applied, the writer's epoch).
Told = list[tuple[BatchId, RowBatch, str]]


@dataclass(frozen=True, slots=True)
class Deferred:
    """What ``DeferredApplies.defer`` did: ``applied`` False for a duplicate (nothing kept);
    ``seq``: acknowledge once the log is synced through it."""

    applied: bool
    seq: int


class DeferredApplies:
    """Batches logged during a fold, applied when it ends (module docstring), for one store and its
    update log. Every method runs on the thread that writes the store; ``apply`` while nothing
    else uses the rows (the fold has ended, writes are still held)."""

    def __init__(self, store: ColumnStore, log: UpdateLog, max_bytes: int = DEFAULT_DEFER_BYTES) -> None:
        self.store = store
        self.log = log
        self.max_bytes = max_bytes
        #: told of every batch ``apply`` applies: (id, what it applied, the writer's epoch)
        self.on_applied: Callable[[BatchId, RowBatch, str], None] | None = None
        self._ops: Ops = []
        #: lists handed out by ``take`` and not settled yet
        self._taken = 0
        #: ids of the batches kept or being applied (a retry of one waits for the fold)
        self._ids: set[BatchId] = set()
        self._tracked: set[int] = set()
        self._floors: dict[int, int] = {}
        self._bytes = 0
        self._growth = 0
        #: batches deferred and applied so far (counters for tests and metrics)
        self.deferred = 0
        self.applied = 0

    def __len__(self) -> int:
        """Batches kept, not applied yet (nor being applied)."""
        return sum(isinstance(op, _Batch) for op in self._ops)

    @property
    def held_bytes(self) -> int:
        """Bytes of the batches kept or being applied (``max_bytes`` bounds it)."""
        return self._bytes

    def defer(self, batch_id: BatchId, batch: RowBatch, writer_floor: int = 0, epoch: str = "") -> Deferred | None:
        """Log ``batch`` (canonical, checked by the caller) and the writer's ``writer_floor`` now,
        keep them for ``apply`` (module docstring, steps 1-3; ``epoch``, the writer's placement
        epoch, goes to ``on_applied``). None, with nothing logged or kept: it cannot be deferred,
        the caller waits for the fold.

        Raises:
            ValueError: the batch id is out of range.
            OSError: a log write failed (what was logged before it is kept, as a live apply would
                have applied it: the floor record of a new writer).
        """
        batch_id = check_batch_id(batch_id)
        applied = self.store.applied
        done = applied.columns(batch_id)
        if done is not None and (done.shape[0] or batch_id in self._ids):
            return None  # another share of it came before: the live path sorts out which columns
        writer = batch_id.writer
        if done is None:  # applied before: a duplicate (its floor still counts)
            return Deferred(False, self._floor(writer, writer_floor, self.log.last_seq))
        # the ids as a live apply counts them (two for a writer new here whose seq is not 1)
        growth = (APPLIED_ID_BYTES * self.store.ids_added(batch_id) + ENTRY_BYTES * batch.num_entries
                  + ROW_OVERHEAD_BYTES * batch.num_rows)
        if (self.store.used_bytes + self._growth + growth > self.store.capacity_bytes
                or self._bytes + batch.nbytes > self.max_bytes):
            return None
        if not applied.tracked(writer) and writer not in self._tracked:  # as DurableStore.apply(track=True)
            self.log.append_floor(writer, 0)
            self._ops.append(_Floor(writer, 0, False))
            self._tracked.add(writer)
        kept = batch.copy()
        seq = self.log.append_batch(batch_id, kept)
        self._ops.append(_Batch(batch_id, kept, epoch, growth))
        self._ids.add(batch_id)
        self._bytes += kept.nbytes
        self._growth += growth
        self.deferred += 1
        return Deferred(True, self._floor(writer, writer_floor, seq))

    def _floor(self, writer: int, floor: int, seq: int) -> int:
        """The writer's floor after its batch, as ``StorageRequests.apply`` does it live: logged when
        it moves past the floor (the applied set's, or one deferred), else a promise; returns the
        seq to acknowledge at."""
        if floor > max(self.store.applied.floor(writer), self._floors.get(writer, 0)):
            seq = max(seq, self.log.append_floor(writer, floor))
            self._floors[writer] = floor
            self._ops.append(_Floor(writer, floor, True))
        else:
            self._ops.append(_Floor(writer, floor, False))
        return seq

    def apply(self) -> int:
        """Apply every batch and floor change kept, in log order (``take``, ``apply_ops``,
        ``settle`` in one go); returns the batches applied."""
        ops = self.take()
        told = self.apply_ops(ops)
        self.settle(ops, told)
        return len(told)

    def take(self) -> Ops:
        """Hand over what is kept, in log order, for ``apply_ops``; what ``defer`` keeps from now on
        comes after it. Its ids stay known (a retry waits) and its bytes counted until ``settle``."""
        ops, self._ops = self._ops, []
        self._taken += 1
        return ops

    def apply_ops(self, ops: Ops) -> Told:
        """Apply ``ops`` (from ``take``) to the rows, in order: may run in a worker thread while the
        owner's thread goes on deferring (``defer`` only reads the applied set and the store's
        size, and logs; a batch's own id is never applied while its retry is looked up: the id
        stays in ``_ids`` until ``settle``). Nothing else may read or write the rows meanwhile.
        Returns what was applied, for ``settle``."""
        told: Told = []
        store = self.store
        for op in ops:
            if isinstance(op, _Floor):
                if op.logged:
                    store.advance_floor(op.writer, op.floor)
                else:
                    store.applied.promise(op.writer, op.floor)
                continue
            prepared = store.prepare(op.batch_id, op.batch, validate=False, enforce_capacity=False)
            if prepared is not None:
                store.commit(prepared)
                told.append((op.batch_id, prepared.batch, op.epoch))
        return told

    def settle(self, ops: Ops, told: Told) -> None:
        """After ``apply_ops(ops)``, on the owner's thread: forget their ids and bytes, and tell
        ``on_applied`` what was applied, in order."""
        self._taken -= 1
        for op in ops:
            if isinstance(op, _Batch):
                self._ids.discard(op.batch_id)
                self._bytes -= op.batch.nbytes
                self._growth -= op.growth
        if not self._ops and not self._taken:  # the applied set has caught up with every floor
            self._tracked.clear()
            self._floors.clear()
        self.applied += len(told)
        if self.on_applied is not None:
            for batch_id, part, epoch in told:
                self.on_applied(batch_id, part, epoch)
