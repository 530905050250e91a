"""Snapshot buffers fault in small pages while they are filled and are offered to khugepaged after
(giaannd/storage/engine/page_advice.py): the kernel's view of the advice, read from smaps."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from giaannd import madvise
from giaannd.storage.engine.page_advice import HUGE_BUFFER_BYTES, allow_huge_pages, filled_buffer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not madvise.AVAILABLE,
                                reason="madvise from the C library (Linux)")


def _vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping holding ``addr`` (hg: MADV_HUGEPAGE, nh: MADV_NOHUGEPAGE)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_filled_buffer_is_small_pages_then_offered_to_khugepaged():
    buf = filled_buffer(np.uint64, 4 * HUGE_BUFFER_BYTES // 8)
    middle = buf.ctypes.data + buf.nbytes // 2
    assert "nh" in _vm_flags(middle) and "hg" not in _vm_flags(middle)
    buf[:] = 7  # filled (a snapshot's readinto)
    allow_huge_pages(buf[:10])  # a view: its owner is advised
    assert "hg" in _vm_flags(middle) and "nh" not in _vm_flags(middle)
    assert int(buf.sum()) == 7 * buf.shape[0]


def test_small_buffers_are_left_alone():
    small = filled_buffer(np.float32, 1000)
    assert small.shape == (1000,) and small.dtype == np.float32
    allow_huge_pages(small)  # below HUGE_BUFFER_BYTES: no madvise at all


def test_room_reserved_for_streams_fills_in_small_pages_then_is_offered_to_khugepaged():
    """``ColumnStore.reserve`` (a stream receiver's room) makes buffers that fault in small pages
    while the chunks fill them (a huge page's first touch cost 3-4x more on this project's VM),
    and ``allow_huge_pages`` (the streams closed) offers them to khugepaged."""
    from giaannd.protocol import BatchId
    from giaannd.storage.engine.column_store import ColumnStore
    from tools.cluster_harness import make_batch

    store = ColumnStore(1 << 40)
    store.apply(BatchId(1, 1), make_batch(np.random.default_rng(1), 50, 8))
    store.reserve(64 * HUGE_BUFFER_BYTES)
    fields = store.engine.base_fields()
    owners = [f.base for f in fields]
    middles = [o.ctypes.data + o.nbytes // 2 for o in owners if o.nbytes >= 4 * HUGE_BUFFER_BYTES]
    assert len(middles) >= 2  # the u64 fields at least
    assert all("nh" in _vm_flags(m) and "hg" not in _vm_flags(m) for m in middles)
    store.allow_huge_pages()
    assert all("hg" in _vm_flags(m) and "nh" not in _vm_flags(m) for m in middles)
