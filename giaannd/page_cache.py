"""Durable bytes of a file out of the kernel's page cache: one place for "synced, then dropped".

Three writers produce files that are not read back soon: the update log (read only at a restart),
a snapshot (read only at a restart) and an export (read by another program, if at all). Each
writes in order, makes a prefix durable (``fdatasync``) and then tells the kernel it will not read
that prefix soon (``posix_fadvise(POSIX_FADV_DONTNEED)``), so its pages are freed at once instead of
crowding out pages that are read (the colocated nodes' snapshots before a restart, docs/operations.md
"Memory"). Only durable bytes may be dropped: the kernel frees clean pages, so dirty ones would stay
(the call would be wasted) or, written back first, would cost a synchronous write.

``DroppedPrefix`` keeps how far a file (or one in-order stream of it) has left the cache and drops
the whole pages from there up to a newly durable end; a partial last page stays until a later call
covers it whole. ``drop_rest`` drops everything from an offset to the end of the file, the last
partial page included (after a final sync). Where ``posix_fadvise`` does not exist (not Linux),
or the kernel refuses it, nothing is dropped and the offsets do not move: it is advice, never an
error for the caller.
"""

from __future__ import annotations

import os
from mmap import PAGESIZE as PAGE
from typing import Final

__all__ = ["AVAILABLE", "DroppedPrefix", "drop_rest"]

#: Whether dropping reaches the kernel here.
AVAILABLE: Final = hasattr(os, "posix_fadvise")


class DroppedPrefix:
    """How far a file written in order has left the page cache (``dropped``: a byte offset; the
    bytes before it, rounded up to a page, are gone). Two threads dropping at once can only make
    a later call drop some pages again: each call drops the pages of its own durable range."""

    __slots__ = ("dropped",)

    def __init__(self, start: int = 0) -> None:
        #: bytes before this offset (rounded up to a page) were dropped, or lie before the region
        self.dropped = start

    def drop(self, fd: int, durable_end: int) -> int:
        """Drop the whole pages of ``[dropped, durable_end)`` of file ``fd`` (every byte before
        ``durable_end`` is durable: the caller synced it); returns the new ``dropped``."""
        lo = -(-self.dropped // PAGE) * PAGE
        hi = durable_end // PAGE * PAGE
        if hi > lo and _advise(fd, lo, hi - lo):
            self.dropped = hi
        return self.dropped


def drop_rest(fd: int, start: int = 0) -> None:
    """Drop file ``fd`` from the page cache from ``start`` (rounded up to a page) to its end, the
    last partial page too (the caller synced the whole file)."""
    _advise(fd, -(-start // PAGE) * PAGE, 0)


def _advise(fd: int, offset: int, length: int) -> bool:
    """``POSIX_FADV_DONTNEED`` over ``[offset, offset + length)`` (0: to the end); False where it
    is missing or refused. Advice only: a kernel, file system or sandbox refusing it (EINVAL,
    ENOSYS, EPERM) costs page-cache room, never the sync or write it follows (the update log's
    sync raised with its bytes durable, so no write was acknowledged again)."""
    if not AVAILABLE:
        return False
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True
