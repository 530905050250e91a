"""A restart's optional speed-ups must not stop a node from starting: a snapshot file the file
system cannot map is loaded by reading it (as a log segment that cannot be mapped already is)."""

from __future__ import annotations

import errno
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from giaannd.protocol import BatchId
from giaannd.storage import DurableStore

from ._gen import random_batch, same_state

BIG = 1 << 40


_REAL_MMAP = mmap.mmap


def _no_file_mappings(fileno: int, *args: Any, **kwargs: Any) -> mmap.mmap:
    """``mmap.mmap`` on a file system without ``mmap`` for files (ENODEV); anonymous maps work."""
    if fileno != -1:
        raise OSError(errno.ENODEV, "No such device")
    return _REAL_MMAP(fileno, *args, **kwargs)


@pytest.mark.parametrize("logged", [0, 2])
def test_a_snapshot_that_cannot_be_mapped_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  logged: int) -> None:
    """``storage.snapshot-load-map`` is on by default; where mapping the snapshot fails (ENODEV,
    ENOMEM), the open loads it as a read load would, instead of failing the restart."""
    rng = np.random.default_rng(31)
    ds = DurableStore.open(tmp_path, BIG)
    for i in range(6):
        ds.apply(BatchId(1, i + 1), random_batch(rng, entries=300, columns=12, features=6))
    ds.snapshot()
    for i in range(logged):  # a small log after it (kill -9: no final snapshot)
        ds.apply(BatchId(1, 100 + i), random_batch(rng, entries=40, columns=12, features=6))
    ds.sync()
    ds.close()
    read = DurableStore.open(tmp_path, BIG, map_snapshot=False)
    monkeypatch.setattr(mmap, "mmap", _no_file_mappings)
    reopened = DurableStore.open(tmp_path, BIG, map_snapshot=True)
    assert reopened.mapping is None and reopened.held_disk_bytes() == 0
    assert reopened.recovery.records_replayed == logged
    assert same_state(reopened.store, read.store)
    reopened.close()
    read.close()
