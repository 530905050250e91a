"""Snapshots: every row and the applied set at one log seq, checksummed, written atomically.

Byte layout (little-endian; docs/storage.md has the full table). Format 3 (written since Nov 29's
direct snapshot writes) holds the engine's arrays as they are, field-major:

    header (64 B): magic "GIAANNSN" | version u32 (3) | flags u32 (0) | last_seq u64 | rows R u64
                   | entries N u64 | body_len u64 | body_xxh3 u64 | header_xxh3 u64 (first 56 B)
    body:          row_column u64[R] | row_feature u64[R] | offsets i64[R+1] | touches u64[R]
                   | target_column u64[N] | target_feature u64[N] | strength f32[N] | segment u8[N]
                   | writers W u64 | writer u64[W] | floor u64[W] | count u64[W] | exceptions u64[E]
                   | tracked T u64 | writer u64[T] | promised u64[T]
                   | batches B u64 | writer u64[B] | seq u64[B] | count u64[B] | columns u64[C]

``body_xxh3`` of format 3 is the xxh3-64 of four digests (``combine_digests``): the xxh3-64 of
each *part* of the body, cut where the target features, the strengths and the segments begin
(``part_offsets``, from R and N). Why parts: the writer makes the four entry sections in one pass
over the entries (each piece of the merged rows is made once, for all four fields) and appends
each to its own part, so no section has to be read back to be hashed in file order, and the file
can be written with ``O_DIRECT`` (snapshot_io.py). Format 2 is the same body under one xxh3-64 of
all of it; it still loads.

The last two sections (formats 2 and 3) are the applied set's columns (applied_set.py, "Which
columns"): the tracked training writers with their promised floors, and the columns applied under
each batch id still in flight. A format-1 file has neither: it loads with no writer tracked.

Rows are in the engine's row-id order (keys unique, not sorted): row i is entries
``[offsets[i], offsets[i+1])`` of each field array, sorted by (segment, target column, target
feature). Format 1 (before the row engine) has the same header and sections up to ``touches``, rows
sorted by key, then the R row *regions* back to back (regions.py layout, 21 B per entry) in place
of the four field arrays; it still loads, converted by four vectorised gathers
(``regions.unpack_regions``), and the next snapshot is written as format 3.

Writing: ``.snapshot-<seq>.tmp`` is written from a frozen view (``ColumnStore.freeze``: no copy of
the rows but their strengths) in pieces of about ``WRITE_CHUNK_BYTES``, its four parts as four
streams at their offsets, the header last; through the page cache (flushed every
``SYNC_EVERY_BYTES``) or, for a timer's snapshot with ``storage.snapshot-direct-io``, around it
(``O_DIRECT``: snapshot_io.py); then fsync, atomic rename to ``snapshot-<seq, 20 digits>.snap``
and a directory fsync: a crash at any point leaves either the old snapshot or the new one, never a
half file under the final name. A write that fails (a full disk) deletes its temporary before
raising, so a failed snapshot does not keep the space it could not finish using; a crash's
temporary is deleted by the next start (``remove_temporaries``, before anything else is written).

Reading: each section is read into its final array in pieces of ``READ_CHUNK_BYTES``, hashed as
it goes; or, from a mapping of the file (``read_snapshot``'s ``mapping``, snapshot_map.py), hashed
through it, the row offsets and the entries' segments, target columns and target features kept as
read-only views of it and the other sections copied out (in slices, one per thread: ``_copy_out``).
The load says how far it got after each piece (``progress``: a restart's read-ahead follows it,
read_ahead.py). Both checksums are verified before anything is trusted, then
the structure; every failure is a :class:`CorruptSnapshotError` naming the file and byte offset.
The arrays then *are* the engine's base run, and the key index is built in one vectorised pass:
no per-row Python anywhere. The header and its checks are the shared record codec's
(``giaannd.records``, ``SNAPSHOT_RECORD``: the whole file is one record whose payload, the body, is
streamed rather than held twice).
"""

from __future__ import annotations

import errno
import io
import logging
import os
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xxhash
from numpy.typing import NDArray

