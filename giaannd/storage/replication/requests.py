"""The storage service's request logic without I/O: decode → check → serve (ARCHITECTURE §8).

Theory of operation
-------------------
``StorageRequests.handle(payload, bulk)`` is the whole protocol of a storage node in one synchronous
call. It decodes the payload (``protocol.decode_request``), checks the bulk buffers against the
named limits and the RowBatch canonical form, checks ownership under this node's placement, and then
either answers (reads, digests, usage, applied-mask) or *steps* a write:

- ``ApplyBatch``: ``DurableStore.apply`` appends the batch to the update log and applies it in RAM
  (idempotent by batch id; refused with nothing changed if the store is full), then the writer's
  floor is logged if it moved. The result is ``WaitDurable(seq, ...)``: the caller (service.py)
  must not send the ack until the log is synced through ``seq`` (group commit);
- ``ApplyBatch`` with ``hint_for``: the batch is appended to the hint log for that node; the result
  is ``WaitHintSynced(target, ...)``: ack once that hint log is synced;
- ``RegisterPrepare`` / ``RegisterAccept``: the register acceptor's rule (register_store.py) on the
  key's state; a change is ``WaitRegistersSynced(seq, ...)`` (answer once the register log is synced
  through it), a refusal is answered at once (``RegisterConflict``). ``RegisterGet`` is answered at
  once. A node answers only for keys it owns under its placement (``NotOwner``).

Every failure is a typed error *reply* (``BadRequest``, ``StoreFull``, ``NotOwner``, ``Unavailable``);
the order decode → limits → validate → mutate means peer garbage never changes state.

Writes (batches, hints, vocabulary) pass the node's ``WriteGuard`` first (disk_full.py): while the
disk is full they are refused with ``Unavailable`` before touching a file, and a write that fails
with an ``OSError`` is reported to the guard (which logs, rate-limited, and may switch to refusing)
instead of being logged here once per request.

**During a fold** (storage/replication/background_fold.py: a worker thread moves the rows, seconds
at 10^8 entries) the service asks ``serve_during_fold`` instead: vocabulary and register requests
are served as ever (not rows); a ``ReadRows`` with ``busy_ok`` is answered ``Unavailable`` at once
(the client reads another replica); an ``ApplyBatch`` is logged and acknowledged now and applied
to the rows when the fold ends (``DurableStore.defer``, storage/engine/deferred_applies.py), a
hint held as ever; anything else, and a batch that cannot be deferred, waits for the fold.

Everything that decides what a request does lives in this file; the service only owns the clock,
threads, transport and locks. Not thread-safe: call from one thread (the event loop).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import xxhash

from giaannd import protocol as p
from giaannd.cluster.view import ClusterView
from giaannd.config import DEFAULT_READ_CHUNK_BYTES
from giaannd.model.rows import Row, RowBatch
from giaannd.protocol import BatchId, scan_chain_mask
from giaannd.storage.engine.column_store import ENTRY_BYTES, ROW_OVERHEAD_BYTES
from giaannd.storage.engine.disk_usage import DiskUsage
from giaannd.storage.engine.errors import StoreFullError
from giaannd.storage.engine.recovery import DurableStore
from giaannd.storage.engine.register_store import RegisterLogCorrupt, RegisterState, RegisterStore, RegisterStoreFull
from giaannd.storage.engine.row_digest import ROW_DIGEST_VERSIONS, fold_row_digests_v2, row_digests
from giaannd.storage.engine.vocab_store import VocabCollision, VocabStore
from giaannd.storage.replication.hints import HintSpaceFull, HintStore

__all__ = ["FOLDING_MESSAGE", "Answer", "StorageCounters", "StorageRequests", "WaitDurable", "WaitHintSynced",
           "WaitRegistersSynced", "WaitVocabSynced", "WriteGuard", "fold_row_digest"]

#: What a ``ReadRows`` with ``busy_ok`` gets while a fold moves the rows (protocol.py, "Reads during a fold").
FOLDING_MESSAGE = "folding: this node's rows are being moved; read them from another replica"
#: Requests that never touch the rows (their own stores): served while a fold moves the rows.
_NOT_ROWS = (p.PutVocab, p.GetVocab, p.RegisterGet, p.RegisterPrepare, p.RegisterAccept, p.HeldHints)

@dataclass
class StorageCounters:
    """Counters for /metrics and tests (``applies / fsync_batches`` is the group-commit ratio)."""

    reads: int = 0
    #: ReadRows with ``busy_ok`` answered Unavailable at once because a fold was moving the rows
    reads_redirected: int = 0
    rows_read: int = 0
    bytes_read: int = 0
    applies: int = 0
    #: of ``applies``, those logged during a fold and applied to the rows when it ended
    applies_deferred: int = 0
    applies_duplicate: int = 0
    bytes_applied: int = 0
    fsync_batches: int = 0
    hints_received: int = 0
    hints_delivered: int = 0
    vocab_added: int = 0
    register_changes: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """Send this reply now."""

    reply: p.Reply
    bulk: Sequence[np.ndarray] = ()


@dataclass(frozen=True)
class WaitDurable:
    """Reply ``ack`` once the update log is durable through ``seq``."""

    seq: int
    ack: p.ApplyAck


@dataclass(frozen=True)
class WaitHintSynced:
    """Reply ``ack`` once ``target``'s hint log is synced."""

    target: str
    ack: p.ApplyAck


