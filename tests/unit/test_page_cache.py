"""``giaannd.page_cache``: durable bytes of a file leave the page cache in whole pages, from where
the last drop ended, never past the durable end given; the rest of a file, partial page included,
on ``drop_rest``; nothing moves where ``posix_fadvise`` does not exist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from giaannd import page_cache
from giaannd.page_cache import PAGE, DroppedPrefix, drop_rest
from tools.bench.page_cache import cached_share

linux = pytest.mark.skipif(not page_cache.AVAILABLE, reason="posix_fadvise (Linux)")


def _advice(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(offset, length) of every DONTNEED advice given meanwhile (still given to the kernel)."""
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        calls.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    return calls


def _in_memory_fs(path: Path) -> bool:
    """Whether ``path`` lies on tmpfs/ramfs (whose pages are the file: nothing to drop)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return True
    best = max((m for m in mounts if len(m) > 2 and str(path.resolve()).startswith(m[1].rstrip("/") + "/")),
               key=lambda m: len(m[1]), default=None)
    return best is None or best[2] in ("tmpfs", "ramfs")


def _file(path: Path, nbytes: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, os.urandom(nbytes))
    os.fdatasync(fd)
    return fd


@linux
def test_whole_pages_from_the_last_drop_up_to_the_durable_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd = _file(tmp_path / "f", 10 * PAGE)
    calls = _advice(monkeypatch)
    try:
        prefix = DroppedPrefix()
        assert prefix.drop(fd, PAGE - 1) == 0 and calls == []  # no whole page yet
        assert prefix.drop(fd, 3 * PAGE + 5) == 3 * PAGE  # the partial fourth page stays
        assert prefix.drop(fd, 3 * PAGE + 9) == 3 * PAGE and len(calls) == 1
        assert prefix.drop(fd, 7 * PAGE) == 7 * PAGE
        assert calls == [(0, 3 * PAGE), (3 * PAGE, 4 * PAGE)]  # contiguous, each page once
    finally:
        os.close(fd)


@linux
def test_a_prefix_starting_inside_a_page_leaves_that_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream of a file that begins mid-page (a snapshot's parts) never drops the page it shares
    with the bytes before it."""
    fd = _file(tmp_path / "f", 10 * PAGE)
    calls = _advice(monkeypatch)
    try:
        prefix = DroppedPrefix(2 * PAGE + 100)
        assert prefix.drop(fd, 6 * PAGE + 1) == 6 * PAGE
        assert calls == [(3 * PAGE, 3 * PAGE)]
    finally:
        os.close(fd)


@linux
def test_drop_rest_takes_the_partial_last_page_and_the_kernel_frees_the_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f"
    fd = _file(path, 64 * PAGE + 17)
    calls = _advice(monkeypatch)
    try:
        before = cached_share(path)
        drop_rest(fd, PAGE + 1)
        assert calls == [(2 * PAGE, 0)]  # from the next page on, to the end (length 0)
        drop_rest(fd)
        after = cached_share(path)
        if before is not None and after is not None and not _in_memory_fs(path):
            assert before > 0.9 and after < 0.1
    finally:
        os.close(fd)


def test_nothing_moves_without_posix_fadvise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(page_cache, "AVAILABLE", False)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        prefix = DroppedPrefix()
        assert prefix.drop(fd, 8 * PAGE) == 0
        drop_rest(fd)  # no error
    finally:
        os.close(fd)