from giaannd.atomic_file import fsync_dir
from giaannd.model.rows import NUM_SEGMENTS, Row
from giaannd.records import RecordError, RecordFormat
from giaannd.rowengine.canon import entries_fault
from giaannd.rowengine.frozen import FrozenEngine
from giaannd.storage.engine.applied_set import AppliedSet
from giaannd.storage.engine.column_store import ENTRY_BYTES, ColumnStore, FrozenRows
from giaannd.storage.engine.errors import CorruptSnapshotError
from giaannd.storage.engine.page_advice import allow_huge_pages, filled_buffer
from giaannd.storage.engine.regions import unpack_regions
from giaannd.storage.engine.snapshot_io import CachedFile, DirectFile, PartStream, SnapshotFile, open_temporary
from giaannd.storage.engine.snapshot_map import SnapshotMapping
from giaannd.unique import unique

__all__ = ["SNAPSHOT_FORMAT_VERSION", "SNAPSHOT_RECORD", "Pacer", "WriteMode", "body_checksum", "combine_digests",
           "direct_io_refused", "first_bad_row", "list_snapshots", "list_temporaries", "part_offsets",
           "read_snapshot", "remove_temporaries", "snapshot_name", "write_frozen", "write_snapshot"]

log = logging.getLogger(__name__)

MAGIC = b"GIAANNSN"
#: Written: the engine's field arrays, the body hashed in four parts (module docstring). Formats 1
#: (row regions) and 2 (one body hash) still load.
SNAPSHOT_FORMAT_VERSION = 3
_REGIONS_FORMAT = 1
#: The first format whose body checksum is over its parts (``part_offsets``, ``combine_digests``).
_PARTS_FORMAT = 3
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
#: A load hashes (and reads, from a file) each section in pieces of this many bytes, saying after
#: each how far it got (``read_snapshot``'s ``progress``): a piece's hash is ~2 ms, so a restart's
#: read-ahead thread (read_ahead.py) gets the GIL between pieces and follows the load closely.
READ_CHUNK_BYTES = 16 << 20
#: How a snapshot's bytes reach the disk (``write_frozen``'s ``mode``; snapshot_io.py).
WriteMode = Literal["cached", "dropped", "direct"]
#: Directories whose file system refused ``O_DIRECT``: their snapshots are written "cached".
_NO_DIRECT: set[Path] = set()
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
    """One part of the body (``part_offsets``): appends its bytes in order to its stream of the
    file (snapshot_io.py) and hashes them; ``n`` bytes so far."""

    def __init__(self, stream: PartStream) -> None:
        self.stream, self.h, self.n = stream, xxhash.xxh3_64(), 0

    def write(self, buf: memoryview | bytes) -> None:
        view = memoryview(buf)
        self.h.update(view)
        self.stream.write(view)
        self.n += len(view)

    def array(self, values: NDArray[np.generic]) -> None:
        self.write(_bytes_of(values))


def part_offsets(rows: int, entries: int) -> tuple[int, int, int]:
    """Body offsets where parts 1, 2 and 3 begin (format 3): the target features, the strengths and
    the segments (the last part runs to the end, the applied set included); part 0 is everything
    before, the row arrays and the target columns."""
    features = 8 * (4 * rows + 1) + 8 * entries
    return features, features + 8 * entries, features + 12 * entries


