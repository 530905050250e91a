"""Snapshots: every row and the applied set at one log seq, checksummed, written atomically.

Byte layout (little-endian; docs/storage.md has the full table). Format 2 (written since the row
engine, issue 14 phase 2) holds the engine's arrays as they are, field-major:

    header (64 B): magic "GIAANNSN" | version u32 (2) | flags u32 (0) | last_seq u64 | rows R u64
                   | entries N u64 | body_len u64 | body_xxh3 u64 | header_xxh3 u64 (first 56 B)
    body:          row_column u64[R] | row_feature u64[R] | offsets i64[R+1] | touches u64[R]
                   | target_column u64[N] | target_feature u64[N] | strength f32[N] | segment u8[N]
                   | writers W u64 | writer u64[W] | floor u64[W] | count u64[W] | exceptions u64[E]
                   | tracked T u64 | writer u64[T] | promised u64[T]
                   | batches B u64 | writer u64[B] | seq u64[B] | count u64[B] | columns u64[C]

The last two sections (format 2) are the applied set's columns (applied_set.py, "Which columns"):
the tracked training writers with their promised floors, and the columns applied under each batch
id still in flight. A format-1 file has neither: it loads with no writer tracked.

Rows are in the engine's row-id order (keys unique, not sorted): row i is entries
``[offsets[i], offsets[i+1])`` of each field array, sorted by (segment, target column, target
feature). Format 1 (before the row engine) has the same header and sections up to ``touches``, rows
sorted by key, then the R row *regions* back to back (regions.py layout, 21 B per entry) in place
of the four field arrays; it still loads, converted by four vectorised gathers
(``regions.unpack_regions``), and the next snapshot is written as format 2.

Writing: ``.snapshot-<seq>.tmp`` is streamed from a frozen view (``ColumnStore.freeze``: no copy of
the rows but their strengths) in chunks of about ``WRITE_CHUNK_BYTES``, the header patched in, then
fsync, atomic rename to ``snapshot-<seq, 20 digits>.snap`` and a directory fsync: a crash at any
point leaves either the old snapshot or the new one, never a half file under the final name. A
write that fails (a full disk) deletes its temporary before raising, so a failed snapshot does not
keep the space it could not finish using; a crash's temporary is deleted by the next start
(``remove_temporaries``, before anything else is written).

Reading: each section is one ``readinto`` into its final array, hashed as it goes; or, from a
mapping of the file (``read_snapshot``'s ``mapping``, snapshot_map.py), hashed through it, the row
offsets and the entries' segments, target columns and target features kept as read-only views of
it and the other sections copied out. Both checksums are verified before anything is trusted, then
the structure; every failure is a :class:`CorruptSnapshotError` naming the file and byte offset.
The arrays then *are* the engine's base run, and the key index is built in one vectorised pass:
no per-row Python anywhere. The header and its checks are the shared record codec's
(``giaannd.records``, ``SNAPSHOT_RECORD``: the whole file is one record whose payload, the body, is
streamed rather than held twice).
"""

from __future__ import annotations

import io
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.atomic_file import fsync_dir
from giaannd.madvise import PAGE as _PAGE
from giaannd.model.rows import NUM_SEGMENTS, Row
from giaannd.records import RecordError, RecordFormat
from giaannd.rowengine.canon import entries_fault
from giaannd.rowengine.frozen import FrozenEngine
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.column_store import ENTRY_BYTES, ColumnStore, FrozenRows
from giaannd.storage.engine.errors import CorruptSnapshotError
from giaannd.storage.engine.page_advice import allow_huge_pages, filled_buffer
from giaannd.storage.engine.regions import unpack_regions
from giaannd.storage.engine.snapshot_map import SnapshotMapping

__all__ = ["SNAPSHOT_FORMAT_VERSION", "SNAPSHOT_RECORD", "Pacer", "first_bad_row", "list_snapshots", "list_temporaries",
           "read_snapshot", "remove_temporaries", "snapshot_name", "write_frozen", "write_snapshot"]

