"""Snapshots: every row and the applied set at one log seq, checksummed, written atomically.

Byte layout (little-endian; docs/storage.md has the full table):

    header (64 B): magic "GIAANNSN" | version u32 | flags u32 (0) | last_seq u64 | rows R u64
                   | entries N u64 | body_len u64 | body_xxh3 u64 | header_xxh3 u64 (first 56 B)
    body:          row_column u64[R] | row_feature u64[R] | offsets i64[R+1] | touches u64[R]
                   | the R row regions back to back (column_store.py layout, 21 B per entry)
                   | writers W u64 | writer u64[W] | floor u64[W] | count u64[W] | exceptions u64[E]
                   | (version 2) tracked T u64 | writer u64[T] | promised u64[T]
                   |   batches B u64 | writer u64[B] | seq u64[B] | count u64[B] | columns u64[C]

Writing: ``.snapshot-<seq>.tmp`` is streamed (each row region written straight from RAM), the header
patched in, then fsync, atomic rename to ``snapshot-<seq, 20 digits>.snap`` and a directory fsync:
a crash at any point leaves either the old snapshot or the new one, never a half file under the
final name. A write that fails (a full disk) deletes its temporary before raising, so a failed
snapshot does not keep the space it could not finish using; a crash's temporary is deleted by the
next start (``remove_temporaries``, before anything else is written).

Reading verifies both checksums before anything is trusted, then checks the structure; every
failure is a :class:`CorruptSnapshotError` naming the file and byte offset. The header and its
checks are the shared record codec's (``giaannd.records``, ``SNAPSHOT_RECORD``: the whole file is one
record whose payload, the body, is streamed rather than held twice).
"""

from __future__ import annotations

import io
import os
import struct
import time
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.atomic_file import fsync_dir
from giaannd.model.rows import NUM_SEGMENTS
from giaannd.records import RecordError, RecordFormat
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.column_store import ENTRY_BYTES, GIL_SLICE_ROWS, ColumnStore, FrozenRows
from giaannd.storage.engine.errors import CorruptSnapshotError

__all__ = ["SNAPSHOT_FORMAT_VERSION", "SNAPSHOT_RECORD", "Pacer", "first_bad_row", "list_snapshots", "list_temporaries",
           "read_snapshot", "remove_temporaries", "snapshot_name", "write_frozen", "write_snapshot"]

MAGIC = b"GIAANNSN"
#: 2 added the applied columns section (applied_set.py, "Which columns"); version 1 files load
#: with no writer tracked (every applied id then counts as wholly applied, as it did).
SNAPSHOT_FORMAT_VERSION = 2
_FIRST_READ_VERSION = 1
#: The header (64 bytes; module docstring). No payload limit: the length must equal the file's size.
SNAPSHOT_RECORD = RecordFormat(
    "snapshot", MAGIC,
    [("version", "I"), ("flags", "I"), ("last_seq", "Q"), ("rows", "Q"), ("entries", "Q"), ("length", "Q"),
     ("payload_xxh3", "Q")],
    versions=(_FIRST_READ_VERSION, SNAPSHOT_FORMAT_VERSION), max_payload_bytes=None)
HEADER_BYTES = SNAPSHOT_RECORD.header_bytes  # 64
_PREFIX, _SUFFIX, _TMP_PREFIX = "snapshot-", ".snap", ".snapshot-"
#: Row regions are written in runs of about this many bytes (one concatenation + one write each):
#: large enough that the per-run Python cost vanishes, small enough that the copy holding the GIL
#: (a few hundred µs) does not stall the thread applying batches meanwhile.
WRITE_CHUNK_BYTES = 1 << 20
_REGION, _TOUCHES = attrgetter("region"), attrgetter("touches")
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
    def __init__(self, f: BinaryIO) -> None:
        self.f, self.h, self.n = f, xxhash.xxh3_64(), 0

    def write(self, buf: memoryview | bytes) -> None:
        self.h.update(buf)
        self.f.write(buf)
        self.n += len(buf)

    def array(self, values: NDArray[np.generic]) -> None:
        self.write(np.ascontiguousarray(values).data.cast("B"))


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


def write_frozen(directory: Path, view: FrozenRows, last_seq: int, pacer: Pacer | None = None) -> Path:
    """Write a frozen view (``ColumnStore.freeze``) as the snapshot at ``last_seq``; meant for a
    worker thread while applies go on, paced by ``pacer`` (None: never rests). Returns the final
    path (durable on return).

    Raises:
        OSError: the write failed (ENOSPC...); the temporary is deleted, nothing else changed.
    """
    tmp = directory / f"{_TMP_PREFIX}{last_seq:020d}.tmp"
    try:
        _write_temporary(tmp, view, last_seq, (pacer or Pacer(1.0)).pause)
        final = directory / snapshot_name(last_seq)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    return final


