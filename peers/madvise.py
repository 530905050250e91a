"""The C library's ``madvise`` over the whole pages of a byte range, through ctypes.

Python's ``mmap.madvise`` only takes mappings made by ``mmap`` itself and holds the GIL; numpy's
buffers come from the allocator, and ``MADV_POPULATE_WRITE`` can take as long as the copy it
prepares, so its callers go through libc, whose call releases the GIL:
giaannd/storage/engine/page_advice.py (huge pages after a bulk load), giaannd/prefault.py (pages
mapped ahead of a large read or of a stream's room) and peers/transport/pool.py (a new receive
buffer's pages). Linux with glibc only: elsewhere ``AVAILABLE`` is False and ``advise`` does
nothing and returns False.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any, Final

from numpy.typing import NDArray

__all__ = ["AVAILABLE", "MADV_POPULATE_WRITE", "PAGE", "advise", "libc_function", "populate"]

PAGE: Final = mmap.PAGESIZE


def libc_function(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    """The C library's function ``name`` through ctypes (``errno`` kept), typed; None off Linux
    or where the library has no such function."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


_MADVISE: Final = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)
#: Whether ``advise`` reaches the kernel here.
AVAILABLE: Final = _MADVISE is not None


def advise(start: int, end: int, advice: int) -> bool:
    """``madvise(advice)`` the whole pages inside the addresses ``[start, end)`` (the partial pages
    at the edges are left out); True if the kernel accepted it or there was no whole page, False
    if it refused or there is no ``madvise`` here."""
    if _MADVISE is None:
        return False
    lo = -(-start // PAGE) * PAGE
    hi = end // PAGE * PAGE
    if hi <= lo:
        return True
    return bool(_MADVISE(lo, hi - lo, advice) == 0)


#: ``<linux/mman.h>``; not in Python's ``mmap`` module before 3.13's constants.
MADV_POPULATE_WRITE: Final = 23


def populate(arr: NDArray[Any], a: int, b: int) -> bool:
    """Map (writable) the whole pages of elements ``[a, b)`` of the contiguous ``arr``, without
    writing them (Linux 5.14); False when the kernel refused (then nothing was done)."""
    base = arr.ctypes.data
    return advise(base + a * arr.itemsize, base + b * arr.itemsize, MADV_POPULATE_WRITE)
