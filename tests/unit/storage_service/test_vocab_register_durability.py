"""What the vocab log and the register log call durable (vocab_store.py, register_store.py): an
acknowledgement needs the bytes *and* the file's directory entry on disk, also for what a restart
inherited from a process killed before its sync, and a log record the store could not read back
is never written.

A small disk model records, per file (inode), how many bytes an fsync/fdatasync has covered, and
which directories were fsynced: no wall clock, no real crash."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from giaannd.model.ids import feature_id
from giaannd.storage.engine import register_store as rs
from giaannd.storage.engine.register_store import REGISTERS_FILE, RegisterState, RegisterStore, RegisterStoreFull
from giaannd.storage.engine.vocab_store import VOCAB_FILE, VocabStore


class _Disk:
    """Records what fsync/fdatasync made durable: bytes per file inode, and directory inodes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files: dict[int, int] = {}
        self.dirs: set[int] = set()
        for name in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, name, self._recording(getattr(os, name)))

    def _recording(self, real):
        def sync(fd: int) -> None:
            real(fd)
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                self.dirs.add(st.st_ino)
            else:
                self.files[st.st_ino] = max(self.files.get(st.st_ino, 0), st.st_size)
        return sync

    def synced_bytes(self, path) -> int:
        return self.files.get(os.stat(path).st_ino, 0)

    def dir_synced(self, path) -> bool:
        return os.stat(path).st_ino in self.dirs


def test_vocab_restart_syncs_the_tail_a_killed_process_left_unsynced(tmp_path, monkeypatch):
    entry = (1, feature_id("word"), "word")
    a = VocabStore.open(tmp_path)
    a.put([entry])
    a.close()  # killed before its sync: the record is in the page cache only
    disk = _Disk(monkeypatch)
    b = VocabStore.open(tmp_path)
    put = b.put([entry])  # the writer's retry: known here
    assert put.known == 1
    if b.durable_offset < put.offset:  # what the service does before it acks (WaitVocabSynced)
        b.sync()
    assert disk.synced_bytes(tmp_path / VOCAB_FILE) >= put.offset, "acked an entry never fsynced"
    b.close()


def test_register_restart_syncs_the_tail_a_killed_process_left_unsynced(tmp_path, monkeypatch):
    a = RegisterStore.open(tmp_path)
    a.prepare("job/a", (1, 7))
    a.accept("job/a", (1, 7), (1, 1, 7), b"row")
    size = a.nbytes
    a.close()  # killed before its sync
    disk = _Disk(monkeypatch)
    b = RegisterStore.open(tmp_path)
    state, seq = b.accept("job/a", (1, 7), (1, 1, 7), b"row")  # the proposer's retransmission
    assert isinstance(state, RegisterState)
    if b.durable_seq < seq:  # what the service does before it answers (WaitRegistersSynced)
        b.sync()
    assert disk.synced_bytes(tmp_path / REGISTERS_FILE) >= size, "answered an accept never fsynced"
    b.close()


def test_vocab_log_created_is_durable_in_its_directory(tmp_path, monkeypatch):
    disk = _Disk(monkeypatch)
    v = VocabStore.open(tmp_path / "vocab")
    v.put([(1, feature_id("word"), "word")])
    v.sync()
    assert disk.dir_synced(tmp_path / "vocab"), "the new log's directory entry was never fsynced"
    assert disk.dir_synced(tmp_path), "the new directory's entry was never fsynced"
    v.close()


def test_register_log_created_is_durable_in_its_directory(tmp_path, monkeypatch):
    disk = _Disk(monkeypatch)
    s = RegisterStore.open(tmp_path / "registers")
    s.prepare("k", (1, 1))
    s.sync()
    assert disk.dir_synced(tmp_path / "registers"), "the new log's directory entry was never fsynced"
    assert disk.dir_synced(tmp_path), "the new directory's entry was never fsynced"
    s.close()


def test_register_store_refuses_a_record_it_could_not_read_back(tmp_path):
    """A RegisterImport's states are not bounded by the protocol's value limit: a state whose
    record is over the log's record limit would be written, then refuse every read of it and stop
    the next start-up as corruption."""
    s = RegisterStore.open(tmp_path)
    s.accept("k", (1, 1), (1, 1, 1), b"v")
    size = s.nbytes
    big = RegisterState((2, 1), (2, 1), (2, 2, 1), b"x" * (3 * 2**20))
    with pytest.raises(RegisterStoreFull):
        s.merge("k", big)
    with pytest.raises(RegisterStoreFull):
        s.merge("y" * (3 * 2**20), RegisterState((2, 1)))  # a key that long: the same
    assert s.nbytes == size and s.get("k").value == b"v"
    s.sync()
    s.close()
    t = RegisterStore.open(tmp_path)
    assert t.get("k").value == b"v"
    t.close()


def test_register_compaction_is_not_durable_before_its_rename_is(tmp_path, monkeypatch):
    """The directory fsync after a compaction's rename failed: nothing may be called durable
    until one succeeds (else a crash may bring back the old file, without later changes)."""
    monkeypatch.setattr(rs, "COMPACT_MIN_BYTES", 2000)
    s = RegisterStore.open(tmp_path)
    for i in range(1, 200):
        s.prepare("k", (i, 1))
    real = rs.fsync_dir
    done: list[bool] = []

    def fsync_dir(directory) -> None:
        if not done:
            done.append(False)
            raise OSError(errno.EIO, "Input/output error")
        real(directory)
        done.append(True)
    monkeypatch.setattr(rs, "fsync_dir", fsync_dir)
    with pytest.raises(OSError):
        s.sync()
    _, seq = s.prepare("k", (500, 1))
    assert s.sync() >= seq
    assert done[1:] and done[-1], "called durable with the compaction's rename never fsynced"
    s.close()