def _write_temporary(tmp: Path, view: FrozenRows, last_seq: int, pause: Callable[[], None]) -> None:
    # Per-row work in this thread holds the GIL the applying thread needs: only C-level loops
    # (map with attrgetter / __getitem__, fromiter), GIL_SLICE_ROWS rows at a time.
    cols, feats, slots = view.in_key_order(pause)
    regions: list[NDArray[np.uint8]] = []
    touches = np.empty(len(slots), np.uint64)
    sizes = np.empty(len(slots), np.int64)
    for a in range(0, len(slots), GIL_SLICE_ROWS):
        chunk = slots[a : a + GIL_SLICE_ROWS]
        regions += map(_REGION, chunk)
        touches[a : a + len(chunk)] = np.fromiter(map(_TOUCHES, chunk), np.uint64, len(chunk))
        sizes[a : a + len(chunk)] = np.fromiter(map(len, regions[a : a + len(chunk)]), np.int64, len(chunk))
        pause()
    del slots
    offsets = np.zeros(len(regions) + 1, np.int64)
    np.cumsum(sizes // ENTRY_BYTES, out=offsets[1:])
    with open(tmp, "wb") as f:
        f.write(bytes(HEADER_BYTES))
        w = _HashingWriter(f)
        w.array(cols)
        w.array(feats)
        w.array(offsets)
        w.array(touches)
        # Regions go out in runs of about WRITE_CHUNK_BYTES, each one concatenation + one write:
        # a write call per row would be a Python call per row (millions) in this thread, holding
        # the GIL the applying thread needs; a run is a short memcpy, then the GIL is released.
        ends = np.cumsum(sizes)
        cuts = np.unique(np.searchsorted(ends, np.arange(WRITE_CHUNK_BYTES, int(ends[-1]) if len(ends) else 0,
                                                          WRITE_CHUNK_BYTES), "left") + 1)
        a = 0
        for b in [*cuts.tolist(), len(regions)]:
            if b > a:  # (bytes.join takes any buffer, at a third of np.concatenate's cost per array)
                w.write(regions[a].data if b == a + 1 else b"".join(regions[a:b]))  # type: ignore[arg-type]
                pause()
            a = max(a, b)
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
        header = SNAPSHOT_RECORD.pack_header(payload_bytes=w.n, payload_xxh3=w.h.intdigest(), last_seq=last_seq,
                                             rows=len(regions), entries=int(offsets[-1]))
        f.seek(0)
        f.write(header)
        f.flush()
        os.fsync(f.fileno())


class _Reader:
    """Reads the body sequentially, hashing as it goes, with offsets for error messages."""

    def __init__(self, f: io.BufferedReader, path: Path, end: int) -> None:
        self.f, self.path, self.end = f, path, end
        self.pos = HEADER_BYTES
        self.h = xxhash.xxh3_64()

    def fail(self, reason: str, at: int | None = None) -> CorruptSnapshotError:
        return CorruptSnapshotError(str(self.path), self.pos if at is None else at, reason)

    def array(self, dtype: type[np.generic], count: int) -> NDArray[Any]:
        nbytes = np.dtype(dtype).itemsize * count
        if count < 0 or self.pos + nbytes > self.end:
            raise self.fail(f"section of {nbytes} bytes runs past the end of the body")
        out = np.empty(count, dtype)
        view = out.view(np.uint8)
        if self.f.readinto(view.data) != nbytes:
            raise self.fail("file shorter than its header says")
        self.h.update(view.data)
        self.pos += nbytes
        return out


def read_snapshot(path: Path, capacity_bytes: int, verify_rows: bool = True,
                  copy_rows: bool = False) -> tuple[ColumnStore, int]:
    """Load a snapshot into a new store; returns (store, last_seq).

    Args:
        path: the snapshot file.
        capacity_bytes: the store's capacity (a snapshot larger than it still loads; ``is_full`` says so).
        verify_rows: also check every row's entry order, segments and strengths (the checksum already
            rules out damage on disk; this guards against a writer bug, at some cost: see the bench).
        copy_rows: give each row a region of its own instead of a view of the one buffer read
            (``ColumnStore.load_bulk``).

    Raises:
        CorruptSnapshotError: naming the file and the byte offset of the first problem.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        try:
            head = SNAPSHOT_RECORD.read_header(f.read(HEADER_BYTES))
            SNAPSHOT_RECORD.check_extent(head, size)
        except RecordError as err:
            raise CorruptSnapshotError(str(path), err.offset, err.detail) from None
        if head.fields["flags"] != 0:
            raise CorruptSnapshotError(str(path), 12, f"unsupported snapshot flags {head.fields['flags']}")
        last_seq, r, n = head.fields["last_seq"], head.fields["rows"], head.fields["entries"]
        rd = _Reader(f, path, size)
        rc, rf = rd.array(np.uint64, r), rd.array(np.uint64, r)
        off_at = rd.pos
        offsets = rd.array(np.int64, r + 1)
        touches = rd.array(np.uint64, r)
        if offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) <= 0):
            raise rd.fail("row offsets are not a partition of the entries into non-empty rows", off_at)
        regions_at = rd.pos
        body = rd.array(np.uint8, ENTRY_BYTES * n)  # every row region: one readinto
        w_at = rd.pos
        (num_writers,) = struct.unpack("<Q", rd.array(np.uint8, 8).tobytes())
        ws = rd.array(np.uint64, num_writers)
        floors = rd.array(np.uint64, num_writers)
        counts = rd.array(np.uint64, num_writers)
        exc = rd.array(np.uint64, int(counts.sum(dtype=np.uint64)) if num_writers else 0)
        column_arrays: list[NDArray[np.uint64]] = []
        c_at = rd.pos
        if head.version >= 2:
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
        if r > 1 and not np.all((rc[1:] > rc[:-1]) | ((rc[1:] == rc[:-1]) & (rf[1:] > rf[:-1]))):
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
        bad = first_bad_row(body, offsets)
        if bad is not None:
            i, problem = bad
            raise CorruptSnapshotError(str(path), regions_at + ENTRY_BYTES * int(offsets[i]), f"row {i}: {problem}")
    store = ColumnStore(capacity_bytes)
    store.applied = applied
    store.load_bulk(rc, rf, offsets, body, touches, copy_rows)
    return store, int(last_seq)


def first_bad_row(body: NDArray[np.uint8], offsets: NDArray[np.int64]) -> tuple[int, str] | None:
    """The first row of ``body`` (regions back to back, entry ``offsets``) that is not well formed,
    with what is wrong (its first problem in the order segment, strength, entry order), or None.
    Entries are ordered by (segment, target column, target feature), as ``row_merge.packed_keys``.

    Vectorised, in runs of about ``VERIFY_CHUNK_ENTRIES`` entries (index arrays that stay in
    cache): each field of every entry is gathered through a view that sees a u64 / f32 at every
    byte offset (as ``regions.rows_of_regions``), at the byte the layout puts it (regions.py):
    entry e of the row at entry offset o with n entries has its target column at byte 13 o + 8 e,
    its feature 8 n further, its strength at 17 o + 16 n + 4 e and its segment at 20 o + 20 n + e —
    a per-row shift repeated over the row's entries, plus a multiple of e. Most of the time is the
    three gathers at unaligned byte offsets, about 4 ns per entry each (measured; views of other
    dtypes and ``np.take`` are no faster).
    """
    num_rows = offsets.shape[0] - 1
    if num_rows < 1:
        return None
    starts = np.searchsorted(offsets, np.arange(0, int(offsets[-1]), VERIFY_CHUNK_ENTRIES), "right") - 1
    bounds = [*np.unique(starts).tolist(), num_rows]
    for r0, r1 in zip(bounds, bounds[1:]):
        run = offsets[r0 : r1 + 1]
        bad = _first_bad_in(body[ENTRY_BYTES * int(run[0]) : ENTRY_BYTES * int(run[-1])], run - run[0])
        if bad is not None:
            return r0 + bad[0], bad[1]
    return None


def _first_bad_in(body: NDArray[np.uint8], offsets: NDArray[np.int64]) -> tuple[int, str] | None:
    """``first_bad_row`` for one run of rows: ``body`` their regions, ``offsets`` from 0."""
    m = int(offsets[-1])
    # int32 indices while they fit (half the memory traffic of int64)
    itype = np.int32 if body.shape[0] < 2**31 else np.int64
    first: NDArray[Any] = offsets[:-1].astype(itype)
    lengths: NDArray[Any] = np.diff(offsets).astype(itype)
    e: NDArray[Any] = np.arange(m, dtype=itype)
    seg = body[np.repeat(20 * (first + lengths), lengths) + e]
    f32 = np.ndarray((body.shape[0] - 3,), np.float32, body, 0, (1,))
    strength = f32[np.repeat(17 * first + 16 * lengths, lengths) + 4 * e]
    found: list[tuple[int, int, str]] = []  # (entry, rank of the problem, problem)
    # (each check is one pass, ``all``/``any``; the failing entry is looked for only on a failure)
    if (seg >= NUM_SEGMENTS).any():
        found.append((int(np.flatnonzero(seg >= NUM_SEGMENTS)[0]), 0, "segment out of range"))
    if not np.isfinite(strength).all():
        found.append((int(np.flatnonzero(~np.isfinite(strength))[0]), 1, "non-finite strength"))
    if m > 1:
        u64 = np.ndarray((body.shape[0] - 7,), np.uint64, body, 0, (1,))
        at = np.repeat(13 * first, lengths) + 8 * e
        c = u64[at]
        at += np.repeat(8 * lengths, lengths)
        f = u64[at]
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
