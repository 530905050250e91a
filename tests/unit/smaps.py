"""The kernel's view of a mapping's advice, for tests of huge-page advice (/proc/self/smaps)."""

from __future__ import annotations

from pathlib import Path

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