MAGIC = b"GIAANNSN"
#: Written: the engine's field arrays (module docstring). Format 1 (row regions) still loads.
SNAPSHOT_FORMAT_VERSION = 2
_REGIONS_FORMAT = 1
#: The header (64 bytes; module docstring). No payload limit: the length must equal the file's size.
SNAPSHOT_RECORD = RecordFormat(
    "snapshot", MAGIC,
    [("version", "I"), ("flags", "I"), ("last_seq", "Q"), ("rows", "Q"), ("entries", "Q"), ("length", "Q"),
     ("payload_xxh3", "Q")],
    versions=(_REGIONS_FORMAT, SNAPSHOT_FORMAT_VERSION), max_payload_bytes=None)
HEADER_BYTES = SNAPSHOT_RECORD.header_bytes  # 64
_PREFIX, _SUFFIX, _TMP_PREFIX = "snapshot-", ".snap", ".snapshot-"
#: The entry arrays are written in pieces of about this many bytes (one merge of the base with its
#: delta entries and one write each; rowengine/frozen.py): large enough that the per-piece Python
#: cost vanishes, small enough that a piece's copy holding the GIL (a few hundred µs) does not stall
#: the thread applying batches meanwhile.
WRITE_CHUNK_BYTES = 1 << 20
#: A snapshot being written is flushed to disk every this many bytes (``fdatasync`` in the writing
#: thread) rather than only at its end. Why: the update log's group commit fsyncs every few ms,
#: and on ext4 (data=ordered) a journal commit waits for the data of other files' blocks allocated
#: in the same transaction, so a snapshot's gigabytes of dirty pages being written back made log
#: fsyncs slow: p99 0.1 s during snapshots against 0.025 s without (tools.bench.scale --cluster).
#: Bounded dirty data keeps that wait short; the snapshot is paced anyway (snapshot-busy-share).
SYNC_EVERY_BYTES = 32 << 20
#: With this many delta runs or more in the frozen view, the entry sections are written in one pass
#: over the entries (``_write_fields``): their merge is made once, not once per field.
ONE_PASS_MIN_DELTAS = 2
#: The entry fields in file order (module docstring) and their dtypes.
_FIELDS = (("tc", np.uint64), ("tf", np.uint64), ("st", np.float32), ("seg", np.uint8))
#: Rows are checked at load (``verify_rows``) in runs of about this many entries: index arrays of
#: a few MiB, cache-sized, instead of several of 8 bytes per entry of the whole store.
VERIFY_CHUNK_ENTRIES = 1 << 17


def snapshot_name(last_seq: int) -> str:
    return f"{_PREFIX}{last_seq:020d}{_SUFFIX}"


def list_snapshots(directory: Path) -> list[tuple[int, Path]]:
    """(last seq, path) of every complete snapshot, oldest first."""
    out = []
    for p in directory.iterdir():
        digits = p.name[len(_PREFIX) : -len(_SUFFIX)]
        if p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX) and len(digits) == 20 and digits.isdigit():
            out.append((int(digits), p))
    return sorted(out)


def list_temporaries(directory: Path) -> list[Path]:
    """Leftovers of snapshot writes a crash interrupted (never valid; safe to delete)."""
    return [p for p in directory.iterdir() if p.name.startswith(_TMP_PREFIX) and p.name.endswith(".tmp")]


def remove_temporaries(directory: Path) -> tuple[int, int]:
    """Delete the snapshot temporaries in ``directory`` (missing: nothing to do); returns (files,
    bytes) removed. Only for the directory's owner (the daemon holding its lock): a live writer's
    temporary would vanish under it. Deleting frees space and writes nothing, so it works on a
    full disk; the directory is not fsynced (a temporary that comes back after a power loss is
    deleted again)."""
    if not directory.is_dir():
        return 0, 0
    files = freed = 0
    for path in list_temporaries(directory):
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        files, freed = files + 1, freed + size
    return files, freed


