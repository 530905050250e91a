"""Crash-safe file replacement: the one place giaannd writes a whole file atomically.

A reader (another process, or this one after a crash) sees either the old file or the complete new
one, never a prefix: the data goes to a temporary file in the same directory, is flushed and
fsync'ed, renamed over the target, and the directory is fsync'ed so the rename itself survives a
power loss (rename is atomic on POSIX file systems; without the directory fsync it may not be
durable). On any failure the temporary file is removed and the target is untouched.

The storage engine's own formats (update log segments, snapshots) build on ``fsync_dir`` too but
keep their own write paths, since they stream gigabytes and name their temporaries for recovery.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["atomic_write_bytes", "atomic_writer", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory, making renames and creations inside it durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(path: str | os.PathLike[str], *, mode: int = 0o644) -> Iterator[IO[bytes]]:
    """Yield a binary file; when the block ends without an exception, it replaces ``path``.

    Args:
        path: the file to create or replace.
        mode: permission bits of the new file (0o600 for secrets).
    """
    dest = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, dest)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(dest.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see the module docstring)."""
    with atomic_writer(path, mode=mode) as fh:
        fh.write(data)
