"""Map a fresh destination's pages in a thread while a socket fills it (large-row reads).

The kernel maps and zeroes each page of fresh memory on its first write: for a large row read by
parts (row_parts.py) that costs as much as the transfer on a loaded host (0.5-0.9 GB/s measured
here, against 1-1.6 GB/s for a loopback socket). ``Prefault`` asks the kernel to map the pages
ahead of the receives, chunk by chunk in a thread, with ``madvise(MADV_POPULATE_WRITE)`` (Linux
5.14): it faults the pages in writable without writing to them, so it may run over a chunk a
receive is already filling, and nothing waits for it. The call goes through ``ctypes``, which
releases the GIL for the system call (``mmap.madvise`` does not, and only takes mappings of its
own). Where the kernel refuses (older kernels, other systems) the thread stops at once and each
receive faults its own pages, as without it.

Before this, a thread *wrote* a byte per page, and a part was requested only once its chunk was
written (a receive must not be overwritten): a descheduled thread on a loaded host then held the
reads back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Final

from numpy.typing import NDArray

from giaannd import madvise

__all__ = ["MADV_POPULATE_WRITE", "Prefault"]

#: ``<linux/mman.h>``; not in Python's ``mmap`` module before 3.13's constants.
MADV_POPULATE_WRITE: Final = 23


def populate(arr: NDArray[Any], a: int, b: int) -> bool:
    """Map (writable) the whole pages of elements ``[a, b)`` of the contiguous ``arr``; False when
    the kernel refused (then nothing was done)."""
    base = arr.ctypes.data
    return madvise.advise(base + a * arr.itemsize, base + b * arr.itemsize, MADV_POPULATE_WRITE)


class Prefault:
    """Populates ``out``'s pages chunk by chunk (``chunk`` elements of each array) in a thread."""

    def __init__(self, out: Sequence[NDArray[Any]], chunk: int) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(list(out), chunk), daemon=True)
        self._thread.start()

    def _run(self, out: list[NDArray[Any]], chunk: int) -> None:
        n = int(out[0].shape[0])
        for a in range(0, n, chunk):
            for o in out:
                if self._stop.is_set() or not populate(o, a, min(a + chunk, n)):
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

