"""How much of a file the page cache holds (``mincore`` over a read-only mapping of it).

A restart's snapshot load runs at page-cache speed when the file is cached and at the disk's when
it is not (docs/storage.md "Recovery in small pages": 0.61 s against 1.4-2.3 s for the same 1.8 GB
on this project's VM), so a benchmark that restarts a node says which it measured.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np

from peers.madvise import libc_function

__all__ = ["cached_share"]


_MINCORE = libc_function("mincore", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p), ctypes.c_int)


def cached_share(path: Path) -> float | None:
    """The share (0-1) of ``path``'s pages in the page cache now; None where ``mincore`` is not
    available or the file cannot be mapped (missing, empty). Maps the file and touches nothing."""
    if _MINCORE is None:
        return None
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            view = np.frombuffer(m, np.uint8)
            size = len(view)
            pages = -(-size // mmap.PAGESIZE)
            vec = np.zeros(pages, np.uint8)
            rc = _MINCORE(view.ctypes.data, size, vec.ctypes.data)
            del view
            if rc != 0:
                return None
            return float(np.count_nonzero(vec & 1)) / pages
    except (OSError, ValueError):
        return None
