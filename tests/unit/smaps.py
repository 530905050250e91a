"""The kernel's view of a mapping: its advice, for tests of huge-page advice (/proc/self/smaps),
and which of its pages are resident (``mincore``)."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np
import pytest

from giaannd.rowengine import pages


def vm_flags(addr: int) -> set[str]:
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


def numpy_advises() -> bool:
    """Whether numpy advises MADV_HUGEPAGE on the large arrays it makes now (read without change)."""
    switch = pages._numpy_switch()
    if switch is None:
        pytest.skip("this numpy has no switch for its huge page advice")
    state = switch(False)
    switch(state)
    return bool(state)


def resident_share(arr: np.ndarray, a: int, b: int) -> float:
    """The share of the pages of elements ``[a, b)`` of ``arr`` that are resident (``mincore``):
    these pages' own state, whatever else the process frees or maps meanwhile."""
    page = mmap.PAGESIZE
    start = arr.ctypes.data + a * arr.itemsize
    first, last = start - start % page, arr.ctypes.data + b * arr.itemsize
    pages = (last - first + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(last - first), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) / pages
