"""How much disk a storage node's files take, and how full their file system is.

Answered with every ``GetUsage`` (giaannd/protocol.py ``UsageReply``) for the status page and
``giaannctl ring usage``. The storage directory holds a handful of files (update-log segments,
snapshots, hint logs, the vocabulary log), so one walk costs a few system calls; the walk is bounded
anyway (``MAX_FILES``) so a directory an operator filled with something else cannot stall the loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["MAX_FILES", "DiskUsage", "disk_usage"]

#: Files counted at most per walk; past it ``DiskUsage.partial`` is set and the sum is a lower bound.
MAX_FILES: Final = 10_000


@dataclass(frozen=True)
class DiskUsage:
    """Bytes of the files under a directory (with those of deleted files still held open, when
    given), and its file system's free and total bytes."""

    files_bytes: int
    free_bytes: int
    total_bytes: int
    partial: bool = False


def disk_usage(directory: Path, max_files: int = MAX_FILES, held_bytes: int = 0) -> DiskUsage:
    """The ``DiskUsage`` of ``directory`` (zeros if it does not exist). Files that vanish during
    the walk (a log segment just truncated) are skipped; symlinks are not followed. ``held_bytes``:
    bytes of files deleted from it that the caller still holds (a snapshot the store's base is
    mapped from: ``DurableStore.held_disk_bytes``), added to ``files_bytes``: they take disk space
    that no walk sees."""
    total, seen, partial = held_bytes, 0, False
    for root, _dirs, files in os.walk(directory):
        for name in files:
            if seen >= max_files:
                partial = True
                break
            seen += 1
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
        if partial:
            break
    try:
        fs = os.statvfs(directory)
    except OSError:
        return DiskUsage(total, 0, 0, partial)
    return DiskUsage(total, fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize, partial)
