"""Snapshots: every row and the applied set at one log seq, checksummed, written atomically.

Byte layout (little-endian; docs/storage.md has the full table):

    header (64 B): magic "GIAANNSN" | version u32 | flags u32 (0) | last_seq u64 | rows R u64
                   | entries N u64 | body_len u64 | body_xxh3 u64 | header_xxh3 u64 (first 56 B)
    body:          row_column u64[R] | row_feature u64[R] | offsets i64[R+1] | touches u64[R]
                   | the R row regions back to back (column_store.py layout, 21 B per entry)
                   | writers W u64 | writer u64[W] | floor u64[W] | count u64[W] | exceptions u64[E]

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
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.atomic_file import fsync_dir
from giaannd.model.rows import NUM_SEGMENTS
from giaannd.records import RecordError, RecordFormat
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.column_store import ENTRY_BYTES, ColumnStore, row_from_region
from giaannd.storage.engine.errors import CorruptSnapshotError
from giaannd.storage.engine.row_merge import packed_keys

__all__ = ["SNAPSHOT_FORMAT_VERSION", "SNAPSHOT_RECORD", "list_snapshots", "list_temporaries", "read_snapshot",
           "remove_temporaries", "snapshot_name", "write_snapshot"]

MAGIC = b"GIAANNSN"
SNAPSHOT_FORMAT_VERSION = 1
#: The header (64 bytes; module docstring). No payload limit: the length must equal the file's size.
SNAPSHOT_RECORD = RecordFormat(
    "snapshot", MAGIC,
    [("version", "I"), ("flags", "I"), ("last_seq", "Q"), ("rows", "Q"), ("entries", "Q"), ("length", "Q"),
     ("payload_xxh3", "Q")],
    versions=(SNAPSHOT_FORMAT_VERSION, SNAPSHOT_FORMAT_VERSION), max_payload_bytes=None)
HEADER_BYTES = SNAPSHOT_RECORD.header_bytes  # 64
_PREFIX, _SUFFIX, _TMP_PREFIX = "snapshot-", ".snap", ".snapshot-"


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
    tmp = directory / f"{_TMP_PREFIX}{last_seq:020d}.tmp"
    try:
        _write_temporary(tmp, store, last_seq)
        final = directory / snapshot_name(last_seq)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    return final


def _write_temporary(tmp: Path, store: ColumnStore, last_seq: int) -> None:
    keys = store.keys()
    num_entries = 0
    with open(tmp, "wb") as f:
        f.write(bytes(HEADER_BYTES))
        w = _HashingWriter(f)
        slots = list(store.iter_slots())  # (key order, as ``keys``)
        offsets = np.zeros(len(keys) + 1, np.int64)
        np.cumsum(np.fromiter((len(region) // ENTRY_BYTES for _, _, region in slots), np.int64, len(slots)),
                  out=offsets[1:])
        num_entries = int(offsets[-1])
        w.array(np.array([k[0] for k in keys], np.uint64))
        w.array(np.array([k[1] for k in keys], np.uint64))
        w.array(offsets)
        w.array(np.array([t for _, t, _ in slots], np.uint64))
        for _, _, region in slots:
            w.write(region)
        writers, floors, counts, exceptions = store.applied.to_arrays()
        w.write(struct.pack("<Q", writers.shape[0]))
        for arr in (writers, floors, counts, exceptions):
            w.array(arr)
        header = SNAPSHOT_RECORD.pack_header(payload_bytes=w.n, payload_xxh3=w.h.intdigest(), last_seq=last_seq,
                                             rows=len(keys), entries=num_entries)
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


def read_snapshot(path: Path, capacity_bytes: int, verify_rows: bool = True) -> tuple[ColumnStore, int]:
    """Load a snapshot into a new store; returns (store, last_seq).

    Args:
        path: the snapshot file.
        capacity_bytes: the store's capacity (a snapshot larger than it still loads; ``is_full`` says so).
        verify_rows: also check every row's entry order, segments and strengths (the checksum already
            rules out damage on disk; this guards against a writer bug, at some cost: see the bench).

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
        regions = [rd.array(np.uint8, ENTRY_BYTES * int(c)) for c in np.diff(offsets)]
        w_at = rd.pos
        (num_writers,) = struct.unpack("<Q", rd.array(np.uint8, 8).tobytes())
        ws = rd.array(np.uint64, num_writers)
        floors = rd.array(np.uint64, num_writers)
        counts = rd.array(np.uint64, num_writers)
        exc = rd.array(np.uint64, int(counts.sum(dtype=np.uint64)) if num_writers else 0)
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
    store = ColumnStore(capacity_bytes)
    store.applied = applied
    pos = regions_at
    for i, region in enumerate(regions):
        if verify_rows:
            problem = _row_problem(region)
            if problem:
                raise CorruptSnapshotError(str(path), pos, f"row {i}: {problem}")
        store.load_row((int(rc[i]), int(rf[i])), region, int(touches[i]))
        pos += region.shape[0]
    return store, int(last_seq)


def _row_problem(region: NDArray[np.uint8]) -> str | None:
    row = row_from_region(region)
    if int(row.segment.max()) >= NUM_SEGMENTS:
        return "segment out of range"
    if not np.all(np.isfinite(row.strength)):
        return "non-finite strength"
    keys = packed_keys(row)  # byte order = key order (row_merge.py), one comparison per entry
    if len(row) > 1 and not np.all(keys[1:] > keys[:-1]):
        return "entries not sorted and unique"
    return None
