"""Crash-safe file replacement: the one place giaannd writes a whole file atomically.

A reader (another process, or this one after a crash) sees either the old file or the complete new
one, never a prefix: the data goes to a temporary file in the same directory, is flushed and
fsync'ed, renamed over the target, and the directory is fsync'ed so the rename itself survives a
power loss (rename is atomic on POSIX file systems; without the directory fsync it may not be
durable). On any failure the temporary file is removed and the target is untouched.

The storage engine's own formats (update log segments, snapshots) build on ``fsync_dir`` too but
keep their own write paths, since they stream gigabytes and name their temporaries for recovery.

Leftovers. A crash (or SIGKILL, or a power loss) between the temporary's creation and the rename
leaves the temporary, ``.<name>.<8 random characters>.tmp`` (``tempfile.mkstemp``'s alphabet:
lower-case letters, digits, ``_``), never valid data but taking space.
``remove_stale_temporaries`` deletes such files, and only them: the daemon over its data
directory at start (its lock keeps other daemons out), an export over its destination's before it
writes (model/export.py ``JsonlWriter`` makes its temporary here too). A writer holds an exclusive
``flock`` on its temporary for as long as it writes, and a file whose lock cannot be taken is
left alone, so a temporary another process (a client writing a report, a second node sharing an
export directory) or this one is still writing is never deleted. Where the file system refuses
locks (some network file systems: ``ENOLCK``) the writer writes without one and the reclaim keeps
every temporary: one cannot tell a live one from a stale one there.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["atomic_write_bytes", "atomic_writer", "fsync_dir", "make_temporary", "remove_stale_temporaries"]

#: The name ``make_temporary`` gives a temporary of the file ``dest`` (module docstring).
_TEMPORARY_NAME = re.compile(r"\.(?P<dest>.+)\.[a-z0-9_]{8}\.tmp")
#: Temporaries ``make_temporary`` makes before it gives up: one is lost only to a reclaim that
#: locked it in the instant between its creation and its writer's lock.
_TEMPORARY_ATTEMPTS = 3


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
    fd, tmp_name = make_temporary(dest)
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


def make_temporary(dest: Path) -> tuple[int, str]:
    """A new temporary file beside ``dest`` (mode 0600), locked against reclaims for as long as the
    returned descriptor is open (module docstring, "Leftovers").

    Returns:
        its open descriptor (read-write) and its path.
    Raises:
        OSError: it cannot be made (``dest``'s directory does not exist, ...).
    """
    for _ in range(_TEMPORARY_ATTEMPTS):
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits only for a reclaim's unlink, if one took it
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            return fd, name  # no locks here: reclaims keep every temporary (module docstring)
        try:
            if os.stat(name).st_ino == os.fstat(fd).st_ino:
                return fd, name
        except FileNotFoundError:
            pass
        os.close(fd)  # a reclaim deleted it before we locked it: make another
    raise OSError(errno.EAGAIN, f"temporary files beside {dest} kept being deleted")


def remove_stale_temporaries(directory: str | os.PathLike[str], *, of: str | None = None,
                             recursive: bool = False) -> list[tuple[Path, int]]:
    """Delete the temporaries of whole-file writes left in ``directory`` (module docstring,
    "Leftovers"): only regular files named as ``make_temporary`` names them, of the file ``of``
    (None: of any file), that no writer holds; with ``recursive``, in every directory below it too
    (links not followed). A missing ``directory`` holds none.

    Returns:
        the files deleted, with their sizes in bytes.
    Raises:
        OSError: a candidate could not be opened, checked or deleted.
    """
    removed: list[tuple[Path, int]] = []
    tops = os.walk(directory) if recursive else [(os.fspath(directory), [], _names(directory))]
    for top, _, names in tops:
        for name in names:
            match = _TEMPORARY_NAME.fullmatch(name)
            if match is None or (of is not None and match["dest"] != of):
                continue
            path = Path(top, name)
            size = _remove_if_stale(path)
            if size is not None:
                removed.append((path, size))
    return removed


def _names(directory: str | os.PathLike[str]) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def _remove_if_stale(path: Path) -> int | None:
    """Delete ``path`` if it is a regular file no one holds locked; its size, or None (kept)."""
    try:  # O_NONBLOCK: a FIFO of that name does not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP):  # gone already; a link: never ours
            return None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a live writer (EWOULDBLOCK), or no locks here: cannot tell
            return None
        try:  # still the file we locked (not a new writer's under a reused name)
            if os.stat(path, follow_symlinks=False).st_ino != st.st_ino:
                return None
        except FileNotFoundError:
            return None
        os.unlink(path)
        return st.st_size
    finally:
        os.close(fd)