@dataclass(frozen=True)
class WaitVocabSynced:
    """Reply ``ack`` once the vocab log is synced through ``offset``."""

    offset: int
    ack: p.VocabAck


@dataclass(frozen=True)
class WaitRegistersSynced:
    """Reply ``reply`` once the register log is durable through change ``seq``."""

    seq: int
    reply: p.RegisterValue | p.RegisterAccepted


Step = Answer | WaitDurable | WaitHintSynced | WaitVocabSynced | WaitRegistersSynced


class WriteGuard(Protocol):
    """Whether writes are refused before they touch a file, and where write errors go
    (``disk_full.DiskWatch``)."""

    @property
    def full(self) -> bool:
        """Refuse every write (the disk is full)."""

    def refuse(self) -> str:
        """Count one refused write; returns the ``Unavailable`` message."""

    def write_failed(self, op: str, exc: OSError, detail: str = "") -> None:
        """A write of ``op`` failed with ``exc`` (the request answers ``Unavailable``)."""


class _Unguarded:
    """No guard: never refuses, drops write errors (the reply carries them)."""

    full = False

    def refuse(self) -> str:
        return "writes refused"

    def write_failed(self, op: str, exc: OSError, detail: str = "") -> None:
        pass


_U64_MASK = (1 << 64) - 1
_ROW_DIGEST = struct.Struct("<QQQ")


def fold_row_digest(column: int, feature: int, digest: int) -> int:
    """One row's share of a column digest (``ColumnInfoPage``): xxh3_64 of (column, feature,
    row digest). Column digests are the sum of these mod 2**64: order-free, so two replicas holding
    the same rows agree however their pages were cut, and adding pages up is a plain sum."""
    return xxhash.xxh3_64_intdigest(_ROW_DIGEST.pack(column, feature, digest))


def _never(_target: str) -> bool:
    return False


def _text(message: str) -> str:
    return message[: p.MAX_TEXT_CHARS]


