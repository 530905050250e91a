"""How a snapshot's bytes reach the disk: through the page cache, or around it (``O_DIRECT``).

A snapshot file is written as a few *parts*, each a run of bytes appended in order at its own
offset (snapshot.py: the body's parts, hashed apart, so that the four entry sections are written
in one pass over the entries without reading anything back). Both writers here take the parts as
streams (``stream(offset)``: ``write`` appends, ``close`` ends it) and end with ``finish(header,
size)``, which puts the header at offset 0, sets the file's length and makes it durable.

``CachedFile`` (mode "cached" and "dropped"): each stream ``pwrite``\\ s at its offset through
the page cache; every ``SYNC_EVERY_BYTES`` written the file is ``fdatasync``\\ ed (bounded dirty
data: a journal commit on ext4 otherwise waits for a snapshot's writeback, and with it the update
log's group commit); with ``drop`` the synced pages leave the cache (``POSIX_FADV_DONTNEED``).

``DirectFile`` (mode "direct", a timer's snapshot with ``storage.snapshot-direct-io``): the file
is opened ``O_DIRECT`` and every write is whole ``DIRECT_BLOCK``-aligned blocks from an aligned
buffer, so the bytes go from the process to the disk with no page-cache page allocated, copied
into, written back or reclaimed. Why: a snapshot is written every ``snapshot-min-log-ratio`` of the
store's size logged (ten bytes of snapshot per logged byte at the default), and on a node whose
snapshot exceeds its free memory each one would fill and reclaim that much page cache, evicting
other pages, for a file read only after a crash; on the development VM the kernel's part of a
write falls from 0.2-1.2 to 0.1-0.3 s per GB (docs/storage.md "Direct snapshot writes"). Each
stream gathers its bytes in an aligned buffer of ``DIRECT_STAGE_BYTES`` and writes it whole; the
blocks a stream shares with its neighbours (the block its first byte falls in when that is not a
block start, the block its last byte falls in) and the header's block are *held* in memory and
written once at ``finish``, when both sides' bytes are in them. The last block is written whole
and the file then truncated to its length. A file system that refuses ``O_DIRECT`` (tmpfs on
older kernels, some network file systems) raises ``EINVAL`` at the open or the first write:
``snapshot.write_frozen`` then writes that directory's snapshots through the page cache.

No logging, no timing: the caller (snapshot.py) decides and reports.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Protocol

from giaannd import page_cache

__all__ = ["DIRECT_BLOCK", "DIRECT_STAGE_BYTES", "SYNC_EVERY_BYTES", "CachedFile", "DirectFile", "O_DIRECT",
           "PartStream", "SnapshotFile", "open_temporary"]

#: Offsets, lengths and buffer addresses of direct writes are multiples of this: the logical block
#: size of disks with 512-byte or 4 KiB sectors (and a page, so ``mmap`` buffers are aligned).
DIRECT_BLOCK = 4096
#: Each stream of a direct write gathers this many bytes before one write (2 MiB: large enough for
#: the disk to stream, four streams' buffers together 8 MiB).
DIRECT_STAGE_BYTES = 2 << 20
#: A snapshot written through the page cache is flushed to disk every this many bytes (``fdatasync``
#: in the writing thread) rather than only at its end. Why: the update log's group commit fsyncs
#: every few ms, and on ext4 (data=ordered) a journal commit waits for the data of other files'
#: blocks allocated in the same transaction, so a snapshot's gigabytes of dirty pages being written
#: back made log fsyncs slow: p99 0.1 s during snapshots against 0.025 s without (tools.bench.scale
#: --cluster). Bounded dirty data keeps that wait short; the snapshot is paced anyway. A direct
#: write leaves no dirty pages behind.
SYNC_EVERY_BYTES = 32 << 20
#: The open flag of a direct write (0 where the platform has none: every open is then buffered).
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class PartStream(Protocol):
    """Bytes appended in order from a fixed offset of the file."""

    def write(self, data: memoryview) -> None: ...

    def close(self) -> None: ...


class SnapshotFile(Protocol):
    def stream(self, offset: int) -> PartStream: ...

    def finish(self, header: bytes, size: int) -> None: ...


def open_temporary(path: os.PathLike[str] | str, direct: bool) -> int:
    """Create ``path`` (truncated if it exists) for writing; ``direct``: with ``O_DIRECT``.

    Raises:
        OSError: EINVAL where the file system refuses direct I/O (or the platform has none).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if direct:
        if not O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")
        flags |= O_DIRECT
    return os.open(path, flags, 0o644)


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    done = 0
    while done < len(data):
        wrote = os.pwrite(fd, data[done:], at + done)
        if wrote <= 0:
            raise OSError(errno.EIO, f"write of {len(data) - done} bytes at offset {at + done} made no progress")
        done += wrote


