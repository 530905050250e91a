"""The append-only update log: checksummed records in segment files, group-committed fsync.

Theory of operation
-------------------
Files: ``log-<first seq, 20 digits>.seg`` in the store directory. Records are numbered by a global
``seq`` (1, 2, 3, ... with no gaps across segments); a segment holds the records from its first seq up
to the next segment's. Byte layout (little-endian; docs/storage.md has the full table):

    header (40 B): magic "GIAL" | version u16 | kind u16 | payload_len u64 | seq u64
                   | payload_xxh3 u64 | header_xxh3 u64 (over the first 32 bytes)
    payload:       kind 1 (batch): writer u64 | batch seq u64 | rows R u64 | entries N u64
                                   | row_column u64[R] | row_feature u64[R] | offsets i64[R+1]
                                   | target_column u64[N] | target_feature u64[N]
                                   | strength f32[N] | segment u8[N]
                   kind 2 (floor): writer u64 | floor u64
                   kind 3 (drop, format version 2): count C u64 | column u64[C] (sorted, unique)

Versions: a record carries the version that introduced its kind (batch and floor records: 1, drop
records: 2), and the reader accepts every version up to ``LOG_FORMAT_VERSION``. So a log without
drops stays readable by a version-1 reader (a downgrade works until the first drop), and a log with
one stops a version-1 reader with "unsupported log format version 2" at that record instead of
being misread; version-1 logs are read unchanged.

The header has its own checksum so a damaged length is never trusted: that is what lets the reader
tell a *torn tail* (the last write was cut short by a crash; it was never acknowledged, because acks
wait for ``sync``) from *corruption* (anything else), and stop with the file and offset in the second
case instead of silently dropping the records after it.

Writing: ``append_*`` writes one record with ``os.writev`` (the row buffers go to the kernel without
being copied into one bytes object) and returns its seq; ``sync()`` fdatasyncs and returns the highest
seq now durable. Many appends share one sync (group commit): the service acknowledges every batch with
seq <= the returned value. ``sync`` may run in a worker thread while appends continue on the event loop
thread: it syncs the file descriptor current when it started and only claims the seq appended before.
Segments rotate at ``segment_max_bytes`` and on ``rotate()`` (before a snapshot), so truncating after a
snapshot deletes whole files.

A failed fdatasync is not retried ("fsyncgate": Linux reports a writeback error once and may then
mark the pages it could not write clean, so the next fdatasync "succeeds" without them; PostgreSQL
PANICs on one for that reason). From then on the records appended so far are in doubt: ``sync``
raises instead of calling them durable, appends are refused (a record after them would be
acknowledged by a sync that does not cover them), and a rotation does not count them synced. What
ends it is a snapshot of the store, which holds them (they were applied in RAM): once its seq
covers them (``drop_through``, after the snapshot is durable), the segments holding them are gone
and the log goes on in the fresh segment the snapshot's rotation opened.

The header, the checksums and the torn-tail rule are the shared record codec's (``giaannd.records``,
format ``LOG_RECORD``); this module adds the seq numbering, the payload kinds and the segment files.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from giaannd import page_cache
from giaannd.atomic_file import fsync_dir
from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.records import RecordError, RecordFormat
from giaannd.storage.engine.errors import CorruptLogError

__all__ = [
    "HEADER_BYTES",
    "KIND_BATCH",
    "KIND_DROP",
    "KIND_FLOOR",
    "LOG_FORMAT_VERSION",
    "LOG_RECORD",
    "MAX_RECORD_PAYLOAD_BYTES",
    "LogRecord",
    "SegmentMapper",
    "SegmentReader",
    "SegmentScan",
    "UpdateLog",
    "encode_batch_payload",
    "encode_drop_payload",
    "list_segments",
    "scan_segment",
]

MAGIC = b"GIAL"
#: The newest record format this code writes and reads (module docstring: versions).
LOG_FORMAT_VERSION = 2
KIND_BATCH = 1
KIND_FLOOR = 2
#: Delete every row of the listed columns (``ColumnStore.drop_columns``).
KIND_DROP = 3
#: The format version that introduced each kind: what a record of that kind is written with, and
#: the least version a record of it may carry.
_KIND_VERSION = {KIND_BATCH: 1, KIND_FLOOR: 1, KIND_DROP: 2}
_BATCH_HEAD = struct.Struct("<QQQQ")
_FLOOR = struct.Struct("<QQ")
#: Largest record payload accepted (checked before allocating): a delta batch from one compute step
#: is megabytes; 1 GiB leaves room while stopping a damaged length from asking for terabytes.
MAX_RECORD_PAYLOAD_BYTES = 1 << 30
#: The record header (module docstring; docs/storage.md has the byte table).
LOG_RECORD = RecordFormat(
    "log", MAGIC,
    [("version", "H"), ("kind", "H"), ("length", "Q"), ("seq", "Q"), ("payload_xxh3", "Q")],
    versions=(1, LOG_FORMAT_VERSION), max_payload_bytes=MAX_RECORD_PAYLOAD_BYTES)
HEADER_BYTES = LOG_RECORD.header_bytes  # 40
#: Default segment size: small enough that truncation after a snapshot frees space promptly,
#: large enough that rotation (an fsync of the old file and the directory) is rare.
DEFAULT_SEGMENT_MAX_BYTES = 64 << 20

_SEGMENT_PREFIX, _SEGMENT_SUFFIX = "log-", ".seg"


def segment_name(first_seq: int) -> str:
    return f"{_SEGMENT_PREFIX}{first_seq:020d}{_SEGMENT_SUFFIX}"


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    """(first seq, path) of every segment file, in seq order."""
    out = []
    for p in directory.iterdir():
        name = p.name
        if name.startswith(_SEGMENT_PREFIX) and name.endswith(_SEGMENT_SUFFIX):
            digits = name[len(_SEGMENT_PREFIX) : -len(_SEGMENT_SUFFIX)]
            if len(digits) == 20 and digits.isdigit():
                out.append((int(digits), p))
    return sorted(out)


def encode_batch_payload(batch_id: BatchId, batch: RowBatch) -> list[memoryview | bytes]:
    """The payload of a batch record as buffers (no copy of the row arrays)."""
    head = _BATCH_HEAD.pack(batch_id[0], batch_id[1], batch.num_rows, batch.num_entries)
    arrays: list[NDArray[np.generic]] = [
        batch.row_column, batch.row_feature, batch.offsets,
        batch.target_column, batch.target_feature, batch.strength, batch.segment,
    ]
    return [head] + [np.ascontiguousarray(a).data.cast("B") for a in arrays]


def encode_drop_payload(columns: NDArray[np.uint64]) -> list[memoryview | bytes]:
    """The payload of a drop record (``columns`` sorted and unique, checked)."""
    cols = np.ascontiguousarray(columns, np.uint64).reshape(-1)
    if cols.shape[0] > 1 and not np.all(cols[1:] > cols[:-1]):
        raise ValueError("drop record: columns must be sorted and unique")
    if 8 + 8 * cols.shape[0] > MAX_RECORD_PAYLOAD_BYTES:
        raise ValueError(f"drop record of {cols.shape[0]} columns over the record size limit")
    return [struct.pack("<Q", cols.shape[0]), cols.data.cast("B")]


@dataclass(frozen=True, slots=True)
class LogRecord:
    """One decoded record: a batch (``batch_id``, ``batch``), a floor (``writer``, ``floor``) or a
    drop (``columns``)."""

    seq: int
    kind: int
    batch_id: BatchId | None = None
    batch: RowBatch | None = None
    writer: int = 0
    floor: int = 0
    columns: NDArray[np.uint64] | None = None


def _decode_payload(kind: int, version: int, seq: int, payload: memoryview) -> LogRecord:
    """Raises ValueError on a payload that does not match its kind (caller adds file and offset)."""
    if _KIND_VERSION.get(kind, version + 1) > version:
        raise ValueError(f"unknown record kind {kind} in a version {version} record")
    if kind == KIND_DROP:
        if len(payload) < 8 or len(payload) != 8 + 8 * struct.unpack_from("<Q", payload)[0]:
            raise ValueError(f"drop record of {len(payload)} bytes does not match its column count")
        cols = np.frombuffer(payload, np.uint64, offset=8)
        if cols.shape[0] > 1 and not np.all(cols[1:] > cols[:-1]):
            raise ValueError("drop record: columns not sorted and unique")
        return LogRecord(seq, kind, columns=cols)
    if kind == KIND_FLOOR:
        if len(payload) != _FLOOR.size:
            raise ValueError(f"floor record of {len(payload)} bytes")
        writer, floor = _FLOOR.unpack(payload)
        return LogRecord(seq, kind, writer=writer, floor=floor)
    if kind != KIND_BATCH:
        raise ValueError(f"unknown record kind {kind}")
    if len(payload) < _BATCH_HEAD.size:
        raise ValueError("batch record shorter than its head")
    writer, bseq, r, n = _BATCH_HEAD.unpack(payload[: _BATCH_HEAD.size])
    if len(payload) != _BATCH_HEAD.size + 8 * (3 * r + 1) + 21 * n:
        raise ValueError(f"batch record length does not match {r} rows, {n} entries")
    pos = _BATCH_HEAD.size
    parts: list[NDArray[np.generic]] = []
    for dtype, count in ((np.uint64, r), (np.uint64, r), (np.int64, r + 1), (np.uint64, n),
                         (np.uint64, n), (np.float32, n), (np.uint8, n)):
        parts.append(np.frombuffer(payload, dtype, count, pos))
        pos += np.dtype(dtype).itemsize * count
    rc, rf, off, tc, tf, st, seg = parts
    batch = RowBatch.from_buffers([rc, rf, off, seg, tc, tf, st], validate=True)
    if bseq < 1:
        raise ValueError("batch seq 0")
    return LogRecord(seq, kind, batch_id=BatchId(writer, bseq), batch=batch)


@dataclass(frozen=True, slots=True)
class SegmentScan:
    """A segment read from disk: its records, where the good data ends, and a torn tail if any."""

    path: Path
    records: list[LogRecord]
    good_bytes: int
    torn_bytes: int


def scan_segment(path: Path, first_seq: int, is_last: bool,
                 reader: SegmentReader | SegmentMapper | None = None) -> SegmentScan:
    """Read and check one segment.

    Args:
        path: the segment file.
        first_seq: the seq its first record must have (from its name).
        is_last: only the last segment may end in a torn record.
        reader: read with it (``SegmentReader``: the records are then valid only until its next
            read; ``SegmentMapper``: they are views of the mapped file); by default into a buffer of
            the segment's own.

    Raises:
        CorruptLogError: any damage that is not a torn tail of the last segment.
    """
    data = (reader or SegmentReader()).read(path)
    records: list[LogRecord] = []
    good, seq = 0, first_seq
    try:
        for rec in LOG_RECORD.scan(data, torn_tail=is_last):
            head = rec.header
            if head.fields["seq"] != seq:
                raise CorruptLogError(str(path), head.offset, f"record seq {head.fields['seq']}, expected {seq}")
            try:
                records.append(_decode_payload(head.fields["kind"], head.version, seq, rec.payload))
            except ValueError as exc:
                raise CorruptLogError(str(path), head.offset, f"bad record payload: {exc}") from None
            good, seq = head.end, seq + 1
    except RecordError as exc:
        raise CorruptLogError(str(path), exc.offset, exc.explanation) from None
    return SegmentScan(path, records, good, len(data) - good)


class SegmentReader:
    """Reads whole segments into one buffer kept from read to read (grown to the largest segment).

    Why a buffer of its own: a segment's read is the page-cache copy plus the page faults of the
    memory it lands in, and a fresh buffer per segment paid those faults at every segment (with
    ``bytes``, 0.43 s/GB of CPU against 0.18 for a reused buffer, ``tools.bench.snapshot``). A
    numpy buffer, also, gets huge pages from the kernel (fewer faults even the first time). The
    buffer is read-only between reads, as ``bytes`` was.

    The catch: what ``read`` returns, and every record decoded from it (``scan_segment``), is a view
    valid only until the next ``read``. ``DurableStore.open`` replays each segment before reading
    the next one, and a replay keeps no view of its records (every batch is copied into the
    engine, recovery.py). Without a reader ``scan_segment`` reads into a fresh buffer."""

    def __init__(self) -> None:
        self._buf = np.empty(0, np.uint8)

    def read(self, path: Path) -> memoryview:
        """The whole file (a view into the reader's buffer, valid until the next ``read``)."""
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size > self._buf.shape[0]:
                self._buf = np.empty(size, np.uint8)
            buf = self._buf
            buf.flags.writeable = True
            view = buf.data.cast("B")
            got = 0
            while got < size:  # a short read (the file shrank meanwhile: nothing else writes it) ends early
                n = f.readinto(view[got:size])
                if not n:
                    break
                got += n
            buf.flags.writeable = False
        return buf.data.cast("B")[:got]


class SegmentMapper:
    """Maps whole segments read-only instead of reading them: a start-up's replay (recovery.py).

    Why: a segment read into a buffer pays the page-cache copy and, in a new process, the first
    touch of the buffer's fresh pages; a mapping maps the page cache's own pages (16 a fault, the
    kernel's fault-around) with no copy. Measured on the two 64 MiB segments of
    ``tools.bench.replay_windows``, read and checksummed in a fresh process: 10-16 ms mapped
    against 35-270 ms read (the fresh pages' cost swings on this VM). A segment the update log
    dropped from the page cache (``drop_synced``) is read from disk either way: a restart's
    read-ahead thread asks for it ahead of the replay (read_ahead.py); the ``MADV_WILLNEED`` over
    the whole mapping here reads only its first few MiB (the kernel cuts such a request to the
    device's readahead size), which is what a caller without that thread still gets.

    Only where nothing writes or truncates the segments meanwhile: a failed append cuts its partial
    record off the active segment (``UpdateLog.append``), and a mapped page past a file's end
    faults the process (SIGBUS). At start-up the log is not open yet; the readers of a live node's
    log (repair, hints) read. The records are views of the mapping, which lives as long as one of
    them does. Where the file cannot be mapped (a filesystem without ``mmap``) it is read into a
    buffer of its own."""

    def read(self, path: Path) -> memoryview:
        """The whole file, mapped read-only (or read where mapping fails)."""
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size == 0:
                return memoryview(b"")
            try:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                return SegmentReader().read(path)
        if hasattr(mm, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            try:
                mm.madvise(mmap.MADV_WILLNEED)
            except OSError:  # advice changes speed only (peers/madvise.py never raises): a kernel
                pass  # or sandbox refusing it (EINVAL, ENOSYS, EPERM) stopped the start-up here
        return memoryview(mm)


class UpdateLog:
    """The writer side: append records, group-commit them, rotate and drop segments.

    Args:
        directory: where the segments live (created by the caller).
        next_seq: the seq of the next record (1 + the last one recovered).
        segment_max_bytes: rotate once the current segment is this large.
        drop_synced: after each sync, tell the kernel the bytes it made durable will not be read
            soon (``posix_fadvise(POSIX_FADV_DONTNEED)``), so their page-cache pages are freed and
            the next appends reuse them. A log nobody reads while the node runs (the store's: it is
            read at the next start, and by repair, from disk then) otherwise grows the page cache
            by every byte written, each append copying into pages the kernel has never used
            since boot: on the shared VM of docs/topology.md "Fifth pass" 1.8-3.2 ms of CPU per
            MB appended, against 0.3-0.6 with this (4 MiB records, an fsync per 16 MiB). Whole
            pages only (``giaannd.page_cache``): the partial last page, which the next append
            writes into, stays cached until a later sync covers it whole, or the segment is
            rotated or closed (so an append never reads that page back from the disk).
    """

    def __init__(self, directory: Path, next_seq: int, segment_max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES,
                 drop_synced: bool = False) -> None:
        if segment_max_bytes < HEADER_BYTES:
            raise ValueError("segment_max_bytes too small")
        self.directory = directory
        self.segment_max_bytes = segment_max_bytes
        self.drop_synced = drop_synced and page_cache.AVAILABLE
        self._next_seq = next_seq
        self._durable_seq = next_seq - 1
        self._lock = threading.Lock()  # guards fd swaps between append/rotate and a threaded sync
        self._fd = -1
        self._segment_bytes = 0
        #: bytes of records appended since this log was opened (``DurableStore.logged_since_snapshot``)
        self.appended_bytes = 0
        #: how far the current segment has left the page cache (``drop_synced``)
        self._cached = page_cache.DroppedPrefix()
        self._failed: OSError | None = None
        #: a failed fdatasync (module docstring) and the last seq appended when it failed: until a
        #: snapshot covers that seq, nothing is called durable past ``_durable_seq`` or appended
        self._sync_failed: OSError | None = None
        self._sync_failed_through = 0
        self._sync_inherited()
        self._open_segment()

    def _sync_inherited(self) -> None:
        """fdatasync the segment holding the records just before ``next_seq``, if any: ``durable_seq``
        starts by calling them durable. A process that stopped without syncing (kill -9 between an
        append and its sync) left them in the page cache only; a restart replays them, and a
        writer's retry of one of their batches is then a duplicate acknowledged at their seq, with
        no sync of their segment to come (``sync`` syncs the current one). Earlier segments were
        synced when they were rotated, or by the start that inherited them."""
        inherited = [path for first, path in list_segments(self.directory) if first < self._next_seq]
        if not inherited:
            return
        fd = os.open(inherited[-1], os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _open_segment(self) -> None:
        """Open (create) the segment starting at the next seq and make it current. On failure (a
        full disk) nothing changed: the current segment, if any, stays open and in use, and a file
        this call created is removed (an empty segment named after records that end up in the
        previous one would read as a gap at the next start)."""
        path = self.directory / segment_name(self._next_seq)
        existed = path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            size = os.fstat(fd).st_size
            fsync_dir(self.directory)
        except OSError:
            os.close(fd)
            if not existed:
                path.unlink(missing_ok=True)
            raise
        self._fd, self._segment_bytes, self._cached = fd, size, page_cache.DroppedPrefix()

    @property
    def last_seq(self) -> int:
        """Seq of the last record appended (durable or not); 0 before the first."""
        return self._next_seq - 1

    @property
    def durable_seq(self) -> int:
        return self._durable_seq

    @property
    def sync_failed(self) -> bool:
        """An fdatasync failed and no snapshot covers its records yet (module docstring): appends
        and syncs raise until one does."""
        return self._sync_failed is not None

    def append_batch(self, batch_id: BatchId, batch: RowBatch) -> int:
        """Append a batch record; returns its seq (durable only after ``sync`` returns >= it)."""
        return self._append(KIND_BATCH, encode_batch_payload(batch_id, batch))

    def append_floor(self, writer: int, floor: int) -> int:
        return self._append(KIND_FLOOR, [_FLOOR.pack(writer, floor)])

    def append_drop(self, columns: NDArray[np.uint64]) -> int:
        """Append a drop record (``columns`` sorted and unique); returns its seq.

        Raises:
            ValueError: columns not sorted and unique, or too many for one record.
        """
        return self._append(KIND_DROP, encode_drop_payload(columns))

    def _append(self, kind: int, payload: list[memoryview | bytes]) -> int:
        if self._fd < 0:
            raise ValueError("update log is closed")
        with self._lock:
            self._check_synced_locked()
            self._cut_partial_locked()
            if self._segment_bytes >= self.segment_max_bytes:
                self._rotate_locked()
            seq = self._next_seq
            parts = [LOG_RECORD.header_for(payload, version=_KIND_VERSION[kind], kind=kind, seq=seq), *payload]
            total = sum(len(p) for p in parts)
            try:
                written = os.writev(self._fd, parts)
                if written != total:  # short write: finish it, the record must be whole
                    rest = b"".join(bytes(p) for p in parts)[written:]
                    while rest:
                        rest = rest[os.write(self._fd, rest) :]
            except OSError as exc:
                # A partial record followed by later records would read as corruption in the middle
                # at the next start: cut it off now, or refuse appends and rotations until it is
                # (``_cut_partial_locked``).
                try:
                    os.ftruncate(self._fd, self._segment_bytes)
                except OSError:
                    self._failed = exc
                raise
            self._segment_bytes += total
            self.appended_bytes += total
            self._next_seq = seq + 1
            return seq

    def sync(self) -> int:
        """fdatasync the current segment; returns the highest seq now durable (group commit).
        With ``drop_synced``, the bytes made durable then leave the page cache."""
        with self._lock:
            self._check_synced_locked()
            current, target = self._fd, self._next_seq - 1
            if current < 0:
                return self._durable_seq
            fd = os.dup(current)  # survives a concurrent rotate closing the original
            cached, end = self._cached, self._segment_bytes  # (that segment's)
        try:
            try:
                os.fdatasync(fd)
            except OSError as exc:
                with self._lock:
                    self._sync_failed_locked(exc)
                raise
            if self.drop_synced:  # (two syncs at once at worst drop some pages twice)
                cached.drop(fd, end)
        finally:
            os.close(fd)
        with self._lock:
            self._check_synced_locked()  # (another sync failed meanwhile: this one's success proves nothing)
            self._durable_seq = max(self._durable_seq, target)
            return self._durable_seq

    def _sync_failed_locked(self, exc: OSError) -> None:
        """An fdatasync failed: every record appended so far is in doubt (module docstring)."""
        if self._sync_failed is None:
            self._sync_failed = exc
        self._sync_failed_through = self._next_seq - 1

    def _check_synced_locked(self) -> None:
        """Raise while an fdatasync failure has not been covered by a snapshot (module docstring);
        the error keeps the first failure's errno (ENOSPC: the disk-full state)."""
        exc = self._sync_failed
        if exc is not None:
            raise OSError(exc.errno, f"update log fsync failed ({exc.strerror or exc}); records after seq "
                                     f"{self._durable_seq} wait for a snapshot")

    def rotate(self) -> None:
        """Close the current segment (synced) and start a new one at the next seq."""
        with self._lock:
            self._rotate_locked()

    def _cut_partial_locked(self) -> None:
        """Cut off the partial record of a failed append that could not be cut at once (``_failed``):
        before anything is appended after it, and before a rotation leaves it in a segment that is
        no longer the last (corruption at the next start, not a torn tail). Once cut, appends go on
        (the disk had no room for the cut either, or it failed for a while).

        Raises:
            OSError: it still cannot be cut; the log stays as it is.
        """
        if self._failed is None:
            return
        try:
            os.ftruncate(self._fd, self._segment_bytes)
        except OSError:
            raise OSError(f"update log unusable after an earlier write error: {self._failed}") from None
        self._failed = None

    def _rotate_locked(self) -> None:
        self._cut_partial_locked()
        old, cached = self._fd, self._cached
        if self._sync_failed is None:  # (after a failed fsync, a snapshot's rotation claims nothing)
            try:
                os.fdatasync(old)
            except OSError as exc:
                self._sync_failed_locked(exc)
                raise
            self._durable_seq = self._next_seq - 1
        self._open_segment()  # raises with ``old`` still current: appends go on into it
        if self.drop_synced:  # synced whole: its last partial page goes too
            page_cache.drop_rest(old, cached.dropped)
        os.close(old)

    def drop_through(self, seq: int) -> list[Path]:
        """Delete the segments whose records all have seq <= ``seq`` (never the current one)."""
        segments = list_segments(self.directory)
        dropped = []
        for (first, path), nxt in zip(segments, segments[1:]):
            if nxt[0] - 1 <= seq and first < self._next_seq:
                path.unlink()
                dropped.append(path)
        if dropped:
            fsync_dir(self.directory)
        with self._lock:
            if self._sync_failed is not None and seq >= self._sync_failed_through:
                # a durable snapshot holds every record a failed fsync left in doubt
                self._sync_failed = None
                self._durable_seq = max(self._durable_seq, seq)
        return dropped

    def close(self) -> None:
        if self._fd >= 0:
            if self._sync_failed is None:  # (else nothing in doubt is called durable: left to recovery)
                self.sync()
            with self._lock:
                if self.drop_synced:  # synced whole and never appended to again: its last page too
                    page_cache.drop_rest(self._fd, self._cached.dropped)
                os.close(self._fd)
                self._fd = -1


def iter_records(scans: list[SegmentScan]) -> Iterator[LogRecord]:
    for scan in scans:
        yield from scan.records
