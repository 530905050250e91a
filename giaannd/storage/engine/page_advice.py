"""Buffers a bulk load fills at once: small pages while they are filled, huge pages afterwards.

Theory of operation
-------------------
numpy asks the kernel for transparent huge pages on every array of 4 MiB or more
(``madvise(MADV_HUGEPAGE)``). Where ``/sys/kernel/mm/transparent_hugepage/defrag`` is ``madvise``
(a common default), the first touch of each 2 MiB of such an array then *compacts memory in the
faulting thread* when no free huge page is at hand. Filling a buffer of gigabytes at once (a
snapshot load) paid that on every page: a 0.63 GB store loaded in 2.7-4.1 s with huge pages
against 1.0-1.5 s without (one store from the cluster scale bench, on this 2-core VM beside a
running cluster: ``compact_stall`` in /proc/vmstat counts the stalls).

Huge pages are still worth having *after* the load: random reads of a 1.6 GB array measured 43 ns
per element with them and 96 without (the TLB), and the engine's searches and the LIF step are
random reads. So ``filled_buffer`` marks a new buffer ``MADV_NOHUGEPAGE`` before anything touches
it (small pages: no compaction in the fault path), and ``allow_huge_pages`` marks it
``MADV_HUGEPAGE`` again once it is filled: the kernel's ``khugepaged`` then collapses it into huge
pages in the background, at its own pace, with nobody waiting.

``small_pages`` (giaannd/rowengine/pages.py, re-exported here; the row engine's own writes run
inside it too) does the same for every array numpy creates inside a block: a restart's recovery
(storage/engine/recovery.py) makes its key index, row lengths, touch counts, the replay's grouped
entries and the delta run they leave in a few seconds, all fresh memory; with numpy's advice on,
their first touches compacted memory in the faulting thread whenever free huge pages ran short,
which a node whose page cache holds its snapshots and logs is (docs/storage.md "Recovery in small
pages"). The store's arrays are offered to khugepaged once the recovery is done
(``ColumnStore.allow_huge_pages``).

Linux with glibc only; elsewhere (no ``madvise`` in the C library) both are plain ``np.empty`` and
a no-op. A failing ``madvise`` changes nothing but speed, so its result is not checked.
"""

from __future__ import annotations

import mmap
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from giaannd.rowengine.pages import small_pages
from peers import madvise

__all__ = ["HUGE_BUFFER_BYTES", "allow_huge_pages", "filled_buffer", "small_pages"]

#: Buffers from this size are advised (numpy's own threshold for ``MADV_HUGEPAGE``: 4 MiB).
HUGE_BUFFER_BYTES: Final = 4 << 20
_MADV_HUGEPAGE: Final = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_NOHUGEPAGE: Final = getattr(mmap, "MADV_NOHUGEPAGE", 15)


def _advise(buf: NDArray[Any], advice: int) -> None:
    """``madvise`` the whole pages inside ``buf``'s memory (none for a small buffer)."""
    if buf.nbytes >= HUGE_BUFFER_BYTES:
        madvise.advise(buf.ctypes.data, buf.ctypes.data + buf.nbytes, advice)


def filled_buffer(dtype: Any, count: int) -> NDArray[Any]:
    """``np.empty(count, dtype)`` whose pages fault in small (module docstring): for a buffer the
    caller fills at once and then hands to ``allow_huge_pages``."""
    out = np.empty(count, dtype)
    _advise(out, _MADV_NOHUGEPAGE)
    return out


def allow_huge_pages(buf: NDArray[Any]) -> None:
    """Let the kernel collapse a filled buffer (``filled_buffer``'s, or its owner of a view) into
    huge pages in the background. Not an array over memory numpy did not allocate (a view of a
    mapped file: its pages are the file's)."""
    owner = buf.base if isinstance(buf.base, np.ndarray) else buf
    if owner.base is None:
        _advise(owner, _MADV_HUGEPAGE)