class _HashingWriter:
    """Writes and hashes the body; every ``SYNC_EVERY_BYTES`` written it flushes the file to disk.

    The body is hashed in file order. ``write`` appends (and hashes); ``write_at`` puts bytes
    further on without hashing them (a section written out of order), and ``adopt`` then hashes
    them by reading them back, in order, before the appends go on after them.

    ``drop_cached``: once bytes are on disk and hashed, tell the kernel they will not be read soon
    (``posix_fadvise(POSIX_FADV_DONTNEED)``), so their page-cache pages are freed and the next
    writes reuse them (the update log does the same: update_log.py ``drop_synced``)."""

    def __init__(self, f: BinaryIO, drop_cached: bool = False) -> None:
        self.f, self.h, self.n = f, xxhash.xxh3_64(), 0
        self._written = self._synced = 0
        self._buf: memoryview | None = None
        self.drop_cached = drop_cached and hasattr(os, "posix_fadvise")
        self._dropped = 0  # file bytes before this (page-aligned) were dropped from the page cache

    def write(self, buf: memoryview | bytes) -> None:
        self.h.update(buf)
        self.f.write(buf)
        self.n += len(buf)
        self._wrote(len(buf))

    def array(self, values: NDArray[np.generic]) -> None:
        self.write(_bytes_of(values))

    def write_at(self, body_offset: int, values: NDArray[np.generic]) -> None:
        """Put ``values`` at ``body_offset`` of the body (past what ``write`` appended so far)."""
        buf = _bytes_of(values)
        self.f.flush()
        fd, at, done = self.f.fileno(), HEADER_BYTES + body_offset, 0
        while done < len(buf):
            done += os.pwrite(fd, buf[done:], at + done)
        self._wrote(len(buf))

    def adopt(self, nbytes: int) -> None:
        """The next ``nbytes`` of the body were put by ``write_at``: hash them (read back from the
        file, in pieces of ``WRITE_CHUNK_BYTES``) and append after them."""
        self.f.flush()
        if self._buf is None:
            self._buf = memoryview(bytearray(WRITE_CHUNK_BYTES))
        fd, at, end = self.f.fileno(), HEADER_BYTES + self.n, HEADER_BYTES + self.n + nbytes
        if self.drop_cached:
            os.fdatasync(fd)  # all of it on disk, so each piece can leave the cache once hashed
            self._synced = self._written
        while at < end:
            got = os.preadv(fd, [self._buf[: min(WRITE_CHUNK_BYTES, end - at)]], at)
            if got <= 0:
                raise OSError(f"snapshot temporary shorter than written: {at} of {end} bytes")
            self.h.update(self._buf[:got])
            at += got
            self.drop(at)
        self.n += nbytes
        self.f.seek(end)

    def drop(self, upto: int) -> None:
        """With ``drop_cached``: the file's bytes before ``upto`` (whole pages), on disk and hashed,
        leave the page cache."""
        upto -= upto % _PAGE
        if self.drop_cached and upto > self._dropped:
            os.posix_fadvise(self.f.fileno(), self._dropped, upto - self._dropped, os.POSIX_FADV_DONTNEED)
            self._dropped = upto

    def _wrote(self, nbytes: int) -> None:
        self._written += nbytes
        if self._written - self._synced >= SYNC_EVERY_BYTES:
            self.f.flush()
            os.fdatasync(self.f.fileno())
            self._synced = self._written
            # (the appended bytes are hashed as written: those before a section put out of order)
            self.drop(HEADER_BYTES + self.n)


def _bytes_of(values: NDArray[np.generic]) -> memoryview:
    return np.ascontiguousarray(values).data.cast("B")


def write_snapshot(directory: Path, store: ColumnStore, last_seq: int) -> Path:
    """Write ``store`` as the snapshot at ``last_seq``; returns the final path (durable on return).

    Raises:
        OSError: the write failed (ENOSPC...); the temporary is deleted, nothing else changed.
    """
    view = store.freeze()
    try:
        return write_frozen(directory, view, last_seq)
    finally:
        view.release()