def combine_digests(digests: list[int]) -> int:
    """Format 3's body checksum: the xxh3-64 of the parts' xxh3-64 digests (u64 little-endian, in
    file order)."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


def body_checksum(body: bytes | memoryview, rows: int, entries: int, version: int = SNAPSHOT_FORMAT_VERSION) -> int:
    """The header's body checksum of ``body`` (formats 1 and 2: the xxh3-64 of the body; 3: of its
    parts, ``combine_digests``). For tools and tests that build or reseal a file."""
    if version < _PARTS_FORMAT:
        return xxhash.xxh3_64_intdigest(body)
    cuts = [0, *part_offsets(rows, entries), len(body)]
    return combine_digests([xxhash.xxh3_64_intdigest(body[a:b]) for a, b in zip(cuts, cuts[1:])])


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


def direct_io_refused(directory: Path) -> bool:
    """Whether ``directory``'s file system refused a direct snapshot write (``write_frozen``): its
    snapshots are then written through the page cache."""
    return directory in _NO_DIRECT


def write_frozen(directory: Path, view: FrozenRows, last_seq: int, pacer: Pacer | None = None,
                 mode: WriteMode = "cached") -> Path:
    """Write a frozen view (``ColumnStore.freeze``) as the snapshot at ``last_seq``; meant for a
    worker thread while applies go on, paced by ``pacer`` (None: never rests). Returns the final
    path (durable on return).

    ``mode``, how the bytes reach the disk (snapshot_io.py): "cached" through the page cache (a
    stop's final snapshot: the next start maps it from there); "dropped" the same, its pages
    leaving the cache once on disk (``storage.snapshot-drop-cache``); "direct" around the cache
    with ``O_DIRECT`` (a timer's snapshot with ``storage.snapshot-direct-io``: read only after a
    crash, less kernel CPU, no page cache filled). Where the file system refuses direct I/O the write is
    made "cached" instead, and so are that directory's later ones (a warning, once).

    Raises:
        OSError: the write failed (ENOSPC...); the temporary is deleted, nothing else changed.
    """
    view.materialize()  # a lazy freeze's copies, made here while applies go on (rowengine/cow.py)
    tmp = directory / f"{_TMP_PREFIX}{last_seq:020d}.tmp"
    pause = (pacer or Pacer(1.0)).pause
    if mode == "direct" and directory in _NO_DIRECT:
        mode = "cached"
    try:
        try:
            _write_temporary(tmp, view, last_seq, pause, mode)
        except OSError as exc:
            if mode != "direct" or exc.errno != errno.EINVAL:
                raise
            _NO_DIRECT.add(directory)
            log.warning("direct I/O refused in %s (%s): its snapshots are written through the page cache",
                        directory, exc)
            _write_temporary(tmp, view, last_seq, pause, "cached")
        final = directory / snapshot_name(last_seq)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    return final


def _write_temporary(tmp: Path, view: FrozenRows, last_seq: int, pause: Callable[[], None], mode: WriteMode) -> None:
    frozen = view.engine
    if frozen is None:
        raise ValueError("write of a released frozen view")
    offsets = frozen.offsets()
    rows, entries = frozen.num_rows, int(offsets[-1])
    cuts = part_offsets(rows, entries)
    fd = open_temporary(tmp, mode == "direct")
    try:
        out: SnapshotFile = DirectFile(fd) if mode == "direct" else CachedFile(fd, drop=mode == "dropped")
        parts = [_HashingWriter(out.stream(HEADER_BYTES + at)) for at in (0, *cuts)]
        head, tail = parts[0], parts[-1]
        head.array(frozen.a)
        head.array(frozen.b)
        head.array(offsets)
        head.array(view.touches)
        pause()
        _write_fields(parts, frozen, pause)
        writers, floors, counts, exceptions = view.applied
        tail.write(struct.pack("<Q", writers.shape[0]))
        for arr in (writers, floors, counts, exceptions):
            tail.array(arr)
        tracked, promised, bw, bs, bc, cols_applied = view.applied_columns
        tail.write(struct.pack("<Q", tracked.shape[0]))
        tail.array(tracked)
        tail.array(promised)
        tail.write(struct.pack("<Q", bw.shape[0]))
        for arr in (bw, bs, bc, cols_applied):
            tail.array(arr)
        for part in parts:
            part.stream.close()
        ends = [sum(p.n for p in parts[: k + 1]) for k in range(len(parts) - 1)]
        if tuple(ends) != cuts:  # the frozen view's own counts disagree: a bug
            raise RuntimeError(f"snapshot parts end at body offsets {ends}, {list(cuts)} due")
        body = cuts[-1] + tail.n
        header = SNAPSHOT_RECORD.pack_header(version=SNAPSHOT_FORMAT_VERSION, payload_bytes=body,
                                             payload_xxh3=combine_digests([p.h.intdigest() for p in parts]),
                                             last_seq=last_seq, rows=rows, entries=entries)
        out.finish(header, HEADER_BYTES + body)
    finally:
        os.close(fd)


def _write_fields(parts: list[_HashingWriter], frozen: FrozenEngine, pause: Callable[[], None]) -> None:
    """The four entry sections, in one pass over the entries: each piece (a slice of the base, or
    one merge of it with the delta runs' entries there, made once for the four fields) appended
    to the end of part 0 (target columns) and to parts 1-3, whose streams begin at their
    sections' offsets."""
    widest = max(np.dtype(dtype).itemsize for _, dtype in _FIELDS)
    for pieces in frozen.entry_chunks([name for name, _ in _FIELDS], WRITE_CHUNK_BYTES // widest):
        for part, piece in zip(parts, pieces):
            part.array(piece)
        pause()


class _Reader:
    """Reads the body sequentially, hashing as it goes, with offsets for error messages; from the
    file, or from its mapping (``mapping``: snapshot_map.py) when given. ``cuts``: body offsets
    where a new part's hash begins (format 3: ``part_offsets``); ``digest()`` is the body's
    checksum as its header states it. ``progress``: told the file offset read up to, every
    ``READ_CHUNK_BYTES`` (a restart's read-ahead follows it: read_ahead.py). ``threads``: a mapped
    section is copied out in up to that many threads (``_copy_out``)."""

    def __init__(self, f: io.BufferedReader, path: Path, end: int, mapping: SnapshotMapping | None = None,
                 cuts: tuple[int, ...] = (), progress: Callable[[int], None] | None = None, threads: int = 1
                 ) -> None:
        self.f, self.path, self.end, self.mapping, self.threads = f, path, end, mapping, threads
        self.pos = HEADER_BYTES
        self.h = xxhash.xxh3_64()
        self._cuts = [HEADER_BYTES + at for at in cuts]
        self._parts: list[int] | None = [] if cuts else None
        self._progress = progress

    def _hash(self, data: memoryview) -> None:
        while self._cuts and self.pos >= self._cuts[0]:  # (sections start at cuts: none spans one)
            assert self._parts is not None
            self._parts.append(self.h.intdigest())
            self.h = xxhash.xxh3_64()
            del self._cuts[0]
        self.h.update(data)

    def _take(self, data: NDArray[np.uint8], read: bool) -> None:
        """Hash the section's bytes ``data`` (``read``: reading them from the file into it first)
        a chunk at a time, moving ``pos`` past each and reporting it."""
        for a in range(0, data.shape[0], READ_CHUNK_BYTES):
            chunk = data[a:a + READ_CHUNK_BYTES].data
            if read and self.f.readinto(chunk) != len(chunk):
                raise self.fail("file shorter than its header says")
            self._hash(chunk)
            self.pos += len(chunk)
            if self._progress is not None:
                self._progress(self.pos)

    def digest(self) -> int:
        if self._parts is None:
            return self.h.intdigest()
        self._hash(memoryview(b""))  # (cuts at the very end: empty parts)
        return combine_digests([*self._parts, self.h.intdigest()])

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
            self._take(src.view(np.uint8), read=False)
            if view:
                return src
        buf = filled_buffer(dtype, count + room)  # small pages while filled (page_advice.py)
        out = buf[:count]
        if self.mapping is not None:
            _copy_out(out, src, self.threads)
        else:
            self._take(out.view(np.uint8), read=True)
        allow_huge_pages(buf)
        return out


#: A mapped load copies a section out of the mapping in shares of at least this many bytes, one per
#: thread (``_copy_out``): what the copy costs is the first touch of its fresh pages (~3 µs per 4 KiB
#: on this project's VM), which threads share: 240 MB of strengths took 0.18-0.28 s in one thread
#: and 0.08-0.11 s in two.
COPY_SHARE_MIN_BYTES = 32 << 20


def _copy_out(out: NDArray[Any], src: NDArray[Any], threads: int) -> None:
    """``np.copyto(out, src)`` (1-d, same length), in up to ``threads`` slices at once (numpy
    releases the GIL while it copies)."""
    shares = min(threads, out.nbytes // COPY_SHARE_MIN_BYTES)
    if shares <= 1:
        np.copyto(out, src)
        return
    cuts = np.linspace(0, out.shape[0], shares + 1).astype(np.int64).tolist()

    def copy(a: int, z: int) -> None:
        np.copyto(out[a:z], src[a:z])

    with ThreadPoolExecutor(shares, thread_name_prefix="snapshot-copy") as pool:
        list(pool.map(copy, cuts[:-1], cuts[1:]))


def read_snapshot(path: Path, capacity_bytes: int, verify_rows: bool = True, room: int = 0,
                  mapping: SnapshotMapping | None = None, progress: Callable[[int], None] | None = None,
                  threads: int = 1) -> tuple[ColumnStore, int]:
    """Load a snapshot (format 3 or 2, or 1 converted: module docstring) into a new store; returns
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
        progress: called with the file offset the load has read up to, as it goes (a restart's
            read-ahead: read_ahead.py).
        threads: the row checks run in up to that many threads (``first_bad_row``), and a mapped
            load copies its sections out in as many (``_copy_out``).

    Raises:
        CorruptSnapshotError: naming the file and the byte offset of the first problem.
    """
    if mapping is not None and room:
        raise ValueError("read_snapshot: a mapped load has no room past its arrays")
    try:
        return _read(path, capacity_bytes, verify_rows, room, mapping, progress, threads)
    finally:
        if mapping is not None:
            mapping.loaded()


def _read(path: Path, capacity_bytes: int, verify_rows: bool, room: int, mapping: SnapshotMapping | None,
          progress: Callable[[int], None] | None = None, threads: int = 1) -> tuple[ColumnStore, int]:
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
        cuts = part_offsets(r, n) if head.version >= _PARTS_FORMAT else ()
        rd = _Reader(f, path, size, mapping, cuts, progress, threads)
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
            SNAPSHOT_RECORD.check_payload(head, rd.digest())
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
        bad = first_bad_row(rows, offsets, threads)
        if bad is not None:
            i, problem = bad
            # (the row's region in format 1, its first target column in formats 2 and 3)
            at = entries_at + (ENTRY_BYTES if head.version == _REGIONS_FORMAT else 8) * int(offsets[i])
            raise CorruptSnapshotError(str(path), at, f"row {i}: {problem}")
    store = ColumnStore(capacity_bytes)
    store.applied = applied
    try:
        store.load_bulk(rc, rf, offsets, rows, touches, spare=room > 0 and head.version != _REGIONS_FORMAT)
    except ValueError as e:  # a key that repeats
        raise CorruptSnapshotError(str(path), HEADER_BYTES, str(e)) from None
    return store, int(last_seq)


def first_bad_row(rows: Row, offsets: NDArray[np.int64], threads: int = 1) -> tuple[int, str] | None:
    """The first row of ``rows`` (concatenated, row i ``[offsets[i], offsets[i+1])``) that is not
    well formed, with what is wrong (its first problem in the order segment, strength, entry
    order), or None. Entries are ordered by (segment, target column, target feature), as
    ``row_merge.packed_keys``. Vectorised, in runs of about ``VERIFY_CHUNK_ENTRIES`` entries
    (temporaries that stay in cache). ``threads``: a clean store is checked in up to that many
    threads at once (``_any_fault``)."""
    num_rows = offsets.shape[0] - 1
    if num_rows < 1:
        return None
    # A clean store (the common case) is one compiled pass (rowengine/canon.py, a few ns per
    # entry against ~1.7 per check for the numpy ones below); those run only to name a fault's row.
    if not _any_fault(rows, offsets, threads):
        return None
    starts = np.searchsorted(offsets, np.arange(0, int(offsets[-1]), VERIFY_CHUNK_ENTRIES), "right") - 1
    bounds = [*unique(starts).tolist(), num_rows]
    for r0, r1 in zip(bounds, bounds[1:]):
        run = offsets[r0 : r1 + 1]
        a, z = int(run[0]), int(run[-1])
        bad = _first_bad_in(rows.segment[a:z], rows.target_column[a:z], rows.target_feature[a:z],
                            rows.strength[a:z], run - run[0])
        if bad is not None:
            return r0 + bad[0], bad[1]
    return None


#: A clean store's rows are checked in shares of at least this many entries, one per thread
#: (``_any_fault``): below it a thread's start costs more than the share's check (~3-6 ns an entry).
CHECK_SHARE_MIN_ENTRIES = 1 << 22


def _any_fault(rows: Row, offsets: NDArray[np.int64], threads: int) -> bool:
    """Whether ``canon.entries_fault`` finds a fault in the rows, in up to ``threads`` shares of
    whole rows checked at once (the kernel releases the GIL): every entry and every pair inside a
    row lies in exactly one share, and pairs across rows are not compared, so the shares find a
    fault exactly where one pass does. ``offsets`` must partition the entries (the reader checked)."""
    n = int(offsets[-1])
    shares = min(threads, n // CHECK_SHARE_MIN_ENTRIES)
    seg, tc, tf, st = rows.segment, rows.target_column, rows.target_feature, rows.strength
    if shares <= 1:
        return bool(entries_fault(offsets, seg, tc, tf, st, NUM_SEGMENTS))
    # share boundaries at the first row start at or after each equal cut of the entries
    cuts = np.searchsorted(offsets, np.arange(1, shares) * (n // shares), "left")
    bounds = unique(np.concatenate([[0], cuts, [offsets.shape[0] - 1]]))

    def check(r0: int, r1: int) -> bool:
        a, z = int(offsets[r0]), int(offsets[r1])
        return bool(entries_fault(offsets[r0:r1 + 1] - a, seg[a:z], tc[a:z], tf[a:z], st[a:z], NUM_SEGMENTS))

    with ThreadPoolExecutor(len(bounds) - 1, thread_name_prefix="row-check") as pool:
        return any(pool.map(check, bounds[:-1].tolist(), bounds[1:].tolist()))


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