class CachedFile:
    """A snapshot temporary written through the page cache (module docstring)."""

    def __init__(self, fd: int, drop: bool = False) -> None:
        self.fd = fd
        self.drop = drop and page_cache.AVAILABLE
        self._written = self._synced = 0
        self._streams: list[_CachedStream] = []

    def stream(self, offset: int) -> _CachedStream:
        stream = _CachedStream(self, offset)
        self._streams.append(stream)
        return stream

    def wrote(self, nbytes: int) -> None:
        self._written += nbytes
        if self._written - self._synced >= SYNC_EVERY_BYTES:
            os.fdatasync(self.fd)
            self._synced = self._written
            if self.drop:
                for stream in self._streams:
                    stream.drop_synced()

    def finish(self, header: bytes, size: int) -> None:
        _pwrite_all(self.fd, memoryview(header), 0)
        os.fsync(self.fd)
        if self.drop:  # the whole file (the header's page was written again just now)
            page_cache.drop_rest(self.fd)


class _CachedStream:
    def __init__(self, file: CachedFile, offset: int) -> None:
        self.file, self.pos = file, offset
        self._cached = page_cache.DroppedPrefix(offset)  # (the bytes before this stream are not its)

    def write(self, data: memoryview) -> None:
        _pwrite_all(self.file.fd, data, self.pos)
        self.pos += len(data)
        self.file.wrote(len(data))

    def drop_synced(self) -> None:
        """This stream's whole pages written so far (and synced by the caller) leave the cache."""
        self._cached.drop(self.file.fd, self.pos)

    def close(self) -> None:
        pass


class DirectFile:
    """A snapshot temporary opened with ``O_DIRECT``: aligned whole-block writes only (module
    docstring). ``fd`` may be a plain descriptor: the writes are the same (tests check the
    alignment on any file system)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        #: blocks shared by two streams (or holding the header): index -> the block's bytes
        self.held: dict[int, bytearray] = {}

    def stream(self, offset: int) -> _DirectStream:
        return _DirectStream(self, offset)

    def hold(self, at: int, data: memoryview) -> None:
        """Keep ``data`` (within one block) for the block written at ``finish``."""
        index, inner = divmod(at, DIRECT_BLOCK)
        assert inner + len(data) <= DIRECT_BLOCK
        self.held.setdefault(index, bytearray(DIRECT_BLOCK))[inner : inner + len(data)] = data

    def finish(self, header: bytes, size: int) -> None:
        self.hold(0, memoryview(header))
        with mmap.mmap(-1, DIRECT_BLOCK) as block:  # (page-aligned)
            view = memoryview(block)
            try:
                for index in sorted(self.held):
                    view[:] = self.held[index]
                    _pwrite_all(self.fd, view, index * DIRECT_BLOCK)
            finally:
                view.release()
        os.ftruncate(self.fd, size)  # the last block was written whole
        os.fsync(self.fd)


class _DirectStream:
    """One stream of a ``DirectFile``: its bytes before its first block boundary are held, the
    whole blocks after it gathered in an aligned buffer and written in ``DIRECT_STAGE_BYTES``, the
    bytes of its last, partial block held at ``close``."""

    def __init__(self, file: DirectFile, offset: int) -> None:
        self.file, self.pos = file, offset
        self._base = -(-offset // DIRECT_BLOCK) * DIRECT_BLOCK  # file offset of the stage's first byte
        self._stage: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._fill = 0

    def write(self, data: memoryview) -> None:
        if self.pos < self._base:  # the head: up to the first block boundary
            k = min(len(data), self._base - self.pos)
            self.file.hold(self.pos, data[:k])
            self.pos += k
            data = data[k:]
        while len(data):
            if self._view is None:
                self._stage = mmap.mmap(-1, DIRECT_STAGE_BYTES)
                self._view = memoryview(self._stage)
            k = min(len(data), DIRECT_STAGE_BYTES - self._fill)
            self._view[self._fill : self._fill + k] = data[:k]
            self._fill += k
            self.pos += k
            data = data[k:]
            if self._fill == DIRECT_STAGE_BYTES:
                _pwrite_all(self.file.fd, self._view, self._base)
                self._base += DIRECT_STAGE_BYTES
                self._fill = 0

    def close(self) -> None:
        if self._view is None or self._stage is None:
            return
        view, stage = self._view, self._stage
        self._view = self._stage = None  # (on a failure the buffer goes with its last reference)
        whole = self._fill - self._fill % DIRECT_BLOCK
        if whole:
            _pwrite_all(self.file.fd, view[:whole], self._base)
        if self._fill > whole:
            self.file.hold(self._base + whole, view[whole : self._fill])
        view.release()
        stage.close()
