"""The streamed JSONL export (model/export.py ``JsonlWriter``) on a full disk: a write that fails
leaves bytes in the file object's buffer, so dropping the writer must not flush them again (a
second ENOSPC), must remove the temporary file, and must not replace the caller's error."""

from __future__ import annotations

import errno
import io
import os

import numpy as np
import pytest

from giaannd.model.export import JsonlWriter
from giaannd.model.rows import RowBatch
from giaannd.model.vocab import Vocabulary


class _FullDisk(io.FileIO):
    """A file on a disk with ``room`` bytes left (None: plenty), written as the kernel does: a
    write takes what fits (a short write), and one that finds no room fails with ENOSPC."""

    room: int | None = None

    def write(self, b):  # type: ignore[override]
        room = _FullDisk.room
        if room is None:
            return super().write(b)
        if room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = super().write(memoryview(b)[:room])
        _FullDisk.room = room - n
        return n


@pytest.fixture
def full_disk(monkeypatch):
    real = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):
        if mode != "wb":
            return real(fd, mode, *args, **kwargs)
        return io.BufferedWriter(_FullDisk(fd, "w"))

    monkeypatch.setattr(os, "fdopen", fdopen)
    _FullDisk.room = None
    yield _FullDisk
    _FullDisk.room = None


def _vocab_batch(n: int) -> tuple[Vocabulary, RowBatch]:
    v = Vocabulary()
    cols = np.array([v.add_column(w) for w in ("cat", "dog", "mat")], np.uint64)
    feats = np.array([v.add_feature(w) for w in ("the", "on", "a")], np.uint64)
    rng = np.random.default_rng(7)
    batch = RowBatch.from_entries(rng.choice(cols, n), rng.choice(feats, n), rng.integers(0, 9, n).astype(np.uint8),
                                  rng.choice(cols, n), rng.choice(feats, n), rng.random(n).astype(np.float32))
    return v, batch


def test_export_writer_abort_after_a_write_failed_for_a_full_disk_leaves_no_temporary(tmp_path, full_disk):
    """Chunks smaller than the file object's buffer (``chunk_entries``): the one whose flush meets
    the full disk fails with part of it still buffered."""
    v, batch = _vocab_batch(20)  # about 2 KB of lines
    w = JsonlWriter(tmp_path / "e.jsonl")
    full_disk.room = 50_000
    with pytest.raises(OSError) as exc:
        for _ in range(1000):
            w.write(batch, v)
    assert exc.value.errno == errno.ENOSPC
    w.abort()  # the caller's cleanup: it must neither raise (a second ENOSPC) nor leave the file
    assert list(tmp_path.iterdir()) == []
    full_disk.room = None  # space is back: the next export is written whole
    w = JsonlWriter(tmp_path / "e.jsonl")
    w.write(batch, v)
    w.commit()
    assert [p.name for p in tmp_path.iterdir()] == ["e.jsonl"]


def test_export_writer_abort_for_another_failure_with_bytes_still_buffered_leaves_no_temporary(tmp_path,
                                                                                                full_disk):
    """The scan failed (not the disk) while lines were still in the buffer, and the disk is full
    meanwhile: the abort's flush fails, yet the temporary goes and the scan's error is the one raised."""
    v, batch = _vocab_batch(1)
    w = JsonlWriter(tmp_path / "e.jsonl")
    w.write(batch, v)
    full_disk.room = 100
    w.abort()
    assert list(tmp_path.iterdir()) == []
