"""A pool's new receive buffer has every page mapped before it is lent (peers/transport/pool.py
``_touch``): large ones by the kernel (``MADV_POPULATE_WRITE``), small ones and any the kernel
refuses written; the receive path then never faults."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from peers import madvise
from peers.transport import pool as pool_mod
from peers.transport.pool import BufferPool
from tests.unit.smaps import resident_share

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and /proc are Linux's")


def _backing(lease) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.frombuffer(lease.whole(), np.uint8)


@pytest.mark.parametrize("nbytes", [3_000, 100_000, 4 << 20, (4 << 20) + 12_345])
def test_a_new_buffer_is_resident_whole_when_lent(nbytes):
    pool = BufferPool()
    lease = pool.lease(nbytes)
    try:
        backing = _backing(lease)
        assert resident_share(backing, 0, backing.shape[0]) == 1.0
        assert pool.allocations == 1
    finally:
        lease.release()


def test_the_kernel_is_asked_for_large_buffers_and_small_ones_are_written(monkeypatch):
    asked: list[int] = []
    real = madvise.populate

    def spy(arr, a, b):  # type: ignore[no-untyped-def]
        asked.append(b - a)
        return real(arr, a, b)

    monkeypatch.setattr(madvise, "populate", spy)
    pool = BufferPool()
    pool.lease(64 << 10).release()
    assert asked == []
    pool.lease(2 << 20).release()
    assert asked == [2 << 20]


def test_a_refused_populate_falls_back_to_writing_every_page(monkeypatch):
    monkeypatch.setattr(madvise, "populate", lambda arr, a, b: False)
    pool = BufferPool()
    lease = pool.lease(8 << 20)
    try:
        backing = _backing(lease)
        assert resident_share(backing, 0, backing.shape[0]) == 1.0
    finally:
        lease.release()
    assert pool_mod._POPULATE_FROM_BYTES <= 8 << 20
