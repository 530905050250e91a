"""The stream receiver's small durable files (streaming/writers.py ``stream-writers.u64``,
streaming/dedupe.py ``streams/<id>.cols`` and ``.closed``) when a write or fsync fails (EIO,
ENOSPC): the call raises, and the caller's retry (the source's next hello or item) only succeeds
once what it records is durable: the bytes *and* a new file's directory entry.

A small disk model records, per file (inode), how many bytes an fsync covered, and which
directories were fsynced; ``fail`` makes the next fsync of a regular file fail (no real crash)."""

from __future__ import annotations

import errno
import os
import stat
from types import SimpleNamespace

import numpy as np
import pytest

from giaannd.storage.streaming.dedupe import SCOPES_DIR, StreamScopes
from giaannd.storage.streaming.writers import STREAM_WRITERS_FILE, record_stream_writer, stream_writers_of


class _Disk:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files: dict[int, int] = {}
        self.dirs: set[int] = set()
        self.fail = 0  # fsyncs of regular files still to fail
        for name in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, name, self._recording(getattr(os, name)))

    def _recording(self, real):
        def sync(fd: int) -> None:
            st = os.fstat(fd)
            if not stat.S_ISDIR(st.st_mode) and self.fail:
                self.fail -= 1
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            real(fd)
            if stat.S_ISDIR(st.st_mode):
                self.dirs.add(st.st_ino)
            else:
                self.files[st.st_ino] = max(self.files.get(st.st_ino, 0), st.st_size)
        return sync

    def synced_bytes(self, path) -> int:
        return self.files.get(os.stat(path).st_ino, 0)

    def dir_synced(self, path) -> bool:
        return os.stat(path).st_ino in self.dirs


def test_stream_writer_whose_fsync_failed_is_made_durable_by_the_retry(tmp_path, monkeypatch):
    """The retry found the id in the file (the page cache) and returned without an fsync: the
    item was then applied under an id that a power loss could drop from the file."""
    service = SimpleNamespace(data_dir=tmp_path)
    disk = _Disk(monkeypatch)
    record_stream_writer(service, 0xA)
    disk.fail = 1
    with pytest.raises(OSError):
        record_stream_writer(service, 0xB)
    record_stream_writer(service, 0xB)  # the source's next hello
    path = tmp_path / STREAM_WRITERS_FILE
    assert stream_writers_of(service) == {0xA, 0xB}
    assert disk.synced_bytes(path) == path.stat().st_size, "recorded a writer id never fsynced"
    assert path.stat().st_size == 16  # one record each: whole u64s, nothing of the failed append left


@pytest.mark.parametrize("first_fails", [False, True])
def test_stream_writers_file_created_is_durable_in_its_directory(tmp_path, monkeypatch, first_fails):
    disk = _Disk(monkeypatch)
    service = SimpleNamespace(data_dir=tmp_path)
    if first_fails:  # the file is created, its first fsync fails: the retry finds it (empty)
        disk.fail = 1
        with pytest.raises(OSError):
            record_stream_writer(service, 0xA)
    record_stream_writer(service, 0xA)
    assert disk.dir_synced(tmp_path), "the new file's directory entry was never fsynced"
    assert stream_writers_of(service) == {0xA}


def test_stream_scope_whose_fsync_failed_is_made_durable_in_its_directory_by_the_retry(tmp_path, monkeypatch):
    """The first attempt created the directory and the file, then its fsync failed; the retry
    found both and skipped the directory fsyncs that make their names durable."""
    disk = _Disk(monkeypatch)
    scopes = StreamScopes.open(tmp_path)
    disk.fail = 1
    with pytest.raises(OSError):
        scopes.add_columns(7, np.array([3, 5], np.uint64))
    scopes.add_columns(7, np.array([3, 5], np.uint64))  # the source's retry
    path = tmp_path / SCOPES_DIR / f"{7:016x}.cols"
    assert disk.synced_bytes(path) == path.stat().st_size
    assert disk.dir_synced(tmp_path / SCOPES_DIR), "the scope file's directory entry was never fsynced"
    assert disk.dir_synced(tmp_path), "the scopes directory's entry was never fsynced"
    assert StreamScopes.open(tmp_path).open_streams() == [7]


def test_stream_closed_marker_is_durable_in_its_directory(tmp_path, monkeypatch):
    """``close`` says durable: the ``.closed`` file's name too, also when its first fsync failed."""
    scopes = StreamScopes.open(tmp_path)
    scopes.add_columns(7, np.array([3], np.uint64))
    disk = _Disk(monkeypatch)
    disk.fail = 1
    with pytest.raises(OSError):
        scopes.close(7)
    scopes.close(7)
    assert disk.dir_synced(tmp_path / SCOPES_DIR), "the .closed file's directory entry was never fsynced"
    assert StreamScopes.open(tmp_path).open_streams() == []


def test_stream_scope_append_cut_short_leaves_no_torn_record(tmp_path, monkeypatch):
    """A scope record cut short by a full disk must not stay: the file is read 8 bytes at a time,
    so a torn record under the retry's whole one shifted every later column id (before: a partial
    append was left in place)."""
    import builtins

    from giaannd.storage.streaming import dedupe

    scopes = dedupe.StreamScopes.open(tmp_path)
    scopes.add_columns(7, np.array([5], np.uint64))

    def torn(fd_or_file_write):
        def write(data):
            fd_or_file_write(bytes(memoryview(data)[:3]))  # 3 bytes land, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write

    real_open = builtins.open

    def open_torn(path, mode="r", *args, **kwargs):  # the file-object path
        f = real_open(path, mode, *args, **kwargs)
        if "a" in mode:
            f.write = torn(f.write)
        return f

    from giaannd.storage.engine import log_tail

    monkeypatch.setattr(dedupe, "open", open_torn, raising=False)  # (the code before: a file object)
    monkeypatch.setattr(log_tail, "write_all", lambda fd, data: torn(lambda b: os.write(fd, b))(data))
    with pytest.raises(OSError):
        scopes.add_columns(7, np.array([1, 2], np.uint64))
    monkeypatch.undo()
    scopes.add_columns(7, np.array([1, 2], np.uint64))  # the writer's retry
    again = dedupe.StreamScopes.open(tmp_path)
    assert again.columns_of_open_streams(but=0).tolist() == [1, 2, 5]
