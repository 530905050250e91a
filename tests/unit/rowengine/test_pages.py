"""The row engine's fresh arrays fault in small pages (giaannd/rowengine/pages.py): numpy's
huge-page advice is off while a method that writes them runs, and restored after, even when the
method raises. The kernel's view is read from /proc/self/smaps."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from giaannd.rowengine import Entries, RowEngine, pages
from peers import madvise
from tests.unit.smaps import numpy_advises, vm_flags

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not madvise.AVAILABLE
                                or pages._numpy_switch() is None,
                                reason="madvise (Linux) and numpy's switch of its huge-page advice")


def _batch(rows: int, per_row: int, first_row: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, Entries]:
    n = rows * per_row
    a = np.arange(first_row, first_row + rows, dtype=np.uint64)
    b = np.zeros(rows, np.uint64)
    offsets = np.arange(0, n + 1, per_row, dtype=np.int64)
    tc = np.tile(np.arange(per_row, dtype=np.uint64) * np.uint64(3), rows)
    entries = Entries(np.zeros(n, np.uint8), tc, np.ones(n, np.uint64), np.ones(n, np.float32))
    return a, b, offsets, entries


def test_merges_and_folds_write_fresh_arrays_in_small_pages():
    """Two batches of 2^20 entries: the second's keys are new (between the first's), so its run is
    merged into the first (a fold or a delta merge into new buffers of >= 8 MiB per u64 field).
    With numpy's advice those buffers were marked MADV_HUGEPAGE ("hg" in smaps)."""
    if not numpy_advises():
        pytest.skip("numpy's huge-page advice is off in this process already")
    engine = RowEngine()
    engine.apply(*_batch(1024, 1024))
    a, b, offsets, entries = _batch(1024, 1024)
    engine.apply(a, b, offsets, Entries(entries.seg, entries.tc + np.uint64(1), entries.tf, entries.st))
    engine.compact()
    tc = engine.base_fields()[1]
    owner = tc.base if isinstance(tc.base, np.ndarray) else tc
    assert owner.nbytes >= 8 << 20
    assert "hg" not in vm_flags(owner.ctypes.data + owner.nbytes // 2)
    assert engine.num_entries == 2 << 20
    control = np.empty(owner.nbytes // 8, np.uint64)  # outside the engine numpy still advises
    assert "hg" in vm_flags(control.ctypes.data + control.nbytes // 2)
    assert numpy_advises()


def test_advice_restored_when_a_commit_raises():
    engine = RowEngine()
    before = numpy_advises()
    plan = engine.plan(*_batch(4, 4))
    engine.apply(*_batch(4, 4, first_row=100))  # the engine changes: the plan is stale
    with pytest.raises(RuntimeError, match="stale"):
        engine.commit(plan)
    assert numpy_advises() == before