class Pacer:
    """Keeps the snapshot thread's share of busy time at most ``busy_share``: ``pause()``, called
    after each slice of work, rests ``work × (1 − share) / share`` for the work done since the
    previous pause. The snapshot thread competes with the applying thread for the GIL (and, on a
    busy host, for a core): resting between slices leaves the rest of the time to applies, at
    the cost of a snapshot that takes up to 1 / share as long (``storage.snapshot-busy-share``).

    Args:
        busy_share: in (0, 1]; 1 never rests.
        clock, sleep: injectable for tests (``time.perf_counter``, ``time.sleep``).
    """

    def __init__(self, busy_share: float, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not 0 < busy_share <= 1:
            raise ValueError(f"busy_share must be in (0, 1], got {busy_share}")
        self.busy_share, self._clock, self._sleep = busy_share, clock, sleep
        self._since = clock()
        self.rested_s = 0.0

    def pause(self) -> None:
        worked = self._clock() - self._since
        if self.busy_share < 1 and worked > 0:
            rest = worked * (1 - self.busy_share) / self.busy_share
            self._sleep(rest)
            self.rested_s += rest
        self._since = self._clock()


def write_frozen(directory: Path, view: FrozenRows, last_seq: int, pacer: Pacer | None = None,
                 keep_cached: bool = True) -> Path:
    """Write a frozen view (``ColumnStore.freeze``) as the snapshot at ``last_seq``; meant for a
    worker thread while applies go on, paced by ``pacer`` (None: never rests). Returns the final
    path (durable on return).

    ``keep_cached`` False: the file's pages leave the page cache as they reach the disk
    (``_HashingWriter``'s ``drop_cached``): a timer's snapshot is read only after a crash, and
    otherwise each snapshot grows the page cache by its size (``storage.snapshot-drop-cache``, off
    by default: no CPU saved where memory is to spare, docs/storage.md). A stop's final snapshot
    keeps them: the next start maps it.

    Raises:
        OSError: the write failed (ENOSPC...); the temporary is deleted, nothing else changed.
    """
    tmp = directory / f"{_TMP_PREFIX}{last_seq:020d}.tmp"
    try:
        _write_temporary(tmp, view, last_seq, (pacer or Pacer(1.0)).pause, keep_cached)
        final = directory / snapshot_name(last_seq)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    return final


def _write_temporary(tmp: Path, view: FrozenRows, last_seq: int, pause: Callable[[], None],
                     keep_cached: bool = True) -> None:
    frozen = view.engine
    if frozen is None:
        raise ValueError("write of a released frozen view")
    offsets = frozen.offsets()
    with open(tmp, "w+b") as f:  # (read too: _HashingWriter.adopt)
        f.write(bytes(HEADER_BYTES))
        w = _HashingWriter(f, drop_cached=not keep_cached)
        w.array(frozen.a)
        w.array(frozen.b)
        w.array(offsets)
        w.array(view.touches)
        pause()
        _write_fields(w, frozen, pause)
        writers, floors, counts, exceptions = view.applied
        w.write(struct.pack("<Q", writers.shape[0]))
        for arr in (writers, floors, counts, exceptions):
            w.array(arr)
        tracked, promised, bw, bs, bc, cols_applied = view.applied_columns
        w.write(struct.pack("<Q", tracked.shape[0]))
        w.array(tracked)
        w.array(promised)
        w.write(struct.pack("<Q", bw.shape[0]))
        for arr in (bw, bs, bc, cols_applied):
            w.array(arr)
        header = SNAPSHOT_RECORD.pack_header(version=SNAPSHOT_FORMAT_VERSION, payload_bytes=w.n,
                                             payload_xxh3=w.h.intdigest(), last_seq=last_seq,
                                             rows=frozen.num_rows, entries=int(offsets[-1]))
        f.seek(0)
        f.write(header)
        f.flush()
        os.fsync(f.fileno())
        if w.drop_cached:  # the whole file (the header's page was written again just now)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _write_fields(w: _HashingWriter, frozen: FrozenEngine, pause: Callable[[], None]) -> None:
    """The four entry sections. With at most one delta run, one section after another, each from
    its own pieces (a piece is a slice of the base, or one merge of it with the delta's entries
    there). With several, the delta runs' entries of a piece would be merged again for every field
    (3/4 of a snapshot's CPU, measured): the pieces are made once, all four fields together, the
    first section appended and the other three put at their offsets, then hashed in order."""
    if len(frozen.deltas) < ONE_PASS_MIN_DELTAS:
        for name, dtype in _FIELDS:
            for (piece,) in frozen.entry_chunks((name,), WRITE_CHUNK_BYTES // np.dtype(dtype).itemsize):
                w.array(piece)
                pause()
        return
    n = frozen.num_entries
    sizes = [n * np.dtype(dtype).itemsize for _, dtype in _FIELDS]
    start = [w.n]
    for size in sizes[:-1]:
        start.append(start[-1] + size)  # each section's body offset
    at = start.copy()
    widest = max(np.dtype(dtype).itemsize for _, dtype in _FIELDS)
    for pieces in frozen.entry_chunks([name for name, _ in _FIELDS], WRITE_CHUNK_BYTES // widest):
        w.array(pieces[0])
        at[0] += pieces[0].nbytes
        for k in range(1, len(pieces)):
            w.write_at(at[k], pieces[k])
            at[k] += pieces[k].nbytes
        pause()
    if [a - b for a, b in zip(at, start)] != sizes:  # the frozen view's own count disagrees: a bug
        raise RuntimeError(f"snapshot entry sections of {[a - b for a, b in zip(at, start)]} bytes, {sizes} due")
    w.adopt(sum(sizes[1:]))


class _Reader:
    """Reads the body sequentially, hashing as it goes, with offsets for error messages; from the
    file, or from its mapping (``mapping``: snapshot_map.py) when given."""

    def __init__(self, f: io.BufferedReader, path: Path, end: int, mapping: SnapshotMapping | None = None) -> None:
        self.f, self.path, self.end, self.mapping = f, path, end, mapping
        self.pos = HEADER_BYTES
        self.h = xxhash.xxh3_64()

    def fail(self, reason: str, at: int | None = None) -> CorruptSnapshotError:
        return CorruptSnapshotError(str(self.path), self.pos if at is None else at, reason)

    def array(self, dtype: type[np.generic], count: int, room: int = 0, view: bool = False) -> NDArray[Any]:
        """The next ``count`` values; with ``room``, the prefix of a buffer that many values longer.
        ``view`` (a mapped load only): a read-only view of the mapping instead of a copy."""
        nbytes = np.dtype(dtype).itemsize * count
        if count < 0 or self.pos + nbytes > self.end:
            raise self.fail(f"section of {nbytes} bytes runs past the end of the body")
        if self.mapping is not None:
            src = self.mapping.view(dtype, count, self.pos)
            self.h.update(src.view(np.uint8).data)
            self.pos += nbytes
            if view:
                return src
        buf = filled_buffer(dtype, count + room)  # small pages while filled (page_advice.py)
        out = buf[:count]
        if self.mapping is not None:
            np.copyto(out, src)
        else:
            data = out.view(np.uint8).data
            if self.f.readinto(data) != nbytes:
                raise self.fail("file shorter than its header says")
            self.h.update(data)
            self.pos += nbytes
        allow_huge_pages(buf)
        return out


def read_snapshot(path: Path, capacity_bytes: int, verify_rows: bool = True, room: int = 0,
                  mapping: SnapshotMapping | None = None) -> tuple[ColumnStore, int]:
    """Load a snapshot (format 2, or 1 converted: module docstring) into a new store; returns
    (store, last_seq).

    Args:
        path: the snapshot file.
        capacity_bytes: the store's capacity (a snapshot larger than it still loads; ``is_full`` says so).
        verify_rows: also check every row's entry order, segments and strengths (the checksum already
            rules out damage on disk; this guards against a writer bug, at some cost: see the bench).
        room: entries the store may grow by next (a log replay's upper bound): the entry fields are
            read into buffers with that much room past their end, so the replay's merges fill it
            (``ColumnStore.load_bulk``) instead of copying the loaded rows into larger buffers
            first. Room never written is address space, not memory. Format 2 only.
        mapping: ``path`` mapped (``SnapshotMapping.open``): the row offsets and the entries' key
            fields become read-only views of it instead of copies (snapshot_map.py: no fresh pages
            for them); the strengths, row keys and the rest are copied out of it. Every check is the
            same. Without ``room`` only (a mapping ends with the file); ``loaded`` is called on it.

    Raises:
        CorruptSnapshotError: naming the file and the byte offset of the first problem.
    """
    if mapping is not None and room:
        raise ValueError("read_snapshot: a mapped load has no room past its arrays")
    try:
        return _read(path, capacity_bytes, verify_rows, room, mapping)
    finally:
        if mapping is not None:
            mapping.loaded()


def _read(path: Path, capacity_bytes: int, verify_rows: bool, room: int, mapping: SnapshotMapping | None
          ) -> tuple[ColumnStore, int]:
    """``read_snapshot``'s load."""
    size = mapping.size if mapping is not None else path.stat().st_size
    with open(path, "rb") as f:
        try:
            head = SNAPSHOT_RECORD.read_header(f.read(HEADER_BYTES))
            SNAPSHOT_RECORD.check_extent(head, size)
        except RecordError as err:
            raise CorruptSnapshotError(str(path), err.offset, err.detail) from None
        if head.fields["flags"] != 0:
            raise CorruptSnapshotError(str(path), 12, f"unsupported snapshot flags {head.fields['flags']}")
        last_seq, r, n = head.fields["last_seq"], head.fields["rows"], head.fields["entries"]
        rd = _Reader(f, path, size, mapping)
        rc, rf = rd.array(np.uint64, r), rd.array(np.uint64, r)
        off_at = rd.pos
        offsets = rd.array(np.int64, r + 1, view=True)
        touches = rd.array(np.uint64, r)
        if offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) <= 0):
            raise rd.fail("row offsets are not a partition of the entries into non-empty rows", off_at)
        entries_at = rd.pos
        if head.version == _REGIONS_FORMAT:
            rows = unpack_regions(rd.array(np.uint8, ENTRY_BYTES * n, view=True), offsets)  # every region: one readinto
        else:
            tc, tf = rd.array(np.uint64, n, room, view=True), rd.array(np.uint64, n, room, view=True)
            rows = Row(target_column=tc, target_feature=tf, strength=rd.array(np.float32, n, room),  # added to in place
                       segment=rd.array(np.uint8, n, room, view=True))
        w_at = rd.pos
        (num_writers,) = struct.unpack("<Q", rd.array(np.uint8, 8).tobytes())
        ws = rd.array(np.uint64, num_writers)
        floors = rd.array(np.uint64, num_writers)
        counts = rd.array(np.uint64, num_writers)
        exc = rd.array(np.uint64, int(counts.sum(dtype=np.uint64)) if num_writers else 0)
        column_arrays: list[NDArray[np.uint64]] = []
        c_at = rd.pos
        if head.version != _REGIONS_FORMAT:
            (num_tracked,) = struct.unpack("<Q", rd.array(np.uint8, 8).tobytes())
            column_arrays += [rd.array(np.uint64, num_tracked), rd.array(np.uint64, num_tracked)]
            (num_batches,) = struct.unpack("<Q", rd.array(np.uint8, 8).tobytes())
            column_arrays += [rd.array(np.uint64, num_batches) for _ in range(3)]
            column_arrays.append(rd.array(np.uint64, int(column_arrays[-1].sum(dtype=np.uint64))))
        if rd.pos != size:
            raise rd.fail("trailing bytes after the applied set")
        try:
            SNAPSHOT_RECORD.check_payload(head, rd.h.intdigest())
        except RecordError:
            raise CorruptSnapshotError(str(path), HEADER_BYTES, "body checksum mismatch") from None
        # The bytes are the ones written; now check that what was written is well formed.
        if (head.version == _REGIONS_FORMAT and r > 1
                and not np.all((rc[1:] > rc[:-1]) | ((rc[1:] == rc[:-1]) & (rf[1:] > rf[:-1])))):
            raise CorruptSnapshotError(str(path), HEADER_BYTES, "row keys not sorted and unique")
        try:
            applied = AppliedSet.from_arrays(ws, floors, counts, exc)
        except ValueError as e:
            raise CorruptSnapshotError(str(path), w_at, str(e)) from None
        if column_arrays:
            try:
                applied.load_column_arrays(*column_arrays)
            except ValueError as e:
                raise CorruptSnapshotError(str(path), c_at, str(e)) from None
    if verify_rows:
        bad = first_bad_row(rows, offsets)
        if bad is not None:
            i, problem = bad
            # (the row's region in format 1, its first target column in format 2)
            at = entries_at + (ENTRY_BYTES if head.version == _REGIONS_FORMAT else 8) * int(offsets[i])
            raise CorruptSnapshotError(str(path), at, f"row {i}: {problem}")
    store = ColumnStore(capacity_bytes)
    store.applied = applied
    try:
        store.load_bulk(rc, rf, offsets, rows, touches, spare=room > 0 and head.version != _REGIONS_FORMAT)
    except ValueError as e:  # a key that repeats
        raise CorruptSnapshotError(str(path), HEADER_BYTES, str(e)) from None
    return store, int(last_seq)


def first_bad_row(rows: Row, offsets: NDArray[np.int64]) -> tuple[int, str] | None:
    """The first row of ``rows`` (concatenated, row i ``[offsets[i], offsets[i+1])``) that is not
    well formed, with what is wrong (its first problem in the order segment, strength, entry
    order), or None. Entries are ordered by (segment, target column, target feature), as
    ``row_merge.packed_keys``. Vectorised, in runs of about ``VERIFY_CHUNK_ENTRIES`` entries
    (temporaries that stay in cache)."""
    num_rows = offsets.shape[0] - 1
    if num_rows < 1:
        return None
    # A clean store (the common case) is one compiled pass (rowengine/canon.py, 0.6-0.8 ns per
    # entry against ~1.7 for the numpy checks below); those run only to name a fault's row.
    if not entries_fault(offsets, rows.segment, rows.target_column, rows.target_feature, rows.strength,
                         NUM_SEGMENTS):
        return None
    starts = np.searchsorted(offsets, np.arange(0, int(offsets[-1]), VERIFY_CHUNK_ENTRIES), "right") - 1
    bounds = [*np.unique(starts).tolist(), num_rows]
    for r0, r1 in zip(bounds, bounds[1:]):
        run = offsets[r0 : r1 + 1]
        a, z = int(run[0]), int(run[-1])
        bad = _first_bad_in(rows.segment[a:z], rows.target_column[a:z], rows.target_feature[a:z],
                            rows.strength[a:z], run - run[0])
        if bad is not None:
            return r0 + bad[0], bad[1]
    return None


def _first_bad_in(seg: NDArray[np.uint8], c: NDArray[np.uint64], f: NDArray[np.uint64], strength: NDArray[np.float32],
                  offsets: NDArray[np.int64]) -> tuple[int, str] | None:
    """``first_bad_row`` for one run of rows (``offsets`` from 0)."""
    m = int(offsets[-1])
    found: list[tuple[int, int, str]] = []  # (entry, rank of the problem, problem)
    # (each check is one pass, ``all``/``any``; the failing entry is looked for only on a failure)
    if (seg >= NUM_SEGMENTS).any():
        found.append((int(np.flatnonzero(seg >= NUM_SEGMENTS)[0]), 0, "segment out of range"))
    if not np.isfinite(strength).all():
        found.append((int(np.flatnonzero(~np.isfinite(strength))[0]), 1, "non-finite strength"))
    if m > 1:
        s0, s1, c0, c1 = seg[:-1], seg[1:], c[:-1], c[1:]
        ok = (s1 > s0) | ((s1 == s0) & ((c1 > c0) | ((c1 == c0) & (f[1:] > f[:-1]))))
        ok[offsets[1:-1] - 1] = True  # pairs across a row boundary are not compared
        if not ok.all():
            found.append((int(np.flatnonzero(~ok)[0]), 2, "entries not sorted and unique"))
    if not found:
        return None
    # entry -> row; the lowest row wins, then the problem's rank
    rows = np.searchsorted(offsets, [entry for entry, _, _ in found], "right") - 1
    row, _, problem = min((int(r), rank, problem) for r, (_, rank, problem) in zip(rows.tolist(), found))
    return row, problem
