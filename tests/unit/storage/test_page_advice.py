"""Snapshot buffers fault in small pages while they are filled and are offered to khugepaged after
(giaannd/storage/engine/page_advice.py): the kernel's view of the advice, read from smaps."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from giaannd.storage.engine import page_advice
from giaannd.storage.engine.page_advice import HUGE_BUFFER_BYTES, allow_huge_pages, filled_buffer
from peers import madvise
from tests.unit.smaps import numpy_advises, vm_flags

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not madvise.AVAILABLE,
                                reason="madvise from the C library (Linux)")


def test_filled_buffer_is_small_pages_then_offered_to_khugepaged():
    buf = filled_buffer(np.uint64, 4 * HUGE_BUFFER_BYTES // 8)
    middle = buf.ctypes.data + buf.nbytes // 2
    assert "nh" in vm_flags(middle) and "hg" not in vm_flags(middle)
    buf[:] = 7  # filled (a snapshot's readinto)
    allow_huge_pages(buf[:10])  # a view: its owner is advised
    assert "hg" in vm_flags(middle) and "nh" not in vm_flags(middle)
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
    assert all("nh" in vm_flags(m) and "hg" not in vm_flags(m) for m in middles)
    store.allow_huge_pages()
    assert all("hg" in vm_flags(m) and "nh" not in vm_flags(m) for m in middles)


def test_small_pages_turns_numpy_advice_off_inside_and_restores_it():
    before = numpy_advises()
    with page_advice.small_pages():
        assert not numpy_advises()
        # 64 MiB: above glibc's largest mmap threshold (32 MiB), so fresh memory, never a reused
        # piece of the heap that an earlier array's advice still covers
        inside = np.empty(16 * HUGE_BUFFER_BYTES // 8, np.uint64)
        assert "hg" not in vm_flags(inside.ctypes.data + inside.nbytes // 2)
    assert numpy_advises() == before
    with pytest.raises(RuntimeError), page_advice.small_pages():
        raise RuntimeError("left by an exception")
    assert numpy_advises() == before


def test_a_file_mapping_is_not_offered_to_khugepaged(tmp_path):
    """``allow_huge_pages`` of a view of a mapped file (a snapshot's base, mapped) leaves the
    mapping alone: its pages are the file's (the kernel would take the advice: before, it was given)."""
    path = tmp_path / "mapped"
    path.write_bytes(bytes(4 * HUGE_BUFFER_BYTES))
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, np.uint64)
        allow_huge_pages(view)
        assert "hg" not in vm_flags(view.ctypes.data + view.nbytes // 2)
        del view


def test_recovery_fills_in_small_pages_then_offers_the_store_to_khugepaged(tmp_path, monkeypatch):
    """``DurableStore.open`` loads and replays with numpy's huge page advice off (a node's page
    cache is full of its snapshots and logs: faults in advised arrays compacted memory), restores
    it, and then offers the store's arrays to khugepaged (``ColumnStore.allow_huge_pages``)."""
    from giaannd.protocol import BatchId
    from giaannd.storage.engine import recovery
    from giaannd.storage.engine.column_store import ColumnStore
    from giaannd.storage.engine.recovery import DurableStore
    from tools.cluster_harness import make_batch

    rng = np.random.default_rng(3)
    ds = DurableStore.open(tmp_path / "s", 1 << 40)
    for i in range(4):
        ds.apply(BatchId(1, i + 1), make_batch(rng, 2_000, 20))
    ds.snapshot()
    ds.apply(BatchId(1, 10), make_batch(rng, 2_000, 20))  # a log after the snapshot: replayed
    ds.close()
    before = numpy_advises()
    seen: list[str] = []
    replay = recovery.replay_segments

    def watched(*args, **kwargs):
        seen.append(f"replay, numpy advises: {numpy_advises()}")
        return replay(*args, **kwargs)

    offer = ColumnStore.allow_huge_pages

    def offered(self):
        seen.append(f"offered, numpy advises: {numpy_advises() == before}")
        return offer(self)

    monkeypatch.setattr(recovery, "replay_segments", watched)
    monkeypatch.setattr(ColumnStore, "allow_huge_pages", offered)
    opened = DurableStore.open(tmp_path / "s", 1 << 40, map_snapshot=False)
    assert seen == ["replay, numpy advises: False", "offered, numpy advises: True"]
    assert numpy_advises() == before
    assert opened.recovery.records_replayed >= 1
    opened.close()


def test_overlapping_small_pages_blocks_restore_numpy_once_the_last_one_leaves():
    """Two stores opening in threads of one process: the first block to leave must not turn
    numpy's advice back on under the other, nor the last leave it off (a plain save and restore
    per block did the latter)."""
    before = numpy_advises()
    first, second = page_advice.small_pages(), page_advice.small_pages()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not numpy_advises()
    second.__exit__(None, None, None)
    assert numpy_advises() == before
