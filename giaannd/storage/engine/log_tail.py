"""The end of an append-only log of whole records (the vocab and register logs).

A record is appended whole or leaves nothing behind it: a short write (a disk that fills up
mid-record) goes on until the disk's own error (ENOSPC, so the node switches to disk full), and a
record that failed part-way is cut off again (``ftruncate`` to the log's size before it). If that
cut fails too (EIO), the next append cuts first and is refused until the cut succeeds: a record
appended after a partial one would make it corruption in the middle of the log, which stops the
next start, instead of a torn tail, which the start cuts off.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["LogTail", "append_synced", "write_all"]


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a short write goes on; an error raises)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def append_synced(path: str | os.PathLike[str], data: bytes) -> int:
    """Append ``data`` to the file at ``path`` (made if absent) and fsync it, whole or not at all:
    for small files of fixed-size records read back whole (a stream's writer ids and column
    scopes), where a record cut short, or one whose fsync failed, would stay under the retry's
    (ids shifted, or an id called durable that a power loss may drop). Returns the file's size
    before (0: new or empty, so its directory entry is the caller's to make durable).

    Raises:
        OSError: the write or fsync failed; what was written is cut off again.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            write_all(fd, data)
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
    return size


class LogTail:
    """Whether bytes of a failed append may lie past the log's end (module docstring). The owner
    calls it under its own lock and keeps the log's size (``size``: where the last whole record
    ends)."""

    __slots__ = ("partial",)

    def __init__(self) -> None:
        #: a failed append left part of a record past the log's size that could not be cut yet
        self.partial = False

    def append(self, fd: int, size: int, record: bytes) -> None:
        """Append ``record`` at ``size`` (the file's position), whole or not at all.

        Raises:
            OSError: the write failed (what was written of it is cut off again, or at the next
                append), or an earlier partial record still cannot be cut.
        """
        self.cut(fd, size)
        try:
            write_all(fd, record)
        except OSError:
            self.partial = True
            with contextlib.suppress(OSError):
                self.cut(fd, size)
            raise

    def cut(self, fd: int, size: int) -> None:
        """Cut off what a failed append left past ``size`` (nothing when none did).

        Raises:
            OSError: it still cannot be cut; nothing may be appended meanwhile.
        """
        if self.partial:
            os.ftruncate(fd, size)
            os.lseek(fd, size, os.SEEK_SET)
            self.partial = False
