"""Prefault (giaannd/prefault.py): pages are mapped without their contents changing, so the thread
may run over memory a receive already filled."""

import sys
import threading

import numpy as np
import pytest

from giaannd.prefault import Prefault
from peers.madvise import populate


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")
def test_prefault_populate_keeps_contents():
    a = np.empty(3 * 2**20 + 5, np.uint64)  # fresh pages, plus edges that are not whole pages
    a[:1000] = np.arange(1000, dtype=np.uint64)  # written before the populate: must stay
    assert populate(a, 0, a.shape[0])
    assert np.array_equal(a[:1000], np.arange(1000, dtype=np.uint64))


def test_prefault_thread_leaves_filled_chunks_alone():
    out = [np.full(100_000, 7, np.uint8), np.full(100_000, 9, np.uint64)]
    pre = Prefault(out, 4096)
    pre.stop()
    assert (out[0] == 7).all() and (out[1] == 9).all()


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")
def test_prefault_waits_at_its_bound_and_goes_on_when_it_moves():
    page = 4096
    out = [np.empty(10 * page, np.uint8)]
    limit = [3 * page]
    reached = threading.Event()
    pre: Prefault | None = None

    def bound() -> int:
        if pre is not None and pre.mapped >= limit[0]:
            reached.set()  # (called again while it waits: the next chunk ends past the bound)
        return limit[0]

    pre = Prefault(out, page, bound=bound)
    assert reached.wait(30)
    assert pre.mapped == 3 * page  # nothing past the bound
    limit[0] = 10 * page
    assert pre.wait(30) and pre.mapped == 10 * page
