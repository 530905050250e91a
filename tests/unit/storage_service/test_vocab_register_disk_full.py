"""The vocab log and the register log (vocab_store.py, register_store.py) when an append meets a
full disk or a failing one: the kernel takes what fits (a short write) and then says ENOSPC. The
put is refused with the disk's errno (ENOSPC is what switches the node to refusing writes,
replication/disk_full.py), its partial record never stays between two good ones (that stops the
next start as corruption), also when cutting it off fails at first, and puts resume after."""

from __future__ import annotations

import errno
import os

import pytest

from giaannd.model.ids import feature_id
from giaannd.storage.engine.register_store import RegisterStore
from giaannd.storage.engine.vocab_store import VocabStore


def _entry(word: str) -> tuple[int, int, str]:
    return (1, feature_id(word), word)


class _Disk:
    """``os.write`` takes ``room`` more bytes (None: plenty) and then fails with ENOSPC;
    ``os.ftruncate`` fails with EIO ``bad_truncates`` more times (a failing disk)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.room: int | None = None
        self.bad_truncates = 0
        real_write, real_truncate = os.write, os.ftruncate

        def write(fd, data):
            if self.room is None:
                return real_write(fd, data)
            if self.room == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = real_write(fd, memoryview(data)[: self.room])
            self.room -= n
            return n

        def ftruncate(fd, length):
            if self.bad_truncates:
                self.bad_truncates -= 1
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_truncate(fd, length)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "ftruncate", ftruncate)


@pytest.mark.parametrize("bad_truncates", [0, 1])
def test_vocab_put_cut_short_by_a_full_disk_is_refused_and_the_log_stays_readable(tmp_path, monkeypatch,
                                                                                    bad_truncates):
    v = VocabStore.open(tmp_path)
    v.put([_entry("before")])
    v.sync()
    disk = _Disk(monkeypatch)
    disk.room, disk.bad_truncates = 10, bad_truncates
    with pytest.raises(OSError) as exc:
        v.put([_entry("lost")])
    assert exc.value.errno == errno.ENOSPC
    assert v.get(1, feature_id("lost")) is None
    disk.room = None  # space is back
    put = v.put([_entry("after")])
    assert put.added == 1
    v.sync()
    v.close()
    again = VocabStore.open(tmp_path)  # not VocabLogCorrupt: nothing partial between two records
    assert again.get(1, feature_id("before")) == "before" and again.get(1, feature_id("after")) == "after"
    assert again.get(1, feature_id("lost")) is None and again.torn_bytes == 0
    again.close()


@pytest.mark.parametrize("bad_truncates", [0, 1])
def test_register_change_cut_short_by_a_full_disk_is_refused_and_the_log_stays_readable(tmp_path, monkeypatch,
                                                                                         bad_truncates):
    s = RegisterStore.open(tmp_path)
    s.prepare("a", (1, 1))
    s.sync()
    disk = _Disk(monkeypatch)
    disk.room, disk.bad_truncates = 10, bad_truncates
    with pytest.raises(OSError) as exc:
        s.prepare("b", (1, 1))
    assert exc.value.errno == errno.ENOSPC
    assert s.get("b").promised == (0, 0)
    disk.room = None  # space is back
    s.prepare("c", (1, 1))
    s.sync()
    s.close()
    again = RegisterStore.open(tmp_path)  # not RegisterLogCorrupt
    assert again.get("a").promised == (1, 1) and again.get("c").promised == (1, 1)
    assert again.get("b").promised == (0, 0) and again.torn_bytes == 0
    again.close()