def _fail_first_fdatasync(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first fdatasync fails (EIO); the kernel then says "fine" to the next one, though the
    pages it dropped are gone ("fsyncgate"; test_fsync_failure.py does the same to the update log).
    Returns the inodes whose fdatasync failed."""
    real = os.fdatasync
    failed: list[int] = []

    def fdatasync(fd: int) -> None:
        if not failed:
            failed.append(os.fstat(fd).st_ino)
            raise OSError(errno.EIO, "Input/output error")
        real(fd)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return failed


def test_vocab_entry_whose_fsync_failed_is_not_acked_through_a_retry(tmp_path, monkeypatch):
    entry = (1, feature_id("word"), "word")
    v = VocabStore.open(tmp_path)
    failed = _fail_first_fdatasync(monkeypatch)
    disk = _Disk(monkeypatch)
    v.put([entry])
    with pytest.raises(OSError):
        v.sync()
    retry = v.put([entry])  # the client's retry: known here
    assert retry.known == 1
    try:
        if v.durable_offset < retry.offset:  # the service's ack rule (WaitVocabSynced)
            v.sync()
        acked = v.durable_offset >= retry.offset
    except OSError:
        acked = False
    if acked:  # only once the table is in a file written and fsynced after the failure
        log = tmp_path / VOCAB_FILE
        assert os.stat(log).st_ino != failed[0], "acked an entry whose fdatasync failed"
        assert disk.synced_bytes(log) >= os.stat(log).st_size and disk.dir_synced(tmp_path)
    v.close()
    w = VocabStore.open(tmp_path)
    assert w.get(1, feature_id("word")) == "word"
    w.close()


def test_register_accept_whose_fsync_failed_is_not_answered_through_a_retransmission(tmp_path, monkeypatch):
    s = RegisterStore.open(tmp_path)
    s.prepare("job/a", (1, 7))
    failed = _fail_first_fdatasync(monkeypatch)
    disk = _Disk(monkeypatch)
    s.accept("job/a", (1, 7), (1, 1, 7), b"row")
    with pytest.raises(OSError):
        s.sync()
    state, seq = s.accept("job/a", (1, 7), (1, 1, 7), b"row")  # the proposer's retransmission
    assert isinstance(state, RegisterState)
    try:
        if s.durable_seq < seq:  # the service's answer rule (WaitRegistersSynced)
            s.sync()
        answered = s.durable_seq >= seq
    except OSError:
        answered = False
    if answered:  # only once the states are in a file written and fsynced after the failure
        log = tmp_path / REGISTERS_FILE
        assert os.stat(log).st_ino != failed[0], "answered an accept whose fdatasync failed"
        assert disk.synced_bytes(log) >= os.stat(log).st_size and disk.dir_synced(tmp_path)
    s.close()
    t = RegisterStore.open(tmp_path)
    assert t.get("job/a") == RegisterState((1, 7), (1, 7), (1, 1, 7), b"row")
    t.close()


def test_register_changes_during_a_compaction_survive_the_switch(tmp_path, monkeypatch):
    """A compaction in a worker thread, held (events) after it wrote the snapshot's states and
    before it takes the lock; meanwhile changes (a spilled value replaced, a new spilled value, a
    small one) are appended to the old file and read back through the old offsets. After the
    switch and after a restart every state is the newest."""
    import threading
    monkeypatch.setattr(rs, "COMPACT_MIN_BYTES", 2000)
    s = RegisterStore.open(tmp_path, spill_bytes=1024)
    s.accept("chunk/0", (1, 1), (1, 1, 1), b"\x00" * 4096)
    s.accept("chunk/1", (1, 1), (1, 1, 1), b"\x01" * 4096)
    for i in range(2, 2000):
        s.prepare("k", (i, 1))
    wrote, go = threading.Event(), threading.Event()
    real = rs.write_all
    calls: list[int] = []

    def write_all(fd: int, data: bytes) -> None:
        real(fd, data)
        calls.append(fd)
        if len(calls) == 1:  # the snapshot's states are in the new file; the lock is not taken yet
            wrote.set()
            assert go.wait(10)
    monkeypatch.setattr(rs, "write_all", write_all)
    errors: list[BaseException] = []

    def sync() -> None:
        try:
            s.sync()
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            errors.append(exc)
    t = threading.Thread(target=sync)
    t.start()
    assert wrote.wait(10)
    s.accept("chunk/0", (2, 1), (2, 2, 1), b"\x02" * 5000)  # replaced: a new record in the old file
    s.accept("chunk/2", (1, 1), (1, 1, 1), b"\x03" * 3000)  # new
    s.prepare("k", (9000, 1))
    assert s.get("chunk/0").value == b"\x02" * 5000 and s.get("chunk/1").value == b"\x01" * 4096
    go.set()
    t.join(10)
    assert not errors and s.compactions == 1
    want = {"chunk/0": b"\x02" * 5000, "chunk/1": b"\x01" * 4096, "chunk/2": b"\x03" * 3000}
    assert all(s.get(k).value == v for k, v in want.items())
    s.sync()
    s.close()
    r = RegisterStore.open(tmp_path, spill_bytes=1024)
    assert all(r.get(k).value == v for k, v in want.items()) and r.get("k").promised == (9000, 1)
    r.close()