class StorageRequests:
    """The request core of one storage node (module docstring).

    Args:
        store, hints: the node's durable store and hint log.
        node_name: this node's member name ("" for a standalone node).
        topology: returns the current topology (None: standalone, owns every row).
        on_count: told about every counter increment (metrics export), as (name, amount).
        disk: measures the node's storage files for ``GetUsage`` (the glue's, since it does
            I/O); None answers zeros.
        read_chunk_bytes: entries x 21 of one read reply (``storage.read-chunk-bytes``): a chunked
            ReadRows answers at most this much, a ReadRowPart at most this much of its row.
    """

    def __init__(self, store: DurableStore, hints: HintStore, node_name: str,
                 topology: Callable[[], ClusterView | None],
                 on_count: Callable[[str, int], None] | None = None,
                 disk: Callable[[], DiskUsage] | None = None,
                 read_chunk_bytes: int = DEFAULT_READ_CHUNK_BYTES,
                 removed_for_good: Callable[[str], bool] | None = None) -> None:
        self.store, self.hints, self.node_name = store, hints, node_name
        #: a hint target the node's delivery would drop at once (the service's rule, service.py)
        self._removed_for_good = removed_for_good or _never
        #: entries per read reply / row part (at least 1, at most the protocol's part cap)
        self.read_chunk_entries = max(1, min(read_chunk_bytes // ENTRY_BYTES, p.MAX_READ_PART_ENTRIES))
        self._topology = topology
        self._on_count = on_count
        self._disk = disk
        self.counters = StorageCounters()
        #: set while the service stops: new writes get Unavailable (reads still served)
        self.refuse_writes = False
        #: the node's vocabulary table (vocab_store.py); None: PutVocab/GetVocab get Unavailable
        self.vocab: VocabStore | None = None
        #: refuses writes while the disk is full and hears about write errors (disk_full.py)
        self.guard: WriteGuard = _Unguarded()
        #: the node's register acceptors (register_store.py); None: Register* get Unavailable
        self.registers: RegisterStore | None = None

    # -- entry point ------------------------------------------------------------------------------
    def handle(self, payload: bytes | memoryview, bulk: Sequence[np.ndarray]) -> Step:
        """One request → an answer now, or a write step to finish once durable."""
        msg = self.parse(payload)
        return msg if isinstance(msg, Answer) else self.serve(msg, bulk)

    def parse(self, payload: bytes | memoryview) -> p.Request | Answer:
        """Decode (a BadRequest answer for garbage). Split from ``serve`` so the service can hold
        store writes back while a snapshot runs, without holding reads back."""
        try:
            return p.decode_request(payload)
        except p.ProtocolViolation as exc:
            return self.error(p.BadRequest(_text(str(exc))))

    def serve_during_fold(self, msg: p.Request, bulk: Sequence[np.ndarray]) -> Step | None:
        """``serve`` while a fold moves the rows (module docstring, "During a fold"); None, nothing
        done, for a request that must wait for the fold (then ``serve`` it)."""
        if isinstance(msg, _NOT_ROWS):
            return self.serve(msg, bulk)
        if isinstance(msg, p.ReadRows) and msg.busy_ok:
            self.count("reads_redirected")
            return Answer(p.Unavailable(FOLDING_MESSAGE))
        if not isinstance(msg, p.ApplyBatch):
            return None
        try:
            checked = self._checked(msg, bulk)
            if not isinstance(checked, tuple):
                return checked
            return self._defer(msg, *checked)
        except p.ProtocolViolation as exc:
            return self.error(p.BadRequest(_text(str(exc))))

    def serve(self, msg: p.Request, bulk: Sequence[np.ndarray]) -> Step:
        try:
            if isinstance(msg, p.ReadRows):
                return self.read_chunked(bulk) if msg.chunked else self.read(bulk)
            if isinstance(msg, p.ReadRowPart):
                return self.read_part(msg)
            if isinstance(msg, p.ApplyBatch):
                return self.apply(msg, bulk)
            if isinstance(msg, p.RowDigests):
                return self.digests(bulk)
            if isinstance(msg, p.GetUsage):
                return self.usage()
            if isinstance(msg, p.ScanRows):
                return self.scan(msg)
            if isinstance(msg, p.PutVocab):
                return self.put_vocab(msg)
            if isinstance(msg, p.GetVocab):
                return self.get_vocab(msg)
            if isinstance(msg, p.ColumnInfo):
                return self.column_info(msg)
            if isinstance(msg, p.RegisterGet | p.RegisterPrepare | p.RegisterAccept):
                return self.register(msg)
            if isinstance(msg, p.HeldHints):
                return self.held_hints(msg)
            return self.batches_applied(msg)
        except p.ProtocolViolation as exc:
            return self.error(p.BadRequest(_text(str(exc))))

    def error(self, msg: p.ErrorReply) -> Answer:
        kind = type(msg).__name__
        self.counters.errors[kind] = self.counters.errors.get(kind, 0) + 1
        if self._on_count is not None:
            self._on_count(f"error:{kind}", 1)
        return Answer(msg)

    def count(self, key: str, n: int = 1) -> None:
        setattr(self.counters, key, getattr(self.counters, key) + n)
        if self._on_count is not None:
            self._on_count(key, n)

    # -- reads ------------------------------------------------------------------------------------
    def not_owner(self, row_column: np.ndarray) -> p.NotOwner | None:
        """NotOwner unless this node owns every row's column under its placement (standalone: all)."""
        topo = self._topology()
        if topo is None or not self.node_name or row_column.size == 0:
            return None
        if self.node_name not in topo:  # ring mode: standby (joining / decommissioned) owns nothing
            return p.NotOwner(topo.epoch, "standby: owns no columns") if topo.ring_mode else None
        placement = topo.placement
        me = placement.names.index(self.node_name)
        owned = (placement.owner_indices(row_column) == me).any(axis=1)
        if bool(owned.all()):
            return None
        return p.NotOwner(placement.epoch, f"{int((~owned).sum())} of {owned.size} rows not owned here")

    def read(self, bulk: Sequence[np.ndarray]) -> Answer:
        cols, feats = p.check_keys(bulk, p.MAX_READ_ROWS)
        if (err := self.not_owner(cols)) is not None:
            return self.error(err)
        batch = self.store.store.read_rows(cols, feats)
        self.count("reads")
        self.count("rows_read", batch.num_rows)
        self.count("bytes_read", batch.nbytes)
        return Answer(p.RowsReply(), batch.buffers())

    def read_chunked(self, bulk: Sequence[np.ndarray]) -> Answer:
        """A ReadRows of a client that reads large rows by parts: rows up to the read chunk, rows
        larger than it listed (protocol "Rows of any size")."""
        cols, feats = p.check_keys(bulk, p.MAX_READ_ROWS)
        if (err := self.not_owner(cols)) is not None:
            return self.error(err)
        res = self.store.store.read_bounded(cols, feats, self.read_chunk_entries, p.MAX_LARGE_ROWS)
        batch = res.batch
        self.count("reads")
        self.count("rows_read", batch.num_rows)
        self.count("bytes_read", batch.nbytes)
        nc, nf = res.stopped_after if res.stopped_after is not None else (0, 0)
        return Answer(p.RowsReply(res.stopped_after is not None, nc, nf, res.large), batch.buffers())

    def read_part(self, msg: p.ReadRowPart) -> Answer:
        """Entries of one large row from ``msg.offset`` (at most the read chunk), with its version."""
        if (err := self.not_owner(np.array([msg.column], np.uint64))) is not None:
            return self.error(err)
        res = self.store.store.read_part((msg.column, msg.feature), msg.offset,
                                         min(msg.limit, self.read_chunk_entries))
        part = res.part
        self.count("reads")
        self.count("bytes_read", part.nbytes)
        return Answer(p.RowPart(res.entries, res.touches, res.drops, msg.offset),
                      [part.segment, part.target_column, part.target_feature, part.strength])

    def digests(self, bulk: Sequence[np.ndarray]) -> Answer:
        cols, feats = p.check_keys(bulk, p.MAX_DIGEST_ROWS)
        n = cols.shape[0]
        present = np.zeros(n, np.uint8)
        keys, strength, batches = (np.zeros(n, np.uint64) for _ in range(3))
        for i, key in enumerate(zip(cols.tolist(), feats.tolist())):
            d = self.store.store.digest(key)
            if d is not None:
                present[i], keys[i], strength[i], batches[i] = 1, d.keys, d.strength, d.batches
        return Answer(p.DigestsReply(), [present, keys, strength, batches])

    def usage(self) -> Answer:
        u = self.store.store.usage()
        d = self._disk() if self._disk is not None else DiskUsage(0, 0, 0)
        return Answer(p.UsageReply(u.capacity_bytes, u.used_bytes, u.num_rows, u.num_entries,
                                   u.is_full or self.guard.full, self.hints.held,
                                   d.files_bytes, d.free_bytes, d.total_bytes,
                                   self.store.store.row_size_log2()))

    def batches_applied(self, msg: p.BatchesApplied) -> Answer:
        if len(msg.seqs) > p.MAX_QUERY_SEQS:
            raise p.ProtocolViolation(f"{len(msg.seqs)} seqs in one query; the limit is {p.MAX_QUERY_SEQS}")
        applied = self.store.store.applied
        return Answer(p.AppliedMask([BatchId(msg.writer, s) in applied for s in msg.seqs]))

    def held_hints(self, msg: p.HeldHints) -> Answer:
        """Which of the seqs are still held here as hints for the target (hints.py). A "no" needs
        no sync: the hint left the log only once delivered or re-split durably, or dropped."""
        if len(msg.seqs) > p.MAX_QUERY_SEQS:
            raise p.ProtocolViolation(f"{len(msg.seqs)} seqs in one query; the limit is {p.MAX_QUERY_SEQS}")
        return Answer(p.HeldMask([self.hints.holds(msg.target, BatchId(msg.writer, s)) for s in msg.seqs]))

    # -- writes -----------------------------------------------------------------------------------
    def _checked(self, msg: p.ApplyBatch, bulk: Sequence[np.ndarray]) -> Step | tuple[BatchId, RowBatch]:
        """An ``ApplyBatch``'s checks: its answer (a refusal, or a hint held), or its batch to apply."""
        if self.refuse_writes:
            return self.error(p.Unavailable("storage service is stopping"))
        if self.guard.full:
            return self.error(p.Unavailable(_text(self.guard.refuse())))
        batch = p.check_batch(bulk)
        p.check_increments(batch)
        batch_id = BatchId(msg.writer, msg.seq)
        if msg.hint_for is not None and msg.hint_for != self.node_name:
            return self.hold_hint(msg.hint_for, batch_id, batch, msg.placement_epoch)
        if (err := self.not_owner(batch.row_column)) is not None:
            return self.error(err)
        return batch_id, batch

    def apply(self, msg: p.ApplyBatch, bulk: Sequence[np.ndarray]) -> Step:
        """Log + apply a batch (or hold it as a hint); the ack waits for durability (module docstring)."""
        checked = self._checked(msg, bulk)
        if not isinstance(checked, tuple):
            return checked
        batch_id, batch = checked
        applied = self.store.store.applied
        try:
            # track=True: another share of one of this writer's batch ids (a hint re-split, a retry
            # after a placement change) applies the columns this node lacks instead of being
            # ignored (applied_set.py, "Which columns").
            result = self.store.apply(batch_id, batch, validate=False, track=True)  # check_batch validated it
            seq = result.seq
            if msg.writer_floor > applied.floor(msg.writer):
                seq = max(seq, self.store.advance_floor(msg.writer, msg.writer_floor))
            else:
                applied.promise(msg.writer, msg.writer_floor)  # drops settled seqs' columns; not logged
        except StoreFullError as exc:
            return self.error(p.StoreFull(exc.needed_bytes, exc.used_bytes, exc.capacity_bytes))
        except ValueError as exc:
            return self.error(p.BadRequest(_text(str(exc))))
        except OSError as exc:
            self.guard.write_failed("update_log", exc)
            return self.error(p.Unavailable(_text(f"update log write failed: {exc}")))
        if result.applied:
            self.count("applies")
            self.count("bytes_applied", batch.nbytes)
        else:
            self.count("applies_duplicate")
        return WaitDurable(seq, p.ApplyAck(durable=True, applied=result.applied))

    def _defer(self, msg: p.ApplyBatch, batch_id: BatchId, batch: RowBatch) -> Step | None:
        try:
            deferred = self.store.defer(batch_id, batch, msg.writer_floor, msg.placement_epoch or "")
        except ValueError as exc:
            return self.error(p.BadRequest(_text(str(exc))))
        except OSError as exc:
            self.guard.write_failed("update_log", exc)
            return self.error(p.Unavailable(_text(f"update log write failed: {exc}")))
        if deferred is None:
            return None
        if deferred.applied:
            self.count("applies")
            self.count("applies_deferred")
            self.count("bytes_applied", batch.nbytes)
        else:
            self.count("applies_duplicate")
        return WaitDurable(deferred.seq, p.ApplyAck(durable=True, applied=deferred.applied))

    def hold_hint(self, target: str, batch_id: BatchId, batch: RowBatch, epoch: str = "") -> Step:
        if self._removed_for_good(target):
            # Held and dropped at once, as the next delivery round would drop it (hint_delivery.py,
            # "A target removed for good"): no durable write for nothing. Not refused: every holder
            # would refuse, and the writer would strand the share and keep its seq unsettled; this
            # way it records the holder, whose HeldHints "no" settles the seq.
            self.count("hints_received")
            return Answer(p.ApplyAck(durable=True, applied=False, hinted=True))
        try:
            added = self.hints.add(target, batch_id, batch.copy(), epoch)  # (hints outlive the receive buffers)
        except HintSpaceFull as exc:
            return self.error(p.Unavailable(str(exc)))
        except ValueError as exc:
            return self.error(p.BadRequest(_text(str(exc))))
        except OSError as exc:
            self.guard.write_failed("hint_log", exc)
            return self.error(p.Unavailable(_text(f"hint log write failed: {exc}")))
        if added:
            self.count("hints_received")
        return WaitHintSynced(target, p.ApplyAck(durable=True, applied=added, hinted=True))

    # -- scan (docs/replication.md "Scan") -------------------------------------------------------
    def scan_filter(self, msg: p.ScanRows) -> tuple[p.NotOwner | None, Callable[[np.ndarray], np.ndarray] | None]:
        """The column filter of an owned scan: columns whose owner list minus ``skip`` is
        ``via + [this node] + ...``. A standalone node (no topology) owns everything: no filter."""
        topo = self._topology()
        if not msg.owned or topo is None or not self.node_name:
            return None, None
        if self.node_name not in topo:  # ring mode: a standby owns no columns (``not_owner``)
            return (p.NotOwner(topo.epoch, "standby: owns no columns") if topo.ring_mode else None), None
        placement = topo.placement
        if msg.placement_epoch != placement.epoch:
            return p.NotOwner(placement.epoch, f"scan under placement {msg.placement_epoch!r}, "
                                               f"this node is at {placement.epoch!r}"), None
        names = placement.names
        unknown = [n for n in (*msg.skip, *msg.via) if n not in names]
        if unknown:
            return p.NotOwner(placement.epoch, f"unknown nodes in the scan filter: {unknown[:4]}"), None
        skip = np.array([n in msg.skip for n in names])
        chain = [names.index(n) for n in msg.via] + [names.index(self.node_name)]
        return None, lambda cols: scan_chain_mask(placement, cols, skip, chain)

    def scan(self, msg: p.ScanRows) -> Answer:
        err, keep = self.scan_filter(msg)
        if err is not None:
            return self.error(err)
        after = (msg.after_column, msg.after_feature) if msg.started else None
        if msg.after_entry and after is None:
            return self.error(p.BadRequest("after_entry needs a cursor (started)"))
        res = self.store.store.scan(after, min(msg.limit, p.MAX_SCAN_ROWS), p.MAX_SCAN_ENTRIES,
                                    p.MAX_SCAN_EXAMINE, keep,
                                    min(msg.max_bytes, p.MAX_SCAN_PAGE_BYTES) if msg.max_bytes else None,
                                    msg.after_entry)
        self.count("reads")
        self.count("rows_read", res.batch.num_rows)
        self.count("bytes_read", res.batch.nbytes)
        nc, nf = res.next_key if res.next_key is not None else (0, 0)
        return Answer(p.ScanPage(nc, nf, res.done, res.examined, res.next_entry), res.batch.buffers())

    # -- column info (docs/replication.md "Column info") -----------------------------------------
    def column_info(self, msg: p.ColumnInfo) -> Answer:
        """Counts and digests of up to ``limit`` of this node's rows of ``msg.column`` after the
        cursor: a store scan from the column's first key (the index is sorted by (column, feature))
        that keeps only that column and stops where the column ends."""
        column = msg.column
        if msg.started:
            after: tuple[int, int] | None = (column, msg.after_feature)
        else:  # strictly before (column, 0): the end of the previous column
            after = (column - 1, _U64_MASK) if column > 0 else None
        limit = min(msg.limit, p.MAX_COLUMN_INFO_ROWS)
        res = self.store.store.scan(after, limit, p.MAX_SCAN_ENTRIES, limit,
                                    lambda cols: cols == np.uint64(column))
        batch = res.batch
        version = min(msg.digest_version, ROW_DIGEST_VERSIONS[-1])  # (a newer asker: the newest known)
        _, touches = self.store.store.row_touches(batch.row_column, batch.row_feature)
        batches = int(touches.sum())
        kd, sd = row_digests(batch.offsets, Row(batch.segment, batch.target_column, batch.target_feature,
                                                batch.strength), version)
        if version == 2:  # one compiled pass for the page
            keys_sum = fold_row_digests_v2(batch.row_column, batch.row_feature, kd)
            strength_sum = fold_row_digests_v2(batch.row_column, batch.row_feature, sd)
        else:  # version 1: a Python hash per row (askers from before versions)
            keys_sum = strength_sum = 0
            for feature, k, st in zip(batch.row_feature.tolist(), kd.tolist(), sd.tolist()):
                keys_sum = (keys_sum + fold_row_digest(column, feature, k)) & _U64_MASK
                strength_sum = (strength_sum + fold_row_digest(column, feature, st)) & _U64_MASK
        rows, entries = batch.num_rows, batch.num_entries
        nxt = res.next_key
        done = res.done or nxt is None or nxt[0] != column
        self.count("reads")
        return Answer(p.ColumnInfoPage(
            rows=rows, entries=entries, bytes=entries * ENTRY_BYTES + rows * ROW_OVERHEAD_BYTES,
            keys_digest=keys_sum, strength_digest=strength_sum, batches=batches,
            next_feature=0 if done or nxt is None else nxt[1], done=done, digest_version=version))

    # -- vocabulary (vocab_store.py) -------------------------------------------------------------
    def put_vocab(self, msg: p.PutVocab) -> Step:
        if self.refuse_writes:
            return self.error(p.Unavailable("storage service is stopping"))
        if self.vocab is None:
            return self.error(p.Unavailable("this node keeps no vocabulary table"))
        if self.guard.full:
            return self.error(p.Unavailable(_text(self.guard.refuse())))
        if len(msg.entries) > p.MAX_VOCAB_ENTRIES:
            raise p.ProtocolViolation(f"{len(msg.entries)} vocabulary entries in one request; "
                                      f"the limit is {p.MAX_VOCAB_ENTRIES}")
        try:
            put = self.vocab.put(msg.entries)
        except VocabCollision as exc:
            return self.error(p.VocabConflict(exc.kind, exc.id, _text(exc.held), _text(exc.offered)))
        except ValueError as exc:
            return self.error(p.BadRequest(_text(str(exc))))
        except OSError as exc:
            self.guard.write_failed("vocab_log", exc)
            return self.error(p.Unavailable(_text(f"vocab log write failed: {exc}")))
        self.count("vocab_added", put.added)
        return WaitVocabSynced(put.offset, p.VocabAck(put.added, put.known))

    def get_vocab(self, msg: p.GetVocab) -> Answer:
        if self.vocab is None:
            return self.error(p.Unavailable("this node keeps no vocabulary table"))
        if len(msg.ids) > p.MAX_VOCAB_ENTRIES or len(msg.kinds) != len(msg.ids):
            raise p.ProtocolViolation(f"GetVocab: {len(msg.kinds)} kinds for {len(msg.ids)} ids "
                                      f"(at most {p.MAX_VOCAB_ENTRIES})")
        return Answer(p.VocabReply(self.vocab.lookup(msg.kinds, msg.ids)))

    # -- registers (register_store.py) -----------------------------------------------------------
    def register(self, msg: p.RegisterGet | p.RegisterPrepare | p.RegisterAccept) -> Step:
        """One acceptor step on ``msg.key`` (module docstring)."""
        store = self.registers
        if store is None:
            return self.error(p.Unavailable("this node keeps no registers"))
        if (err := self.not_owner(np.array([p.register_key_id(msg.key)], np.uint64))) is not None:
            return self.error(err)
        topo = self._topology()
        epoch = "" if topo is None else topo.placement.epoch
        if store.sealed(msg.key, epoch):  # handed off to its new owners (rebalance/register_handoff.py)
            return self.error(p.NotOwner(epoch, p.REGISTER_SEALED))
        if isinstance(msg, p.RegisterGet):
            try:
                return Answer(_register_value(store.get(msg.key)))
            except (RegisterLogCorrupt, OSError) as exc:  # a spilled value unreadable: other replicas answer
                return self.error(p.Unavailable(_text(f"register value unreadable: {exc}")))
        if self.refuse_writes:
            return self.error(p.Unavailable("storage service is stopping"))
        if self.guard.full:
            return self.error(p.Unavailable(_text(self.guard.refuse())))
        ballot = (msg.round, msg.proposer)
        try:
            if isinstance(msg, p.RegisterPrepare):
                result, seq = store.prepare(msg.key, ballot)
            else:
                version = (msg.version, msg.origin_round, msg.origin_proposer)
                result, seq = store.accept(msg.key, ballot, version, msg.value)
        except RegisterStoreFull as exc:
            return self.error(p.Unavailable(_text(str(exc))))
        except RegisterLogCorrupt as exc:  # the prepare could not read back a spilled value
            return self.error(p.Unavailable(_text(f"register value unreadable: {exc}")))
        except OSError as exc:
            self.guard.write_failed("register_log", exc)  # logged (rate-limited); ENOSPC: disk full
            return self.error(p.Unavailable(_text(f"register log write failed: {exc}")))
        if not isinstance(result, RegisterState):
            return self.error(p.RegisterConflict(*result))
        self.count("register_changes")
        reply = _register_value(result) if isinstance(msg, p.RegisterPrepare) else p.RegisterAccepted()
        return WaitRegistersSynced(seq, reply)


def _register_value(state: RegisterState) -> p.RegisterValue:
    return p.RegisterValue(*state.accepted, *state.version, state.value)
