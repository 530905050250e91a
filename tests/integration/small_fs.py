"""A small tmpfs for disk-full tests: mounted for one test, always unmounted, skipped (with the
reason) where mounting is not permitted (not root, no CAP_SYS_ADMIN, a container without it).

``fill(directory)`` writes a filler file until the file system says ENOSPC; unlinking it frees the
space again. tmpfs allocates whole pages, so a full tmpfs refuses even a one-byte append.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_CHUNK = b"\0" * (64 << 10)


@contextmanager
def small_tmpfs(mountpoint: Path, size: str = "8m", *, read_only: bool = False) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` on ``mountpoint`` (created) for the block; skip the test if the
    mount is refused."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    try:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mountpoint)],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if result.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {result.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        if subprocess.run(["umount", str(mountpoint)], capture_output=True, timeout=30).returncode:
            # something still holds a file there (a process the test failed to stop): detach it
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=30)


def remount(mountpoint: Path, *, read_only: bool) -> None:
    subprocess.run(["mount", "-o", f"remount,{'ro' if read_only else 'rw'}", str(mountpoint)],
                   check=True, capture_output=True, timeout=30)


def fill(directory: Path, name: str = "filler") -> Path:
    """Write ``directory/name`` until the file system is full; returns its path."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            try:
                if os.write(fd, _CHUNK) < len(_CHUNK):
                    continue  # the last pages: the next write says ENOSPC
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        # a write smaller than a page may still fit in the file's last page: fill that too
        for size in (4096, 512, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)
    return path


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
