"""Hint logs (replication/hints.py) on a failing or full disk.

When the disk fails while a delivered target's log is deleted (EIO on its closing fsync, its
removal or the directory fsync): the delivery goes on (no error escapes into the delivery loop,
whose task would end), and the next hints for that target never land in the undeleted log as a
second seq 1 (corruption that stops the next start)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from giaannd.model.rows import RowBatch
from giaannd.protocol import BatchId
from giaannd.storage.replication import hints as hints_mod
from giaannd.storage.replication.hints import HintStore


def _batch(seed: int) -> RowBatch:
    rng = np.random.default_rng(seed)
    n = 4
    return RowBatch.from_entries(np.repeat(rng.integers(1, 99, 2, dtype=np.uint64), 2), np.zeros(n, np.uint64),
                                 np.zeros(n, np.uint8), rng.integers(1, 9, n, dtype=np.uint64),
                                 np.arange(n, dtype=np.uint64), np.ones(n, np.float32))


def _eio(*_args, **_kwargs):
    raise OSError(errno.EIO, os.strerror(errno.EIO))


@pytest.mark.parametrize("failing", ["close", "rmtree", "fsync_dir"])
def test_hints_log_whose_deletion_failed_is_neither_fatal_nor_reused(tmp_path, monkeypatch, failing):
    hs = HintStore.open(tmp_path)
    hs.add("b", BatchId(1, 1), _batch(1))
    hs.sync("b")
    with monkeypatch.context() as m:
        if failing == "close":
            m.setattr(os, "fdatasync", _eio)
        elif failing == "rmtree":
            m.setattr(hints_mod.shutil, "rmtree", _eio)
        else:
            m.setattr(hints_mod, "fsync_dir", _eio)
        assert hs.delivered("b", BatchId(1, 1))  # the target acknowledged it: forgotten, no error
    assert hs.held == 0 and hs.targets() == []
    second = _batch(2)
    assert hs.add("b", BatchId(1, 2), second)
    hs.sync("b")
    hs.close()
    again = HintStore.open(tmp_path)  # not CorruptLogError ("record seq 1, expected 2")
    assert [h.batch_id for h in again.pending("b")] == [BatchId(1, 2)]
    again.close()
